"""Wall time of apply, of verify on the applied tree, and of `import libcst.matchers`.

    python bench/bench_engine.py [--version 0.30.0] [--repeat 5]

Runs the real command (a fresh interpreter per run, as a Dockerfile step or an
entrypoint would) on a copy of a real vLLM release from the test cache, and
checks that verify's fast path never imports libcst.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.releases import copy_tree, pristine_tree  # noqa: E402 - the checkout must be on sys.path first

PROBE = (
    "import sys, runpy; sys.argv = ['patch-dsv4', *sys.argv[1:]];\n"
    "from patch_dsv4.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print('LIBCST_IMPORTED' if 'libcst' in sys.modules else 'LIBCST_NOT_IMPORTED', file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    return time.perf_counter() - start, proc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", default="0.30.0")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    pristine = pristine_tree(args.version)
    py = sys.executable
    applies, verifies, imports, noop_applies = [], [], [], []
    libcst_on_verify = set()
    for _ in range(args.repeat):
        work = Path(tempfile.mkdtemp())
        tree = copy_tree(pristine, work / "site-packages")
        t, proc = timed([py, "-c", PROBE, "apply", "--site-packages", str(tree), "--json"])
        assert proc.returncode == 0, proc.stderr
        applies.append(t)
        t, proc = timed([py, "-c", PROBE, "apply", "--site-packages", str(tree), "--json"])
        assert proc.returncode == 0, proc.stderr
        noop_applies.append(t)
        t, proc = timed([py, "-c", PROBE, "verify", "--site-packages", str(tree), "--json"])
        assert proc.returncode == 0, proc.stderr
        verifies.append(t)
        libcst_on_verify.add(proc.stderr.strip().splitlines()[-1])
        t, proc = timed([py, "-c", "import libcst.matchers"])
        imports.append(t)
        t0, _ = timed([py, "-c", "pass"])
        shutil.rmtree(work)
    med = statistics.median
    print(f"vLLM {args.version}, {args.repeat} runs, median wall time (fresh interpreter each):")
    print(f"  apply (patches written)        {med(applies):.3f} s")
    print(f"  apply again (nothing to do)    {med(noop_applies):.3f} s")
    print(f"  verify on the applied tree     {med(verifies):.3f} s   [{', '.join(sorted(libcst_on_verify))}]")
    print(f"  python -c 'import libcst.matchers'  {med(imports):.3f} s")
    print(f"  python -c 'pass'               {t0:.3f} s")


if __name__ == "__main__":
    main()
