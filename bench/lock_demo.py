"""Eight ranks apply at once, with and without the per-environment lock.

    python bench/lock_demo.py            # with the lock: all exit 0, revert byte-exact
    python bench/lock_demo.py --no-lock  # lock disabled: ranks refuse, wrong backups
"""
import contextlib, sys, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import patcher.state as st
from tests.releases import copy_tree, pristine_tree
from tests.test_safety import _run_ranks
from tests.conftest import run_cli
if "--no-lock" in sys.argv:
    st.StateStore.lock = lambda self, timeout: contextlib.nullcontext()
for trial in range(3):
    tree = copy_tree(pristine_tree("0.30.0"), Path(tempfile.mkdtemp()) / "sp")
    codes = _run_ranks(tree)
    v = run_cli("verify", "--site-packages", tree).code
    backups = sorted(str(p.relative_to(tree)) for p in (tree / ".patch-dsv4").rglob("*") if p.is_file()) if (tree / ".patch-dsv4").exists() else []
    print(f"trial {trial}: exit codes {codes}, verify {v}, state files {len(backups)}")
    r = run_cli("revert", "--site-packages", tree)
    import hashlib
    from tests.releases import wheel_file
    ok = all((tree / f).read_bytes() == wheel_file("0.30.0", f) for f in ["vllm/models/deepseek_v4/common/vl_model.py", "vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py"])
    print(f"   revert {r.code}, byte-exact {ok}")
