"""Load an EXL3 `wo_a` stored per group (`attn.wo_a.slice.G.*`, lna-lab's dense-EXL3 bakes) (opt-in).

lna-lab's dense-EXL3 packs store each layer's `wo_a` as one EXL3 tensor set per
output group (`layers.N.attn.wo_a.slice.G.{trellis,suh,svh,...}`), so that each
tensor-parallel rank loads its own group. `DeepseekV4Model.load_weights`
(`nvidia/model.py`) has no mapping for those names in any release 0.28.0-0.34.0:
`KeyError: 'layers.N.attn.wo_a.slice.0.trellis'`. The patch extends
`stacked_params_mapping`, for a model whose quant config is vllm-exl3's, with
one entry per group, `("attn.wo_a.", "attn.wo_a.slice.G.", G)`: the tensor loads
into `attn.wo_a.*` with the group index as shard id. The trailing dots keep
`slice.1.` from matching `slice.10.`. Any other pack gets no entry, and the
loader runs as before.

The plugin must take that shard id as the owning rank: lna-lab's fork of
vllm-exl3 does (`_wo_a_slice_rank`); vllm-exl3 main does not, and there the load
still fails (`ValueError: shard_idx ... out of range` instead of the `KeyError`).
`patch-dsv4 doctor` says which one is installed. The MTP draft's loader
(`nvidia/mtp.py`) is left alone, as lna-lab's script leaves it. Use it with
`dense-exl3`; applied only when asked for (`patch-dsv4 apply --with
exl3-wo-a-slices`), then kept by later applies.

DeepSeek-V4.1 EXL3 packs store `wo_a` per group too (MiaAI-Lab's kit maps
`wo_a.slice.G.*` in V4.1's loader), and V4.1's `DeepseekV4Model.load_weights`
(`deepseek_v41/nvidia/model.py`; `deepseek_v4_1/` in the nightlies, vLLM
0.30.0-0.34.0) has the same `stacked_params_mapping` and no mapping for them:
the patch extends it the same way.

Not fixed upstream in vLLM 0.28.0-0.34.0.

What the probes check, through the evaluator (patcher/patching/evaluate), whatever
the code is called: the mappings `load_weights` iterates as `(param, shard, id)`,
as the code builds them (displays, `+=`, `.extend`, comprehensions, helpers in any
module, evaluated); the fix is an entry that loads a `wo_a.slice` name into `wo_a`
with a shard id. A mention of the name that skips, rejects or logs those tensors is
no fix.
"""

from __future__ import annotations

import ast
import re

from patch_dsv4.output.verdicts import Outcome, Verdict
from patch_dsv4.patches import miaai_kit
from patch_dsv4.patches._v41 import in_layouts
from patch_dsv4.patching.edits import (
    ForeignEdit,
    NotProven,
    ReplaceStatements,
    Variant,
    injected_names,
    mentions_injected,
)
from patch_dsv4.patching.evaluate import Evaluator, mappings_iterated
from patch_dsv4.patching.evaluate.values import Const, Repeated, Seq, options
from patch_dsv4.patching.patch import Context, Example, Patch, Scope

MODEL = "vllm/models/deepseek_v4/nvidia/model.py"
SLICE = "wo_a.slice"


# The helpers below are written into vLLM as they stand here (edits.helper_source): not formatted.
# fmt: off
def _patch_dsv4_wo_a_slice_mapping(model):
    """stacked_params_mapping entries for an EXL3 wo_a stored per group (attn.wo_a.slice.G.*).

    Written by patch-dsv4 (exl3-wo-a-slices). The shard id is the group index,
    which the plugin's wo_a loader takes as the owning tensor-parallel rank; the
    trailing dots keep slice.1. from matching slice.10.; no entry unless the
    model's quant config is EXL3.
    """
    quant_config = getattr(model, "quant_config", None)
    get_name = getattr(quant_config, "get_name", None)
    if not callable(get_name) or get_name() != "exl3":
        return []
    groups = int(getattr(model.config, "o_groups", 0) or 0)
    return [("attn.wo_a.", f"attn.wo_a.slice.{g}.", g) for g in range(groups)]
# fmt: on


ANCHOR = """
stacked_params_mapping = [
    ("gate_up_proj", "w1", 0),
    ("gate_up_proj", "w3", 1),
    ("attn.fused_wqa_wkv", "attn.wq_a", 0),
    ("attn.fused_wqa_wkv", "attn.wkv", 1),
    ("compressor.fused_wkv_wgate", "compressor.wkv", 0),
    ("compressor.fused_wkv_wgate", "compressor.wgate", 1),
]
"""
REPLACEMENT = (
    ANCHOR.strip("\n")
    + """
# patch-dsv4 (exl3-wo-a-slices): an EXL3 pack may store wo_a per group as wo_a.slice.G.
stacked_params_mapping += _patch_dsv4_wo_a_slice_mapping(self)
"""
)
OWN = injected_names(REPLACEMENT)
_LNA_SLICE = re.compile(r"attn\.wo_a\.slice\.(\d+)")


def _lna_entries(scope: ast.AST) -> list[ast.Tuple]:
    """lna-lab's entries: ``("attn.wo_a", "attn.wo_a.slice.N", N)``, the slice name without its trailing dot."""
    found = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Tuple) and len(node.elts) == 3 and all(isinstance(e, ast.Constant) for e in node.elts):
            param, shard, index = (e.value for e in node.elts)
            match = _LNA_SLICE.fullmatch(shard) if isinstance(shard, str) else None
            if param == "attn.wo_a" and match and index == int(match.group(1)):
                found.append(node)
    return found


def _lna_slices(tree: ast.Module, scope: ast.AST | None) -> str | None:
    """lna-lab's patch_dsv4_dense_exl3.py closes stacked_params_mapping with its wo_a slice entries."""
    entries = _lna_entries(scope) if scope is not None else []
    if not entries:
        return None
    return f"stacked_params_mapping holds {len(entries)} entries ('attn.wo_a', 'attn.wo_a.slice.N', N)"


LNA_SLICES = ForeignEdit(
    script="patch_dsv4_dense_exl3.py",
    recipe="lna-lab recipe",
    meaning=(
        "its entries apply to every pack and have no trailing dot (slice.1 also matches slice.10 to slice.15 "
        "once o_groups > 10), and patch-dsv4 can neither verify nor revert them: take them over with "
        "takeover --with exl3-wo-a-slices"
    ),
    found=_lna_slices,
)


def _entries(value) -> list[tuple[tuple, object]]:
    """The (param, shard, id) entries a mapping holds, as constants (an f-string's unknown part shown as
    ``{g}``), each with the display that built it."""
    found = []
    for option in options(value):
        items = option.items if isinstance(option, Seq) else (option.item,) if isinstance(option, Repeated) else ()
        for item in items:
            for entry in options(item):
                if (
                    isinstance(entry, Seq)
                    and len(entry.items) == 3
                    and all(isinstance(e, Const) for e in entry.items[:2])
                ):
                    found.append((tuple(getattr(e, "value", "{?}") for e in entry.items), entry.where))
    return found


def _maps_slices(entry: tuple) -> bool:
    """An entry that loads a per-group wo_a into wo_a with a shard id: its shard names ``wo_a.slice``, its
    parameter ``wo_a`` without the slice."""
    param, shard, _shard_id = entry
    return (
        isinstance(shard, str)
        and isinstance(param, str)
        and SLICE in shard
        and "wo_a" in param
        and (SLICE not in param)
    )


def _upstream_slices(file: str = MODEL):
    def probe(ctx: Context, tree: ast.Module | None) -> Outcome | NotProven | None:
        """vLLM maps wo_a slices itself: a mapping ``load_weights`` iterates as ``(param, shard, id)``, as the
        code builds it (in load_weights or a helper whose result it adds, evaluated), holds an entry that loads
        ``wo_a.slice.G`` into ``wo_a`` with a shard id. A mention of the name that only skips, rejects or logs
        those tensors is no evidence."""
        scope = ctx.scope(file, "DeepseekV4Model", "load_weights") if tree is not None else None
        if tree is None or (scope is not None and mentions_injected(scope, OWN)):
            return None
        where = "" if file == MODEL else f"{file}: "
        ev = Evaluator.of(ctx)
        start = ev.follower.function(file, "DeepseekV4Model", "load_weights")  # a base's or a mixin's too
        if start is None:
            return None
        for mapping in mappings_iterated(ev, start, width=3):
            for entry, made in _entries(mapping):
                if _maps_slices(entry):
                    shown = f"{ast.unparse(made.node)} (first: {entry!r})" if made is not None else repr(entry)
                    if made is not None and made.defn.node is not start.node:  # built in a helper
                        return Outcome.upstream(
                            f"{where}DeepseekV4Model.load_weights maps wo_a slices itself (in {made.defn.file}: "
                            f"{start.qualname} -> {made.defn.qualname}): {shown}"
                        )
                    return Outcome.upstream(f"{where}DeepseekV4Model.load_weights maps wo_a slices itself: {shown}")
        return NotProven("no mapping DeepseekV4Model.load_weights loads with maps wo_a.slice into wo_a")

    return probe


class Exl3WoASlices(Patch):
    id = "exl3-wo-a-slices"
    title = "opt-in: an EXL3 wo_a stored per group (attn.wo_a.slice.G) loads"
    serve_impact = "the loader has no mapping for attn.wo_a.slice.G: KeyError part-way through the load"
    opt_in = True
    edits = tuple(
        ReplaceStatements(
            label=label,
            file=file,
            scope=Scope("DeepseekV4Model", "load_weights"),
            variants=(Variant(ANCHOR, REPLACEMENT, releases=releases),),
            helpers=(_patch_dsv4_wo_a_slice_mapping,),
            probe=_upstream_slices(file),
            foreign=(LNA_SLICES, miaai_kit.V41_WO_A_SLICES),
        )
        for label, file, releases in (
            ("load_weights maps attn.wo_a.slice.G to wo_a, shard G", MODEL, "0.28.0-0.34.0"),
            *(
                (f"load_weights maps attn.wo_a.slice.G to wo_a, shard G ({tag})", file, "V4.1: 0.30.0-0.34.0")
                for file, tag in in_layouts("nvidia/model.py")
            ),
        )
    )


EXAMPLES = (
    Example(
        "slices-mapped-for-exl3",
        MODEL,
        before="""\
class DeepseekV4Model(nn.Module, EagleModelMixin):
    def load_weights(self, weights):
        stacked_params_mapping = [
            # (param_name, shard_name, shard_id)
            ("gate_up_proj", "w1", 0),
            ("gate_up_proj", "w3", 1),
            ("attn.fused_wqa_wkv", "attn.wq_a", 0),
            ("attn.fused_wqa_wkv", "attn.wkv", 1),
            ("compressor.fused_wkv_wgate", "compressor.wkv", 0),
            ("compressor.fused_wkv_wgate", "compressor.wgate", 1),
        ]
        params_dict = dict(self.named_parameters())
""",
        after='''\
def _patch_dsv4_wo_a_slice_mapping(model):
    """stacked_params_mapping entries for an EXL3 wo_a stored per group (attn.wo_a.slice.G.*).

    Written by patch-dsv4 (exl3-wo-a-slices). The shard id is the group index,
    which the plugin's wo_a loader takes as the owning tensor-parallel rank; the
    trailing dots keep slice.1. from matching slice.10.; no entry unless the
    model's quant config is EXL3.
    """
    quant_config = getattr(model, "quant_config", None)
    get_name = getattr(quant_config, "get_name", None)
    if not callable(get_name) or get_name() != "exl3":
        return []
    groups = int(getattr(model.config, "o_groups", 0) or 0)
    return [("attn.wo_a.", f"attn.wo_a.slice.{g}.", g) for g in range(groups)]


class DeepseekV4Model(nn.Module, EagleModelMixin):
    def load_weights(self, weights):
        stacked_params_mapping = [
            # (param_name, shard_name, shard_id)
            ("gate_up_proj", "w1", 0),
            ("gate_up_proj", "w3", 1),
            ("attn.fused_wqa_wkv", "attn.wq_a", 0),
            ("attn.fused_wqa_wkv", "attn.wkv", 1),
            ("compressor.fused_wkv_wgate", "compressor.wkv", 0),
            ("compressor.fused_wkv_wgate", "compressor.wgate", 1),
        ]
        # patch-dsv4 (exl3-wo-a-slices): an EXL3 pack may store wo_a per group as wo_a.slice.G.
        stacked_params_mapping += _patch_dsv4_wo_a_slice_mapping(self)
        params_dict = dict(self.named_parameters())
''',
    ),
    Example(
        "lna-lab-slices",
        MODEL,
        before="""\
class DeepseekV4Model(nn.Module, EagleModelMixin):
    def load_weights(self, weights):
        stacked_params_mapping = [
            ("gate_up_proj", "w1", 0),
            ("gate_up_proj", "w3", 1),
            ("attn.fused_wqa_wkv", "attn.wq_a", 0),
            ("attn.fused_wqa_wkv", "attn.wkv", 1),
            ("compressor.fused_wkv_wgate", "compressor.wkv", 0),
            ("compressor.fused_wkv_wgate", "compressor.wgate", 1),
            # LNA-LAB: one pre-fusion wo_a slice per TP rank
            ("attn.wo_a", "attn.wo_a.slice.0", 0),
            ("attn.wo_a", "attn.wo_a.slice.1", 1),
        ]
""",
        after=None,
        verdict=Verdict.FOREIGN,
    ),
    Example(
        "upstream-maps-slices",
        MODEL,
        before="""\
class DeepseekV4Model(nn.Module, EagleModelMixin):
    def load_weights(self, weights):
        stacked_params_mapping = [
            ("gate_up_proj", "w1", 0),
            ("gate_up_proj", "w3", 1),
        ]
        stacked_params_mapping += [("attn.wo_a.", f"attn.wo_a.slice.{g}.", g) for g in range(8)]
        for param_name, weight_name, shard_id in stacked_params_mapping:
            load(param_name, weight_name, shard_id)
""",
        after=None,
        verdict=Verdict.UPSTREAM,
    ),
)
