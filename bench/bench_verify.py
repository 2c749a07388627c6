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
   ``VENV/bin/python -c 'import re, sys'``, ``VENV/bin/python -c pass``. Wall time of each process from the parent,
   and the CPU time (user + system) the kernel charged it with (``os.wait4``), which waiting on a busy machine does
   not inflate; the medians, their spread, and verify's own work: median(verify) - median(import re, sys), in wall
   time (the target) and in CPU time.
4. One more verify run per checkout, under ``python -X importtime``, lists the modules verify imports beyond the
   floor, and the heavy ones (libcst, typer, rich, click, ...) that must not load when the hashes match.

The machine's load falls on every command alike (interleaved); on a busy machine, raise --repeat, read the CPU
columns, or prepare here and measure on a quiet machine (only Python 3.10+ needed there):

    python bench/bench_verify.py [--version 0.30.0] [--repeat 30] [--against /tmp/main-checkout]
    python bench/bench_verify.py --prepare DIR [--against CHECKOUT]; python bench/bench_verify.py --measure DIR
"""

from __future__ import annotations

import argparse
import json
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

HEAVY = ("libcst", "typer", "click", "rich", "packaging", "importlib.metadata", "dataclasses", "inspect", "typing")
TARGET_MS = 10.0


def _wheel(checkout: Path, out: Path) -> Path:
    """``checkout`` built into a wheel in ``out``."""
    quiet = {**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), "."],
        cwd=checkout,
        check=True,
        env=quiet,
    )
    (wheel,) = out.glob("patch_dsv4-*.whl")
    return wheel


def _install(wheel: Path, env_dir: Path, dependencies: str | None) -> Path:
    """``wheel`` pip-installed into a fresh venv ``env_dir`` (bytecode compiled, RECORD beside it); with
    ``dependencies``, a .pth line after the venv's own site-packages that lets it import them from there."""
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    quiet = {**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, env=quiet)
    if dependencies:
        site = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        Path(site, "zz_bench_dependencies.pth").write_text(dependencies + "\n")
    return env_dir


def prepare(version: str, checkouts: dict[str, Path], work: Path) -> None:
    """Per checkout: its wheel, and a copy of ``version``'s installed tree applied with it, trimmed to what verify
    reads (bench_guard's trim: a few MB), under ``work`` with setups.json: what :func:`measure` needs, on any
    machine with Python 3.10+ (no dependency, no vLLM, no test cache)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_guard import _trimmed

    from tests.releases import copy_tree, pristine_tree  # the checkout's tests: not needed to measure

    setups = {}
    for n, (label, checkout) in enumerate(checkouts.items()):
        wheel = _wheel(checkout, work / f"c{n}" / "wheel")
        env_dir = _install(wheel, work / f"c{n}" / "prepare-venv", sysconfig.get_paths()["purelib"])
        tree = copy_tree(pristine_tree(version), work / f"c{n}" / "full" / "site-packages")
        subprocess.run([str(env_dir / "bin" / "patch-dsv4"), "apply", "--site-packages", str(tree), "-q"], check=True)
        site = next((env_dir / "lib").glob("python3*/site-packages"))
        trimmed = _trimmed(tree, site, work / f"c{n}" / "tree" / "site-packages")
        shutil.rmtree(work / f"c{n}" / "full")
        shutil.rmtree(env_dir)
        setups[label] = {"wheel": str(wheel.relative_to(work)), "tree": str(trimmed.relative_to(work))}
    (work / "setups.json").write_text(json.dumps({"version": version, "setups": setups}, indent=1))


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


def measure(work: Path, repeat: int) -> None:
    """Each prepared checkout installed into a fresh venv here, then every command interleaved, ``repeat`` rounds."""
    prepared = json.loads((work / "setups.json").read_text())
    commands: dict[str, list[str]] = {}
    setups = {}
    for n, (label, setup) in enumerate(prepared["setups"].items()):
        env_dir = _install(work / setup["wheel"], work / f"venv-{n}", None)
        script, python, tree = (
            str(env_dir / "bin" / "patch-dsv4"),
            str(env_dir / "bin" / "python"),
            work / setup["tree"],
        )
        verify = [script, "verify", "--site-packages", str(tree), "-q"]
        checked = subprocess.run(verify, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr
        commands[f"{label}: patch-dsv4 verify"] = verify
        commands[f"{label}: python -c 'import re, sys'"] = [python, "-c", "import re, sys"]
        commands[f"{label}: python -c pass"] = [python, "-c", "pass"]
        setups[label] = (python, script, tree)
    for command in commands.values():  # warm-up round: the page cache
        _time(command)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, command in commands.items():
            times[name].append(_time(command))
    wall = {name: statistics.median(w for w, _ in values) * 1000 for name, values in times.items()}
    cpu = {name: statistics.median(c for _, c in values) * 1000 for name, values in times.items()}
    print(f"vLLM {prepared['version']}, applied; installed console script; Python {sys.version.split()[0]};")
    print(f"fresh process each, interleaved; median of {repeat}")
    print(f"  {'':<58} {'wall':>9}  {'(min-max)':<10} {'CPU':>8}  (min)")
    for name, values in times.items():
        spread = f"({min(w for w, _ in values) * 1000:.0f}-{max(w for w, _ in values) * 1000:.0f})"
        low = min(c for _, c in values) * 1000
        print(f"  {name:<58} {wall[name]:6.1f} ms  {spread:<10} {cpu[name]:5.1f} ms  ({low:.1f})")
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", default="0.30.0")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--against", type=Path, help="another checkout, measured the same way, interleaved")
    parser.add_argument("--prepare", type=Path, metavar="DIR", help="only prepare DIR (wheels, applied trees)")
    parser.add_argument("--measure", type=Path, metavar="DIR", help="only measure what --prepare left in DIR")
    args = parser.parse_args()
    if args.measure is not None:
        measure(args.measure.resolve(), args.repeat)
        return
    checkouts = {"this checkout": ROOT}
    if args.against is not None:
        checkouts[f"{args.against}"] = args.against.resolve()
    if args.prepare is not None:
        args.prepare.mkdir(parents=True, exist_ok=True)
        prepare(args.version, checkouts, args.prepare.resolve())
        return
    work = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    try:
        prepare(args.version, checkouts, work)
        measure(work, args.repeat)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
