"""rt.overlay-imports on a real vLLM 0.34.0 tree: pristine, and with a file overlaid from 0.30.0 (v41-packs.md §5:
vcruz305's dspark-in-checkpoint overlay installs a 0.30-era model_executor/model_loader/weight_utils.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from patch_dsv4.doctor.checks import overlay
from patch_dsv4.doctor.checks.overlay import check_overlay_imports
from patch_dsv4.doctor.readers.base import DoctorContext, Runtime
from tests.conftest import run_cli
from tests.releases import hand_edit, wheel_file

WEIGHT_UTILS = "vllm/model_executor/model_loader/weight_utils.py"
V41_MODEL = "vllm/models/deepseek_v41/nvidia/model.py"


def writable(tree: Path, relpath: str) -> Path:
    """``tree/relpath`` with no link into the shared pristine cache above it: the first linked folder on the
    way becomes a real one whose files are hard links (hand_edit then replaces a file, never writes through)."""
    path = tree
    for part in Path(relpath).parent.parts:
        path = path / part
        if path.is_symlink():
            target = os.readlink(path)
            path.unlink()
            shutil.copytree(target, path, copy_function=os.link, symlinks=True)
            break
    return tree / relpath


def row_for(tree: Path):
    runtime = Runtime(site_dirs=(tree,), vllm_root=tree, vllm_version="0.34.0")
    return check_overlay_imports(DoctorContext(runtime=runtime))


@pytest.fixture
def tree034(make_tree):
    return make_tree("0.34.0")


def test_a_pristine_tree_passes_reading_no_source_file(tree034, monkeypatch):
    read = []
    real = overlay.read_regular_file

    def counting(path, limit=64 << 20):
        read.append(Path(path).name)
        return real(path, limit)

    monkeypatch.setattr(overlay, "read_regular_file", counting)
    row = row_for(tree034)
    assert row.status == "pass" and "all 3,604 .py files of vLLM 0.34.0 are pip's" in row.detail
    assert read == ["RECORD"]  # sizes and time stamps only: no .py read, none hashed


def test_weight_utils_from_0_30_on_0_34_names_the_overlay_the_missing_names_and_the_importers(tree034):
    hand_edit(writable(tree034, WEIGHT_UTILS), wheel_file("0.30.0", WEIGHT_UTILS).decode())
    row = row_for(tree034)
    assert row.status == "fail"
    assert row.detail.startswith(f"{WEIGHT_UTILS} differs from pip's RECORD (an overlay from another vLLM)")
    for name in ("drop_checkpoint_cache", "finalize_model_weights", "make_attention_sink"):
        assert name in row.detail
    assert f"{V41_MODEL}:52 imports drop_checkpoint_cache" in row.detail
    assert row.detail.endswith("vLLM stops at import (ImportError).")
    reinstall = f"pip install --no-deps --upgrade --target {tree034} --force-reinstall vllm==0.34.0"
    assert f"Restore vLLM 0.34.0's own {WEIGHT_UTILS} ({reinstall})" in row.fix
    # A name the overlay keeps is no finding: default_weight_loader is in both releases.
    assert "default_weight_loader" not in row.detail


def test_the_row_in_doctor_as_a_user_sees_it(tree034):
    hand_edit(writable(tree034, WEIGHT_UTILS), wheel_file("0.30.0", WEIGHT_UTILS).decode())
    result = run_cli("doctor", "--site-packages", tree034, "--json")
    (row,) = [r for r in result.json()["checks"] if r["id"] == "rt.overlay-imports"]
    assert row["status"] == "fail" and "drop_checkpoint_cache" in row["detail"] and result.code == 1


def test_a_same_size_overlay_with_an_old_time_stamp_is_found_by_its_hash(tree034):
    path = writable(tree034, WEIGHT_UTILS)
    text = path.read_text()
    stamp = path.stat().st_mtime
    edited = text.replace("def drop_checkpoint_cache(", "def drop_checkpoint_cachX(")
    assert len(edited) == len(text) and edited != text
    hand_edit(path, edited)
    os.utime(path, (stamp - 7200, stamp - 7200))  # copied with its time kept, from an older install
    row = row_for(tree034)
    assert row.status == "fail" and "does not define drop_checkpoint_cache," in row.detail


def test_an_overlaid_importer_naming_what_the_tree_lacks_is_named(tree034):
    importer = tree034 / V41_MODEL  # under vllm/models: a real copy in the test tree
    text = importer.read_text()
    hand_edit(importer, "from vllm.model_executor.model_loader.weight_utils import fetch_engram_shards\n" + text)
    row = row_for(tree034)
    assert row.status == "fail"
    assert f"{V41_MODEL}:1 imports fetch_engram_shards, which {WEIGHT_UTILS} does not define" in row.detail


def test_an_import_inside_a_function_is_a_warning(tree034):
    importer = tree034 / V41_MODEL
    hand_edit(
        importer,
        importer.read_text()
        + "\n\ndef _later():\n    from vllm.model_executor.model_loader.weight_utils import fetch_engram_shards\n",
    )
    row = row_for(tree034)
    assert row.status == "warn" and "(inside a function) imports fetch_engram_shards" in row.detail


def test_imports_under_type_checking_or_guarded_by_import_error_are_not_findings(tree034):
    importer = tree034 / V41_MODEL
    hand_edit(
        importer,
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from vllm.model_executor.model_loader.weight_utils import fetch_engram_shards\n"
        "try:\n    from vllm.model_executor.model_loader.weight_utils import other_name\n"
        "except ImportError:\n    other_name = None\n" + importer.read_text(),
    )
    row = row_for(tree034)
    assert row.status == "pass" and f"1 .py file differs from pip's RECORD ({V41_MODEL})" in row.detail
