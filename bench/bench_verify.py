"""verify on an applied tree, side by side with `import libcst.matchers` and `python -c pass`.

Each command runs in a fresh interpreter, the three interleaved, ``--repeat``
times; the medians are printed with the ratio verify / libcst.matchers (the
target is at most 0.5) and verify's own work over a bare interpreter (the
target is at most 30 ms). Also says which heavy modules the verify process
imported (none of libcst, typer, rich, dataclasses, inspect, typing or the typed
report model is expected).

Two rounds, each its own warm-up: first with bytecode cached, as an installed
package has it (pip compiles it at install; here it is cached in a private
directory, ``PYTHONPYCACHEPREFIX``, removed afterwards); then as this
environment runs Python, which, with ``PYTHONDONTWRITEBYTECODE`` set and no
``__pycache__`` in the checkout, compiles every module of patch_dsv4 from
source in every run.

    python bench/bench_verify.py [--version 0.30.0] [--repeat 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.releases import copy_tree, pristine_tree  # noqa: E402 (the checkout's tests, once it is on the path)

HEAVY = (
    "libcst",
    "typer",
    "rich",
    "packaging",
    "importlib.metadata",
    "dataclasses",
    "inspect",
    "typing",
    "patch_dsv4.verdicts",
    "patch_dsv4.commands",
    "patch_dsv4.state",
)
PROBE = (
    "import sys; sys.argv = ['patch-dsv4'] + sys.argv[1:];"
    "from patch_dsv4.cli import main; code = main(sys.argv[1:]);"
    f"heavy = sorted(m for m in {HEAVY!r} if m in sys.modules);"
    "print('imported:', heavy or 'none', file=sys.stderr); sys.exit(code)"
)


def _time(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - started


def _round(title: str, commands: dict[str, list[str]], env: dict[str, str], repeat: int) -> None:
    for command in commands.values():  # warm the page cache (and, where it is written, the bytecode)
        _time(command, env)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, command in commands.items():
            times[name].append(_time(command, env))
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"{title}; fresh interpreter each; median of {repeat} (min-max)")
    for name, values in times.items():
        print(f"  {name:<38} {medians[name] * 1000:7.1f} ms  ({min(values) * 1000:.0f}-{max(values) * 1000:.0f})")
    names = list(commands)
    ratio = medians[names[0]] / medians[names[1]]
    print(f"  verify / import libcst.matchers = {ratio:.2f} (target <= 0.5)")
    print(f"  verify's own work over a bare interpreter: {(medians[names[0]] - medians[names[2]]) * 1000:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", default="0.30.0")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    try:
        tree = copy_tree(pristine_tree(args.version), work / "site-packages")
        subprocess.run([sys.executable, "-m", "patch_dsv4", "apply", "--site-packages", str(tree), "-q"], check=True)
        verify = [sys.executable, "-m", "patch_dsv4", "verify", "--site-packages", str(tree), "-q"]
        commands = {
            "patch-dsv4 verify (applied tree)": verify,
            "python -c 'import libcst.matchers'": [sys.executable, "-c", "import libcst.matchers"],
            "python -c pass": [sys.executable, "-c", "pass"],
        }
        cached = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        cached["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
        setting = os.environ.get("PYTHONDONTWRITEBYTECODE") or "unset"
        print(f"vLLM {args.version}, applied")
        _round("bytecode cached (as installed)", commands, cached, args.repeat)
        _round(
            f"as this environment runs it (PYTHONDONTWRITEBYTECODE={setting})", commands, dict(os.environ), args.repeat
        )
        probe = subprocess.run(
            [sys.executable, "-c", PROBE, "verify", "--site-packages", str(tree), "-q"], capture_output=True, text=True
        )
        print(f"verify exit {probe.returncode}; {probe.stderr.strip().splitlines()[-1]}")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
