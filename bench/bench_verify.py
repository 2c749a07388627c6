"""verify on an applied tree, through the installed console script, side by side with the floor under it.

The floor is what every run of ``patch-dsv4`` pays before patch-dsv4 does anything: the interpreter's start and
the console-script wrapper pip writes, which imports ``re`` and ``sys``. So ``python -c 'import re, sys'`` of the
same venv is the baseline, and verify's own work is the difference of the medians (the target: at most 10 ms).
``python -c pass`` is shown beside them.

Method:
1. Each checkout measured (this one, and with ``--against DIR`` another, e.g. a worktree of main) is built into a
   wheel and installed with pip into a fresh venv of its own, as a user installs it: bytecode compiled at install,
   the package's RECORD beside it, the ``patch-dsv4`` console script in the venv's bin/. The venv sees this
   interpreter's site-packages through a .pth line (the dependencies, for apply), after its own.
2. A copy of the release's installed tree (tests/releases.py) is applied with that venv's ``patch-dsv4 apply``.
3. The commands of every checkout run interleaved, one fresh process each, ``--repeat`` rounds after one warm-up
   round (page cache, nothing else): ``VENV/bin/patch-dsv4 verify --site-packages TREE -q``,
   ``VENV/bin/python -c 'import re, sys'``, ``VENV/bin/python -c pass``. Wall time of each process from the parent;
   the medians, their spread (min-max), and verify's own work: median(verify) - median(import re, sys).
4. One more verify run per checkout, under ``python -X importtime``, lists the modules verify imports beyond the
   floor, and the heavy ones (libcst, typer, rich, click, ...) that must not load when the hashes match.

The machine's load falls on every command alike (interleaved); on a busy machine, raise --repeat.

    python bench/bench_verify.py [--version 0.30.0] [--repeat 30] [--against /tmp/main-checkout]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.releases import copy_tree, pristine_tree  # noqa: E402 (the checkout's tests, once it is on the path)

HEAVY = ("libcst", "typer", "click", "rich", "packaging", "importlib.metadata", "dataclasses", "inspect", "typing")
TARGET_MS = 10.0


def _install(checkout: Path, work: Path) -> Path:
    """``checkout`` as a wheel, pip-installed into a fresh venv under ``work``; the venv's directory."""
    wheels, env_dir = work / "wheel", work / "venv"
    quiet = {**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), "."],
        cwd=checkout,
        check=True,
        env=quiet,
    )
    venv.create(env_dir, with_pip=True)
    (wheel,) = wheels.glob("patch_dsv4-*.whl")
    subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    site = subprocess.run(
        [str(env_dir / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "zz_bench_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env_dir


def _time(command: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run: the wall time from the parent, the CPU time (user + system) the kernel
    charged the child with, which a busy machine's waiting does not inflate."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{command} exited {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


def _imports(python: str, args: list[str]) -> set[str]:
    """The modules a run imports (``-X importtime``)."""
    err = subprocess.run([python, "-X", "importtime", *args], capture_output=True, text=True).stderr
    return {line.split("|")[-1].strip() for line in err.splitlines() if line.startswith("import time:")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", default="0.30.0")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--against", type=Path, help="another checkout, measured the same way, interleaved")
    args = parser.parse_args()
    checkouts = {"this checkout": ROOT}
    if args.against is not None:
        checkouts[f"{args.against}"] = args.against.resolve()
    work = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    try:
        commands: dict[str, list[str]] = {}
        setups = {}
        for n, (label, checkout) in enumerate(checkouts.items()):
            env_dir = _install(checkout, work / f"c{n}")
            tree = copy_tree(pristine_tree(args.version), work / f"c{n}" / "site-packages")
            script, python = str(env_dir / "bin" / "patch-dsv4"), str(env_dir / "bin" / "python")
            subprocess.run([script, "apply", "--site-packages", str(tree), "-q"], check=True)
            verify = [script, "verify", "--site-packages", str(tree), "-q"]
            assert subprocess.run(verify, capture_output=True).returncode == 0
            commands[f"{label}: patch-dsv4 verify"] = verify
            commands[f"{label}: python -c 'import re, sys'"] = [python, "-c", "import re, sys"]
            commands[f"{label}: python -c pass"] = [python, "-c", "pass"]
            setups[label] = (python, script, tree)
        for command in commands.values():  # warm-up round: the page cache
            _time(command)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        for _ in range(args.repeat):
            for name, command in commands.items():
                times[name].append(_time(command))
        wall = {name: statistics.median(w for w, _ in values) * 1000 for name, values in times.items()}
        cpu = {name: statistics.median(c for _, c in values) * 1000 for name, values in times.items()}
        print(f"vLLM {args.version}, applied; installed console script; fresh process each; median of {args.repeat}")
        print(f"  {'':<58} {'wall':>9}  {'(min-max)':<10} {'CPU':>8}")
        for name, values in times.items():
            spread = f"({min(w for w, _ in values) * 1000:.0f}-{max(w for w, _ in values) * 1000:.0f})"
            print(f"  {name:<58} {wall[name]:6.1f} ms  {spread:<10} {cpu[name]:5.1f} ms")
        for label, (python, script, tree) in setups.items():
            floor_name = f"{label}: python -c 'import re, sys'"
            own = wall[f"{label}: patch-dsv4 verify"] - wall[floor_name]
            own_cpu = cpu[f"{label}: patch-dsv4 verify"] - cpu[floor_name]
            verdict = "ok" if own <= TARGET_MS else "OVER"
            print(
                f"{label}: verify's own work over the floor: {own:.1f} ms wall (target <= 10: {verdict}),"
                f" {own_cpu:.1f} ms CPU"
            )
            floor = _imports(python, ["-c", "import re, sys"])
            used = _imports(python, [script, "verify", "--site-packages", str(tree), "-q"])
            heavy = sorted(m for m in used if m.split(".")[0] in HEAVY or m in HEAVY)
            print(f"  imported beyond the floor: {' '.join(sorted(used - floor))}")
            print(f"  heavy modules imported: {', '.join(heavy) or 'none'}")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
