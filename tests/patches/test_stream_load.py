"""stream-load on the real releases: its scope, its evidence, and drift (numerics in test_stream_load_torch.py)."""

from __future__ import annotations

import shutil
import textwrap

import pytest

from patch_dsv4.patches.stream_load import VISION_CLASS, VL_MODEL, StreamLoad, text_class_finalizes, vision_flow
from patch_dsv4.patching.patch import Context
from tests.errors import error_lines
from tests.records import recorded_verdict, releases_needing
from tests.releases import RELEASES, hand_edit, rewrite_record, stat_snapshot

HELPER = "_patch_dsv4_stream_language_model_first"


@pytest.mark.parametrize("version", [v for v in RELEASES if recorded_verdict(v, "stream-load") == "upstream"])
def test_upstream_names_its_evidence(version, make_tree, cli):
    """Each vision class's edit names its file and function, and the property that makes it stream."""
    patch = cli("status", "--site-packages", make_tree(version), "--json").patch("stream-load")
    assert patch["verdict"] == "upstream"
    for edit in patch["edits"]:
        if edit["verdict"] == "not-applicable":
            continue
        assert edit["verdict"] == "upstream", edit
        assert edit["file"].removeprefix("vllm/models/") in edit["detail"]
        assert f"{edit['scope']} passes the weights to the loader" in edit["detail"]
        assert "WeightsMapper.apply" in edit["detail"]  # followed into vLLM's mapper, which streams
        if version == "0.33.0":  # LM tensors stream, the small rest deferred
            assert (
                "stream_language_model_first (deepseek_v4/common/vl_model.py) yields language_model.*"
                in (edit["detail"])
            )
        else:  # 0.34.0: straight to the loader, the text class finalizes after the load
            assert "no process_weights_after_loading is reachable from" in edit["detail"]


@pytest.mark.parametrize(
    ("version", "old", "new"),
    [
        # 0.30.0 without its sort: the text class still finalizes inside load_weights, so streaming it cuts the
        # language model's group in runs; the sort's absence is no evidence of the fix
        ("0.30.0", "mapped = iter(sorted(mapped, key=lambda x: x[0]))", "pass"),
        # 0.33.0 without its helper, the same
        ("0.33.0", "mapped = stream_language_model_first(mapped)", "pass"),
    ],
    ids=["0.30.0-sort-removed", "0.33.0-helper-removed"],
)
def test_absent_old_shape_is_drifted_not_upstream(version, old, new, make_tree, cli):
    tree = make_tree(version)
    path = tree / VL_MODEL
    text = path.read_text()
    assert text.count(old) == 1
    hand_edit(path, text.replace(old, new))
    rewrite_record(tree, [VL_MODEL])  # a release that really ships this code
    patch = cli("status", "--site-packages", tree, "--json").patch("stream-load")
    (edit,) = [e for e in patch["edits"] if e["file"] == VL_MODEL]
    assert edit["verdict"] == "drifted", edit["detail"]


@pytest.mark.parametrize("version", releases_needing("stream-load"))
def test_only_the_vision_class_method_changes(version, make_tree, cli):
    """V4's vision class and V4.1's (nvidia/ and amd/), not the nvidia/vl_model.py shim, not another method."""
    tree = make_tree(version)
    before = stat_snapshot(tree)
    result = cli("apply", "--site-packages", tree, "--only", "stream-load", "--json")
    assert result.code == 0, result.stderr
    after = stat_snapshot(tree)
    changed = {f for f in after if before.get(f) != after[f] and not f.startswith(".patch-dsv4")}
    v41 = {f"vllm/models/deepseek_v41/{vendor}/vl_model.py" for vendor in ("nvidia", "amd")}
    assert changed == {VL_MODEL, *v41}
    text = (tree / VL_MODEL).read_text()
    assert text.count(f"{HELPER}(mapped)") == 1
    assert "iter(sorted(mapped" not in text
    for rel in v41:
        text = (tree / rel).read_text()
        assert text.count(f"{HELPER}(self.hf_to_vllm_mapper.apply(weights))") == 1
        assert "sorted(" not in text


def test_recognised_as_ours_without_state(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    shutil.rmtree(tree / ".patch-dsv4")
    result = cli("status", "--site-packages", tree, "--json")
    assert result.verdicts()["stream-load"] == "applied"
    assert result.json()["state"] == "none"


@pytest.mark.parametrize("version", ["0.30.0", "0.32.0"])
def test_changed_anchor_is_drifted_and_nothing_written(version, make_tree, cli):
    tree = make_tree(version)
    path = tree / VL_MODEL
    hand_edit(path, path.read_text().replace("key=lambda x: x[0]", "key=lambda item: item[0]"))
    rewrite_record(tree, [VL_MODEL])  # a release that really ships this code
    before = stat_snapshot(tree)
    status = cli("status", "--site-packages", tree, "--json")
    patch = status.patch("stream-load")
    assert patch["verdict"] == "drifted"
    (edit,) = [e for e in patch["edits"] if e["file"] == VL_MODEL]
    assert "iter(sorted(mapped, key=lambda x: x[0]))" in edit["expected"]
    assert "lambda item: item[0]" in edit["found"]
    applied = cli("apply", "--site-packages", tree)
    assert applied.code == 1
    assert "stream-load is drifted" in applied.stderr
    assert len(error_lines(applied.stderr)) == 1
    assert stat_snapshot(tree) == before


# -- the injected generator, executed on CPU torch ---------------------------------


# -- shapes no release has: fixes in other spellings, defects in new ones ----------------
HELPERS = "vllm/models/deepseek_v4/common/weight_order.py"
TEXT = "vllm/models/deepseek_v4/nvidia/model.py"
TEXT_CLASS = """\
class DeepseekV4ForCausalLM:
    def load_weights(self, weights):
        return AutoWeightsLoader(self).load_weights(weights)
"""
FINALIZING_TEXT_CLASS = """\
class FinalizingForCausalLM:
    def load_weights(self, weights):
        loaded = AutoWeightsLoader(self).load_weights(weights)
        self.process_weights_after_loading()
        return loaded
"""


def _vision(load_weights: str, init: str = "") -> str:
    init = init or "self.language_model = DeepseekV4ForCausalLM(vllm_config)"
    return f"""\
from vllm.models.deepseek_v4.common.weight_order import outer, ready
from vllm.models.deepseek_v4.nvidia.model import DeepseekV4ForCausalLM, FinalizingForCausalLM


class DeepseekV4ForConditionalGeneration:
    def __init__(self, vllm_config, cpu):
        {init}

    def load_weights(self, weights):
{textwrap.indent(textwrap.dedent(load_weights), " " * 8)}"""


def _judged(vl_model: str, helpers: str = ""):
    (edit,) = [e for e in StreamLoad.edits if e.file == VL_MODEL]
    ctx = Context.from_texts({VL_MODEL: vl_model, HELPERS: helpers, TEXT: TEXT_CLASS + "\n\n" + FINALIZING_TEXT_CLASS})
    outcome = edit.evaluate(ctx, vl_model)
    path, _where = vision_flow(ctx, VL_MODEL, VISION_CLASS)
    finalizes, _evidence = text_class_finalizes(ctx, VL_MODEL, VISION_CLASS)
    return outcome, path, finalizes


PICK = "text = DeepseekV4ForCausalLM if cpu else {other}\n        self.language_model = text(vllm_config)"
#: name -> (load_weights body, the helper module, __init__ body, verdict, what the probe must have seen)
SHAPES = {
    # the upstream fix kept, through a helper of another module imported inside the function
    "helper-in-another-module-imported-in-the-function": (
        """\
        from vllm.models.deepseek_v4.common.weight_order import as_they_come
        return AutoWeightsLoader(self).load_weights(as_they_come(weights))
        """,
        "def as_they_come(stream):\n    for item in stream:\n        yield item\n",
        "",
        "upstream",
        lambda flow, finalizes: flow.through() == ["as_they_come"] and finalizes is False,
    ),
    # a conditional pick of the text class: both candidates are followed, neither finalizes
    "conditional-text-class-neither-finalizes": (
        "return AutoWeightsLoader(self).load_weights(weights)\n",
        "",
        PICK.format(other="DeepseekV4ForCausalLM"),
        "upstream",
        lambda path, finalizes: finalizes is False,
    ),
    # one candidate finalizes inside load_weights: streaming it unsorted is not safe
    "conditional-text-class-one-finalizes": (
        "return AutoWeightsLoader(self).load_weights(weights)\n",
        "",
        PICK.format(other="FinalizingForCausalLM"),
        "drifted",
        lambda flow, finalizes: flow.streams and finalizes is True,
    ),
    # the sort moved into a helper of another module
    "sort-moved-into-a-helper-of-another-module": (
        """\
        from vllm.models.deepseek_v4.common.weight_order import by_name
        return AutoWeightsLoader(self).load_weights(by_name(weights))
        """,
        "def by_name(stream):\n    return iter(sorted(stream, key=lambda x: x[0]))\n",
        "",
        "drifted",
        lambda flow, finalizes: flow.holds[0].text.startswith(f"sorted() at {HELPERS}:by_name"),
    ),
    # list() in a renamed helper, reached through a module-level import
    "list-in-a-renamed-helper-of-another-module": (
        "return AutoWeightsLoader(self).load_weights(iter(ready(weights)))\n",
        "def ready(stream):\n    return list(stream)\n",
        "",
        "drifted",
        lambda flow, finalizes: flow.holds[0].text.startswith(f"list() at {HELPERS}:ready"),
    ),
    # a starred display holds the stream, then .sort() reorders it, two helpers down (the display is the first
    # hold: before the evaluator, only the sort was seen)
    "sort-on-a-materialized-list-two-helpers-down": (
        "return AutoWeightsLoader(self).load_weights(outer(weights))\n",
        "def inner(stream):\n    held = [*stream]\n    held.sort()\n    return held\n\n\n"
        "def outer(stream):\n    return inner(stream)\n",
        "",
        "drifted",
        lambda flow, finalizes: (
            [h.text.split(" at ")[0] for h in flow.holds] == ["[*stream]", "held.sort()"]
            and flow.holds[0].where.at() == f"{HELPERS}:inner:2"
        ),
    ),
    # the stream handed on through *args: bound to the tuple the helper takes, whose first item it sorts
    "stream-through-star-args": (
        """\
        from vllm.models.deepseek_v4.common.weight_order import gather
        return AutoWeightsLoader(self).load_weights(gather(weights))
        """,
        "def gather(*streams):\n    return sorted(streams[0])\n",
        "",
        "drifted",
        lambda flow, finalizes: flow.holds[0].text.startswith(f"sorted() at {HELPERS}:gather"),
    ),
    # a helper nobody can follow (an attribute of unknown type) is no evidence of streaming
    "unfollowable-helper": (
        "return AutoWeightsLoader(self).load_weights(self.reorder(weights))\n",
        "",
        "",
        "drifted",
        lambda flow, finalizes: flow.unknown and not flow.holds,
    ),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_shapes_no_release_has(name):
    body, helpers, init, verdict, seen = SHAPES[name]
    outcome, path, finalizes = _judged(_vision(body, init), helpers)
    assert outcome.verdict.value == verdict, outcome.detail
    assert seen(path, finalizes), (path, finalizes)
    if verdict == "upstream":
        assert "DeepseekV4ForConditionalGeneration.load_weights" in outcome.detail
