"""The state's files damaged or unreadable: one clear line, never an internal error, nothing written."""

from __future__ import annotations

import json

import pytest

from patch_dsv4.patches.stream_load import VL_MODEL
from tests.errors import exit_2_line as _error
from tests.errors import one_line as _one_line
from tests.releases import stat_snapshot

STATE = ".patch-dsv4"


@pytest.mark.parametrize("damage", ["truncated", "not-utf8", "wrong-schema"])
def test_damaged_state_is_exit_2_and_nothing_written(damage, make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    manifest = tree / ".patch-dsv4" / "manifest.json"
    data = manifest.read_bytes()
    if damage == "truncated":
        manifest.write_bytes(data[: len(data) // 2])
    elif damage == "not-utf8":
        manifest.write_bytes(b"\xff\xfe" + data)
    else:
        manifest.write_text(json.dumps({**json.loads(data), "schema": 99}))
    before = stat_snapshot(tree)
    for command in ("status", "verify", "apply", "revert"):
        result = cli(command, "--site-packages", tree)
        assert result.code == 2, (command, result.stdout, result.stderr)
        assert "unreadable state" in _one_line(result.stderr)
    assert stat_snapshot(tree) == before


# -- damaged state: unreadable, never an internal error -------------------------------------------------------
@pytest.mark.parametrize(
    "key, value", [("opt_in", [[1]]), ("opt_in", {"a": 1}), ("opt_in", [{}]), ("files.patches", [[]])]
)
def test_wrong_types_in_the_state_are_an_unreadable_state(key, value, make_tree, cli):
    tree = make_tree("0.28.0")
    assert cli("apply", "--site-packages", tree, "--with", "aux-streams").code == 0
    path = tree / STATE / "manifest.json"
    manifest = json.loads(path.read_text())
    if key == "files.patches":
        next(iter(manifest["files"].values()))["patches"] = value
    else:
        manifest[key] = value
    path.write_text(json.dumps(manifest))
    for command in ("status", "verify", "apply", "revert"):
        result = cli(command, "--site-packages", tree)
        assert result.code == 2 and "unreadable state" in result.stderr and "internal error" not in result.stderr


def test_state_entry_naming_a_huge_file_is_never_read_whole(make_tree, cli):
    """A 4 GiB file where the state expects ours: not ours, never read whole, one line."""
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    target = tree / VL_MODEL
    target.unlink()
    with open(target, "wb") as fh:
        fh.truncate(4 << 30)  # sparse: 4 GiB of size, no disk
    try:
        status = cli("status", "--site-packages", tree)
        _error(status, VL_MODEL, "bytes")
        assert cli("revert", "--site-packages", tree).code == 1  # modified since we wrote it: kept
        assert target.stat().st_size == 4 << 30
    finally:
        target.unlink()
