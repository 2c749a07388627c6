"""Stream the checkpoint through the vision class's loader instead of sorting it.

vLLM 0.30.0-0.32.0 `DeepseekV4ForConditionalGeneration.load_weights`
(`vllm/models/deepseek_v4/common/vl_model.py`) keeps the language model's
weights in one contiguous group, as a child that finalizes during load needs,
by sorting the whole weight iterator by name: every tensor of the checkpoint
(about 95 GB for DeepSeek-V4-Flash-Vision) sits in host memory before the first
one is loaded. The patch yields `language_model.*` tensors as they arrive and
defers only the rest (vision tower, aligner, image tokens: well under 1 GB),
cloned so that they do not keep the loader's per-shard storage alive.

Fixed upstream in vLLM 0.33.0 (`stream_language_model_first` in the same file).
No vision class in the releases before 0.30.0; nightlies between 0.29.0 and
0.30.0 define it in `nvidia/vl_model.py` (from 0.30.0 a re-export shim), with
the same sort: the patch streams it wherever the package defines the class.

DeepSeek-V4.1's vision class, `DeepseekV41ForCausalLM.load_weights`
(`deepseek_v41/nvidia/vl_model.py` and its `amd/` copy; `deepseek_v4_1/` in the
nightlies), sorts the mapper's whole output the same way on vLLM 0.30.0-0.32.0
(a 196 GiB pack for V4.1-Flash): the same helper streams it. vLLM 0.33.0 streams
it with V4's `stream_language_model_first`, imported from
`deepseek_v4/common/vl_model.py`.
"""

from __future__ import annotations

import ast

from patch_dsv4.edits import ForeignEdit, ReplaceStatements, Variant
from patch_dsv4.fingerprint import find_scope
from patch_dsv4.patch import Context, Example, Patch, Scope
from patch_dsv4.patches._v41 import imported_from, in_layouts
from patch_dsv4.verdicts import Outcome, Verdict

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


def _helper_source_file(tree: ast.Module, file: str) -> str | None:
    """Where the file takes the upstream helper from: itself, or the vLLM module it imports it from (None: neither)."""
    if any(isinstance(n, ast.FunctionDef) and n.name == UPSTREAM_HELPER for n in tree.body):
        return file
    return imported_from(tree, file, UPSTREAM_HELPER)


def _upstream_streams(file: str, cls: str = VISION_CLASS):
    def probe(ctx: Context, tree: ast.Module | None) -> Outcome | None:
        if tree is None:
            return Outcome.not_applicable(f"no vision class in this release ({file} is absent)")
        if find_scope(tree, cls, None) is None:
            return Outcome.not_applicable(f"{file} defines no {cls}")
        method = find_scope(tree, cls, "load_weights")
        if method is None:
            return None
        calls = {n.func.id for n in ast.walk(method) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        if UPSTREAM_HELPER not in calls or "sorted" in calls:
            return None
        source = _helper_source_file(tree, file)
        if source == file:
            return Outcome.upstream(f"{file}: {cls}.load_weights streams with upstream's {UPSTREAM_HELPER}()")
        if source is not None and ctx.scope(source, None, UPSTREAM_HELPER) is not None:
            return Outcome.upstream(
                f"{file}: {cls}.load_weights streams with upstream's {UPSTREAM_HELPER}(), imported from {source}"
            )
        return None

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
    Example(
        "upstream-streams",
        VL_MODEL,
        before="""\
def stream_language_model_first(w):
    yield from w


class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        mapped = stream_language_model_first(weights)
""",
        after=None,
        verdict=Verdict.UPSTREAM,
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
