"""Serve packs whose attention and compressor linears are EXL3 (lna-lab's dense-EXL3 bakes) (opt-in).

A pack that quantizes not only the routed experts but also the attention and
compressor linears with EXL3 (lna-lab/dsv4-carve "D2-K2x3-Dense6", served with
the vllm-exl3 plugin) needs three things stock vLLM 0.28.0-0.34.0 does not do:
- `DeepseekCompressor.__init__` (`compressor.py`) builds `fused_wkv_wgate` with
  `quant_config=None` (0.34.0 picks the class first: `kv_score_linear(...)`), so
  the pack's EXL3 compressor tensors have no parameter: `KeyError` mid-load.
  The patch passes the quant config only when it is vllm-exl3's and that
  config declares the compressor EXL3 (its `_matches_non_routed_exl3`); every
  other pack keeps `None`, as vLLM chose.
- vllm-exl3 deletes an EXL3 linear's `.weight` once it has built its
  `LinearEXL3` objects (`_exl3_linears`), but vLLM's O projections read
  `wo_a.weight` (`deep_gemm_fp8_o_proj`, `rocm_inv_rope_einsum`) and the
  compressor scores run `torch.mm` on `fused_wkv_wgate.weight`:
  `AttributeError` at the first forward. `DeepseekV4Attention.forward` (every
  NVIDIA attention class inherits it) sends a `wo_a` with EXL3 linears through
  inverse RoPE, the rank-local `LinearEXL3` and `wo_b`; the two score closures
  of `_run_parallel_input_projections` run the EXL3 shards (wkv, then wgate).
  In 0.34.0 the closures call the module and the read moved into its class:
  `DeepseekV4CompressorKVScoreLinear.forward` (`compressor.py`) returns
  `torch.mm(input_, self.weight.T, ...)`. One edit there serves the attention's
  and the indexer's compressors (and V4.1's, which builds the same class); for
  a layer with a BF16 shard or padding it calls the plugin's
  `quant_method.apply` directly, never the module (that would run the patched
  forward again). A module without EXL3 linears runs vLLM's own statement, unchanged.
The scores' probes follow the closure's call into the class's forward
(patcher/follow): `upstream` only when no code on that path reads `.weight` and
the work is handed to `quant_method.apply`; a closure that no longer reads the
weight is no fix by itself.
The O-projection edit sits before the `_o_proj` call, not in `_o_proj`, so it
composes with dtype-policy (0.28/0.29), which edits `_o_proj` itself: an EXL3
`wo_a` never reaches it, a BF16 or FP8 one takes it as before. The EXL3 O
projection needs one `wo_a` group per rank (tensor parallel size = `o_groups`,
8 for DeepSeek-V4-Flash). Packs that store `wo_a` per group also need
`exl3-wo-a-slices`. Applied only when asked for (`patch-dsv4 apply --with
dense-exl3`), then kept by later applies.

DeepSeek-V4.1 packs are not carried: V4.1's compressor also passes `quant_config=None`
(`deepseek_v41/compressor.py`), and its specialized decode reads
`fused_wkv_wgate.weight` itself, so an EXL3 V4.1 compressor still stops at load
(`KeyError`), never later; its unquantized compressors run vLLM's `torch.mm` through
the patched forward, unchanged.

Not fixed upstream in vLLM 0.28.0-0.34.0 nor in vllm-exl3 (which does not patch vLLM).
"""

from __future__ import annotations

import ast

from patch_dsv4.output.verdicts import Outcome, Verdict
from patch_dsv4.patching.edits import (
    ForeignEdit,
    NotProven,
    ReplaceStatements,
    Variant,
    injected_names,
    mentions_injected,
)
from patch_dsv4.patching.evaluate import Evaluator, built_with, callee, cases, guarded_by
from patch_dsv4.patching.evaluate.interpret import Event
from patch_dsv4.patching.evaluate.values import NONE, Inst, Reach, describe, one_of, options
from patch_dsv4.patching.follow import Follower, Frame
from patch_dsv4.patching.patch import Context, Example, Patch, Scope

COMPRESSOR = "vllm/models/deepseek_v4/compressor.py"
ATTENTION = "vllm/models/deepseek_v4/attention.py"
O_PROJ_OP = "vllm/models/deepseek_v4/nvidia/ops/o_proj.py"
ATTENTION_CLASS = "DeepseekV4Attention"


# -- injected helpers ------------------------------------------------------------------------------------
# The helpers below are written into vLLM as they stand here (edits.helper_source): not formatted.
# fmt: off
def _patch_dsv4_compressor_quant_config(vllm_config, prefix):
    """The quant config for a compressor's fused_wkv_wgate: None (vLLM's choice) unless EXL3 claims it.

    Written by patch-dsv4 (dense-exl3). vLLM builds the compressor unquantized on
    purpose; only a pack whose EXL3 config declares this linear (vllm-exl3's
    non_routed_exl3, by its fused name or its wkv/wgate shards) needs the config,
    or its EXL3 tensors have no parameter.
    """
    quant_config = getattr(vllm_config, "quant_config", None)
    get_name = getattr(quant_config, "get_name", None)
    if not callable(get_name) or get_name() != "exl3":
        return None
    claims = getattr(quant_config, "_matches_non_routed_exl3", None)
    if not callable(claims):
        return None
    head = prefix.rpartition(".")[0]
    names = (prefix, f"{head}.wkv", f"{head}.wgate") if head else (prefix,)
    return quant_config if any(claims(name) for name in names) else None


def _patch_dsv4_exl3_wo_a(layer):
    """Whether this attention layer's wo_a is EXL3 (vllm-exl3 built LinearEXL3 objects for it).

    Written by patch-dsv4 (dense-exl3). vLLM's O projections read wo_a.weight,
    which vllm-exl3 deletes once it has built them.
    """
    linears = getattr(getattr(layer, "wo_a", None), "_exl3_linears", None)
    return bool(linears) and any(linear is not None for linear in linears)


def _patch_dsv4_exl3_o_proj(layer, o, positions):
    """Inverse RoPE, the rank-local EXL3 wo_a group, then wo_b.

    Written by patch-dsv4 (dense-exl3). vLLM's BF16 path (rocm_inv_rope_einsum)
    with the grouped einsum replaced by the one local group's LinearEXL3; needs
    tensor parallel size == o_groups (one wo_a group per rank).
    """
    import sys

    import torch
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import _fused_inverse_rope_gptj

    linears = layer.wo_a._exl3_linears
    if not isinstance(o, torch.Tensor) or layer.n_local_groups != 1 or len(linears) != 1 or linears[0] is None:
        raise NotImplementedError(
            "patch-dsv4 (dense-exl3): an EXL3 wo_a needs one wo_a group per rank and a BF16 attention output "
            f"(n_local_groups={layer.n_local_groups}, {len(linears)} EXL3 linears)"
        )
    o_ref = _fused_inverse_rope_gptj(o, positions, layer.rotary_emb.cos_sin_cache, layer.rope_head_dim)
    x = o_ref.reshape(o_ref.shape[0], -1).to(torch.float16).contiguous()
    dense_forward = getattr(sys.modules.get("vllm_exl3.exl3"), "_dense_forward", None)
    z = dense_forward(linears[0], x) if callable(dense_forward) else linears[0].forward(x, {}, out_dtype=torch.float32)
    return layer.wo_b(z.to(o.dtype))


def _patch_dsv4_kv_score(module, hidden_states):
    """fused_wkv_wgate(hidden_states) in float32: vLLM's torch.mm, or the layer's EXL3 shards.

    Written by patch-dsv4 (dense-exl3). vllm-exl3 replaces an EXL3 linear's
    weight by LinearEXL3 objects (_exl3_linears, one per shard: wkv, wgate) and
    deletes .weight; a module without them runs vLLM's own torch.mm.
    """
    import sys

    import torch

    linears = getattr(module, "_exl3_linears", None)
    if not linears or all(linear is None for linear in linears):
        return torch.mm(hidden_states, module.weight.T, out_dtype=torch.float32)
    if any(linear is None for linear in linears) or getattr(module, "_exl3_linear_padded", False):
        return module(hidden_states).to(torch.float32)  # BF16 shards or padding: the plugin's own apply
    x = hidden_states.reshape(-1, hidden_states.shape[-1]).to(torch.float16).contiguous()
    dense_forward = getattr(sys.modules.get("vllm_exl3.exl3"), "_dense_forward", None)
    if callable(dense_forward):
        outs = [dense_forward(linear, x) for linear in linears]
    else:
        outs = [linear.forward(x, {}, out_dtype=torch.float32) for linear in linears]
    out = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).to(torch.float32)
    return out.reshape(*hidden_states.shape[:-1], out.shape[-1])


def _patch_dsv4_has_exl3_shards(module):
    """Whether vllm-exl3 built LinearEXL3 objects for this linear (it deletes the linear's .weight once it has).

    Written by patch-dsv4 (dense-exl3).
    """
    linears = getattr(module, "_exl3_linears", None)
    return bool(linears) and any(linear is not None for linear in linears)


def _patch_dsv4_exl3_kv_score(module, input_):
    """An EXL3 fused_wkv_wgate's kv/score projection in float32: its EXL3 shards, wkv then wgate.

    Written by patch-dsv4 (dense-exl3). A layer with a BF16 shard or padding
    takes the plugin's own quant_method.apply, called directly: calling the
    module would run the patched forward, and this helper, again.
    """
    import sys

    import torch

    linears = module._exl3_linears
    if any(linear is None for linear in linears) or getattr(module, "_exl3_linear_padded", False):
        return module.quant_method.apply(module, input_, None).to(torch.float32)  # built with bias=False
    x = input_.reshape(-1, input_.shape[-1]).to(torch.float16).contiguous()
    dense_forward = getattr(sys.modules.get("vllm_exl3.exl3"), "_dense_forward", None)
    if callable(dense_forward):
        outs = [dense_forward(linear, x) for linear in linears]
    else:
        outs = [linear.forward(x, {}, out_dtype=torch.float32) for linear in linears]
    out = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).to(torch.float32)
    return out.reshape(*input_.shape[:-1], out.shape[-1])


def _patch_dsv4_compressor_kv_score(module, hidden_states):
    """The attention compressor's kv/score projection (see _patch_dsv4_kv_score).

    Written by patch-dsv4 (dense-exl3).
    """
    return _patch_dsv4_kv_score(module, hidden_states)


def _patch_dsv4_indexer_kv_score(module, hidden_states):
    """The indexer compressor's kv/score projection (see _patch_dsv4_kv_score).

    Written by patch-dsv4 (dense-exl3).
    """
    return _patch_dsv4_kv_score(module, hidden_states)
# fmt: on


# -- E(a): the compressor's quant config -----------------------------------------------------------------
QUANT_ANCHOR = """
self.fused_wkv_wgate = MergedColumnParallelLinear(
    self.hidden_size,
    [self.coff * self.head_dim, self.coff * self.head_dim],
    bias=False,
    return_bias=False,
    quant_config=None,
    disable_tp=True,
    prefix=f"{prefix}.fused_wkv_wgate",
)
"""
QUANT_REPLACEMENT = """
# patch-dsv4 (dense-exl3): an EXL3 pack that quantizes the compressor gets its quant config.
self.fused_wkv_wgate = MergedColumnParallelLinear(
    self.hidden_size,
    [self.coff * self.head_dim, self.coff * self.head_dim],
    bias=False,
    return_bias=False,
    quant_config=_patch_dsv4_compressor_quant_config(vllm_config, f"{prefix}.fused_wkv_wgate"),
    disable_tp=True,
    prefix=f"{prefix}.fused_wkv_wgate",
)
"""


# 0.34.0 picks the class first (`kv_score_linear = MergedColumnParallelLinear if ... else
# DeepseekV4CompressorKVScoreLinear`), then builds it with the same arguments.
QUANT_ANCHOR_034 = QUANT_ANCHOR.replace("= MergedColumnParallelLinear(", "= kv_score_linear(")
QUANT_REPLACEMENT_034 = QUANT_REPLACEMENT.replace("= MergedColumnParallelLinear(", "= kv_score_linear(")
QUANT_VARIANTS = (
    Variant(QUANT_ANCHOR, QUANT_REPLACEMENT, releases="0.28.0-0.33.0"),
    Variant(QUANT_ANCHOR_034, QUANT_REPLACEMENT_034, releases="0.34.0"),
)


def _fused_wkv_wgate_quant_configs(scope: ast.AST) -> list[ast.expr]:
    """The quant_config= of every ``self.fused_wkv_wgate = ...(...)`` in ``scope``."""
    found = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            if [ast.unparse(t) for t in node.targets] == ["self.fused_wkv_wgate"]:
                found += [k.value for k in node.value.keywords if k.arg == "quant_config"]
    return found


def _lna_compressor(tree: ast.Module, scope: ast.AST | None) -> str | None:
    """lna-lab's patch_dsv4_dense_exl3.py: fused_wkv_wgate gets vllm_config.quant_config, unconditionally."""
    if scope is None:
        return None
    if any(ast.unparse(v) == "vllm_config.quant_config" for v in _fused_wkv_wgate_quant_configs(scope)):
        return "fused_wkv_wgate gets quant_config=vllm_config.quant_config, whatever the pack"
    return None


LNA_COMPRESSOR = ForeignEdit(
    script="patch_dsv4_dense_exl3.py",
    recipe="lna-lab recipe",
    meaning=(
        "it hands every pack's compressor to its quant method (for an EXL3 pack that does not quantize the "
        "compressor, the non-routed delegate, e.g. FP8), and patch-dsv4 can neither verify nor revert it: "
        "take it over with takeover --with dense-exl3"
    ),
    found=_lna_compressor,
)


QUANT_OWN = injected_names(*(v.replacement for v in QUANT_VARIANTS))


def _upstream_compressor_config(ctx: Context, tree: ast.Module | None) -> Outcome | NotProven | None:
    """Upstream where ``DeepseekCompressor.__init__``, for an EXL3 pack that quantizes the compressor, builds
    fused_wkv_wgate with the pack's quant config (every class it may build, every path)."""
    scope = ctx.scope(COMPRESSOR, "DeepseekCompressor", "__init__") if tree is not None else None
    if scope is None or mentions_injected(scope, QUANT_OWN):
        return None
    ev = Evaluator.of(ctx)
    built = built_with(ev, ev.follower.class_def(COMPRESSOR, "DeepseekCompressor"), "fused_wkv_wgate", cases.EXL3_PACK)
    wanted = cases.EXL3_PACK.role("vllm_config").attr("quant_config")  # type: ignore[union-attr]
    given = [one_of(*options(b.get("quant_config", NONE))) for b in built]
    if built and all(g == wanted for g in given):
        return Outcome.upstream(
            f"{COMPRESSOR}: DeepseekCompressor.__init__ builds fused_wkv_wgate with the pack's quant config for "
            f"{cases.EXL3_PACK}"
        )
    found = ", ".join(describe(g) for g in given) or "no construction found"
    return NotProven(f"DeepseekCompressor.__init__ builds fused_wkv_wgate with quant_config {found} for an EXL3 pack")


# -- E(b): the EXL3 O projection, at the one call site every NVIDIA class inherits -----------------------
def _o_proj_variant(name: str, releases: str) -> Variant:
    return Variant(
        f"return self._o_proj({name}, positions)",
        f"""
if _patch_dsv4_exl3_wo_a(self):
    # patch-dsv4 (dense-exl3): an EXL3 wo_a has no dense weight for vLLM's O projection.
    return _patch_dsv4_exl3_o_proj(self, {name}, positions)
return self._o_proj({name}, positions)
""",
        releases=releases,
    )


O_PROJ_VARIANTS = (_o_proj_variant("o", "0.28.0-0.30.0"), _o_proj_variant("attn_out", "0.31.0-0.34.0"))
O_PROJ_OWN = injected_names(*(v.replacement for v in O_PROJ_VARIANTS))


def _o_proj_call(call: ast.Call, _args) -> bool:
    """The attention's O projection: ``self._o_proj(...)``, the call the edit guards."""
    receiver, name = callee(call)
    return receiver is not None and name == "_o_proj"


def _upstream_exl3_wo_a(ctx: Context, tree: ast.Module | None) -> Outcome | NotProven | None:
    """Upstream where ``DeepseekV4Attention.forward`` keeps an EXL3 wo_a (no ``.weight``) from the O projection
    that reads its weight, and sends BF16 and FP8 ones to it: ``guarded_by(forward, _o_proj, allowed=BF16 and
    FP8, forbidden=EXL3)``."""
    forward = ctx.scope(ATTENTION, ATTENTION_CLASS, "forward") if tree is not None else None
    if tree is None or (forward is not None and mentions_injected(forward, O_PROJ_OWN)):
        return None
    ev = Evaluator.of(ctx)
    owner = ev.follower.class_def(ATTENTION, ATTENTION_CLASS)
    start = ev.follower.method(owner, "forward") if owner is not None else None  # a base's or a mixin's too
    if start is None:
        return None
    guard = guarded_by(ev, start, _o_proj_call, (cases.WO_A_BF16, cases.WO_A_FP8), (cases.WO_A_EXL3,),
                       bind={"self.wo_a": "wo_a"}, self_value=Inst(owner))  # fmt: skip
    raised = guard.runs[cases.WO_A_EXL3].of("raises")  # kept from _o_proj by a crash is no fix
    if guard.proven and not raised:
        return Outcome.upstream(
            f"{ATTENTION}: {ATTENTION_CLASS}.forward keeps a wo_a without .weight (EXL3) from _o_proj, which "
            "BF16 and FP8 ones take"
        )
    return NotProven(raised[0].text if raised else guard.failure())


# -- F: the compressor scores ----------------------------------------------------------------------------
def _score_edit(closure: str, owner: str, helper) -> ReplaceStatements:
    weight = f"{owner}.fused_wkv_wgate.weight"
    variant = Variant(
        f"return torch.mm(hidden_states, {weight}.T, out_dtype=torch.float32)",
        f"""
# patch-dsv4 (dense-exl3): an EXL3 fused_wkv_wgate has no .weight; run its EXL3 shards.
return {helper.__name__}({owner}.fused_wkv_wgate, hidden_states)
""",
        releases="0.28.0-0.33.0",
    )
    own = injected_names(variant.replacement)

    def follow(ctx: Context, tree: ast.Module | None) -> Outcome | None:
        """The closure reads the weight itself (the anchors decide), or calls the module: then its forward is judged."""
        scope = ctx.scope(ATTENTION, ATTENTION_CLASS, "_run_parallel_input_projections") if tree is not None else None
        if scope is None or mentions_injected(scope, own) or _lna_score_calls(scope):
            return None
        if any(ast.unparse(n) == weight for n in ast.walk(scope) if isinstance(n, ast.Attribute)):
            return None
        module = f"{owner}.fused_wkv_wgate"
        calls = [n for n in ast.walk(scope) if isinstance(n, ast.Call) and ast.unparse(n.func) == module]
        return _module_call_outcome(ctx, closure, module, calls) if calls else None

    def lna(tree: ast.Module, scope: ast.AST | None) -> str | None:
        calls = [c for c in _lna_score_calls(scope) if ast.unparse(c.args[0]) == f"{owner}.fused_wkv_wgate"]
        if not calls:
            return None
        name = ast.unparse(calls[0].func)
        evidence = f"{closure} returns {name}({owner}.fused_wkv_wgate, hidden_states)"
        helper_def = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
        if helper_def is not None and "module.fused_wkv_wgate.weight" in ast.unparse(helper_def):
            evidence += f" ({name}'s fallback reads module.fused_wkv_wgate.weight: a BF16 compressor fails)"
        return evidence

    return ReplaceStatements(
        label=f"{closure} runs an EXL3 fused_wkv_wgate",
        file=ATTENTION,
        scope=Scope(ATTENTION_CLASS, "_run_parallel_input_projections"),
        variants=(variant,),
        helpers=(_patch_dsv4_kv_score, helper),
        probe=follow,
        foreign=(
            ForeignEdit(
                script="patch_dsv4_attention_compressor_exl3.py",
                recipe="lna-lab recipe",
                meaning=(
                    "its helper prefers vllm_exl3.exl3.run_exl3_group, which only lna-lab's plugin fork has, and "
                    "patch-dsv4 can neither verify nor revert it: take it over with takeover --with dense-exl3"
                ),
                found=lna,
            ),
        ),
    )


# -- F on 0.34.0: the read moved into the projection's own class ------------------------------------------------
# The closures call `compressor.fused_wkv_wgate(hidden_states)`; the class built there (on GPUs) reads the weight
# in its forward: `return torch.mm(input_, self.weight.T, out_dtype=torch.float32)`. One edit there covers the
# attention's and the indexer's compressors, and V4.1's, which builds the same class.
KV_SCORE_CLASS = "DeepseekV4CompressorKVScoreLinear"
KV_SCORE_VARIANT = Variant(
    "return torch.mm(input_, self.weight.T, out_dtype=torch.float32)",
    """
if _patch_dsv4_has_exl3_shards(self):
    # patch-dsv4 (dense-exl3): an EXL3 fused_wkv_wgate has no .weight; run its EXL3 shards.
    return _patch_dsv4_exl3_kv_score(self, input_)
return torch.mm(input_, self.weight.T, out_dtype=torch.float32)
""",
    releases="0.34.0",
)
KV_SCORE_OWN = injected_names(KV_SCORE_VARIANT.replacement)


def _is_dispatch(call: ast.Call, _args=None) -> bool:
    """``<layer>.quant_method.apply(...)``: the linear hands its work to its quant method (EXL3's, for a pack)."""
    receiver, name = callee(call)
    return name == "apply" and receiver is not None and receiver.rsplit(".", 1)[-1] == "quant_method"


def _exl3_forward(ctx: Context, cls, forward) -> tuple[list[Event], list[Event]]:
    """``forward`` of ``cls`` run for an EXL3 linear (no ``.weight``, its shards, its quant method): the reads of
    what it lacks (each with the calls followed to it), and the calls that hand the work to its quant method (not
    followed further: what the quant method does is the pack's)."""
    run = Evaluator.of(ctx).run(forward, self_value=Inst(cls, cases.EXL3_LINEAR), sink=_is_dispatch)
    return run.of("raises"), [e for e in run.of("sink") if e.reach is not Reach.NO]


def _read_where(event: Event, caller: str = "") -> str:
    """Where a read of what an EXL3 linear lacks is, with the calls followed to it (from ``caller`` when given)."""
    text = event.text.split(" (", 1)[0]  # "reads self.weight"
    return f"{caller + ' -> ' if caller else ''}{event.where.evidence()} {text} (line {event.where.line})"


def _first(frame: Frame) -> str:
    params = [a.arg for a in frame.defn.node.args.args]  # type: ignore[union-attr]
    return params[0] if params else "self"


def _is_kv_score_forward(defn) -> bool:
    return defn.file == COMPRESSOR and defn.qualname == f"{KV_SCORE_CLASS}.forward"


def _module_call_outcome(ctx: Context, closure: str, module: str, calls: list[ast.Call]) -> Outcome:
    """A closure that calls the projection module: follow the call into each class it may be, and judge there."""
    follower = Follower(ctx)
    outer = follower.function(ATTENTION, ATTENTION_CLASS, "_run_parallel_input_projections")
    frame = follower.frame(outer) if outer is not None else None
    forwards = [callee for call in calls for callee in follower.callees(frame, call)] if frame is not None else []
    found = f"{closure} returns {ast.unparse(calls[0])}"
    caller = f"{outer.where()} ({closure}, line {calls[0].lineno})" if outer is not None else closure
    if not forwards:
        return Outcome.drifted(
            f"{ATTENTION_CLASS}.{closure} calls {module}, and its class could not be followed",
            expected=f"{module} built as a class of {COMPRESSOR} (DeepseekCompressor.__init__)",
            found=found,
        )
    readers, silent, dispatchers = [], [], []
    for start in forwards:  # each class the module may be, its forward run for an EXL3 linear
        built = next((v.defn for v in start.names.get(_first(start), []) if v.instance), start.defn.owner)
        reads, dispatches = _exl3_forward(ctx, built, start.defn)
        if reads:
            readers += reads
        elif dispatches:
            dispatchers += dispatches
        else:
            silent.append(start)
    uncovered = [event for event in readers if not _is_kv_score_forward(event.where.defn)]
    if uncovered or silent:
        what = (
            _read_where(uncovered[0], caller)
            if uncovered
            else f"{caller} -> {silent[0].defn.where()} neither reads .weight nor dispatches"
        )
        return Outcome.drifted(
            f"{ATTENTION_CLASS}.{closure} calls {module}; {what}: no edit of dense-exl3 is there",
            expected=f"the read in {KV_SCORE_CLASS}.forward ({COMPRESSOR}), or a quant_method.apply dispatch",
            found=what,
        )
    if readers:
        return Outcome.not_applicable(
            f"{closure} calls {module}: the .weight read is in {KV_SCORE_CLASS}.forward, judged by the edit there "
            f"({_read_where(readers[0], caller)})"
        )
    return Outcome.upstream(
        f"{ATTENTION_CLASS}.{closure} calls {module}, whose forward reads no .weight and hands the work to its "
        f"quant method: {'; '.join(dict.fromkeys(f'{caller} -> {e.where.evidence()}' for e in dispatchers))}"
    )


def _kv_score_class_probe(ctx: Context, tree: ast.Module | None) -> Outcome | NotProven | None:
    """The projection class's forward: EXL3-ready when no code on its path reads .weight and it dispatches."""
    if tree is None:
        return None
    follower = Follower(ctx)
    cls = follower.class_def(COMPRESSOR, KV_SCORE_CLASS)
    if cls is None:
        return Outcome.not_applicable(
            f"{COMPRESSOR} defines no {KV_SCORE_CLASS} (0.34.0's); the closures of "
            f"{ATTENTION_CLASS}._run_parallel_input_projections are judged where they read the weight"
        )
    forward = follower.method(cls, "forward")
    if forward is None or mentions_injected(forward.node, KV_SCORE_OWN):
        return None
    reads, dispatches = _exl3_forward(ctx, cls, forward)
    if not reads and dispatches:
        return Outcome.upstream(
            f"{KV_SCORE_CLASS}.forward reads no .weight and hands the work to its quant method: "
            + "; ".join(dict.fromkeys(e.where.evidence() for e in dispatches))
        )
    return NotProven(reads[0].text if reads else f"{KV_SCORE_CLASS}.forward hands no work to a quant method")


KV_SCORE_EDIT = ReplaceStatements(
    label=f"{KV_SCORE_CLASS}.forward runs an EXL3 fused_wkv_wgate",
    file=COMPRESSOR,
    scope=Scope(KV_SCORE_CLASS, "forward"),
    variants=(KV_SCORE_VARIANT,),
    helpers=(_patch_dsv4_has_exl3_shards, _patch_dsv4_exl3_kv_score),
    probe=_kv_score_class_probe,
)


def _lna_score_calls(scope: ast.AST | None) -> list[ast.Call]:
    """Calls of lna-lab's score helpers (``_lna_kv_score``, ``_lna_kv_score_v2``) returned in ``scope``."""
    if scope is None:
        return []
    return [
        node.value
        for node in ast.walk(scope)
        if isinstance(node, ast.Return)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id.startswith("_lna_kv_score")
        and len(node.value.args) == 2
    ]


class DenseExl3(Patch):
    id = "dense-exl3"
    title = "opt-in: EXL3 attention and compressor linears (lna-lab's dense-EXL3 packs) load and run"
    serve_impact = (
        "an EXL3 attention or compressor linear has no parameter (KeyError mid-load) or no .weight "
        "(AttributeError at the first forward)"
    )
    opt_in = True
    edits = (
        ReplaceStatements(
            label="the compressor gets the quant config an EXL3 pack declares for it",
            file=COMPRESSOR,
            scope=Scope("DeepseekCompressor", "__init__"),
            variants=QUANT_VARIANTS,
            helpers=(_patch_dsv4_compressor_quant_config,),
            probe=_upstream_compressor_config,
            foreign=(LNA_COMPRESSOR,),
        ),
        ReplaceStatements(
            label="an EXL3 wo_a takes the EXL3 O projection",
            file=ATTENTION,
            scope=Scope(ATTENTION_CLASS, "forward"),
            variants=O_PROJ_VARIANTS,
            helpers=(_patch_dsv4_exl3_wo_a, _patch_dsv4_exl3_o_proj),
            probe=_upstream_exl3_wo_a,
        ),
        _score_edit("compressor_kv_score", "compressor", _patch_dsv4_compressor_kv_score),
        _score_edit("indexer_compressor_kv_score", "indexer.compressor", _patch_dsv4_indexer_kv_score),
        KV_SCORE_EDIT,
    )


EXAMPLES = (
    Example(
        "compressor-gets-an-exl3-config",
        COMPRESSOR,
        before="""\
class DeepseekCompressor(nn.Module):
    def __init__(self, vllm_config: VllmConfig, compress_ratio: int, prefix: str = ""):
        self.fused_wkv_wgate = MergedColumnParallelLinear(
            self.hidden_size,
            [self.coff * self.head_dim, self.coff * self.head_dim],
            bias=False,
            return_bias=False,
            quant_config=None,
            disable_tp=True,
            prefix=f"{prefix}.fused_wkv_wgate",
        )
        self.norm = RMSNorm(self.head_dim, self.rms_norm_eps)
""",
        after='''\
def _patch_dsv4_compressor_quant_config(vllm_config, prefix):
    """The quant config for a compressor's fused_wkv_wgate: None (vLLM's choice) unless EXL3 claims it.

    Written by patch-dsv4 (dense-exl3). vLLM builds the compressor unquantized on
    purpose; only a pack whose EXL3 config declares this linear (vllm-exl3's
    non_routed_exl3, by its fused name or its wkv/wgate shards) needs the config,
    or its EXL3 tensors have no parameter.
    """
    quant_config = getattr(vllm_config, "quant_config", None)
    get_name = getattr(quant_config, "get_name", None)
    if not callable(get_name) or get_name() != "exl3":
        return None
    claims = getattr(quant_config, "_matches_non_routed_exl3", None)
    if not callable(claims):
        return None
    head = prefix.rpartition(".")[0]
    names = (prefix, f"{head}.wkv", f"{head}.wgate") if head else (prefix,)
    return quant_config if any(claims(name) for name in names) else None


class DeepseekCompressor(nn.Module):
    def __init__(self, vllm_config: VllmConfig, compress_ratio: int, prefix: str = ""):
        # patch-dsv4 (dense-exl3): an EXL3 pack that quantizes the compressor gets its quant config.
        self.fused_wkv_wgate = MergedColumnParallelLinear(
            self.hidden_size,
            [self.coff * self.head_dim, self.coff * self.head_dim],
            bias=False,
            return_bias=False,
            quant_config=_patch_dsv4_compressor_quant_config(vllm_config, f"{prefix}.fused_wkv_wgate"),
            disable_tp=True,
            prefix=f"{prefix}.fused_wkv_wgate",
        )
        self.norm = RMSNorm(self.head_dim, self.rms_norm_eps)
''',
    ),
    # vLLM 0.34.0: the read moved into the projection's class; the class is picked before it is built
    Example(
        "0.34-kv-score-class-and-config",
        COMPRESSOR,
        before="""\
class DeepseekV4CompressorKVScoreLinear(MergedColumnParallelLinear):
    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        return torch.mm(input_, self.weight.T, out_dtype=torch.float32)


class DeepseekCompressor(nn.Module):
    def __init__(self, vllm_config: VllmConfig, compress_ratio: int, hidden_size: int, prefix: str = ""):
        kv_score_linear = (
            MergedColumnParallelLinear
            if current_platform.is_cpu()
            else DeepseekV4CompressorKVScoreLinear
        )
        self.fused_wkv_wgate = kv_score_linear(
            self.hidden_size,
            [self.coff * self.head_dim, self.coff * self.head_dim],
            bias=False,
            return_bias=False,
            quant_config=None,
            disable_tp=True,
            prefix=f"{prefix}.fused_wkv_wgate",
        )
""",
        after="""\
class DeepseekV4CompressorKVScoreLinear(MergedColumnParallelLinear):
    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if _patch_dsv4_has_exl3_shards(self):
            # patch-dsv4 (dense-exl3): an EXL3 fused_wkv_wgate has no .weight; run its EXL3 shards.
            return _patch_dsv4_exl3_kv_score(self, input_)
        return torch.mm(input_, self.weight.T, out_dtype=torch.float32)


class DeepseekCompressor(nn.Module):
    def __init__(self, vllm_config: VllmConfig, compress_ratio: int, hidden_size: int, prefix: str = ""):
        kv_score_linear = (
            MergedColumnParallelLinear
            if current_platform.is_cpu()
            else DeepseekV4CompressorKVScoreLinear
        )
        # patch-dsv4 (dense-exl3): an EXL3 pack that quantizes the compressor gets its quant config.
        self.fused_wkv_wgate = kv_score_linear(
            self.hidden_size,
            [self.coff * self.head_dim, self.coff * self.head_dim],
            bias=False,
            return_bias=False,
            quant_config=_patch_dsv4_compressor_quant_config(vllm_config, f"{prefix}.fused_wkv_wgate"),
            disable_tp=True,
            prefix=f"{prefix}.fused_wkv_wgate",
        )
""",
        with_helpers=False,
    ),
    # helpers left out (their source is compared with this module's elsewhere), to keep it short
    Example(
        "o-projection-and-scores-run-exl3",
        ATTENTION,
        before="""\
class DeepseekV4Attention(nn.Module, AttentionLayerBase, ABC):
    def forward(self, positions, hidden_states):
        attn_out = self.attention_impl(positions, hidden_states)
        # Inverse-RoPE + wo_a + wo_b output projection (platform-specific).
        return self._o_proj(attn_out, positions)

    def _run_parallel_input_projections(self, hidden_states):
        if self.compressor is not None:
            compressor = self.compressor

            def compressor_kv_score() -> torch.Tensor:
                return torch.mm(
                    hidden_states,
                    compressor.fused_wkv_wgate.weight.T,
                    out_dtype=torch.float32,
                )

            aux_fns[0] = compressor_kv_score

        if self.indexer is not None:
            indexer = self.indexer

            def indexer_compressor_kv_score() -> torch.Tensor:
                return torch.mm(
                    hidden_states,
                    indexer.compressor.fused_wkv_wgate.weight.T,
                    out_dtype=torch.float32,
                )

            aux_fns[2] = indexer_compressor_kv_score
""",
        after="""\
class DeepseekV4Attention(nn.Module, AttentionLayerBase, ABC):
    def forward(self, positions, hidden_states):
        attn_out = self.attention_impl(positions, hidden_states)
        # Inverse-RoPE + wo_a + wo_b output projection (platform-specific).
        if _patch_dsv4_exl3_wo_a(self):
            # patch-dsv4 (dense-exl3): an EXL3 wo_a has no dense weight for vLLM's O projection.
            return _patch_dsv4_exl3_o_proj(self, attn_out, positions)
        return self._o_proj(attn_out, positions)

    def _run_parallel_input_projections(self, hidden_states):
        if self.compressor is not None:
            compressor = self.compressor

            def compressor_kv_score() -> torch.Tensor:
                # patch-dsv4 (dense-exl3): an EXL3 fused_wkv_wgate has no .weight; run its EXL3 shards.
                return _patch_dsv4_compressor_kv_score(compressor.fused_wkv_wgate, hidden_states)

            aux_fns[0] = compressor_kv_score

        if self.indexer is not None:
            indexer = self.indexer

            def indexer_compressor_kv_score() -> torch.Tensor:
                # patch-dsv4 (dense-exl3): an EXL3 fused_wkv_wgate has no .weight; run its EXL3 shards.
                return _patch_dsv4_indexer_kv_score(indexer.compressor.fused_wkv_wgate, hidden_states)

            aux_fns[2] = indexer_compressor_kv_score
""",
        with_helpers=False,
    ),
    Example(
        "lna-lab-compressor",
        COMPRESSOR,
        before="""\
class DeepseekCompressor(nn.Module):
    def __init__(self, vllm_config: VllmConfig, compress_ratio: int, prefix: str = ""):
        self.fused_wkv_wgate = MergedColumnParallelLinear(
            self.hidden_size,
            [self.coff * self.head_dim, self.coff * self.head_dim],
            bias=False,
            return_bias=False,
            # LNA-LAB: dense EXL3 overlay
            quant_config=vllm_config.quant_config,
            disable_tp=True,
            prefix=f"{prefix}.fused_wkv_wgate",
        )
""",
        after=None,
        verdict=Verdict.FOREIGN,
    ),
    # the quant config handed over through a helper (followed: its result is the pack's config)
    Example(
        "upstream-quantizes-the-compressor",
        COMPRESSOR,
        before="""\
def compressor_quant_config(vllm_config, prefix):
    return vllm_config.quant_config


class DeepseekCompressor(nn.Module):
    def __init__(self, vllm_config: VllmConfig, compress_ratio: int, prefix: str = ""):
        self.fused_wkv_wgate = MergedColumnParallelLinear(
            self.hidden_size,
            [self.coff * self.head_dim, self.coff * self.head_dim],
            bias=False,
            return_bias=False,
            quant_config=compressor_quant_config(vllm_config, prefix),
            disable_tp=True,
            prefix=f"{prefix}.fused_wkv_wgate",
        )
""",
        after=None,
        verdict=Verdict.UPSTREAM,
    ),
)
