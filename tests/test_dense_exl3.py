"""dense-exl3 and exl3-wo-a-slices on the real releases: opt-in, applied when asked, composed with dtype-policy,
and the way out of lna-lab's own scripts (recipe trees built by tests/recipe_trees.py)."""

from __future__ import annotations

import pytest

from tests import recipe_trees as R
from tests.releases import content_snapshot

VERSIONS = ["0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"]
OPT_INS = ("dense-exl3", "exl3-wo-a-slices")


def _verdicts(cli, tree) -> dict[str, str]:
    return cli("status", "--site-packages", tree, "--json").verdicts()


@pytest.mark.parametrize("version", VERSIONS)
def test_opt_in_until_asked_then_applied_and_reverted(version, make_tree, cli):
    tree = make_tree(version)
    pristine = content_snapshot(tree)
    before = _verdicts(cli, tree)
    assert all(before[pid] == "opt-in" for pid in OPT_INS)
    assert cli("apply", "--site-packages", tree).code == 0
    assert all(_verdicts(cli, tree)[pid] == "opt-in" for pid in OPT_INS)  # a plain apply leaves them alone
    done = cli("apply", "--site-packages", tree, "--with", "dense-exl3", "--with", "exl3-wo-a-slices")
    assert done.code == 0, done.stderr
    after = _verdicts(cli, tree)
    assert all(after[pid] == "applied" for pid in OPT_INS)
    if version in ("0.28.0", "0.29.0"):  # dense-exl3's call-site edit and dtype-policy's _o_proj stand together
        assert after["dtype-policy"] == "applied" and after["loader-skips"] == "applied"
    verify = cli("verify", "--site-packages", tree)
    assert verify.code == 0, verify.stdout
    again = cli("apply", "--site-packages", tree, "--json")  # remembered in the state: nothing more to do
    assert again.code == 0 and again.json()["changed_files"] == []
    assert cli("revert", "--site-packages", tree).code == 0
    assert content_snapshot(tree) == pristine
    assert all(_verdicts(cli, tree)[pid] == "opt-in" for pid in OPT_INS)


@pytest.mark.parametrize("version", ["0.28.0", "0.30.0"])
def test_lna_lab_tree_status_takeover_verify(version, make_tree, cli):
    """lna-lab's two dense-EXL3 scripts, as its Dockerfile runs them: named, taken over, verified, reverted."""
    tree = make_tree(version)
    pristine = content_snapshot(tree)
    changed = R.apply_dense_exl3(tree, version) + R.apply_attention_compressor(tree, version)
    status = cli("status", "--site-packages", tree, "--json")
    dense, slices = status.patch("dense-exl3"), status.patch("exl3-wo-a-slices")
    assert dense["verdict"] == "opt-in" and "patch_dsv4_dense_exl3.py" in dense["detail"]
    assert "takeover --with dense-exl3" in dense["detail"]
    scripts = {e["foreign"] for e in dense["edits"] if e["verdict"] == "foreign"}
    assert scripts == {"patch_dsv4_dense_exl3.py", "patch_dsv4_attention_compressor_exl3.py"}
    assert slices["verdict"] == "opt-in" and "slice.1 also matches slice.10" in slices["detail"]
    assert status.patch("dtype-policy")["verdict"] == "foreign"
    assert "takeover --with dense-exl3" in status.patch("dtype-policy")["detail"]
    taken = cli("takeover", "--site-packages", tree, "--with", "dense-exl3", "--with", "exl3-wo-a-slices", "--json")
    assert taken.code == 0, taken.stderr
    assert set(changed) <= set(taken.json()["changed_files"])  # restored from pip's bytes, then patched
    assert len(taken.json()["saved_edits"]) == len(set(changed))  # each edited file saved first
    verify = cli("verify", "--site-packages", tree, "--json")
    assert verify.code == 0, verify.stdout
    assert all(verify.verdicts()[pid] == "applied" for pid in OPT_INS)
    assert cli("revert", "--site-packages", tree).code == 0
    after = content_snapshot(tree)
    assert {rel: sha for rel, sha in after.items() if rel in pristine} == pristine  # lna's backups stay beside


@pytest.mark.parametrize("version", ["0.31.0", "0.33.0"])
def test_lna_lab_script_on_new_releases_leaves_the_compressor_edit(version, make_tree, cli):
    """On 0.31+ the script writes compressor.py, then refuses: that edit is named and taken over too."""
    tree = make_tree(version)
    with pytest.raises(R.RecipeRefuses) as refused:
        R.apply_dense_exl3(tree, version)
    assert list(refused.value.written) == [R.COMPRESSOR]
    dense = cli("status", "--site-packages", tree, "--json").patch("dense-exl3")
    assert dense["verdict"] == "opt-in" and "vllm_config.quant_config" in dense["detail"]
    taken = cli("takeover", "--site-packages", tree, "--with", "dense-exl3")
    assert taken.code == 0, taken.stderr
    assert _verdicts(cli, tree)["dense-exl3"] == "applied"
    assert cli("verify", "--site-packages", tree).code == 0


def test_the_v1_helper_renamed_by_v2_is_named_with_its_broken_fallback(make_tree, cli):
    tree = make_tree("0.30.0")
    R.apply_attention_compressor(tree, "0.30.0", helper="v1")
    R.apply_attention_compressor(tree, "0.30.0", helper="v2")
    dense = cli("status", "--site-packages", tree, "--json", "-v").patch("dense-exl3")
    assert "_lna_kv_score_v2" in dense["detail"] and "a BF16 compressor fails" in dense["detail"]
