"""dtype-policy on the real releases: its scope, its evidence, and drift (the projection on torch: _torch.py)."""

from __future__ import annotations

import ast

import pytest

from patch_dsv4.patches.dtype_policy import ATTENTION_CLASSES, FLASHINFER, FLASHMLA, O_PROJ
from tests.errors import error_lines
from tests.injected import function_node
from tests.records import recorded_verdict, releases_needing
from tests.releases import RELEASES, hand_edit, rewrite_record, stat_snapshot
from tests.roundtrip import roundtrip_one_patch

NEEDED = releases_needing("dtype-policy")
HELPER = "_patch_dsv4_bf16_o_proj"


@pytest.mark.parametrize("version", [v for v in RELEASES if recorded_verdict(v, "dtype-policy") == "upstream"])
def test_upstream_names_its_evidence(version, make_tree, cli):
    patch = cli("status", "--site-packages", make_tree(version), "--json").patch("dtype-policy")
    assert patch["verdict"] == "upstream"
    for edit in patch["edits"]:
        if "deepseek_v4_1/" in edit["file"]:  # V4.1's nightly layout: not in a release
            assert edit["verdict"] == "not-applicable" and "not part of this release" in edit["detail"]
            continue
        assert O_PROJ in edit["detail"] and "deep_gemm_fp8_o_proj" in edit["detail"], edit


@pytest.mark.parametrize("reformatted", [False, True], ids=["pristine", "reformatted"])
@pytest.mark.parametrize("version", NEEDED)
def test_apply_again_verify_revert(version, reformatted, make_tree, cli):
    tree = make_tree(version, reformatted=reformatted)
    roundtrip_one_patch(cli, tree, "dtype-policy", {FLASHINFER, FLASHMLA}, version, reformatted)


@pytest.mark.parametrize("version", NEEDED)
def test_each_class_routes_bf16_to_the_helper(version, make_tree, cli):
    tree = make_tree(version)
    assert cli("apply", "--site-packages", tree, "--only", "dtype-policy").code == 0
    for _what, file, cls in ATTENTION_CLASSES:
        method = function_node(tree / file, cls, "_o_proj")
        text = ast.unparse(method)
        assert f"return {HELPER}(self, o, positions)" in text, cls
        assert "return deep_gemm_fp8_o_proj(" in text, cls
    for file in (FLASHINFER, FLASHMLA):
        assert (tree / file).read_text().count(f"def {HELPER}(") == 1


def test_changed_projection_is_drifted_and_nothing_written(make_tree, cli):
    tree = make_tree("0.28.0")
    path = tree / FLASHMLA
    text = path.read_text()
    changed = text.replace("tma_aligned_scales=self._tma_aligned_scales,", "tma_aligned_scales=True,", 1)
    assert changed != text
    hand_edit(path, changed)
    rewrite_record(tree, [FLASHMLA])  # a release that really ships this code
    before = stat_snapshot(tree)

    status = cli("status", "--site-packages", tree, "--json")
    patch = status.patch("dtype-policy")
    assert patch["verdict"] == "drifted"
    drifted = [e for e in patch["edits"] if e["verdict"] == "drifted"]
    assert len(drifted) == 1 and FLASHMLA == drifted[0]["file"]
    assert "tma_aligned_scales=self._tma_aligned_scales" in drifted[0]["expected"]
    assert "tma_aligned_scales=True" in drifted[0]["found"]

    applied = cli("apply", "--site-packages", tree)
    assert applied.code == 1
    assert "dtype-policy is drifted" in applied.stderr
    assert len(error_lines(applied.stderr)) == 1
    assert stat_snapshot(tree) == before


# -- the patched _o_proj, executed on CPU torch ----------------------------------------
