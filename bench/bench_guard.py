"""The serve guard's cost per vLLM process, and which vLLM processes call it, in a real vLLM venv.

Runs in the real, fully installed venv of tests/integration/venvs.py (built on first
use: about 8 GB and 10 minutes), with this checkout installed into it.

1. Cost. In fresh processes of the venv, one after another: ``import vllm``, then
   ``import patch_dsv4.guard``, then ``patch_dsv4.guard.check()`` (each timed in the
   process), on a pristine known build (no state: the guard decides from anchors/)
   and on an applied tree (the guard checks the state's hashes). One warm-up process,
   then ``--repeat`` measured ones per tree; medians. It also says whether ``check()``
   took a fast path or fell back to a full judgement. The target is at most 10 ms per
   process on an applied tree.
2. Callers. A throwaway ``vllm.general_plugins`` entry point (a dist-info and a module
   written into the venv for this run only, removed after) appends its pid, parent pid
   and argv to a file; ``vllm serve --help``, ``EngineArgs(model=...)`` and, as a
   control, ``import vllm`` run with ``PATCH_DSV4_GUARD=warn`` on the pristine tree
   (pending patches), and the bench prints the processes that called the plugins and
   how many ERROR lines of our guard each command logged.

The venv is left as it was found: the state is reverted, the throwaway plugin removed.

    python bench/bench_guard.py [--version 0.30.0] [--repeat 5] [--skip-callers]

``--tree`` measures the guard's first call without the real venv (no torch, nothing installed anywhere): a
writable copy of the release's installed tree (tests/releases.py) is applied, then each fresh interpreter
(``python -I``) registers that tree's ``vllm/`` as the imported vLLM and times ``import patch_dsv4.guard`` plus
``check()``, wall and CPU: in a bare interpreter (every module the guard needs counted), and after the standard
library modules a vLLM process has imported before it calls its plugins (logging, json, hashlib, re, fcntl).

    python bench/bench_guard.py --tree [--version 0.30.0] [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.integration import venvs  # noqa: E402 - the checkout must be on sys.path first
from tests.integration.conftest import RealVenv  # noqa: E402 - the checkout must be on sys.path first

MARK = "PATCH_DSV4_BENCH="
TIMING = (
    f"MARK = {MARK!r}\n"
    + r"""
import json, os, sys, time
t0 = time.perf_counter()
import vllm
t1 = time.perf_counter()
import patch_dsv4.guard as guard
t2 = time.perf_counter()
full = []
judge = guard._full_judgement
guard._full_judgement = lambda *a: full.append(1) or judge(*a)
os.environ["PATCH_DSV4_GUARD"] = "warn"
guard.check()
t3 = time.perf_counter()
problems = guard.judge_this_vllm()
print(MARK + json.dumps({"import_vllm": t1 - t0, "import_guard": t2 - t1, "check": t3 - t2,
                          "full_judgement": bool(full), "problems": [p[0] + " " + p[1] for p in problems]}))
"""
)

# The first call in a fresh interpreter: the tree's vllm/ stands for the imported vLLM (the guard reads its path).
# argv: the tree, then the standard library modules to import first (a vLLM process has them already).
COLD = (
    f"MARK = {MARK!r}\n"
    + r"""
import sys, time, types
tree = sys.argv[1]
for name in sys.argv[2:]:
    __import__(name)
sys.path.insert(0, tree)
vllm = types.ModuleType("vllm")
vllm.__file__ = tree + "/vllm/__init__.py"
sys.modules["vllm"] = vllm
before = set(sys.modules)
t1, c1 = time.perf_counter(), time.process_time()
import patch_dsv4.guard as guard
t2 = time.perf_counter()
full = []
judge = guard._full_judgement
guard._full_judgement = lambda *a: full.append(1) or judge(*a)
guard.check()
t3, c3 = time.perf_counter(), time.process_time()
problems = guard.judge_this_vllm()
import json
print(MARK + json.dumps({"import_guard": t2 - t1, "check": t3 - t2, "cpu": c3 - c1, "full_judgement": bool(full),
                          "modules": len(set(sys.modules) - before),
                          "problems": [p[0] + " " + p[1] for p in problems]}))
"""
)
# What vLLM has imported before it calls its plugins, of what the guard uses.
VLLM_PRELOADED = ("logging", "json", "hashlib", "re", "fcntl")


def cold_tree(version: str, repeat: int) -> None:
    """The guard's first call in fresh interpreters on an applied copy of ``version``'s installed tree."""
    import shutil
    import subprocess

    from tests.releases import copy_tree, pristine_tree

    work = Path(tempfile.mkdtemp(prefix="bench-guard-"))
    results = {}
    try:
        tree = copy_tree(pristine_tree(version), work / "site-packages")
        subprocess.run([sys.executable, "-m", "patch_dsv4", "apply", "--site-packages", str(tree), "-q"], check=True)
        cases = {"bare interpreter": [], "after vLLM's stdlib imports": list(VLLM_PRELOADED)}
        for i in range(repeat + 1):
            for label, preload in cases.items():  # interleaved: a load that comes and goes hits both alike
                proc = subprocess.run(
                    [sys.executable, "-I", "-c", COLD, str(tree), *preload],
                    capture_output=True,
                    text=True,
                    env={"PATCH_DSV4_GUARD": "warn", "PATH": "/usr/bin:/bin"},
                )
                lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
                if proc.returncode or not lines:
                    raise SystemExit(f"the timing process failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
                if i:  # the first round warms the page cache and writes the bytecode
                    results.setdefault(label, []).append(json.loads(lines[-1][len(MARK) :]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"vLLM {version}, applied tree; {repeat} fresh interpreters (python -I) per case after a warm-up round;")
    print(f"the guard's first call, its imports included; medians (min) in ms; load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':30} {'import':>8} {'check()':>8} {'wall':>14} {'CPU':>14} modules full")
    for label, runs in results.items():
        wall = [r["import_guard"] + r["check"] for r in runs]
        cpu = [r["cpu"] for r in runs]

        def med(values):
            return f"{statistics.median(values) * 1000:6.1f}"

        print(
            f"{label:30} {med(r['import_guard'] for r in runs):>8} {med(r['check'] for r in runs):>8} "
            f"{med(wall):>7} ({min(wall) * 1000:4.1f}) {med(cpu):>7} ({min(cpu) * 1000:4.1f}) "
            f"{runs[-1]['modules']:7} {sum(r['full_judgement'] for r in runs)}/{len(runs)}"
        )
    print(f"reported: {', '.join(results['bare interpreter'][-1]['problems']) or 'nothing'}")
    bare = statistics.median(r["import_guard"] + r["check"] for r in results["bare interpreter"])
    print(f"target: first call <= 10 ms (bare interpreter, wall median): {'met' if bare <= 0.010 else 'NOT met'}")


PROBE_NAME = "patch_dsv4_bench_probe"
PROBE_MODULE = '''
import json, os, sys, time

def record():
    """Written by bench/bench_guard.py: which processes call vLLM's general plugins."""
    path = os.environ.get("PATCH_DSV4_BENCH_CALLS")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "t": time.time()}) + "\\n")
'''


def timings(venv: RealVenv, label: str, repeat: int) -> dict:
    runs = []
    for i in range(repeat + 1):
        proc = venv.run([venv.python, "-c", TIMING])
        lines = [line for line in proc.output.splitlines() if line.startswith(MARK)]
        if proc.rc != 0 or not lines:
            raise SystemExit(f"{label}: the timing process failed (exit {proc.rc}):\n{proc.tail()}")
        result = json.loads(lines[-1][len(MARK) :])
        if i:  # the first one warms the page cache and bytecode
            runs.append(result)
    med = {key: statistics.median(r[key] for r in runs) for key in ("import_vllm", "import_guard", "check")}
    return {
        "label": label,
        "runs": runs,
        "median": med,
        "full": sum(r["full_judgement"] for r in runs),
        "problems": runs[-1]["problems"],
    }


def install_probe(venv: RealVenv) -> list[Path]:
    module = venv.site / f"{PROBE_NAME}.py"
    dist = venv.site / f"{PROBE_NAME}-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PROBE_NAME}\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PROBE_NAME} = {PROBE_NAME}:record\n")
    module.write_text(PROBE_MODULE)
    return [module, dist]


def remove(paths: list[Path]) -> None:
    import shutil

    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for cached in (paths[0].parent / "__pycache__").glob(f"{PROBE_NAME}.*"):
        cached.unlink()


def callers(venv: RealVenv) -> list[dict]:
    seen = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"  # a local model directory: EngineArgs does not go to the hub for it
        model.mkdir()
        (model / "config.json").write_text('{"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]}')
        commands = {
            "vllm serve --help": [venv.bin("vllm"), "serve", "--help"],
            "EngineArgs(model=...)": [
                venv.python,
                "-c",
                f"from vllm.engine.arg_utils import EngineArgs; EngineArgs(model={str(model)!r})",
            ],
            "import vllm (control)": [venv.python, "-c", "import vllm"],
        }
        for name, command in commands.items():
            calls = Path(tmp) / f"{len(seen)}.jsonl"
            proc = venv.run(command, env={"PATCH_DSV4_GUARD": "warn", "PATCH_DSV4_BENCH_CALLS": str(calls)})
            recorded = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
            guard_lines = [line for line in proc.output.splitlines() if "patch-dsv4: this vLLM lacks patches" in line]
            seen.append(
                {
                    "command": name,
                    "rc": proc.rc,
                    "seconds": proc.seconds,
                    "calls": recorded,
                    "guard_error_lines": len(guard_lines),
                    "tail": proc.tail(3),
                }
            )
    return seen


def ms(seconds: float) -> str:
    return f"{seconds * 1000:9.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="0.30.0")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--skip-callers", action="store_true")
    parser.add_argument("--tree", action="store_true", help="no real venv: a fresh bare interpreter per run")
    args = parser.parse_args()
    if args.tree:
        cold_tree(args.version, args.repeat)
        return

    started = time.monotonic()
    root = venvs.build(args.version)
    venvs.install_this_project(root)
    venv = RealVenv(args.version, root)
    venv.ensure_pristine()
    results, seen, probe = [], [], []
    try:
        results.append(timings(venv, "pristine known build (no state)", args.repeat))
        if not args.skip_callers:
            probe = install_probe(venv)
            seen = callers(venv)
            remove(probe)
            probe = []
        report = venv.cli("apply")
        assert report["exit_code"] == 0, report
        results.append(timings(venv, "applied tree", args.repeat))
    finally:
        if probe:
            remove(probe)
        venv.ensure_pristine()

    print(f"\nvLLM {args.version} venv {root}; {args.repeat} fresh processes per tree (after one warm-up), medians")
    print(f"{'tree':36} {'import vllm':>12} {'import guard':>12} {'check()':>12}  check/import vllm  full judgement")
    for r in results:
        m = r["median"]
        print(
            f"{r['label']:36} {ms(m['import_vllm'])} {ms(m['import_guard'])} {ms(m['check'])}  "
            f"{m['check'] / m['import_vllm']:16.2%}  {r['full']}/{len(r['runs'])}"
        )
        per_run = ", ".join(f"{x['check'] * 1000:.1f}" for x in r["runs"])
        print(f"{'':36} check() per run: {per_run} ms; reported: {', '.join(r['problems']) or 'nothing'}")
    applied = results[-1]["median"]["check"] + results[-1]["median"]["import_guard"]
    print(
        f"target: guard (import + check) <= 10 ms per process on an applied tree: "
        f"{'met' if applied <= 0.010 else 'NOT met'} ({applied * 1000:.1f} ms)"
    )
    if seen:
        print("\nprocesses that called vllm.general_plugins (PATCH_DSV4_GUARD=warn, pending tree):")
        for s in seen:
            pids = "; ".join(f"pid {c['pid']} (parent {c['ppid']}) argv {c['argv']}" for c in s["calls"]) or "none"
            print(
                f"  {s['command']:24} exit {s['rc']}, {s['seconds']:.0f} s: {len(s['calls'])} call(s): {pids}; "
                f"our ERROR lines: {s['guard_error_lines']}"
            )
            if s["rc"]:
                print(f"  {'':24} (its last line: {s['tail'].splitlines()[-1][:150]})")
    print(f"\n({time.monotonic() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
