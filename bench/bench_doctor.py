"""Wall time and peak memory of doctor on a full-size pack: its pack checks, and the whole command.

    python bench/bench_doctor.py [--repeat 5] [--version 0.30.0] [--pack mixedk|v41]

Builds a full-size synthetic pack in a temporary directory: the vcruz305 MixedK
vision pack (``--pack mixedk``, the default: 48 sparse shards, 101 GB apparent,
a few MB on disk) or the DeepSeek-V4.1-Flash routed-only EXL3 pack (``--pack v41``:
48 shards, ~188k tensors, tests/doctor/synthetic_v41.py); then, in a fresh
interpreter per run as a Dockerfile step would: (1) every pack check, and (2)
the whole ``patch-dsv4 doctor --site-packages TREE --pack PACK --serve-args ...``
on a real vLLM release tree (patched), every row included. Prints the median
wall time of the process and its peak RSS (``ru_maxrss`` of that child).
Targets: under 2 s and under 200 MB.

Measured for issue 39 (backbone.complete, typed statuses), on a shared 2-core host at load 7, the pack checks
of each checkout run alternately in fresh interpreters on one pack, 11 runs each, CPU time of the child (its
wall time followed the load, 1.1-1.7 s): V4.1-Flash 0.739 s before, 0.749 s after, peak RSS 105 / 103 MB;
MixedK 0.407 s before, 0.424 s after, 24 / 25 MB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = """
import sys
from pathlib import Path
if sys.argv[2] == "v41":
    from tests.doctor.synthetic_v41 import FLASH, build_v41_pack
    build_v41_pack(Path(sys.argv[1]), FLASH)
else:
    from tests.doctor.synthetic import FULL, build_mixedk_pack
    build_mixedk_pack(Path(sys.argv[1]), FULL)
"""
CHILD = """
import json, resource, sys, time
from pathlib import Path
start = time.perf_counter()
from patch_dsv4.doctor.readers.base import DoctorContext, run_checks
from patch_dsv4.doctor.run import pack_checks
ctx = DoctorContext.from_serve_args(sys.argv[2], pack=Path(sys.argv[1]))
rows = run_checks(ctx, pack_checks())
print(json.dumps({
    "seconds": time.perf_counter() - start,
    "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "statuses": sorted({row.status for row in rows}),
    "rows": len(rows),
}))
"""
DSPARK = """--speculative-config '{"method":"dspark","num_speculative_tokens":3}'"""


def _whole_command(command: list[str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS in MB, exit status) of one run of ``command``, measured for that child alone."""
    import os

    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - started, usage.ru_maxrss / 1024, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--version", default="0.30.0", help="the vLLM release tree the whole command runs on")
    parser.add_argument("--pack", choices=("mixedk", "v41"), default="mixedk", help="the full-size pack to judge")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-doctor-"))
    try:
        # Built in another process: a child inherits its parent's peak RSS across fork, so the parent stays small.
        pack = work / "pack"
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", BUILD, str(pack), args.pack], cwd=ROOT, check=True)
        built = time.perf_counter() - started
        shards = sorted(pack.glob("*.safetensors"))
        apparent = sum(p.stat().st_size for p in shards)
        on_disk = sum(p.stat().st_blocks * 512 for p in shards)
        walls, inside, rss = [], [], []
        for _ in range(args.repeat):
            started = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, str(pack), DSPARK], capture_output=True, text=True, cwd=ROOT, check=True
            )
            walls.append(time.perf_counter() - started)
            report = json.loads(proc.stdout)
            inside.append(report["seconds"])
            rss.append(report["max_rss_mb"])
        med = statistics.median
        print(
            f"pack: {len(shards)} shards, {apparent / 1e9:.2f} GB apparent, {on_disk / 1e6:.1f} MB on disk "
            f"(built in {built:.1f} s)"
        )
        print(
            f"{args.repeat} runs of the {report['rows']} pack checks, one fresh interpreter each "
            f"(statuses seen: {', '.join(report['statuses'])}):"
        )
        print(f"  wall time of the process, median   {med(walls):.3f} s   (target < 2 s)")
        print(f"  imports + checks inside it, median {med(inside):.3f} s")
        print(f"  peak RSS (ru_maxrss), max          {max(rss):.1f} MB   (target < 200 MB)")

        sys.path.insert(0, str(ROOT))
        from tests.releases import copy_tree, pristine_tree

        tree = copy_tree(pristine_tree(args.version), work / "site-packages")
        subprocess.run([sys.executable, "-m", "patch_dsv4", "apply", "--site-packages", str(tree), "-q"], check=True)
        command = [
            sys.executable,
            "-m",
            "patch_dsv4",
            "doctor",
            "--site-packages",
            str(tree),
            "--pack",
            str(pack),
            "--serve-args",
            f"--max-model-len 65536 --kv-cache-dtype fp8 --quantization exl3 {DSPARK}",
            "--json",
        ]
        _whole_command(command)  # warm
        runs = [_whole_command(command) for _ in range(args.repeat)]
        print(
            f"the whole `patch-dsv4 doctor` on vLLM {args.version} (patched) and this pack, {args.repeat} runs "
            f"(exit {runs[-1][2]}: the fake host has no vllm-exl3 or exllamav3):"
        )
        print(f"  wall time of the process, median   {med(r[0] for r in runs):.3f} s   (target < 2 s)")
        print(f"  peak RSS (ru_maxrss), max          {max(r[1] for r in runs):.1f} MB   (target < 200 MB)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
