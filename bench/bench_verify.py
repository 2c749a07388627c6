"""verify on an applied tree, through the installed console script, side by side with the floor under it.

The floor is what every run of ``patch-dsv4`` pays before patch-dsv4 does anything: the interpreter's start and
the console-script wrapper pip writes, which imports ``re`` and ``sys``. So ``python -c 'import re, sys'`` of the
same venv is the baseline, and verify's own work is the difference of the medians (the target: at most 10 ms).
``python -c pass`` is shown beside them.

Method:
1. Each checkout measured (this one, and with ``--against DIR`` another, e.g. a worktree of main) is built into a
   wheel (from a clean copy of its files: a stale build/ adds nothing) and installed with pip into a fresh venv of
   its own, as a user installs it: bytecode compiled at install, the package's RECORD beside it, the
   ``patch-dsv4`` console script in the venv's bin/. To apply, the venv sees this interpreter's site-packages
   through a .pth line (the dependencies), after its own.
2. A minimal copy of the release's installed tree (tests/releases.py: vLLM's dist-info, the DeepSeek-V4 and V4.1
   packages, every file anchors/ lists) is applied in place with that venv's ``patch-dsv4 apply``.
3. The commands of every checkout run interleaved, one fresh process each, ``--repeat`` rounds after one warm-up
   round (page cache, nothing else): ``VENV/bin/patch-dsv4 verify --site-packages TREE -q`` on the applied tree
   and on a copy of it made at measure time (other inodes, as in an image pulled onto another host: a version
   that kept file attributes for the hashes reads every file there), ``VENV/bin/python -c 'import re, sys'``,
   ``VENV/bin/python -c pass``. Wall time of each process from the parent, and the CPU time (user + system) the
   kernel charged it with (``os.wait4``), which waiting on a busy machine does not inflate; the medians, their
   spread, the load average before and after, and verify's own work: median(verify) - median(import re, sys),
   in wall time (the target) and in CPU time. verify reads and hashes every file it vouches for in every run
   (33 files, 0.9 MB on 0.30.0): the figure is that of the bytes read.
4. One more verify run per tree, under ``python -X importtime``, lists the modules verify imports beyond the
   floor, and the heavy ones (libcst, typer, rich, click, ...) that must not load when the hashes match.

The machine's load falls on every command alike (interleaved); on a busy machine, raise --repeat, read the CPU
columns, or prepare here and measure on a quiet machine (only Python 3.10+ needed there; the trees carried there
are copies of the applied trees):

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


def _source_copy(checkout: Path, to: Path) -> Path:
    """The files of ``checkout`` that git tracks or would (as they are in the work tree), copied to ``to``: a build
    there holds nothing a stale build/ of the checkout left (setuptools adds what build/lib holds to the wheel)."""
    listed = subprocess.run(
        ["git", "-C", str(checkout), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=False,
    )
    if listed.returncode:  # not a git checkout: all of it but what a build or a venv leaves
        skip = shutil.ignore_patterns("build", "dist", ".venv", ".git", "__pycache__", "*.egg-info")
        shutil.copytree(checkout, to, ignore=skip)
        return to
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = checkout / name
        if source.is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)
    return to


def _wheel(checkout: Path, out: Path) -> Path:
    """``checkout`` built into a wheel in ``out`` (from a clean copy of its files)."""
    quiet = {**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    with tempfile.TemporaryDirectory(prefix="bench-verify-source-") as tmp:
        source = _source_copy(checkout, Path(tmp) / "source")
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), "."],
            cwd=source,
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


def _minimal_tree(version: str, checkouts: list[Path], to: Path) -> Path:
    """Of ``version``'s installed tree, what any of ``checkouts`` reads to judge it (vLLM's dist-info and
    ``vllm/__init__.py``, the DeepSeek-V4 and V4.1 packages, every file their anchors/ record lists), copied as
    regular files: a few MB, applied and verified in place."""
    from tests.releases import pristine_tree  # the checkout's tests: not needed to measure

    source = pristine_tree(version)
    names = {"vllm/__init__.py"}
    for checkout in checkouts:
        names |= set(json.loads((checkout / "anchors" / f"vllm-{version}.json").read_text())["files"])
    for folder in [source / f"vllm-{version}.dist-info", *source.glob("vllm/models/deepseek_v4*")]:  # V4, V4.1
        names |= {str(p.relative_to(source)) for p in folder.rglob("*") if p.is_file()}
    for name in sorted(names):
        if (source / name).is_file() and "__pycache__" not in name:
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, to / name)
    return to


def prepare(version: str, checkouts: dict[str, Path], work: Path) -> None:
    """Per checkout: its wheel, and a minimal copy of ``version``'s installed tree applied with it, under ``work``
    with setups.json: what :func:`measure` needs, on any machine with Python 3.10+ (no dependency, no vLLM, no test
    cache)."""
    setups = {}
    for n, (label, checkout) in enumerate(checkouts.items()):
        wheel = _wheel(checkout, work / f"c{n}" / "wheel")
        env_dir = _install(wheel, work / f"c{n}" / "prepare-venv", sysconfig.get_paths()["purelib"])
        tree = _minimal_tree(version, list(checkouts.values()), work / f"c{n}" / "tree" / "site-packages")
        subprocess.run([str(env_dir / "bin" / "patch-dsv4"), "apply", "--site-packages", str(tree), "-q"], check=True)
        shutil.rmtree(env_dir)
        setups[label] = {"wheel": str(wheel.relative_to(work)), "tree": str(tree.relative_to(work))}
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


def measure(work: Path, repeat: int, copies: bool = True) -> None:
    """Each prepared checkout installed into a fresh venv here, then every command interleaved, ``repeat`` rounds;
    with ``copies``, verify also runs on a copy of each applied tree (other inodes, as in an image pulled onto
    another host)."""
    prepared = json.loads((work / "setups.json").read_text())
    commands: dict[str, list[str]] = {}
    setups = {}
    for n, (label, setup) in enumerate(prepared["setups"].items()):
        env_dir = _install(work / setup["wheel"], work / f"venv-{n}", None)
        script, python = str(env_dir / "bin" / "patch-dsv4"), str(env_dir / "bin" / "python")
        trees = {"": work / setup["tree"]}
        if copies:
            copy = work / f"copy-{n}" / "site-packages"
            shutil.rmtree(copy.parent, ignore_errors=True)
            trees[" (a copy of the tree)"] = shutil.copytree(work / setup["tree"], copy, symlinks=True)
        for suffix, tree in trees.items():
            verify = [script, "verify", "--site-packages", str(tree), "-q"]
            checked = subprocess.run(verify, capture_output=True, text=True)
            assert checked.returncode == 0, checked.stderr
            assert "hashes match the recorded state" in checked.stdout, checked.stdout  # the fast path answered
            commands[f"{label}: patch-dsv4 verify{suffix}"] = verify
        commands[f"{label}: python -c 'import re, sys'"] = [python, "-c", "import re, sys"]
        commands[f"{label}: python -c pass"] = [python, "-c", "pass"]
        setups[label] = (python, script, trees)
    load = os.getloadavg()
    for command in commands.values():  # warm-up round: the page cache
        _time(command)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, command in commands.items():
            times[name].append(_time(command))
    wall = {name: statistics.median(w for w, _ in values) * 1000 for name, values in times.items()}
    cpu = {name: statistics.median(c for _, c in values) * 1000 for name, values in times.items()}
    print(f"vLLM {prepared['version']}, applied; installed console script; Python {sys.version.split()[0]};")
    print(
        f"fresh process each, interleaved; median of {repeat}; load average {load[0]:.2f} before,"
        f" {os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs)"
    )
    print(f"  {'':<78} {'wall':>9}  {'(min-max)':<10} {'CPU':>8}  (min)")
    for name, values in times.items():
        spread = f"({min(w for w, _ in values) * 1000:.0f}-{max(w for w, _ in values) * 1000:.0f})"
        low = min(c for _, c in values) * 1000
        print(f"  {name:<78} {wall[name]:6.1f} ms  {spread:<10} {cpu[name]:5.1f} ms  ({low:.1f})")
    for label, (python, script, trees) in setups.items():
        floor_name = f"{label}: python -c 'import re, sys'"
        floor = _imports(python, ["-c", "import re, sys"])
        for suffix, tree in trees.items():
            own = wall[f"{label}: patch-dsv4 verify{suffix}"] - wall[floor_name]
            own_cpu = cpu[f"{label}: patch-dsv4 verify{suffix}"] - cpu[floor_name]
            verdict = "ok" if own <= TARGET_MS else "OVER"
            used = _imports(python, [script, "verify", "--site-packages", str(tree), "-q"])
            print(
                f"{label}{suffix}: verify's own work over the floor: {own:.1f} ms wall (target <= 10: {verdict}),"
                f" {own_cpu:.1f} ms CPU"
            )
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
