"""A tree patched by the previous patch-dsv4 still works with this one.

The previous version (the last commit before the single ``patch_dsv4`` package
and helpers written as real functions) is taken from this repository's own
history with ``git archive`` and run on a real release tree; then this version
verifies it (passing, or naming the one command that updates it), updates it,
and reverts it byte for byte to the wheel's files.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile

import pytest

from tests.conftest import ROOT
from tests.releases import content_snapshot, wheel_file

PREVIOUS = "af99729"  # patch-dsv4 before this layout: packages patcher/patches/anchors, helpers in strings


@pytest.fixture(scope="module")
def previous(tmp_path_factory):
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", PREVIOUS, "patcher", "patches", "anchors"],
        capture_output=True,
    )
    if archive.returncode != 0:
        pytest.skip(f"commit {PREVIOUS} is not in this clone's history: {archive.stderr.decode().strip()}")
    dest = tmp_path_factory.mktemp("previous")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def _previous_apply(previous, tree) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "patcher", "apply", "--site-packages", str(tree)],
        cwd=previous,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(previous), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("version", ["0.28.0", "0.30.0"])
def test_a_tree_the_previous_version_patched(version, previous, make_tree, cli):
    tree = make_tree(version)
    original = content_snapshot(tree)
    _previous_apply(previous, tree)
    patched_by_previous = content_snapshot(tree)
    written = [rel for rel in original if original[rel] != patched_by_previous[rel]]
    assert written

    verify = cli("verify", "--site-packages", tree, "--json")
    if verify.code != 0:
        assert verify.code == 1
        needed = [p for p in verify.json()["patches"] if p["verdict"] == "pending"]  # opt-ins not asked for aside
        pending = [e for p in needed for e in p["edits"] if e["verdict"] == "pending"]
        # each is either an edit of the previous version's to update, or one it never made (V4.1's files)
        outdated = [e for e in pending if e["file"] in written]
        added = {e["file"] for e in pending if e["file"] not in written}
        assert pending and all("older patch-dsv4" in e["detail"] for e in outdated), verify.stdout
        assert all(rel.startswith("vllm/models/deepseek_v41/") for rel in added), added
        assert "patch-dsv4 apply" in verify.stderr, verify.stderr
        updated = cli("apply", "--site-packages", tree, "--json")
        assert updated.code == 0, updated.stderr
        assert set(updated.json()["changed_files"]) <= set(written) | added
        assert cli("verify", "--site-packages", tree).code == 0

    reverted = cli("revert", "--site-packages", tree)
    assert reverted.code == 0, reverted.stderr
    assert content_snapshot(tree) == original
    for rel in written:
        assert (tree / rel).read_bytes() == wheel_file(version, rel)
