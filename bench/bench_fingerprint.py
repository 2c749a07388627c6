"""The fingerprint's cost: verify's fast path and the serve guard, this checkout against another (main's HEAD).

For each checkout (its Python: one whose ``patch_dsv4`` is that checkout), a copy of a real release tree is
applied with that checkout (a state is trusted only by the patch definitions that wrote it), then, in fresh
interpreters, ``--repeat`` times after one warm-up:

1. ``patch-dsv4 verify --site-packages TREE`` (the fast path; this checkout also with ``--expect FP``): the wall
   time of the whole process;
2. the guard as vLLM calls it (a stand-in ``vllm`` module whose file is in the tree, as
   tests/engine/fastpath/test_guard.py does): ``import patch_dsv4.guard`` and ``check()`` timed in the
   process; this checkout also with ``PATCH_DSV4_EXPECT`` set to the tree's fingerprint (equal: silent).

Medians and minimums are printed (on a loaded machine the minimums say more). The guard's target is
10 ms per process (import + check) on an applied tree.

    python bench/bench_fingerprint.py --baseline-python /work/main/.venv/bin/python [--version 0.30.0] [--repeat 15]
"""

from __future__ import annotations

import argparse
import json
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

GUARD = r"""
import json, os, sys, time, types
tree = sys.argv[1]
module = types.ModuleType("vllm")
module.__file__ = os.path.join(tree, "vllm", "__init__.py")
sys.modules["vllm"] = module
t0 = time.perf_counter()
import patch_dsv4.guard as guard
t1 = time.perf_counter()
guard.check()
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "check": t2 - t1}))
"""


PYCACHE = tempfile.mkdtemp(prefix="bench-fingerprint-pyc-")  # bytecode cached, as an installed package has it


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PATCH_DSV4_") and k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PATCH_DSV4_GUARD="strict", PYTHONPYCACHEPREFIX=PYCACHE, **extra)
    return env


def _wall(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - started


def _guard(python: str, tree: Path, env: dict[str, str]) -> float:
    out = subprocess.run([python, "-c", GUARD, str(tree)], capture_output=True, text=True, check=True, env=env)
    timed = json.loads(out.stdout)
    return timed["import"] + timed["check"]


def measure(runs: dict[str, tuple], repeat: int) -> dict[str, tuple[float, float]]:
    """Each run ``name: (function, args)`` once per round, the rounds interleaved (the machine's load falls on all
    alike); the first round warms the caches. (median, min) in ms."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeat + 1):
        for name, (function, args) in runs.items():
            value = function(*args)
            if i:
                samples[name].append(value)
    return {name: (statistics.median(values) * 1000, min(values) * 1000) for name, values in samples.items()}


MICRO = r"""
import sys, time
from patch_dsv4.fastpath import quick, serving
site = quick.locate([sys.argv[1]])
known = quick.known_judgement(site)
n = 300
t0 = time.perf_counter()
for _ in range(n):
    text = serving.of_recorded(site, known).text
t1 = time.perf_counter()
other = text.replace(text.split(":")[2], "a" * 12)
for _ in range(n):
    serving.of_recorded(site, known).differences(other)
t2 = time.perf_counter()
print((t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6)
"""


def prepared(python: str, source: Path, where: Path) -> Path:
    tree = copy_tree(source, where / "site-packages")
    done = subprocess.run(
        [python, "-m", "patch_dsv4", "apply", "--site-packages", str(tree)], capture_output=True, text=True, env=_env()
    )
    if done.returncode:
        raise SystemExit(f"{python}: apply failed:\n{done.stderr}")
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-python", required=True, help="a Python whose patch_dsv4 is the other checkout")
    parser.add_argument("--version", default="0.30.0")
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    source = pristine_tree(args.version)
    with tempfile.TemporaryDirectory() as tmp:
        here_tree = prepared(sys.executable, source, Path(tmp) / "here")
        base_tree = prepared(args.baseline_python, source, Path(tmp) / "base")
        fp = subprocess.run(
            [sys.executable, "-m", "patch_dsv4", "status", "--fingerprint", "--site-packages", str(here_tree)],
            capture_output=True,
            text=True,
            check=True,
            env=_env(),
        ).stdout.strip()
        base_python = args.baseline_python
        verify = ["-m", "patch_dsv4", "verify", "--site-packages"]
        medians = measure(
            {
                "verify (baseline)": (_wall, ([base_python, *verify, str(base_tree)], _env())),
                "verify": (_wall, ([sys.executable, *verify, str(here_tree)], _env())),
                "verify --expect FP": (_wall, ([sys.executable, *verify, str(here_tree), "--expect", fp], _env())),
                "guard (baseline)": (_guard, (base_python, base_tree, _env())),
                "guard": (_guard, (sys.executable, here_tree, _env())),
                "guard, EXPECT=FP": (_guard, (sys.executable, here_tree, _env(PATCH_DSV4_EXPECT=fp))),
            },
            args.repeat,
        )
        micro = subprocess.run(
            [sys.executable, "-c", MICRO, str(here_tree)], capture_output=True, text=True, check=True, env=_env()
        ).stdout.split()
    shutil.rmtree(PYCACHE, ignore_errors=True)
    print(f"vLLM {args.version}, applied tree; {args.repeat} rounds of fresh processes (after one warm-up), medians;")
    print(f"baseline: {args.baseline_python}; load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"  fingerprint: {fp}")
    print(f"  {'':22} {'median':>9} {'min':>9}")
    for name, (median, least) in medians.items():
        what = "wall time of the process" if name.startswith("verify") else "import patch_dsv4.guard + check()"
        print(f"  {name:22} {median:6.1f} ms {least:6.1f} ms  ({what})")
    print(
        f"  in process: the fingerprint of a vouched judgement {float(micro[0]):.0f} us; "
        f"naming what differs from another {float(micro[1]):.0f} us"
    )
    guard = medians["guard, EXPECT=FP"][0]
    print(f"guard (import + check, PATCH_DSV4_EXPECT set) <= 10 ms: {'met' if guard <= 10 else 'NOT met'}")


if __name__ == "__main__":
    main()
