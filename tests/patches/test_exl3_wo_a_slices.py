"""exl3-wo-a-slices' upstream recognition on shapes no release has: vLLM mapping ``wo_a.slice.G`` into ``wo_a``
itself, in ``load_weights`` or in a helper it builds its mapping with, is upstream; a mention of the name that
skips, rejects or logs those tensors is not (the anchors decide: pending)."""

from __future__ import annotations

import textwrap

import pytest

from patch_dsv4.patches import exl3_wo_a_slices as S
from patch_dsv4.patching.patch import Context

HELPERS = "vllm/models/deepseek_v4/common/exl3_mapping.py"
LOADER = (
    """\
from vllm.models.deepseek_v4.common.exl3_mapping import wo_a_group_entries


class DeepseekV4Model(nn.Module):
    def load_weights(self, weights):
"""
    + textwrap.indent(S.ANCHOR.strip("\n"), " " * 8)  # vLLM's stacked_params_mapping, as every release has it
    + """
{extra}
        for name, loaded_weight in weights:
{loop}
            for param_name, weight_name, shard_id in stacked_params_mapping:  # as vLLM's loader iterates it
                load(name.replace(weight_name, param_name), loaded_weight, shard_id)
"""
)
HELPER = """\
def wo_a_group_entries(config):
    return [("attn.wo_a.", f"attn.wo_a.slice.{g}.", g) for g in range(config.o_groups)]
"""
SHAPES = {
    # the fix, as vLLM might write it
    "entries-in-load-weights": (
        '        stacked_params_mapping += [("attn.wo_a.", f"attn.wo_a.slice.{g}.", g) for g in range(8)]',
        "            pass",
        "upstream",
    ),
    "entries-from-a-helper-in-another-module": (
        "        stacked_params_mapping.extend(wo_a_group_entries(self.config))",
        "            pass",
        "upstream",
    ),
    # look-alikes: the name is there, nothing maps it
    "slices-skipped": ("", '            if ".wo_a.slice." in name:\n                continue', "pending"),
    "slices-rejected": (
        "",
        '            if "wo_a.slice" in name:\n                raise ValueError("wo_a.slice: unsupported")',
        "pending",
    ),
    "helper-called-but-not-for-the-mapping": (
        "        log(wo_a_group_entries(self.config))",
        "            pass",
        "pending",
    ),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_slice_mapping_shapes_no_release_has(name):
    extra, loop, verdict = SHAPES[name]
    text = LOADER.format(extra=extra, loop=loop)
    (edit,) = [e for e in S.Exl3WoASlices.edits if e.file == S.MODEL]
    outcome = edit.evaluate(Context.from_texts({S.MODEL: text, HELPERS: HELPER}), text)
    assert outcome.verdict.value == verdict, outcome.detail
    if verdict == "upstream":
        assert "DeepseekV4Model.load_weights maps wo_a slices itself" in outcome.detail
        assert "'attn.wo_a.slice.{g}.'" in outcome.detail or 'f"attn.wo_a.slice.{g}."' in outcome.detail, outcome.detail
        if "helper" in name:
            assert f"(in {HELPERS}: DeepseekV4Model.load_weights -> wo_a_group_entries)" in outcome.detail, (
                outcome.detail
            )
