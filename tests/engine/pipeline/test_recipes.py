"""The trees users really have: recipe-patched, between releases, hand-edited, forced.

Recipe-patched trees are built by tests/recipe_trees.py, which reproduces what each public recipe script leaves
(edited scopes, injected names, backups) from its published behaviour, on the real release trees.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import types
from pathlib import Path

import pytest

from patch_dsv4 import guard
from patch_dsv4.tree.environment import locate_vllm, record_digest
from tests import recipe_trees as R
from tests.releases import content_snapshot, hand_edit, wheel

FLASHINFER = R.FLASHINFER
MODEL = R.MODEL


def _record_equal(tree: Path, under: str = "vllm/models/deepseek_v4") -> list[str]:
    """The files under ``under`` that are not byte for byte what pip's RECORD lists."""
    env = locate_vllm(site_packages=tree)
    return sorted(
        rel
        for rel, digest in env.record.items()
        if rel.startswith(under + "/") and (tree / rel).is_file() and record_digest((tree / rel).read_bytes()) != digest
    )


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _take_over_then_revert(cli, tree: Path, foreign_files: list[str], left: tuple[str, ...] = ()) -> None:
    """The way out: takeover saves each edited file, restores pip's bytes, applies; verify passes; revert gives
    RECORD."""
    edited = {rel: (tree / rel).read_bytes() for rel in foreign_files}
    dry = cli("takeover", "--site-packages", tree, "--dry-run")
    assert dry.code == 0, dry.stderr
    assert all(f"a/{rel}" in dry.stdout for rel in foreign_files), dry.stdout
    done = cli("takeover", "--site-packages", tree, "--json")
    assert done.code == 0, done.stderr
    saved = [Path(p) for p in done.json()["saved_edits"]]
    assert sorted(p.read_bytes() for p in saved) == sorted(edited.values())  # nothing of the user's is lost
    assert all(".patch-dsv4/saved-edits/" in str(p) for p in saved)
    for rel in foreign_files:
        for suffix in R.BACKUP_SUFFIX.values():  # the other tool's backups stay where they were
            backup = tree / (rel + suffix)
            if backup.exists():
                assert backup.is_file()
    verify = cli("verify", "--site-packages", tree, "--json")
    assert verify.code == 0, verify.stdout
    assert not {v for v in verify.verdicts().values()} & {"foreign", "pending", "drifted", "modified"}
    assert cli("revert", "--site-packages", tree).code == 0
    assert _record_equal(tree, R.NVIDIA) == sorted(left)
    assert all(p.exists() for p in saved)


# -- foreign edits: recognised, never pending/applied/upstream, never stacked behind ------------------------
@pytest.mark.parametrize("version", ["0.30.0", "0.31.0", "0.33.0"])
def test_wide_swa_recipe_is_foreign_and_taken_over(version, make_tree, cli):
    tree = make_tree(version)
    R.apply_wide_swa(tree, version)
    status = cli("status", "--site-packages", tree, "--json")
    wide = status.patch("wide-swa")
    assert wide["verdict"] == "foreign" and wide["foreign"] == "patch_dsv4_vl_sm120_wide_swa.py"
    assert "base 2" in wide["detail"] and "must be replaced" in wide["detail"]
    assert status.json()["next"].startswith("patch-dsv4 takeover --site-packages")
    assert "foreign: patch_dsv4_vl_sm120_wide_swa.py" in cli("status", "--site-packages", tree).stdout
    # verify fails, even where FlashInfer takes wide rows (0.31 on): the recipe's slicer still intercepts them
    verify = cli("verify", "--site-packages", tree)
    assert verify.code == 1 and "wide-swa is foreign: patch_dsv4_vl_sm120_wide_swa.py" in verify.stderr
    # apply, and apply --force, refuse: ours is never written behind theirs
    before = content_snapshot(tree)
    for args in ((), ("--force",)):
        refused = cli("apply", "--site-packages", tree, *args)
        assert refused.code == 1 and "another tool's edit" in refused.stderr and "--force" not in refused.stderr
        assert "takeover" in refused.stderr
    assert content_snapshot(tree) == before
    _take_over_then_revert(cli, tree, [FLASHINFER])


def test_the_guard_reports_a_foreign_edit(make_tree, monkeypatch, caplog):
    tree = make_tree("0.31.0")
    R.apply_wide_swa(tree, "0.31.0")
    module = types.ModuleType("vllm")
    module.__file__ = str(tree / "vllm" / "__init__.py")
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(guard, "_reported", False)
    monkeypatch.setenv(guard.ENV, "warn")
    with caplog.at_level(logging.DEBUG, logger="vllm.patch_dsv4"):
        guard.check()
    # the fingerprint it serves is logged at DEBUG on every start; what it reports is the one line above that
    (record,) = [r for r in caplog.records if r.name == "vllm.patch_dsv4" and r.levelno > logging.DEBUG]
    assert record.levelno == logging.ERROR
    assert "wide-swa is foreign: patch_dsv4_vl_sm120_wide_swa.py" in record.getMessage()


def test_stock028_on_0_28_is_foreign_for_both_fixes(make_tree, cli):
    tree = make_tree("0.28.0")
    changed = R.apply_stock028(tree, "0.28.0")
    verdicts = cli("status", "--site-packages", tree, "--json")
    assert verdicts.patch("dtype-policy")["foreign"] == "patch_dsv4_stock028.py"
    assert verdicts.patch("loader-skips")["foreign"] == "patch_dsv4_stock028.py"
    draft = [e for e in verdicts.patch("loader-skips")["edits"] if e["file"] == R.DSPARK]
    assert draft[0]["verdict"] == "foreign" and "uninitialised" in draft[0]["detail"]
    # not-applicable stays what it is, whatever else the files hold
    assert (
        verdicts.verdicts()["wide-swa"] == "not-applicable" and verdicts.verdicts()["stream-load"] == "not-applicable"
    )
    assert cli("verify", "--site-packages", tree).code == 1
    _take_over_then_revert(cli, tree, changed)


def test_stock028_half_applied_on_0_30(make_tree, cli):
    tree = make_tree("0.30.0")
    with pytest.raises(R.RecipeRefuses) as refused:
        R.apply_stock028(tree, "0.30.0")
    assert refused.value.written == [FLASHINFER]
    status = cli("status", "--site-packages", tree, "--json")
    assert status.patch("dtype-policy")["verdict"] == "foreign"  # never upstream, though o_proj.py has the fix
    assert status.verdicts()["loader-skips"] == "upstream"  # model.py untouched; flashinfer_sparse.py is no evidence
    assert status.verdicts()["wide-swa"] == "pending"  # its own scope is untouched
    _take_over_then_revert(cli, tree, [FLASHINFER])


@pytest.mark.parametrize("version", ["0.28.0", "0.30.0"])
def test_dense_exl3_o_proj_is_foreign(version, make_tree, cli):
    tree = make_tree(version)
    changed = R.apply_dense_exl3(tree, version)
    status = cli("status", "--site-packages", tree, "--json")
    dtype = status.patch("dtype-policy")
    assert dtype["verdict"] == "foreign" and dtype["foreign"] == "patch_dsv4_dense_exl3.py"
    assert "EXL3" in dtype["detail"]
    # the script's other edits are those of our opt-ins: the compressor's quant config, the wo_a slice entries
    assert (
        status.patch("dense-exl3")["verdict"] == "opt-in"
        and "takeover --with dense-exl3" in status.patch("dense-exl3")["detail"]
    )
    assert status.patch("exl3-wo-a-slices")["verdict"] == "opt-in"
    refused = cli("apply", "--site-packages", tree, "--force")
    assert refused.code == 1 and "--force" not in refused.stderr
    # takeover restores every file the script edited, from the backup that holds pip's bytes, and takes over
    # the opt-ins whose edits it provided: dense-exl3 (EXL3 branch, compressor) and exl3-wo-a-slices
    restored = sorted(set(changed))
    assert set(restored) == {R.COMPRESSOR, FLASHINFER, MODEL}
    _take_over_then_revert(cli, tree, restored)
    assert _record_equal(tree, R.DSV4) == []


def test_aux_streams_recipe_is_named_and_taken_over_as_the_opt_in(make_tree, cli):
    tree = make_tree("0.30.0")
    R.apply_aux_streams(tree, "0.30.0")
    status = cli("status", "--site-packages", tree, "--json")
    aux = status.patch("aux-streams")
    # nobody asked for our opt-in: it stays opt-in (verify ignores it), naming the other tool's switch
    assert aux["verdict"] == "opt-in" and "patch_dsv4_aux_streams_env.py" in aux["detail"]
    assert "LNA_DSV4_AUX_STREAMS" in aux["detail"] and "MTP draft" in aux["detail"]
    asked = cli("apply", "--site-packages", tree, "--with", "aux-streams")
    assert asked.code == 1 and "another tool's edit" in asked.stderr
    done = cli("takeover", "--site-packages", tree, "--json")
    assert done.code == 0, done.stderr
    assert done.verdicts()["aux-streams"] == "applied"  # both models now honour either switch
    assert "None if _patch_dsv4_aux_streams_off() else" in (tree / R.MTP).read_text()
    assert cli("verify", "--site-packages", tree).code == 0
    assert cli("revert", "--site-packages", tree).code == 0 and _record_equal(tree, R.NVIDIA) == []


def test_a_chain_of_scripts_is_undone_from_the_backup_that_equals_record(make_tree, cli):
    """lna-lab's Dockerfile order on 0.28.0 (each script run as its own command): later backups hold earlier edits."""
    tree = make_tree("0.28.0")
    chain = R.run_chain(tree, "0.28.0", keep_going=True)
    orig, later = tree / (FLASHINFER + ".orig"), tree / (FLASHINFER + ".orig-lna")
    assert orig.exists() and later.exists() and _sha(orig) != _sha(later)
    # a decoy that sorts first and is not pip's bytes is never chosen
    (tree / (FLASHINFER + ".a-decoy")).write_bytes(later.read_bytes())
    status = cli("status", "--site-packages", tree, "--json")
    assert status.patch("dtype-policy")["verdict"] == "foreign"
    edited = [
        rel for rel in sorted(set(chain.changed)) if rel in {FLASHINFER, MODEL, R.DSPARK, R.COMPRESSOR, R.ATTENTION}
    ]
    assert R.COMPRESSOR in edited and R.ATTENTION in edited  # dense-exl3's scopes: taken over as the opt-in
    _take_over_then_revert(cli, tree, edited)


def test_no_backup_of_pips_bytes_takes_over_from_the_wheel(make_tree, cli, monkeypatch, tmp_path):
    """Without a backup the bytes come from the release's wheel (the tests' cache, offline); without the wheel
    either, a reinstall is the way out, and nothing is written."""
    tree = make_tree("0.30.0")
    R.apply_wide_swa(tree, "0.30.0")
    (tree / (FLASHINFER + ".orig-wideswa")).unlink()
    status = cli("status", "--site-packages", tree, "--json")
    assert "takeover" in status.json()["next"] and "vllm==0.30.0 wheel" in status.json()["next"]
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PATCH_DSV4_CACHE", str(tmp_path / "empty"))
    before = content_snapshot(tree)
    refused = cli("takeover", "--site-packages", tree)
    assert refused.code == 1 and "no backup beside it" in refused.stderr and "vllm==0.30.0" in refused.stderr
    assert "release wheel cannot serve" in refused.stderr and "--force-reinstall" in refused.stderr
    assert content_snapshot(tree) == before
    monkeypatch.setenv("PATCH_DSV4_CACHE", str(wheel("vllm", "0.30.0").parent.parent))
    _take_over_then_revert(cli, tree, [FLASHINFER])


def test_takeover_on_a_clean_tree_applies(make_tree, cli):
    tree = make_tree("0.30.0")
    done = cli("takeover", "--site-packages", tree, "--json")
    assert done.code == 0 and "nothing to take over" in " ".join(done.json()["notes"])
    assert done.verdicts()["stream-load"] == "applied"


# -- scope-local verdicts ---------------------------------------------------------------------------------------
def _edit_another_function(path: Path, cls: str, method: str) -> None:
    text = path.read_text()
    head = f"    def {method}("
    start = text.index(head, text.index(f"class {cls}"))
    body = text.index(":\n", start) + 2
    hand_edit(path, text[:body] + "        _ = 'a local hotfix'\n" + text[body:])


def test_an_edit_elsewhere_in_a_file_changes_no_verdict(make_tree, cli):
    tree = make_tree("0.28.0")
    pristine = cli("status", "--site-packages", tree, "--json").verdicts()
    _edit_another_function(tree / FLASHINFER, "DeepseekV4FlashInferSM120Attention", "_forward_decode")
    _edit_another_function(tree / MODEL, "DeepseekV4Model", "forward")
    status = cli("status", "--site-packages", tree, "--json")
    assert status.verdicts() == pristine  # wide-swa not-applicable, aux-streams opt-in, the rest pending
    notes = status.json()["notes"]
    assert sum("differs from pip's RECORD" in n for n in notes) == 2  # a note per file, once
    verify = cli("verify", "--site-packages", tree, "--json")
    assert "aux-streams" not in verify.stderr  # the opt-in nobody asked for is still ignored
    # RECORD still guards writes: nothing is written without consent
    before = content_snapshot(tree)
    refused = cli("apply", "--site-packages", tree)
    assert refused.code == 1 and "refusing to patch" in refused.stderr and content_snapshot(tree) == before


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_upstream_verdicts_survive_an_edit_elsewhere(version, make_tree, cli):
    tree = make_tree(version)
    pristine = cli("status", "--site-packages", tree, "--json").verdicts()
    _edit_another_function(tree / MODEL, "DeepseekV4Model", "forward")
    _edit_another_function(tree / FLASHINFER, "DeepseekV4FlashInferSM120Attention", "_forward_decode")
    assert cli("status", "--site-packages", tree, "--json").verdicts() == pristine
    assert pristine["loader-skips"] == pristine["dtype-policy"] == "upstream"


# -- --force: one judgement, printed, acted on, recorded ---------------------------------------------------------
def test_force_prints_what_it_does_and_status_agrees(make_tree, cli):
    tree = make_tree("0.28.0")
    _edit_another_function(tree / FLASHINFER, "DeepseekV4FlashInferSM120Attention", "_forward_decode")
    plain = cli("status", "--site-packages", tree, "--json").verdicts()
    forced = cli("apply", "--site-packages", tree, "--force", "--json")
    assert forced.code == 0, forced.stderr
    assert {pid: v for pid, v in forced.verdicts().items() if plain[pid] == "pending"} == {
        pid: "applied" for pid, v in plain.items() if v == "pending"
    }
    after = cli("status", "--site-packages", tree, "--json").verdicts()
    assert after == forced.verdicts() == cli("verify", "--site-packages", tree, "--json").verdicts()
    assert "_ = 'a local hotfix'" in (tree / FLASHINFER).read_text()  # patched as it was


def test_force_that_writes_nothing_leaves_verify_agreeing(make_tree, cli):
    tree = make_tree("0.33.0")
    _edit_another_function(tree / MODEL, "DeepseekV4Model", "forward")
    forced = cli("apply", "--site-packages", tree, "--force", "--only", "dtype-policy", "--json")
    assert forced.code == 0
    verify = cli("verify", "--site-packages", tree, "--json")
    assert verify.verdicts() == forced.verdicts()


def test_a_drifted_refusal_under_force_names_the_cause(make_tree, cli):
    tree = make_tree("0.30.0")
    text = (tree / R.COMMON_VL).read_text().replace("key=lambda x: x[0]", "key=lambda item: item[0]")
    hand_edit(tree / R.COMMON_VL, text)
    refused = cli("apply", "--site-packages", tree, "--force")
    assert refused.code == 1 and "stream-load is drifted" in refused.stderr and "--force" not in refused.stderr


def test_only_and_with_together_apply_both(make_tree, cli):
    tree = make_tree("0.28.0")
    done = cli("apply", "--site-packages", tree, "--only", "dtype-policy", "--with", "aux-streams", "--json")
    assert done.code == 0, done.stderr
    assert done.verdicts()["dtype-policy"] == "applied" and done.verdicts()["aux-streams"] == "applied"
    assert done.verdicts()["loader-skips"] == "pending"


# -- between releases -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sort_form", ["iter", "sorted-mapper"])
def test_nightly_with_the_vision_class_in_nvidia_vl_model(sort_form, make_tree, cli):
    tree = make_tree("0.30.0")
    R.make_nvidia_vl_model_nightly(tree, "0.30.0", record_matches=True, eager_sort=sort_form)
    status = cli("status", "--site-packages", tree, "--json")
    stream = status.patch("stream-load")
    v4_files = [f for f in stream["files"] if f.startswith("vllm/models/deepseek_v4/")]  # V4.1's are pending too
    assert stream["verdict"] == "pending" and v4_files == [R.NVIDIA_VL], stream
    assert status.json()["build"]["known"] is False and "removed" in status.json()["build"]["detail"]
    done = cli("apply", "--site-packages", tree, "--json")
    assert done.code == 0 and done.verdicts()["stream-load"] == "applied"
    assert "_patch_dsv4_stream_language_model_first(" in (tree / R.NVIDIA_VL).read_text()
    assert cli("verify", "--site-packages", tree).code == 0
    assert cli("revert", "--site-packages", tree).code == 0 and _record_equal(tree) == []


def test_hand_made_nightly_layout_is_judged_but_not_written_without_consent(make_tree, cli):
    tree = make_tree("0.30.0")
    R.make_nvidia_vl_model_nightly(tree, "0.30.0", record_matches=False)
    stream = cli("status", "--site-packages", tree, "--json").patch("stream-load")
    assert (
        stream["verdict"] == "pending"
        and [f for f in stream["files"] if f.startswith("vllm/models/deepseek_v4/")] == [R.NVIDIA_VL]
        and "no vision class" not in stream["detail"]
    )
    before = content_snapshot(tree)
    refused = cli("apply", "--site-packages", tree)
    assert refused.code == 1 and "--force" not in refused.stderr.split("refusing")[0]
    assert content_snapshot(tree) == before


def test_recipe_stream_load_on_the_nightly_layout_is_foreign(make_tree, cli):
    tree = make_tree("0.30.0")
    R.make_nvidia_vl_model_nightly(tree, "0.30.0", record_matches=True, eager_sort="sorted-mapper")
    R.apply_stream_load(tree, "0.30.0")
    stream = cli("status", "--site-packages", tree, "--json").patch("stream-load")
    assert stream["verdict"] == "foreign" and stream["foreign"] == "patch_dsv4_vl_stream_load.py"


def test_a_file_added_to_a_release_makes_an_unknown_build(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("status", "--site-packages", tree, "--json").json()["build"]["known"] is True
    (tree / R.NVIDIA / "extra_model.py").write_text("X = 1\n")
    build = cli("status", "--site-packages", tree, "--json").json()["build"]
    assert build["known"] is False and "extra_model.py added" in build["detail"]


@pytest.mark.parametrize("record_matches", [True, False])
def test_a_rocm_only_condition_is_not_upstreams_switch(record_matches, make_tree, cli):
    tree = make_tree("0.30.0")
    R.make_rocm_conditional_mtp_nightly(tree, "0.30.0", record_matches=record_matches)
    aux = cli("status", "--site-packages", tree, "--json").patch("aux-streams")
    (mtp,) = [e for e in aux["edits"] if e["file"] == R.MTP]
    assert mtp["verdict"] != "upstream", mtp
    asked = cli("apply", "--site-packages", tree, "--with", "aux-streams")
    assert asked.code == 1  # drifted on mtp.py: never applied to the target model alone
