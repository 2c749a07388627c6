"""apply / apply again / verify / revert on every real release, pristine and reformatted.

Generic over the patches: whatever a release needs is applied, proven idempotent
(a second apply changes no byte, state included) and reverted byte for byte to
the wheel's own content.
"""

from __future__ import annotations

import ast
import hashlib

import pytest

from patch_dsv4.patching.edits import helper_source
from patch_dsv4.patching.registry import discover_patches
from tests.conftest import RELEASE_PARAMS
from tests.releases import content_snapshot, stat_snapshot, wheel_file

NEEDS_ACTION = {"pending", "drifted", "modified"}


def _state_bytes(tree):
    state = tree / ".patch-dsv4"
    return {
        str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(state.rglob("*"))
        if p.is_file()
    }


def _holds_the_helpers_as_written(tree, applied) -> None:
    """Each injected helper stands in the patched file exactly as its patch module has it."""
    by_id = {p.id: p for p in discover_patches()}
    for patch_id, verdict in applied.verdicts().items():
        if verdict != "applied":
            continue
        in_place = {(e["file"], e["scope"]) for e in applied.patch(patch_id)["edits"] if e["verdict"] == "applied"}
        for edit in by_id[patch_id].edits:
            if (edit.file, str(edit.scope)) not in in_place:
                continue  # an edit with no code path in this release (another edit of the patch has one)
            text = (tree / edit.file).read_text()
            lines = text.splitlines(keepends=True)
            defs = {n.name: n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)}
            for helper in edit.helpers:
                node = defs[helper.__name__]
                assert "".join(lines[node.lineno - 1 : node.end_lineno]) == helper_source(helper), helper.__name__


@pytest.mark.parametrize("reformatted", [False, True], ids=["pristine", "reformatted"])
@pytest.mark.parametrize("version", RELEASE_PARAMS)
def test_apply_twice_verify_revert(version, reformatted, make_tree, cli):
    tree = make_tree(version, reformatted=reformatted)
    before = stat_snapshot(tree)
    original = content_snapshot(tree)

    status = cli("status", "--site-packages", tree, "--json")
    assert status.code == 0, status.stderr
    needed = {pid for pid, v in status.verdicts().items() if v == "pending"}
    assert not {v for v in status.verdicts().values()} & {"drifted", "modified"}, status.stdout

    applied = cli("apply", "--site-packages", tree, "--json")
    assert applied.code == 0, applied.stderr
    for pid in needed:
        assert applied.verdicts()[pid] == "applied"
    after_first = stat_snapshot(tree)
    changed = {f for f, st in after_first.items() if before.get(f) != st}
    patched_files = set(applied.json()["changed_files"])
    assert {f for f in changed if not f.startswith(".patch-dsv4")} == patched_files
    assert bool(patched_files) == bool(needed)

    _holds_the_helpers_as_written(tree, applied)

    snap_files, snap_state = content_snapshot(tree), _state_bytes(tree)
    stat_after_first = stat_snapshot(tree)
    again = cli("apply", "--site-packages", tree, "--json")
    assert again.code == 0, again.stderr
    assert again.json()["changed_files"] == []
    assert content_snapshot(tree) == snap_files
    assert _state_bytes(tree) == snap_state
    assert stat_snapshot(tree) == stat_after_first, "a second apply rewrote a file"

    verify = cli("verify", "--site-packages", tree, "--json")
    assert verify.code == 0, verify.stdout
    assert not set(verify.verdicts().values()) & NEEDS_ACTION

    reverted = cli("revert", "--site-packages", tree, "--json")
    assert reverted.code == 0, reverted.stderr
    assert content_snapshot(tree) == original
    if not reformatted:
        for relpath in patched_files:
            assert (tree / relpath).read_bytes() == wheel_file(version, relpath), relpath
    assert not (tree / ".patch-dsv4").exists()
    assert not (tree / ".patch-dsv4.lock").exists()

    after = cli("verify", "--site-packages", tree, "--json")
    assert after.code == (1 if needed else 0), after.stdout
    assert {pid for pid, v in after.verdicts().items() if v == "pending"} == needed


@pytest.mark.parametrize("version,problem", [("0.28.0", False), ("0.29.0", True)])
def test_injected_constructor_call_binds_to_the_release(version, problem, make_tree):
    """0.29.0 dropped AutoWeightsLoader's skip_substrs: injected code using it must not fit there."""
    from patch_dsv4.patching.resolve import check_injected
    from patch_dsv4.pipeline.reading import context_for
    from patch_dsv4.tree.environment import locate_vllm

    env = locate_vllm(make_tree(version))
    code = "loader = AutoWeightsLoader(self, skip_substrs=['mtp.'])"
    problems = check_injected(context_for(env), "vllm/models/deepseek_v4/nvidia/model.py", [code], {"self"})
    assert bool(problems) == problem, problems
    if problem:
        assert "AutoWeightsLoader" in problems[0] and "skip_substrs" in problems[0]
    fits = "loader = AutoWeightsLoader(self, ignore_unexpected_prefixes=['vision.'])"
    assert check_injected(context_for(env), "vllm/models/deepseek_v4/nvidia/model.py", [fits], {"self"}) == []
