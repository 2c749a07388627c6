"""dtype-policy on the real releases: its scope, its evidence, and drift (the projection on torch: _torch.py)."""

from __future__ import annotations

import ast

import pytest

from patch_dsv4.patches.dtype_policy import (
    ATTENTION_CLASSES,
    FLASHINFER,
    FLASHMLA,
    O_PROJ,
    DtypePolicy,
    wo_a_dtype_gate,
)
from patch_dsv4.patching.patch import Context
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
        assert O_PROJ in edit["detail"] and "deep_gemm_fp8_o_proj runs fp8_einsum only when" in edit["detail"], edit
        assert "`wo_a.weight.dtype == torch.float8_e4m3fn`" in edit["detail"], edit
        if version == "0.34.0":  # one hop further: the class wo_a is assigned, its method, an import inside it
            assert "DeepseekV4GroupedWoA.grouped_forward" in edit["detail"], edit
        if "deepseek_v41/" in edit["file"] and version >= "0.31.0":
            assert "dsv41_o_proj" in edit["detail"], edit


def test_dtype_branch_removed_from_a_real_release_is_not_upstream(make_tree, cli):
    """0.34.0 with the op's dtype test gone: fp8_einsum runs for any wo_a, and the 0.28 anchor is not there."""
    tree = make_tree("0.34.0")
    path = tree / O_PROJ
    text = path.read_text()
    old = "use_fp8 = wo_a.weight.dtype == torch.float8_e4m3fn"
    assert text.count(old) == 1
    hand_edit(path, text.replace(old, "use_fp8 = True"))
    rewrite_record(tree, [O_PROJ])
    patch = cli("status", "--site-packages", tree, "--json").patch("dtype-policy")
    assert patch["verdict"] == "drifted"
    assert {e["verdict"] for e in patch["edits"] if "deepseek_v4_1/" not in e["file"]} == {"drifted"}


def test_dtype_branch_inverted_in_a_real_release_is_not_upstream(make_tree, cli):
    """0.34.0 with its flag's sense inverted (``!=``): fp8_einsum runs for a BF16 wo_a; a branch on the dtype
    is evidence only where the GEMM sits on the arm taken for FP8 alone."""
    tree = make_tree("0.34.0")
    path = tree / O_PROJ
    text = path.read_text()
    old = "use_fp8 = wo_a.weight.dtype == torch.float8_e4m3fn"
    assert text.count(old) == 1
    hand_edit(path, text.replace(old, "use_fp8 = wo_a.weight.dtype != torch.float8_e4m3fn"))
    rewrite_record(tree, [O_PROJ])
    patch = cli("status", "--site-packages", tree, "--json").patch("dtype-policy")
    assert patch["verdict"] == "drifted"
    assert {e["verdict"] for e in patch["edits"] if "deepseek_v4_1/" not in e["file"]} == {"drifted"}


# -- shapes no release has ------------------------------------------------------------------------
GROUPED = "vllm/models/deepseek_v4/common/grouped.py"
OPS = "vllm/models/deepseek_v4/common/ops/gemm.py"
ATTENTION = "vllm/models/deepseek_v4/attention.py"
FLASHMLA_CLASS = """\
from vllm.models.deepseek_v4.attention import DeepseekV4Attention


class DeepseekV4FlashMLAAttention(DeepseekV4Attention):
    def _o_proj(self, o, positions):
        z = self.wo_a.project(o, positions)
        return self.wo_b(z)
"""
ATTENTION_CLASS = """\
from vllm.models.deepseek_v4.common import grouped


class DeepseekV4Attention:
    def __init__(self, config):
        projection = grouped.GroupedWoA if config.grouped else grouped.PlainWoA
        self.wo_a = projection(config)
"""
GROUPED_CLASSES = """\
class GroupedWoA:
    def project(self, o, positions):
        from vllm.models.deepseek_v4.common.ops.gemm import grouped_gemm

        return grouped_gemm(o, layer_wo_a=self)


class PlainWoA(GroupedWoA):
    pass
"""
GATED = """\
def grouped_gemm(o, *, layer_wo_a):
    weight = getattr(layer_wo_a, "weight", None)
    if weight is not None and weight.dtype == torch.float8_e4m3fn:
        return fp8_einsum("bhr,hdr->bhd", o, layer_wo_a.weight)
    return torch.bmm(o, layer_wo_a.weight)
"""
#: name -> (the op module, verdict)
O_PROJ_SHAPES = {
    # the fix in another spelling: attribute class picked by a conditional expression through a module attribute,
    # a function-level import, a keyword argument, the dtype read through getattr
    "fix-through-a-conditional-class-pick-and-a-function-import": (GATED, "upstream"),
    # the dtype branch missing
    "fp8-gemm-whatever-the-dtype": (
        'def grouped_gemm(o, *, layer_wo_a):\n    return fp8_einsum("x", o, 1)\n',
        "drifted",
    ),
    # a dtype test that decides nothing (computed, never branched on)
    "dtype-tested-but-not-branched-on": (
        "def grouped_gemm(o, *, layer_wo_a):\n"
        "    is_fp8 = layer_wo_a.weight.dtype == torch.float8_e4m3fn\n"
        '    return fp8_einsum("x", o, layer_wo_a.weight)\n',
        "drifted",
    ),
    # the dtype branch with its sense inverted: the FP8 GEMM runs for a BF16 wo_a
    "fp8-gemm-on-the-bf16-arm": (
        "def grouped_gemm(o, *, layer_wo_a):\n"
        "    if layer_wo_a.weight.dtype != torch.float8_e4m3fn:\n"
        '        return fp8_einsum("x", o, layer_wo_a.weight)\n'
        "    return torch.bmm(o, layer_wo_a.weight)\n",
        "drifted",
    ),
    "fp8-gemm-after-an-early-return-for-fp8": (
        "def grouped_gemm(o, *, layer_wo_a):\n"
        "    if layer_wo_a.weight.dtype == torch.float8_e4m3fn:\n"
        "        return torch.bmm(o, layer_wo_a.weight)\n"
        '    return fp8_einsum("x", o, layer_wo_a.weight)\n',
        "drifted",
    ),
    # the fix with its test negated: a flag for BF16, the FP8 GEMM on its else arm; an early return for BF16
    "fp8-gemm-on-the-else-of-a-bf16-flag": (
        "def grouped_gemm(o, *, layer_wo_a):\n"
        "    is_bf16 = not (layer_wo_a.weight.dtype == torch.float8_e4m3fn)\n"
        "    if is_bf16:\n"
        "        return torch.bmm(o, layer_wo_a.weight)\n"
        "    else:\n"
        '        return fp8_einsum("x", o, layer_wo_a.weight)\n',
        "upstream",
    ),
    "fp8-gemm-after-an-early-return-for-bf16": (
        "def grouped_gemm(o, *, layer_wo_a):\n"
        "    if layer_wo_a.weight.dtype != torch.float8_e4m3fn:\n"
        "        return torch.bmm(o, layer_wo_a.weight)\n"
        '    return fp8_einsum("x", o, layer_wo_a.weight)\n',
        "upstream",
    ),
    # the branch tests another tensor's dtype (the activation's)
    "branch-on-the-activation-dtype": (
        "def grouped_gemm(o, *, layer_wo_a):\n"
        "    if o.dtype == torch.float8_e4m3fn:\n"
        '        return fp8_einsum("x", o, layer_wo_a.weight)\n'
        "    return torch.bmm(o, layer_wo_a.weight)\n",
        "drifted",
    ),
}


@pytest.mark.parametrize("name", list(O_PROJ_SHAPES))
def test_o_proj_shapes_no_release_has(name):
    op, verdict = O_PROJ_SHAPES[name]
    package = "vllm/models/deepseek_v4/common/__init__.py"
    texts = {FLASHMLA: FLASHMLA_CLASS, ATTENTION: ATTENTION_CLASS, package: "", GROUPED: GROUPED_CLASSES, OPS: op}
    (edit,) = [e for e in DtypePolicy.edits if e.file == FLASHMLA and e.scope.cls == "DeepseekV4FlashMLAAttention"]
    ctx = Context.from_texts(texts)
    outcome = edit.evaluate(ctx, FLASHMLA_CLASS)
    assert outcome.verdict.value == verdict, outcome.detail
    evidence, seen = wo_a_dtype_gate(ctx, FLASHMLA, "DeepseekV4FlashMLAAttention")
    if verdict == "upstream":
        assert f"{OPS}: grouped_gemm runs fp8_einsum only when" in evidence
        assert "through GroupedWoA.project" in evidence
    else:
        assert evidence is None and "calls fp8_einsum" in seen, seen
        if "layer_wo_a.weight.dtype" in op:  # a test of wo_a's dtype that does not gate the call: named
            assert "a BF16 wo_a takes too: `layer_wo_a.weight.dtype " in seen, seen
        else:
            assert "whatever wo_a's dtype" in seen, seen


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


def test_wo_a_handed_to_code_that_cannot_be_followed_is_no_evidence():
    """One path is gated, but _o_proj also hands wo_a to a function nobody can follow: not upstream."""
    flashmla = FLASHMLA_CLASS.replace(
        "        return self.wo_b(z)\n",
        "        z = z + self.extra_projection(o, self.wo_a)\n        return self.wo_b(z)\n",
    )
    package = "vllm/models/deepseek_v4/common/__init__.py"
    texts = {FLASHMLA: flashmla, ATTENTION: ATTENTION_CLASS, package: "", GROUPED: GROUPED_CLASSES, OPS: GATED}
    evidence, seen = wo_a_dtype_gate(Context.from_texts(texts), FLASHMLA, "DeepseekV4FlashMLAAttention")
    assert evidence is None
    assert seen.startswith(f"unknown: self.extra_projection() at {FLASHMLA}:DeepseekV4FlashMLAAttention._o_proj:"), seen
