"""doctor on a full-size DeepSeek-V4.1 pack: on disk, from a stand-in Hub at a real Hub's latency, and the
overlay check on a real tree.

    python bench/bench_doctor_hub.py [--repeat 5] [--delays 0 0.05 0.15] [--code CHECKOUT]
                                     [--tree SITE --overlay-file FILE | --skip-overlay] [--skip-local]

Builds the full-size synthetic V4.1-Flash routed-only pack (tests/doctor/synthetic_v41.py: 48 shards, ~188k
tensors, real headers, sparse data) in a temporary directory, then, each run in a fresh interpreter:

1. every pack check on the pack on disk: wall time of the process, CPU time, peak RSS (targets: < 1 s, < 200 MB);
2. the same checks on ``hf://OWNER/NAME`` served by the stand-in Hub (tests/doctor/hub_server.py, in a process
   of its own on 127.0.0.1), once per ``--delays`` value: each answer that many seconds late (a real Hub is
   50-200 ms away), its large files (the shards, the 14 MB index) behind a 302 to a second loopback port, the
   "CDN", as the Hub's LFS/Xet files are. Wall time of the process, the requests both servers answered (the
   redirects included), the bytes doctor read and the bytes the servers sent, against the bound of the issue
   (twice the headers' bytes plus the JSON files). Target: under 2 s at 0.15 s a request;
3. rt.overlay-imports on a copy of the real vLLM 0.34.0 tree, pristine and with 0.30.0's
   model_executor/model_loader/weight_utils.py laid over it (from the test cache: tests/releases.py; or, where
   that cache is absent, ``--tree`` a scratch vLLM 0.34.0 site-packages, whose weight_utils.py this overwrites,
   and ``--overlay-file`` 0.30.0's weight_utils.py).

``--code CHECKOUT`` runs the doctor of another checkout (e.g. a ``git worktree`` of an older commit) against the
same pack and stand-in, for before/after figures.

Measured (2-core shared host, busy with other work; 7 runs, the package's .pyc present): on disk 0.77-0.83 s
wall, 0.72-0.79 s CPU, 105 MB (main before this round, same host and hour: 1.12 s, 1.07 s, 109 MB; before issue
32 item 5's work: 1.50 s, 1.45 s, 108 MB); from the stand-in Hub 34,428,785 bytes read, 0.65 of the bound. Where
the project's modules have no .pyc (PYTHONDONTWRITEBYTECODE set, an editable install) compiling them adds ~0.25 s
to each run: ``python -m compileall patcher`` first.

Issue 39 item 4 (the same host at a load of 5-6 on its 2 cores, 5 runs a delay, the stand-in with its CDN;
``--code`` a checkout of 484095a for "before"; requests counted by the stand-in, redirects included):

    delay   before: wall   CPU  requests  bytes read   after: wall   CPU  requests  bytes read
     0 ms        2.57 s  1.06 s     131   34,428,785        2.94 s  1.06 s    104   34,137,902
    50 ms        9.68 s  1.20 s     131   34,428,785        3.22 s  1.07 s    104   34,137,902
   150 ms       22.79 s  1.20 s     131   34,428,785        3.48 s  1.09 s    104   34,137,902

On that host a run's wall time is its CPU time stretched by the load (on disk: 1.8 s wall for 0.75 s of CPU;
at 0 ms the stand-in, answering 96 requests at once beside the parse, takes its share too); what latency adds
is the measure of the change: +0.5 s from 0 to 150 ms a request (4 round trips one after the other, and the 150
ms of the first), where it added 20.2 s before (one round trip a request). On a quiet host (on disk 0.8 s) that
would be about 1.1 s at 0 ms and 1.6 s at 150 ms (an estimate from these figures, not a run there). Peak RSS
145 MB (117 before): the headers read ahead, at most 64 MB of them, wait for the parse.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPO = "vcruz305/DeepSeek-V4.1-Flash-EXL3"
BUILD = """
import sys
from pathlib import Path
from tests.doctor.synthetic_v41 import FLASH, build_v41_pack
build_v41_pack(Path(sys.argv[1]), FLASH)
"""
LOCAL = """
import json, resource, sys, time
start, cpu = time.perf_counter(), time.process_time()
from pathlib import Path
from patch_dsv4.doctor.readers.base import DoctorContext, run_checks
from patch_dsv4.doctor.run import pack_checks
rows = run_checks(DoctorContext(pack=Path(sys.argv[1])), pack_checks())
print(json.dumps({
    "seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu,
    "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "rows": len(rows), "fails": [r.id for r in rows if r.status == "fail"],
}))
"""
HUB = """
import json, resource, sys, time
start, cpu = time.perf_counter(), time.process_time()
from patch_dsv4.doctor.readers.base import CHECKS, DoctorContext, run_checks
from patch_dsv4.doctor.run import _read_hub_pack, _register_checks, pack_checks
from patch_dsv4.doctor.readers.hub import open_source
try:  # as run.doctor does: the first requests made, the check modules imported while they are answered
    source = open_source(sys.argv[1], wait=False)
except TypeError:  # a doctor from before the Hub's reads were made side by side
    source = open_source(sys.argv[1])
ctx = DoctorContext(pack=source)
_register_checks()
_read_hub_pack(ctx)
rows = run_checks(ctx, [s for s in CHECKS if s.id == "pack.source"] + pack_checks())
source = ctx.source
print(json.dumps({
    "seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu,
    "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "bytes_read": source.bytes_read, "header_bytes": source.header_bytes, "requests": source.requests,
    "rows": len(rows), "fails": [r.id for r in rows if r.status == "fail"], "source": rows[0].detail,
}))
"""
SERVER = """
import json, sys
from pathlib import Path
from tests.doctor.hub_server import serving
with serving({sys.argv[1]: Path(sys.argv[2])}, delay=float(sys.argv[3]), cdn=True) as hub:
    print(hub.endpoint, flush=True)
    for line in sys.stdin:  # each line: what both servers answered since the last one
        with hub.lock:
            counts = {"requests": len(hub.requests), "sent": hub.bytes_sent - hub.tree_bytes}
            hub.requests.clear()
            hub.bytes_sent = hub.tree_bytes = 0
        print(json.dumps(counts), flush=True)
"""
OVERLAY = """
import json, sys, time
start = time.perf_counter()
from pathlib import Path
from patch_dsv4.doctor.readers.base import DoctorContext, Runtime
from patch_dsv4.doctor.checks.overlay import check_overlay_imports
tree = Path(sys.argv[1])
row = check_overlay_imports(DoctorContext(runtime=Runtime(site_dirs=(tree,), vllm_root=tree, vllm_version="0.34.0")))
print(json.dumps({"seconds": time.perf_counter() - start, "status": row.status, "detail": row.detail}))
"""
WEIGHT_UTILS = "vllm/model_executor/model_loader/weight_utils.py"


def child(code: str, *args: str, env: dict | None = None) -> tuple[float, dict]:
    """(wall seconds, the JSON the child printed) of ``code`` run in a fresh interpreter."""
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, check=True, env=env
    )
    return time.perf_counter() - started, json.loads(proc.stdout.strip().splitlines()[-1])


def headers_bytes(pack: Path) -> int:
    total = 0
    for shard in pack.glob("*.safetensors"):
        with open(shard, "rb") as fh:
            total += 8 + struct.unpack("<Q", fh.read(8))[0]
    return total


def _code_path(checkout: Path, work: Path) -> str:
    """A directory that makes ``import patch_dsv4`` find ``checkout``'s sources (laid out as the wheel is)."""
    package = work / "code" / "patch_dsv4"
    package.mkdir(parents=True)
    for entry in (checkout / "patcher").iterdir():
        (package / entry.name).symlink_to(entry)
    (package / "patches").symlink_to(checkout / "patches")
    (package / "anchors").symlink_to(checkout / "anchors")
    return f"{package.parent}{os.pathsep}{ROOT}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--delays", type=float, nargs="*", default=[0.0, 0.05, 0.15], help="seconds per answer")
    parser.add_argument("--code", type=Path, help="run the doctor of this checkout instead")
    parser.add_argument("--skip-local", action="store_true")
    parser.add_argument("--skip-overlay", action="store_true")
    parser.add_argument(
        "--tree", type=Path, help="a scratch vLLM 0.34.0 site-packages (its weight_utils.py is overwritten)"
    )
    parser.add_argument("--overlay-file", type=Path, help="vLLM 0.30.0's weight_utils.py, with --tree")
    args = parser.parse_args()
    med = statistics.median
    work = Path(tempfile.mkdtemp(prefix="bench-doctor-hub-"))
    try:
        code_env = dict(os.environ)
        if args.code:
            paths = [_code_path(args.code.resolve(), work), os.environ.get("PYTHONPATH", "")]
            code_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        print(f"doctor of {args.code or ROOT}")
        pack = work / "pack"
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", BUILD, str(pack)], cwd=ROOT, check=True)
        built = time.perf_counter() - started
        shards = sorted(pack.glob("*.safetensors"))
        headers = headers_bytes(pack)
        json_files = sum(p.stat().st_size for p in pack.glob("*.json"))
        print(
            f"pack: {len(shards)} shards, {sum(p.stat().st_size for p in shards) / 1e9:.1f} GB apparent, "
            f"{headers:,} bytes of headers, {json_files:,} bytes of JSON (built in {built:.1f} s)"
        )

        if not args.skip_local:
            runs = [child(LOCAL, str(pack), env=code_env) for _ in range(args.repeat)]
            report = runs[-1][1]
            print(
                f"on disk: {args.repeat} runs of the {report['rows']} pack checks (fails: {report['fails'] or 'none'}):"
            )
            print(f"  wall time of the process, median   {med(r[0] for r in runs):.3f} s   (target < 1 s)")
            print(f"  CPU time inside it, median         {med(r[1]['cpu'] for r in runs):.3f} s")
            print(
                f"  peak RSS (ru_maxrss), max          {max(r[1]['max_rss_mb'] for r in runs):.1f} MB   "
                "(target < 200 MB)"
            )

        bound = 2 * headers + json_files
        print(f"from the stand-in Hub, its large files behind a loopback CDN; {args.repeat} runs a delay:")
        print(
            f"  {'delay':>6} {'wall (median)':>14} {'CPU':>8} {'max RSS':>9} {'requests':>9} {'bytes read':>12} "
            f"{'sent':>12}"
        )
        for delay in args.delays:
            server = subprocess.Popen(
                [sys.executable, "-c", SERVER, REPO, str(pack), str(delay)],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                endpoint = server.stdout.readline().strip()
                env = {**code_env, "HF_ENDPOINT": endpoint, "HF_HOME": str(work / "hf-home"), "NO_PROXY": "127.0.0.1"}
                env.pop("HF_TOKEN", None)
                runs, counts = [], []
                for _ in range(args.repeat):
                    runs.append(child(HUB, f"hf://{REPO}", env=env))
                    server.stdin.write("\n")
                    server.stdin.flush()
                    counts.append(json.loads(server.stdout.readline()))
            finally:
                server.stdin.close()
                server.wait(timeout=30)
            report = runs[-1][1]
            wall, rss = med(r[0] for r in runs), max(r[1]["max_rss_mb"] for r in runs)
            cpu = med(r[1]["cpu"] for r in runs)
            print(
                f"  {delay * 1000:4.0f} ms {wall:12.3f} s {cpu:6.3f} s {rss:6.1f} MB "
                f"{counts[-1]['requests']:9} {report['bytes_read']:12,} {counts[-1]['sent']:12,}"
                + (f"  fails: {report['fails']}" if report["fails"] else "")
            )
        print(
            f"  bytes read: {report['header_bytes']:,} of shard headers ({report['header_bytes'] / headers:.3f} x the "
            f"headers); bound 2 x headers + JSON {bound:,} ({report['bytes_read'] / bound:.2f} of it)"
        )
        print(f"  pack.source: {report['source']}")

        if args.skip_overlay:
            return
        sys.path.insert(0, str(ROOT))
        if args.tree:
            tree, overlay = args.tree, args.overlay_file.read_text()
        else:
            from tests.releases import copy_tree, pristine_tree, wheel_file

            tree = copy_tree(pristine_tree("0.34.0"), work / "site-packages")
            overlay = wheel_file("0.30.0", WEIGHT_UTILS).decode()
        runs = [child(OVERLAY, str(tree)) for _ in range(args.repeat)]
        print(f"rt.overlay-imports on vLLM 0.34.0, pristine ({runs[-1][1]['status']}):")
        print(f"  the check alone, median            {med(r[1]['seconds'] for r in runs):.3f} s (imports included)")
        link = tree / "vllm" / "model_executor"
        if link.is_symlink():  # a test copy: a real folder of hard links, never written through
            target = os.readlink(link)
            link.unlink()
            shutil.copytree(target, link, copy_function=os.link, symlinks=True)
        (tree / WEIGHT_UTILS).unlink()
        (tree / WEIGHT_UTILS).write_text(overlay)
        runs = [child(OVERLAY, str(tree)) for _ in range(args.repeat)]
        print(
            f"  with 0.30.0's weight_utils.py over it ({runs[-1][1]['status']}): median "
            f"{med(r[1]['seconds'] for r in runs):.3f} s"
        )
        print(f"  {runs[-1][1]['detail']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
