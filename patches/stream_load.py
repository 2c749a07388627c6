"""Stream the checkpoint through the vision class's loader instead of sorting it.

vLLM 0.30.0-0.32.0 `DeepseekV4ForConditionalGeneration.load_weights`
(`vllm/models/deepseek_v4/common/vl_model.py`) keeps the language model's
weights in one contiguous group, as a child that finalizes during load needs,
by sorting the whole weight iterator by name: every tensor of the checkpoint
(about 95 GB for DeepSeek-V4-Flash-Vision) sits in host memory before the first
one is loaded. The patch yields `language_model.*` tensors as they arrive and
defers only the rest (vision tower, aligner, image tokens: well under 1 GB),
cloned so that they do not keep the loader's per-shard storage alive.

Fixed upstream in vLLM 0.33.0 (`stream_language_model_first` in the same file:
language-model tensors stream, the small rest is deferred) and again, completely,
in vLLM 0.34.0 (the mapper's output goes straight to the loader, and the text
class no longer finalizes inside `load_weights`, so its tensors may arrive in
several runs).

What the probes check, through the evaluator (patcher/patching/evaluate), whatever
the code is called: `flows_into(load_weights's weights, the loader)` by the iterator
table, and on from the language model's own `load_weights` (every class it may be)
to its loader. The defect: anything on the way that holds the weights whole or
reorders them (in any module, any spelling). The fix: they reach the loaders one at
a time on every path, and either a generator on the way yields a `language_model.*` weight
before it takes the next one (`yields_as_they_arrive`, 0.33.0), or the language
model (the class of `self.language_model`, every platform's candidate) reaches no
`process_weights_after_loading` from its `load_weights` (0.34.0). An unknown
construct proves nothing: the anchors decide, and a drifted verdict names it.
No vision class in the releases before 0.30.0; nightlies between 0.29.0 and
0.30.0 define it in `nvidia/vl_model.py` (from 0.30.0 a re-export shim), with
the same sort: the patch streams it wherever the package defines the class.

DeepSeek-V4.1's vision class, `DeepseekV41ForCausalLM.load_weights`
(`deepseek_v41/nvidia/vl_model.py` and its `amd/` copy; `deepseek_v4_1/` in the
nightlies), sorts the mapper's whole output the same way on vLLM 0.30.0-0.32.0
(a 196 GiB pack for V4.1-Flash): the same helper streams it. vLLM 0.33.0 streams
it with V4's `stream_language_model_first`, 0.34.0 as V4's.
"""

from __future__ import annotations

import ast

from patch_dsv4.output.verdicts import Outcome, Verdict
from patch_dsv4.patches._v41 import in_layouts
from patch_dsv4.patching.edits import ForeignEdit, NotProven, ReplaceStatements, Variant, mentions_injected
from patch_dsv4.patching.evaluate import (
    Evaluator,
    Flow,
    callee,
    cases,
    flows_into,
    reaches_call,
    yields_as_they_arrive,
)
from patch_dsv4.patching.evaluate.values import Inst
from patch_dsv4.patching.fingerprint import find_scope
from patch_dsv4.patching.patch import Context, Example, Patch, Scope

VL_MODEL = "vllm/models/deepseek_v4/common/vl_model.py"
#: Where nightlies between 0.29.0 and 0.30.0 define the vision class (0.30.0 on: a re-export shim).
NIGHTLY_VL_MODEL = "vllm/models/deepseek_v4/nvidia/vl_model.py"
VISION_CLASS = "DeepseekV4ForConditionalGeneration"
V41_VISION_CLASS = "DeepseekV41ForCausalLM"
UPSTREAM_HELPER = "stream_language_model_first"


# The helpers below are written into vLLM as they stand here (edits.helper_source): not formatted.
# fmt: off
def _patch_dsv4_stream_language_model_first(weights):
    """Yield ``language_model.*`` weights as they arrive, then the rest.

    Written by patch-dsv4 (stream-load). Sorting the whole iterator held every
    tensor of the checkpoint in host memory; this keeps the language model's
    weights in one contiguous group while holding only the small rest, cloned
    so it does not pin the loader's per-shard storage. The rest is grouped by
    top-level module (stable, so arrival order holds within a group).
    """
    rest = []
    handoff = []
    for item in weights:
        if item[0].startswith("language_model."):
            # Hand the tensor over without keeping a reference in this frame,
            # so the caller can free it before asking for the next one.
            handoff.append(item)
            del item
            yield handoff.pop()
        else:
            name, tensor = item
            rest.append((name, tensor.clone()))
            del item, name, tensor
    rest.sort(key=lambda entry: entry[0].split(".", 1)[0])
    rest.reverse()
    while rest:
        yield rest.pop()
# fmt: on


LM_PREFIX = "language_model."


def _is_loader(call: ast.Call) -> bool:
    """The loader: ``<loader>.load_weights(...)`` (AutoWeightsLoader's, or a child model's; ``getattr`` too); a
    base's ``super().load_weights(...)`` is followed, the same load going on there."""
    receiver, name = callee(call)
    return receiver not in (None, "super()") and name == "load_weights"


def vision_flow(ctx: Context, file: str, cls: str) -> tuple[Flow | None, str]:
    """Where ``cls.load_weights`` (found through the MRO: a mixin's counts) sends its weights (None, and why, where
    it cannot be followed), with the scope's name for the evidence."""
    ev = Evaluator.of(ctx)
    vision = ev.follower.class_def(file, cls)
    start = ev.follower.method(vision, "load_weights") if vision is not None else None
    if start is None:
        return None, f"{cls}.load_weights not found in {file}"
    params = [a.arg for a in start.node.args.args][1:2]  # type: ignore[union-attr]
    if not params:
        return None, f"{cls}.load_weights takes no weights"
    where = f"{file.removeprefix('vllm/models/')}: {cls}.load_weights"
    if start.owner is not None and start.owner.node is not vision.node:  # type: ignore[union-attr]
        where += f" ({start.owner.qualname}'s, {start.file.removeprefix('vllm/models/')})"
    return flows_into(ev, start, params[0], _is_loader, self_value=Inst(vision)), where  # type: ignore[arg-type]


def text_class_finalizes(ctx: Context, file: str, cls: str) -> tuple[bool | None, str]:
    """Whether the language model of the vision class runs ``process_weights_after_loading`` inside its
    ``load_weights`` (None: its class could not be found), with the evidence."""
    ev = Evaluator.of(ctx)
    vision = ev.follower.class_def(file, cls)
    classes = ev.follower.classes_of_attribute(vision, "language_model") if vision is not None else []
    if not classes:
        return None, f"the class of {cls}.language_model could not be followed from {file}"
    checked = []
    for text_class in classes:
        load = ev.follower.method(text_class, "load_weights")
        if load is None:
            return None, f"{text_class.where()} has no load_weights"
        checked.append(load)
        found = reaches_call(ev, load, text_class, "process_weights_after_loading")
        if found is not None:
            path, call = found
            where = f"{path.frame.defn.file}:{path.frame.defn.qualname}:{call.lineno}"
            return True, f"{path.names()} calls {ast.unparse(call.func)}() ({where})"
    by_name: dict[str, list[str]] = {}
    for load in checked:
        by_name.setdefault(load.qualname, []).append(load.file.rsplit("/", 2)[-2])
    where = "; ".join(f"{name} ({', '.join(dirs)})" if len(dirs) > 1 else name for name, dirs in by_name.items())
    return False, f"no process_weights_after_loading is reachable from {where}"


def text_classes_stream(ctx: Context, file: str, cls: str) -> tuple[bool, str]:
    """Whether every class the vision class's language model may be passes the weights it is given on to its own
    loader one at a time (AutoWeightsLoader hands it the language model's part of the stream), with the evidence
    or the first thing that holds them."""
    ev = Evaluator.of(ctx)
    vision = ev.follower.class_def(file, cls)
    classes = ev.follower.classes_of_attribute(vision, "language_model") if vision is not None else []
    if not classes:
        return False, f"the class of {cls}.language_model could not be followed from {file}"
    for text_class in classes:
        load = ev.follower.method(text_class, "load_weights")
        params = [a.arg for a in load.node.args.args][1:2] if load is not None else []  # type: ignore[union-attr]
        if not params:
            return False, f"{text_class.where()} has no load_weights taking the weights"
        flow = flows_into(ev, load, params[0], _is_loader, self_value=Inst(text_class))  # type: ignore[arg-type]
        if not flow.streams:
            return False, f"the language model's {load.qualname}: {flow.defect()}"  # type: ignore[union-attr]
    return True, "the language model's load_weights passes them on to its loader as they come"


def _upstream_streams(file: str, cls: str = VISION_CLASS):
    """Upstream where the weights reach the loader one at a time on every path (the iterator table: nothing
    holds or reorders them, nothing unknown), and either a generator on the way yields a language model's tensor
    before it takes the next one, or the language model does not finalize inside its ``load_weights`` (so it may
    take its tensors in several runs)."""

    def probe(ctx: Context, tree: ast.Module | None) -> Outcome | NotProven | None:
        if tree is None:
            return Outcome.not_applicable(f"no vision class in this release ({file} is absent)")
        if find_scope(tree, cls, None) is None:
            return Outcome.not_applicable(f"{file} defines no {cls}")
        method = find_scope(tree, cls, "load_weights")
        if method is not None and mentions_injected(method):
            return None  # ours: the anchors tell applied from modified
        flow, where = vision_flow(ctx, file, cls)
        if flow is None:
            return NotProven(where)
        if not flow.streams:
            return NotProven(flow.defect())  # type: ignore[arg-type]
        through = f" through {', '.join(flow.through())}" if flow.through() else ""
        onward, evidence = text_classes_stream(ctx, file, cls)
        if not onward:  # the language model's part of the stream is held there
            return NotProven(evidence)
        ev = Evaluator.of(ctx)
        grouped = [g for g in flow.generators if yields_as_they_arrive(ev, g, cases.LANGUAGE_MODEL_WEIGHT)]
        if grouped:
            gen = grouped[0].defn
            return Outcome.upstream(
                f"{where} passes the weights to the loader as a stream{through}; {gen.qualname} "
                f"({gen.file.removeprefix('vllm/models/')}) yields {LM_PREFIX}* tensors as they arrive and defers "
                "only the rest"
            )
        finalizes, evidence = text_class_finalizes(ctx, file, cls)
        if finalizes is False:
            return Outcome.upstream(
                f"{where} passes the weights to the loader as they come{through}, nothing sorts or holds them, "
                f"and the language model finalizes after the load: {evidence}"
            )
        return NotProven(f"the language model finalizes inside its load_weights: {evidence}" if finalizes else evidence)

    return probe


def _recipe_stream_load(tree: ast.Module, scope: ast.AST | None) -> str | None:
    """The DGX-Spark recipe's patch_dsv4_vl_stream_load.py: a nested generator replaces the eager sort."""
    if scope is None:
        return None
    for node in ast.walk(scope):
        if isinstance(node, ast.FunctionDef) and node.name == "_stream_language_model_first":
            return f"load_weights defines the nested generator {node.name}() in place of the sort"
    return None


RECIPE_STREAM_LOAD = ForeignEdit(
    script="patch_dsv4_vl_stream_load.py",
    recipe="DGX-Spark recipe",
    meaning="it streams the load as this patch does, but patch-dsv4 can neither verify nor revert it: take it over",
    found=_recipe_stream_load,
)


SORTED_MAPPED = Variant(
    anchor="mapped = iter(sorted(mapped, key=lambda x: x[0]))",
    replacement=(
        "# patch-dsv4 (stream-load): stream language-model tensors, defer the rest.\n"
        "mapped = _patch_dsv4_stream_language_model_first(mapped)\n"
    ),
    releases="0.30.0-0.32.0",
)
#: The 0.28.1rc nightlies sorted the mapper's output in one statement.
SORTED_MAPPER = Variant(
    anchor="mapped = sorted(self.hf_to_vllm_mapper.apply(weights), key=lambda x: x[0])",
    replacement=(
        "# patch-dsv4 (stream-load): stream language-model tensors, defer the rest.\n"
        "mapped = _patch_dsv4_stream_language_model_first(self.hf_to_vllm_mapper.apply(weights))\n"
    ),
    releases="0.28.1rc nightlies (vision class in nvidia/vl_model.py)",
)
#: V4.1's vision class sorts the mapper's output in one statement too.
V41_SORTED_MAPPER = Variant(
    anchor=SORTED_MAPPER.anchor, replacement=SORTED_MAPPER.replacement, releases="V4.1: 0.30.0-0.32.0"
)


class StreamLoad(Patch):
    id = "stream-load"
    title = "vision-class load_weights streams the checkpoint instead of sorting it in host memory"
    serve_impact = (
        "the vision loader sorts the checkpoint and holds the whole pack in host memory: a 128 GB unified-memory "
        "box wedges mid-load"
    )
    edits = tuple(
        ReplaceStatements(
            label=label,
            file=file,
            scope=Scope(cls, "load_weights"),
            variants=variants,
            helpers=(_patch_dsv4_stream_language_model_first,),
            probe=_upstream_streams(file, cls),
            foreign=(RECIPE_STREAM_LOAD,),
        )
        for label, file, cls, variants in (
            ("stream language-model tensors", VL_MODEL, VISION_CLASS, (SORTED_MAPPED,)),
            (
                "stream language-model tensors (nightly layout)",
                NIGHTLY_VL_MODEL,
                VISION_CLASS,
                (SORTED_MAPPED, SORTED_MAPPER),
            ),
            *(
                (f"stream language-model tensors ({tag}, {vendor})", file, V41_VISION_CLASS, (V41_SORTED_MAPPER,))
                for vendor in ("nvidia", "amd")
                for file, tag in in_layouts(f"{vendor}/vl_model.py")
            ),
        )
    )


EXAMPLES = (
    Example(
        "sorted-iterator",
        VL_MODEL,
        before="""\
import torch


class DeepseekV4ForConditionalGeneration(torch.nn.Module):
    def load_weights(self, weights):
        mapped = self.hf_to_vllm_mapper.apply(weights)
        if child_finalizes:
            # one contiguous delegation
            mapped = iter(sorted(mapped, key=lambda x: x[0]))
        return AutoWeightsLoader(self).load_weights(mapped)

    def other(self, mapped):
        mapped = iter(sorted(mapped, key=lambda x: x[0]))
        return mapped
""",
        after='''\
import torch


def _patch_dsv4_stream_language_model_first(weights):
    """Yield ``language_model.*`` weights as they arrive, then the rest.

    Written by patch-dsv4 (stream-load). Sorting the whole iterator held every
    tensor of the checkpoint in host memory; this keeps the language model's
    weights in one contiguous group while holding only the small rest, cloned
    so it does not pin the loader's per-shard storage. The rest is grouped by
    top-level module (stable, so arrival order holds within a group).
    """
    rest = []
    handoff = []
    for item in weights:
        if item[0].startswith("language_model."):
            # Hand the tensor over without keeping a reference in this frame,
            # so the caller can free it before asking for the next one.
            handoff.append(item)
            del item
            yield handoff.pop()
        else:
            name, tensor = item
            rest.append((name, tensor.clone()))
            del item, name, tensor
    rest.sort(key=lambda entry: entry[0].split(".", 1)[0])
    rest.reverse()
    while rest:
        yield rest.pop()


class DeepseekV4ForConditionalGeneration(torch.nn.Module):
    def load_weights(self, weights):
        mapped = self.hf_to_vllm_mapper.apply(weights)
        if child_finalizes:
            # one contiguous delegation
            # patch-dsv4 (stream-load): stream language-model tensors, defer the rest.
            mapped = _patch_dsv4_stream_language_model_first(mapped)
        return AutoWeightsLoader(self).load_weights(mapped)

    def other(self, mapped):
        mapped = iter(sorted(mapped, key=lambda x: x[0]))
        return mapped
''',
    ),
    Example(
        "reformatted-anchor",
        VL_MODEL,
        before="""\
class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        mapped = iter(sorted(mapped,key=lambda x:(x[0])))  # sort by name
""",
        after='''\
def _patch_dsv4_stream_language_model_first(weights):
    """Yield ``language_model.*`` weights as they arrive, then the rest.

    Written by patch-dsv4 (stream-load). Sorting the whole iterator held every
    tensor of the checkpoint in host memory; this keeps the language model's
    weights in one contiguous group while holding only the small rest, cloned
    so it does not pin the loader's per-shard storage. The rest is grouped by
    top-level module (stable, so arrival order holds within a group).
    """
    rest = []
    handoff = []
    for item in weights:
        if item[0].startswith("language_model."):
            # Hand the tensor over without keeping a reference in this frame,
            # so the caller can free it before asking for the next one.
            handoff.append(item)
            del item
            yield handoff.pop()
        else:
            name, tensor = item
            rest.append((name, tensor.clone()))
            del item, name, tensor
    rest.sort(key=lambda entry: entry[0].split(".", 1)[0])
    rest.reverse()
    while rest:
        yield rest.pop()


class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        # patch-dsv4 (stream-load): stream language-model tensors, defer the rest.
        mapped = _patch_dsv4_stream_language_model_first(mapped)
''',
    ),
    # 0.33.0's fix, spelled anew: a renamed generator yields the language model's tensors as they arrive (and the
    # language model passes them on to its loader as they come)
    Example(
        "upstream-groups-language-model-first",
        VL_MODEL,
        before="""\
def _lm_tensors_then_rest(stream):
    later = []
    for name, tensor in stream:
        if name.startswith("language_model."):
            yield name, tensor
        else:
            later.append((name, tensor.clone()))
    yield from later


class TextModel:
    def load_weights(self, weights):
        return AutoWeightsLoader(self).load_weights(weights)


class DeepseekV4ForConditionalGeneration:
    def __init__(self, vllm_config):
        self.language_model = TextModel(vllm_config)

    def load_weights(self, weights):
        mapped = _lm_tensors_then_rest(weights)
        return AutoWeightsLoader(self).load_weights(mapped)
""",
        after=None,
        verdict=Verdict.UPSTREAM,
    ),
    # 0.34.0's fix: the stream goes straight to the loader, and the text class finalizes after the load
    Example(
        "upstream-streams-to-a-text-class-that-finalizes-later",
        VL_MODEL,
        before="""\
class TextModel:
    def load_weights(self, weights):
        return AutoWeightsLoader(self).load_weights(weights)

    def process_weights_after_loading(self):
        pass


class DeepseekV4ForConditionalGeneration:
    def __init__(self, vllm_config):
        text_class = TextModel
        self.language_model = text_class(vllm_config)

    def load_weights(self, weights):
        loader = AutoWeightsLoader(self)
        return loader.load_weights(iter(weights))
""",
        after=None,
        verdict=Verdict.UPSTREAM,
    ),
    # streaming into a text class that finalizes inside load_weights cuts its group in runs: not the fix
    Example(
        "streams-into-a-text-class-that-finalizes-drifts",
        VL_MODEL,
        before="""\
class TextModel:
    def load_weights(self, weights):
        loaded = AutoWeightsLoader(self).load_weights(weights)
        self._finalize()
        return loaded

    def _finalize(self):
        self.process_weights_after_loading()


class DeepseekV4ForConditionalGeneration:
    def __init__(self, vllm_config):
        self.language_model = TextModel(vllm_config)

    def load_weights(self, weights):
        return AutoWeightsLoader(self).load_weights(weights)
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
    # the upstream helper's name is no evidence: this one holds the whole stream before yielding
    Example(
        "helper-named-as-upstream-buffers-everything-drifts",
        VL_MODEL,
        before="""\
def stream_language_model_first(weights):
    held = []
    for item in weights:
        held.append(item)
    yield from held


class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        mapped = stream_language_model_first(weights)
        return AutoWeightsLoader(self).load_weights(mapped)
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
    # a list() in a renamed helper materializes the stream as sorted() did
    Example(
        "list-in-a-renamed-helper-drifts",
        VL_MODEL,
        before="""\
def _prepared(stream):
    return list(stream)


class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        return AutoWeightsLoader(self).load_weights(_prepared(weights))
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
    # .sort() on a list comprehension of the stream: materialized and reordered
    Example(
        "sort-on-a-materialized-list-drifts",
        VL_MODEL,
        before="""\
class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        mapped = [item for item in weights]
        mapped.sort(key=lambda x: x[0])
        return AutoWeightsLoader(self).load_weights(mapped)
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
    # the sort is gone but nothing shows where the stream goes: absence of the defect is no evidence of the fix
    Example(
        "no-sort-and-no-loader-drifts",
        VL_MODEL,
        before="""\
def stream_language_model_first(w):
    yield from w


class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        mapped = stream_language_model_first(weights)
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
    Example(
        "changed-key-drifts",
        VL_MODEL,
        before="""\
class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        mapped = iter(sorted(mapped, key=lambda x: x[1]))
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
    Example(
        "no-vision-class",
        VL_MODEL,
        before="class DeepseekV4ForCausalLM:\n    pass\n",
        after=None,
        verdict=Verdict.NOT_APPLICABLE,
    ),
)
