"""All or none, nothing lost: a hand-changed file refused or kept, and a transform that is not idempotent
caught before writing."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from patch_dsv4.output.verdicts import Outcome, Verdict
from patch_dsv4.patches.stream_load import VL_MODEL
from patch_dsv4.patching.patch import Edit, Patch, Scope
from patch_dsv4.pipeline import commands
from tests.errors import one_line as _one_line
from tests.releases import hand_edit, stat_snapshot

STATE = ".patch-dsv4"


def test_hand_changed_file_refused_unless_force(make_tree, cli):
    tree = make_tree("0.30.0")
    target = tree / VL_MODEL
    edited = target.read_text() + "\n# a local hotfix\n"
    hand_edit(target, edited)
    before = stat_snapshot(tree)
    refused = cli("apply", "--site-packages", tree)
    assert refused.code == 1
    line = _one_line(refused.stderr)
    assert VL_MODEL in line and "RECORD" in line and "--force" in line
    assert stat_snapshot(tree) == before

    forced = cli("apply", "--site-packages", tree, "--force", "--json")
    assert forced.code == 0
    assert forced.verdicts()["stream-load"] == "applied"
    assert cli("revert", "--site-packages", tree).code == 0
    assert target.read_text() == edited  # the backup is what was there, hotfix included


def test_patched_file_changed_before_revert_is_kept(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    target = tree / VL_MODEL
    edited = target.read_text().replace("# patch-dsv4 (stream-load)", "# patch-dsv4 (stream-load) reviewed")
    hand_edit(target, edited)
    status = cli("status", "--site-packages", tree, "--json")
    assert status.verdicts()["stream-load"] == "modified"
    assert cli("verify", "--site-packages", tree).code == 1
    before = stat_snapshot(tree)
    refused = cli("revert", "--site-packages", tree)
    assert refused.code == 1
    assert "refusing to revert" in _one_line(refused.stderr)
    assert cli("apply", "--site-packages", tree).code == 1
    assert stat_snapshot(tree) == before
    assert target.read_text() == edited


class _Appending(Edit):
    """A broken transform: every run appends again."""

    label = "append forever"
    file = VL_MODEL
    scope = Scope("DeepseekV4ForConditionalGeneration", None)

    def evaluate(self, ctx, text):
        return Outcome(Verdict.PENDING, "always pending", variant=0)

    def rewrite(self, module, outcome):
        import libcst as cst

        return module.with_changes(body=[*module.body, *cst.parse_module("X = 1\n").body])

    def injected_code(self, outcome):
        return ()


class _NotIdempotent(Patch):
    """Test patch whose transform is not idempotent."""

    id = "not-idempotent"
    title = "test"
    edits = (_Appending(),)


def test_non_idempotent_transform_caught_before_writing(make_tree, cli, monkeypatch):
    monkeypatch.setattr(commands, "discover_patches", lambda: [_NotIdempotent()])
    tree = make_tree("0.30.0")
    before = stat_snapshot(tree)
    result = cli("apply", "--site-packages", tree)
    assert result.code == 2
    assert "not idempotent" in _one_line(result.stderr)
    assert stat_snapshot(tree) == before


# -- saved edits: contained, never wider, never replaced ------------------------------------------------------
def test_a_patched_file_replaced_by_a_link_out_of_the_package_is_never_saved(make_tree, cli, tmp_path):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    secret = tmp_path / "secret.py"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    (tree / VL_MODEL).unlink()
    (tree / VL_MODEL).symlink_to(secret)
    refused = cli("revert", "--site-packages", tree, "--discard-local-edits")
    assert refused.code in (1, 2) and "outside the vLLM package" in refused.stderr, refused.stderr
    saved = tree / STATE / "saved-edits"
    assert not saved.exists() or not any(p.is_file() for p in saved.rglob("*"))
    assert (tree / VL_MODEL).is_symlink()  # nothing was changed


def test_a_saved_edit_keeps_the_files_mode(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    hand_edit(tree / VL_MODEL, (tree / VL_MODEL).read_text() + "\n# mine\n")
    (tree / VL_MODEL).chmod(0o600)
    done = cli("revert", "--site-packages", tree, "--discard-local-edits", "--json")
    assert done.code == 0, done.stderr
    (saved,) = done.json()["saved_edits"]
    assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600 and "# mine" in Path(saved).read_text()


def test_two_discarding_reverts_in_one_second_keep_both_edits(make_tree, cli):
    tree = make_tree("0.30.0")
    kept = []
    for mark in ("first", "second"):
        assert cli("apply", "--site-packages", tree).code == 0
        hand_edit(tree / VL_MODEL, (tree / VL_MODEL).read_text() + f"\n# {mark}\n")
        done = cli("revert", "--site-packages", tree, "--discard-local-edits", "--json")
        assert done.code == 0, done.stderr
        kept += done.json()["saved_edits"]
    assert len(set(kept)) == 2
    assert [Path(p).read_text().rstrip().rsplit("\n", 1)[-1] for p in kept] == ["# first", "# second"]
