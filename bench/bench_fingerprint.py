"""The fingerprint's cost: verify's fast path and the serve guard, this checkout against another (main's HEAD).

For each checkout (its Python: one whose ``patch_dsv4`` is that checkout), a copy of a real release tree is
applied with that checkout (a state is trusted only by the patch definitions that wrote it), then, in fresh
interpreters, ``--repeat`` times after one warm-up:

1. ``patch-dsv4 verify --site-packages TREE`` (the fast path; this checkout also with ``--expect FP``): the wall
   time of the whole process;
2. the guard as vLLM calls it (a stand-in ``vllm`` module whose file is in the tree, as tests/test_guard.py
   does): ``import patch_dsv4.guard`` and ``check()`` timed in the process; this checkout also with
   ``PATCH_DSV4_EXPECT`` set to the tree's fingerprint (equal: silent).

Medians are printed. The guard's target is 10 ms per process (import + check) on an applied tree.

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


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PATCH_DSV4_")}
    env.update(PATCH_DSV4_GUARD="strict", **extra)
    return env


def _wall(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - started


def _median(values: list[float]) -> float:
    return statistics.median(values) * 1000


def measure(python: str, tree: Path, repeat: int, expect: str | None) -> dict[str, float]:
    verify = [python, "-m", "patch_dsv4", "verify", "--site-packages", str(tree)]
    runs: dict[str, list[float]] = {"verify": [], "guard": []}
    if expect:
        runs.update({"verify --expect": [], "guard + EXPECT": []})
    for i in range(repeat + 1):
        sample = {"verify": _wall(verify, _env())}
        guard = json.loads(
            subprocess.run(
                [python, "-c", GUARD, str(tree)], capture_output=True, text=True, check=True, env=_env()
            ).stdout
        )
        sample["guard"] = guard["import"] + guard["check"]
        if expect:
            sample["verify --expect"] = _wall([*verify, "--expect", expect], _env())
            with_expect = subprocess.run(
                [python, "-c", GUARD, str(tree)],
                capture_output=True,
                text=True,
                check=True,
                env=_env(PATCH_DSV4_EXPECT=expect),
            )
            guard = json.loads(with_expect.stdout)
            sample["guard + EXPECT"] = guard["import"] + guard["check"]
        if i:  # the first warms the page cache
            for key, value in sample.items():
                runs[key].append(value)
    return {key: _median(values) for key, values in runs.items()}


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
        # interleaved, so that the machine's load falls on both alike
        base = measure(args.baseline_python, base_tree, args.repeat, None)
        here = measure(sys.executable, here_tree, args.repeat, fp)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"vLLM {args.version}, applied tree; {args.repeat} fresh processes each (after one warm-up), medians")
    print(f"  fingerprint: {fp}")
    print(f"{'':24} {'baseline':>10} {'this':>10}")
    for key in ("verify", "verify --expect", "guard", "guard + EXPECT"):
        b = f"{base[key]:8.1f} ms" if key in base else f"{'-':>10}"
        print(f"  {key:22} {b} {here[key]:7.1f} ms")
    guard = here["guard + EXPECT"]
    print(f"guard (import + check, with PATCH_DSV4_EXPECT) <= 10 ms: {'met' if guard <= 10 else 'NOT met'}")


if __name__ == "__main__":
    main()
