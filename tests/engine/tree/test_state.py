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
def test_damaged_state_is_exit_2_for_status_and_verify_and_apply_rebuilds_it(damage, make_tree, cli):
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
    for command in ("status", "verify"):
        result = cli(command, "--site-packages", tree)
        assert result.code == 2, (command, result.stdout, result.stderr)
        line = _one_line(result.stderr)
        assert "unreadable state" in line and f"(next: patch-dsv4 apply --site-packages {tree} (rebuilds" in line
    assert stat_snapshot(tree) == before
    rebuilt = cli("apply", "--site-packages", tree, "--json")
    assert rebuilt.code == 0 and rebuilt.json()["notes"][0].startswith("rebuilt the state (5 file(s), vLLM 0.30.0)")
    assert cli("verify", "--site-packages", tree).code == 0


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
    for command in ("status", "verify"):
        result = cli(command, "--site-packages", tree)
        assert result.code == 2 and "unreadable state" in result.stderr and "internal error" not in result.stderr
    rebuilt = cli("apply", "--site-packages", tree)  # from proof: the opt-in it finds applied is kept
    assert rebuilt.code == 0 and "rebuilt the state" in rebuilt.stdout, rebuilt.stderr
    assert json.loads(path.read_text())["opt_in"] == ["aux-streams"]
    assert cli("verify", "--site-packages", tree).code == 0


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
