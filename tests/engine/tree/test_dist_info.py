"""vLLM's dist-info damaged, odd or hostile: one clear line, and nothing the guard or a command opens can block it."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from patch_dsv4.fastpath import quick
from tests.errors import error_lines
from tests.errors import exit_2_line as _error
from tests.releases import stat_snapshot


def _dist_info(tree: Path) -> Path:
    (found,) = tree.glob("vllm-*.dist-info")
    return found


# -- nothing the guard or a command opens can block it -------------------------------------------------------
def _returns_within(seconds: float, fn):
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except Exception as exc:  # noqa: BLE001 (the test looks at what was raised)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked"
    return box


@pytest.mark.parametrize("which", ["vllm", "flashinfer"])
def test_a_fifo_metadata_never_blocks_the_guard_or_a_command(which, make_tree):
    from patch_dsv4.tree.environment import locate_vllm

    tree = make_tree("0.30.0")
    if which == "vllm":
        metadata = _dist_info(tree) / "METADATA"
    else:
        fake = tree / "flashinfer_python-0.6.18.post1.dist-info"
        fake.mkdir()
        metadata = fake / "METADATA"
    if metadata.exists():
        metadata.unlink()
    os.mkfifo(metadata)
    _returns_within(10, lambda: quick.locate([str(tree)]))
    box = _returns_within(10, lambda: locate_vllm(site_packages=tree))
    if which == "vllm":
        assert "error" in box and "not a regular file" in str(box["error"].line())


@pytest.mark.parametrize("damage", ["absent", "directory", "fifo"])
def test_a_dist_info_without_a_usable_record_is_one_clear_line(damage, make_tree, cli):
    tree = make_tree("0.30.0")
    record = _dist_info(tree) / "RECORD"
    record.unlink()
    if damage == "directory":
        record.mkdir()
    elif damage == "fifo":
        os.mkfifo(record)
    result = _returns_within(30, lambda: cli("status", "--site-packages", tree))["value"]
    assert result.code == 2 and result.stdout == ""
    (line,) = error_lines(result.stderr)
    assert "RECORD" in line and "drifted" not in line
    # the way out runs as printed, into the directory the user named
    assert line.endswith(f"(next: pip install --no-deps --force-reinstall --upgrade --target {tree} vllm==0.30.0)")


# -- damaged metadata ------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["record-not-utf8", "record-huge-field", "metadata-not-utf8"])
def test_damaged_record_or_metadata(damage, make_tree, cli):
    tree = make_tree("0.30.0")
    dist = _dist_info(tree)
    if damage == "record-not-utf8":
        (dist / "RECORD").write_bytes(b"\xff\xfe" + (dist / "RECORD").read_bytes())
    elif damage == "record-huge-field":
        (dist / "RECORD").write_text("vllm/x.py,sha256=" + "A" * 300_000 + ",1\n")
    else:
        (dist / "METADATA").write_bytes((dist / "METADATA").read_bytes() + b"\nSummary: \xff\xfe\n")
    before = stat_snapshot(tree)
    reinstall = f"pip install --no-deps --force-reinstall --upgrade --target {tree} vllm==0.30.0"
    for command in ("status", "verify", "apply", "revert"):
        line = _error(cli(command, "--site-packages", tree), "vllm")
        assert line.endswith(f"(next: {reinstall})"), line  # the release its dist-info's name gives
    assert stat_snapshot(tree) == before


def test_two_dist_infos_that_match_equally_well(make_tree, cli):
    tree = make_tree("0.30.0")
    dist = _dist_info(tree)
    other = tree / "vllm-0.31.0.dist-info"
    shutil.copytree(dist, other)
    meta = other / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 0.30.0", "Version: 0.31.0", 1))
    line = _error(cli("status", "--site-packages", tree), "0.30.0", "0.31.0", "equally well")
    assert "dist-info" in line
