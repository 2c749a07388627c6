"""Shapes the evaluator reads by what the code does, each written into a real release (re-released: RECORD
matches it), each with the verdict it must earn.

The first group is issue 37's list: shapes a next release could plausibly write (one function changed each) that
read wrong before the evaluator (a false upstream, a false pending, false drifted). The second group is ours: other
spellings of each fix (upstream) and of each defect (pending or drifted, never upstream)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.releases import hand_edit, record_digest, rewrite_record

V4_VL = "vllm/models/deepseek_v4/common/vl_model.py"
V41_VL = "vllm/models/deepseek_v41/nvidia/vl_model.py"
V4_MODEL = "vllm/models/deepseek_v4/nvidia/model.py"
O_PROJ = "vllm/models/deepseek_v4/nvidia/ops/o_proj.py"
COMPRESSOR = "vllm/models/deepseek_v4/compressor.py"
MIXIN = "vllm/models/deepseek_v4/common/weight_loading.py"

LOAD_034 = "        return loader.load_weights(self.hf_to_vllm_mapper.apply(weights))\n"
USE_FP8 = "    use_fp8 = wo_a.weight.dtype == torch.float8_e4m3fn\n"
BIAS_VL_TEST = '        if getattr(config, "vision_n_layers", 0) > 0:\n            # Vision checkpoints route'
BIAS_VL = """\
            self.gate.bias_vl = nn.Parameter(
                torch.empty(self.n_routed_experts, dtype=torch.float32),
                requires_grad=False,
            )
"""
KV_READ = "        return torch.mm(input_, self.weight.T, out_dtype=torch.float32)\n"
V4_LOAD_WEIGHTS = """\
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(self.hf_to_vllm_mapper.apply(weights))
"""
V4_CLASS_LINE = "class DeepseekV4ForConditionalGeneration(\n"
MIXIN_SOURCE = """\
from vllm.model_executor.models.utils import AutoWeightsLoader


class VisionWeightLoading:
    def load_weights(self, weights):
        loader = AutoWeightsLoader(self)
        return loader.load_weights(self.hf_to_vllm_mapper.apply(weights))
"""


def _add_to_record(tree: Path, relpath: str) -> None:
    """List a file a re-release adds in its RECORD."""
    (dist_info,) = tree.glob("vllm-*.dist-info")
    data = (tree / relpath).read_bytes()
    record = dist_info / "RECORD"
    text = record.read_text() + f"{relpath},sha256={record_digest(data)},{len(data)}\n"
    record.unlink()
    record.write_text(text)


def _shaped(make_tree, version: str, edits: dict[str, list[tuple[str, str]]], new: dict[str, str] | None = None):
    """A copy of ``version`` with each file's text replacements made (each old text once), re-released."""
    tree = make_tree(version)
    for relpath, replacements in edits.items():
        text = (tree / relpath).read_text()
        for old, replacement in replacements:
            assert text.count(old) == 1, (relpath, old)
            text = text.replace(old, replacement)
        hand_edit(tree / relpath, text)
    rewrite_record(tree, list(edits))
    for relpath, source in (new or {}).items():
        (tree / relpath).write_text(source)
        _add_to_record(tree, relpath)
    return tree


def _patch(cli, tree, patch_id: str) -> dict:
    return cli("status", "--site-packages", tree, "--json").patch(patch_id)


def _edit(patch: dict, relpath: str) -> dict:
    (edit,) = [e for e in patch["edits"] if e["file"] == relpath]
    return edit


# -- issue 37's shapes: each with the verdict the release's own code earns (or, for a defect, not upstream) ---------
def test_starred_display_in_v41_load_weights_is_not_upstream(make_tree, cli):
    """``mapped = [*self.hf_to_vllm_mapper.apply(weights)]`` holds the whole checkpoint in host memory."""
    tree = _shaped(
        make_tree,
        "0.34.0",
        {V41_VL: [(LOAD_034, "        mapped = [*self.hf_to_vllm_mapper.apply(weights)]\n"
                             "        return loader.load_weights(mapped)\n")]},
    )  # fmt: skip
    patch = _patch(cli, tree, "stream-load")
    edit = _edit(patch, V41_VL)
    assert patch["verdict"] == "drifted" and edit["verdict"] == "drifted"
    assert "not upstream: the weights are held whole: [*self.hf_to_vllm_mapper.apply(weights)] at" in edit["detail"]
    assert _edit(patch, V4_VL)["verdict"] == "upstream"  # V4's class is untouched


def test_bias_vl_left_out_of_hash_layers_is_not_upstream(make_tree, cli):
    """A vision checkpoint's hash layers without gate.bias_vl: the load stops with a KeyError."""
    test = BIAS_VL_TEST.replace(" > 0:", " > 0 and not is_hash_moe:")
    tree = _shaped(make_tree, "0.34.0", {V4_MODEL: [(BIAS_VL_TEST, test)]})
    patch = _patch(cli, tree, "loader-skips")
    assert patch["verdict"] == "pending"  # 0.34's loader still holds the 0.28 anchor: apply adds the skip
    target = [e for e in patch["edits"] if e["scope"] == "DeepseekV4Model.load_weights" and e["file"] == V4_MODEL]
    draft = [e for e in patch["edits"] if e["file"].endswith("dspark.py")]
    assert target[0]["verdict"] == draft[0]["verdict"] == "pending"


def test_bias_vl_made_by_setattr_is_upstream(make_tree, cli):
    setattr_call = """\
            setattr(
                self.gate,
                "bias_vl",
                nn.Parameter(torch.empty(self.n_routed_experts, dtype=torch.float32), requires_grad=False),
            )
"""
    tree = _shaped(make_tree, "0.34.0", {V4_MODEL: [(BIAS_VL, setattr_call)]})
    patch = _patch(cli, tree, "loader-skips")
    assert patch["verdict"] == "upstream", patch["detail"]
    target = [e for e in patch["edits"] if e["scope"] == "DeepseekV4Model.load_weights" and e["file"] == V4_MODEL]
    assert "DeepseekV4MoE.__init__ creates gate.bias_vl" in target[0]["detail"]


def test_load_weights_in_a_mixin_of_a_new_module_reads_as_the_release(make_tree, cli):
    imports = "import torch\n\nfrom vllm.models.deepseek_v4.common.weight_loading import VisionWeightLoading\n"
    tree = _shaped(
        make_tree,
        "0.34.0",
        {
            V4_VL: [
                (V4_LOAD_WEIGHTS, ""),
                ("import torch\n", imports),
                (V4_CLASS_LINE, V4_CLASS_LINE + "    VisionWeightLoading,\n"),
            ]
        },
        new={MIXIN: MIXIN_SOURCE},
    )
    patch = _patch(cli, tree, "stream-load")
    edit = _edit(patch, V4_VL)
    assert edit["verdict"] == "upstream", edit["detail"]
    assert "(VisionWeightLoading's, deepseek_v4/common/weight_loading.py)" in edit["detail"]
    assert patch["verdict"] == "upstream"


def test_dtype_test_in_a_helper_is_upstream(make_tree, cli):
    helper = "def _is_fp8(layer):\n    return layer.weight.dtype == torch.float8_e4m3fn\n\n\ndef deep_gemm_fp8_o_proj("
    tree = _shaped(
        make_tree,
        "0.34.0",
        {O_PROJ: [(USE_FP8, "    use_fp8 = _is_fp8(wo_a)\n"), ("def deep_gemm_fp8_o_proj(", helper)]},
    )
    patch = _patch(cli, tree, "dtype-policy")
    assert patch["verdict"] == "upstream"
    for edit in patch["edits"]:
        if edit["verdict"] != "not-applicable":
            assert "runs fp8_einsum only when `layer.weight.dtype == torch.float8_e4m3fn`" in edit["detail"], edit


def test_kv_score_forward_through_super_is_not_drifted(make_tree, cli):
    """``return super().forward(input_).float()``: the base's forward hands the work to the quant method."""
    tree = _shaped(make_tree, "0.34.0", {COMPRESSOR: [(KV_READ, "        return super().forward(input_).float()\n")]})
    patch = _patch(cli, tree, "dense-exl3")
    assert patch["verdict"] == "opt-in"
    verdicts = {e["label"]: e["verdict"] for e in patch["edits"]}
    assert "drifted" not in verdicts.values(), verdicts
    kv = [e for e in patch["edits"] if e["scope"] == "DeepseekV4CompressorKVScoreLinear.forward"][0]
    assert kv["verdict"] == "upstream" and "ColumnParallelLinear.forward" in kv["detail"]


def test_map_over_the_stream_is_upstream(make_tree, cli):
    lazy = "        return loader.load_weights(map(lambda item: item, self.hf_to_vllm_mapper.apply(weights)))\n"
    tree = _shaped(make_tree, "0.34.0", {V4_VL: [(LOAD_034, lazy)]})
    edit = _edit(_patch(cli, tree, "stream-load"), V4_VL)
    assert edit["verdict"] == "upstream" and "through WeightsMapper.apply, map" in edit["detail"]


def test_membership_test_of_the_dtype_is_upstream(make_tree, cli):
    tree = _shaped(
        make_tree, "0.34.0", {O_PROJ: [(USE_FP8, "    use_fp8 = wo_a.weight.dtype in (torch.float8_e4m3fn,)\n")]}
    )
    patch = _patch(cli, tree, "dtype-policy")
    assert patch["verdict"] == "upstream"


@pytest.mark.parametrize(("held", "verdict"), [(False, "upstream"), (True, "drifted")])
def test_load_weights_delegating_to_a_mixin_through_super(held, verdict, make_tree, cli):
    """The class keeps ``load_weights`` as ``return super().load_weights(weights)``: the mixin's is followed
    (``super().load_weights`` is not the loader), so what it does with the stream decides."""
    imports = "import torch\n\nfrom vllm.models.deepseek_v4.common.weight_loading import VisionWeightLoading\n"
    sort = "loader.load_weights(sorted(self.hf_to_vllm_mapper.apply(weights)))"
    mixin = MIXIN_SOURCE.replace("loader.load_weights(self.hf_to_vllm_mapper.apply(weights))", sort)
    mixin = mixin if held else MIXIN_SOURCE
    tree = _shaped(
        make_tree,
        "0.34.0",
        {
            V4_VL: [
                (V4_LOAD_WEIGHTS, V4_LOAD_WEIGHTS.split("\n")[0] + "\n        return super().load_weights(weights)\n"),
                ("import torch\n", imports),
                (V4_CLASS_LINE, V4_CLASS_LINE + "    VisionWeightLoading,\n"),
            ]
        },
        new={MIXIN: mixin},
    )
    edit = _edit(_patch(cli, tree, "stream-load"), V4_VL)
    assert edit["verdict"] == verdict, edit["detail"]
    if held:
        assert "not upstream: the weights are held whole: sorted(" in edit["detail"]
    else:
        assert "(VisionWeightLoading's, deepseek_v4/common/weight_loading.py)" not in edit["detail"]
        assert "through WeightsMapper.apply" in edit["detail"]


# -- shapes of our own: the fix in other spellings (upstream), the defect in other constructs (never upstream) --------
FIXES = {
    # a generator expression over the stream, and itertools.chain of it: lazy
    "stream-load: a generator expression": (
        V4_VL,
        LOAD_034,
        "        mapped = (item for item in self.hf_to_vllm_mapper.apply(weights))\n"
        "        return loader.load_weights(mapped)\n",
        "stream-load",
    ),
    "stream-load: functools.partial of map": (
        V4_VL,
        LOAD_034,
        "        import functools\n\n"
        "        keep = functools.partial(map, lambda item: item)\n"
        "        return loader.load_weights(keep(self.hf_to_vllm_mapper.apply(weights)))\n",
        "stream-load",
    ),
    # the language model holds what its loader returns (the names it loaded), not the stream it is given
    "stream-load: the loaded names in a list": (
        V4_MODEL,
        "        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)\n",
        "        return list(loader.load_weights(weights, mapper=self.hf_to_vllm_mapper))\n",
        "stream-load",
    ),
    # the dtype read through getattr with a default, tested with `is`
    "dtype-policy: getattr and is": (
        O_PROJ,
        USE_FP8,
        '    use_fp8 = getattr(wo_a.weight, "dtype", None) is torch.float8_e4m3fn\n',
        "dtype-policy",
    ),
    # the parameter registered by name
    "loader-skips: register_parameter": (
        V4_MODEL,
        BIAS_VL,
        '            self.gate.register_parameter(\n                "bias_vl",\n'
        "                nn.Parameter(torch.empty(self.n_routed_experts, dtype=torch.float32), requires_grad=False),\n"
        "            )\n",
        "loader-skips",
    ),
}
DEFECTS = {
    # containers and itertools that keep every item
    "stream-load: collections.deque": (
        V4_VL,
        LOAD_034,
        "        import collections\n\n"
        "        return loader.load_weights(iter(collections.deque(self.hf_to_vllm_mapper.apply(weights))))\n",
        "stream-load",
    ),
    "stream-load: itertools.tee": (
        V4_VL,
        LOAD_034,
        "        import itertools\n\n"
        "        first, second = itertools.tee(self.hf_to_vllm_mapper.apply(weights))\n"
        "        return loader.load_weights(second)\n",
        "stream-load",
    ),
    # the language model holds its part of the stream before its loader takes it
    "stream-load: the language model's part in a tuple": (
        V4_MODEL,
        "        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)\n",
        "        return loader.load_weights(tuple(weights), mapper=self.hf_to_vllm_mapper)\n",
        "stream-load",
    ),
    # a generator that takes every item before it yields one
    "stream-load: a generator that loops first": (
        V4_VL,
        LOAD_034,
        "        def in_order(stream):\n"
        "            held = []\n"
        "            for item in stream:\n"
        "                held.append(item)\n"
        "            yield from held\n\n"
        "        return loader.load_weights(in_order(self.hf_to_vllm_mapper.apply(weights)))\n",
        "stream-load",
    ),
    # an iterator handed to reversed() (a TypeError) or to another package's function: unknown
    "stream-load: reversed": (
        V4_VL,
        LOAD_034,
        "        return loader.load_weights(reversed(self.hf_to_vllm_mapper.apply(weights)))\n",
        "stream-load",
    ),
    # a membership test that lets BF16 through
    "dtype-policy: BF16 in the FP8 set": (
        O_PROJ,
        USE_FP8,
        "    use_fp8 = wo_a.weight.dtype in (torch.float8_e4m3fn, torch.bfloat16)\n",
        "dtype-policy",
    ),
    # bias_vl only for checkpoints with more vision layers than any has
    "loader-skips: a test no vision checkpoint meets": (
        V4_MODEL,
        BIAS_VL_TEST,
        '        if getattr(config, "vision_n_layers", 0) > 1000:\n            # Vision checkpoints route',
        "loader-skips",
    ),
}


@pytest.mark.parametrize("name", list(FIXES))
def test_a_fix_in_another_spelling_is_upstream(name, make_tree, cli):
    relpath, old, new, patch_id = FIXES[name]
    patch = _patch(cli, _shaped(make_tree, "0.34.0", {relpath: [(old, new)]}), patch_id)
    assert patch["verdict"] == "upstream", [e["detail"] for e in patch["edits"]]


@pytest.mark.parametrize("name", list(DEFECTS))
def test_a_defect_in_another_construct_is_never_upstream(name, make_tree, cli):
    relpath, old, new, patch_id = DEFECTS[name]
    patch = _patch(cli, _shaped(make_tree, "0.34.0", {relpath: [(old, new)]}), patch_id)
    assert patch["verdict"] in ("pending", "drifted"), patch["detail"]
    drifted = [e for e in patch["edits"] if e["verdict"] == "drifted"]
    assert all("not upstream: " in e["detail"] for e in drifted), [e["detail"] for e in drifted]  # says why
