"""loader-skips on the real releases: scope, evidence, signatures, drift (the loaders on torch: _torch.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from patch_dsv4.patches.loader_skips import DSPARK, MODEL, TEXT_CLASS, VL_MODEL
from tests.injected import function_node
from tests.records import recorded_verdict, releases_needing
from tests.releases import RELEASES, hand_edit, rewrite_record, stat_snapshot
from tests.roundtrip import roundtrip_one_patch

NEEDED = releases_needing("loader-skips")
UTILS = "vllm/model_executor/models/utils.py"


@pytest.mark.parametrize("version", [v for v in RELEASES if recorded_verdict(v, "loader-skips") == "upstream"])
def test_upstream_names_its_evidence(version, make_tree, cli):
    patch = cli("status", "--site-packages", make_tree(version), "--json").patch("loader-skips")
    vision, target, draft, *v41 = patch["edits"]
    assert (vision["file"], target["file"], draft["file"]) == (MODEL, MODEL, DSPARK)
    # V4.1's text class (release layout; the nightly one is absent): its own skip is the evidence
    assert [e["verdict"] for e in v41] == ["upstream", "not-applicable"]
    assert "drops vision., aligner. and image_ itself (its weight mapper and DeepseekV4Model" in v41[0]["detail"]
    assert VL_MODEL in vision["detail"] and "DeepseekV4ForConditionalGeneration" in vision["detail"]
    assert "DeepseekV4MoE.__init__ creates gate.bias_vl" in target["detail"], target
    assert DSPARK in draft["detail"] and "DeepseekV4DecoderLayer" in draft["detail"], draft


@pytest.mark.parametrize("reformatted", [False, True], ids=["pristine", "reformatted"])
@pytest.mark.parametrize("version", NEEDED)
def test_apply_again_verify_revert(version, reformatted, make_tree, cli):
    tree = make_tree(version, reformatted=reformatted)
    roundtrip_one_patch(cli, tree, "loader-skips", {MODEL, DSPARK}, version, reformatted)


def test_changed_loader_is_drifted_and_nothing_written(make_tree, cli):
    tree = make_tree("0.29.0")
    path = tree / MODEL
    text = path.read_text()
    changed = text.replace('suffixed = f"{head}.base_layer.{leaf}"', 'suffixed = f"{head}.base.{leaf}"')
    assert changed != text
    hand_edit(path, changed)
    rewrite_record(tree, [MODEL])
    before = stat_snapshot(tree)

    patch = cli("status", "--site-packages", tree, "--json").patch("loader-skips")
    assert patch["verdict"] == "drifted"
    assert [e["verdict"] for e in patch["edits"]] == [
        "pending",
        "drifted",
        "pending",
        "not-applicable",
        "not-applicable",
    ]
    assert "base_layer" in patch["edits"][1]["expected"]

    applied = cli("apply", "--site-packages", tree)
    assert applied.code == 1
    assert "loader-skips is drifted" in applied.stderr
    assert stat_snapshot(tree) == before


def loader_call(path: Path) -> ast.Assign:
    """``loader = AutoWeightsLoader(...)`` in the text class's load_weights."""
    method = function_node(path, TEXT_CLASS, "load_weights")
    (assign,) = [n for n in ast.walk(method) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "loader"]
    return assign


@pytest.mark.parametrize("version", NEEDED)
def test_loader_call_fits_the_release_signature(version, make_tree, cli):
    """0.29 dropped AutoWeightsLoader's skip_prefixes/skip_substrs: each release gets its own call."""
    tree = make_tree(version)
    assert cli("apply", "--site-packages", tree, "--only", "loader-skips").code == 0
    init = function_node(tree / UTILS, "AutoWeightsLoader", "__init__")
    accepted = {a.arg for a in (*init.args.args, *init.args.kwonlyargs)}
    call = loader_call(tree / MODEL).value
    assert isinstance(call, ast.Call) and ast.unparse(call.func) == "AutoWeightsLoader"
    assert "ignore_unexpected_prefixes" in {k.arg for k in call.keywords}
    assert {k.arg for k in call.keywords} <= accepted, ast.unparse(call)


# -- the patched loader code, executed on CPU torch ------------------------------------


# -- the DSpark draft's layers, in spellings no release has -------------------------------------------
MOE_WITH_BOTH_BIASES = """\
class DeepseekV4MoE(nn.Module):
    def __init__(self, config):
        self.gate.bias_vl = nn.Parameter(torch.empty(8))
        if config.vision_n_layers > 0:
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(8))


class DeepseekV4DecoderLayer(nn.Module):
    pass
"""
DRAFT_LOADER = """
class DSparkDeepseekV4ForCausalLM:
    def load_weights(self, weights):
        for name, tensor in weights:
            if name.endswith(".ffn.gate.bias"):
                name = name.replace(".ffn.gate.bias", ".ffn.gate.e_score_correction_bias")
            param = params_dict[name]
"""


@pytest.mark.parametrize(
    ("imports", "verdict"),
    [
        # the target's layer through a re-export of another module: upstream (its MoE has both biases)
        ("from vllm.models.deepseek_v4.nvidia.layers import DeepseekV4DecoderLayer\n", "upstream"),
        # a layer class of the draft's own, named as the target's: its MoE is not the target's, so no evidence
        ("class DeepseekV4DecoderLayer:\n    pass\n", "pending"),
    ],
    ids=["reexported-target-layer", "own-layer-of-the-same-name"],
)
def test_draft_layers_are_found_by_what_they_are(imports, verdict):
    from patch_dsv4.patches.loader_skips import LoaderSkips
    from patch_dsv4.patching.patch import Context

    dspark = imports + DRAFT_LOADER
    texts = {
        MODEL: MOE_WITH_BOTH_BIASES,
        "vllm/models/deepseek_v4/nvidia/layers.py": "from .model import DeepseekV4DecoderLayer\n",
        DSPARK: dspark,
    }
    (edit,) = [e for e in LoaderSkips.edits if e.file == DSPARK]
    outcome = edit.evaluate(Context.from_texts(texts), dspark)
    assert outcome.verdict.value == verdict, outcome.detail
