"""Eight ranks apply at once, with and without the per-environment lock.

    python bench/lock_demo.py [--trials 3]            # the lock: every rank exits 0, revert is byte-exact
    python bench/lock_demo.py [--trials 3] --no-lock  # lock disabled: ranks refuse, backups are wrong

The ranks are those of tests/engine/pipeline/test_concurrency.py::test_eight_ranks_apply_at_once;
this shows that the test fails when the lock is disabled.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import patch_dsv4.tree.state
from tests.conftest import run_cli
from tests.releases import content_snapshot, copy_tree, pristine_tree
from tests.test_safety import run_ranks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--no-lock", action="store_true")
    parser.add_argument("--version", default="0.30.0")
    args = parser.parse_args()
    if args.no_lock:
        patch_dsv4.tree.state.StateStore.lock = lambda self, timeout, on_wait=None: contextlib.nullcontext()
    for trial in range(args.trials):
        work = Path(tempfile.mkdtemp())
        tree = copy_tree(pristine_tree(args.version), work / "site-packages")
        original = content_snapshot(tree)
        codes, _fired = run_ranks(tree)
        verify = run_cli("verify", "--site-packages", tree).code
        revert = run_cli("revert", "--site-packages", tree).code
        exact = content_snapshot(tree) == original
        print(f"trial {trial}: rank exit codes {codes}; verify {verify}; revert {revert}, byte-exact {exact}")
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
