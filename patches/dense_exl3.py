"""Serve packs whose attention and compressor linears are EXL3 (lna-lab's dense-EXL3 bakes) (opt-in).

A pack that quantizes not only the routed experts but also the attention and
compressor linears with EXL3 (lna-lab/dsv4-carve "D2-K2x3-Dense6", served with
the vllm-exl3 plugin) needs three things stock vLLM 0.28.0-0.33.0 does not do:
- `DeepseekCompressor.__init__` (`compressor.py`) builds `fused_wkv_wgate` with
  `quant_config=None`, so the pack's EXL3 compressor tensors have no parameter:
  `KeyError` mid-load. The patch passes the quant config only when it is
  vllm-exl3's and that config declares the compressor EXL3 (its
  `_matches_non_routed_exl3`); every other pack keeps `None`, as vLLM chose.
- vllm-exl3 deletes an EXL3 linear's `.weight` once it has built its
  `LinearEXL3` objects (`_exl3_linears`), but vLLM's O projections read
  `wo_a.weight` (`deep_gemm_fp8_o_proj`, `rocm_inv_rope_einsum`) and the
  compressor scores run `torch.mm` on `fused_wkv_wgate.weight`:
  `AttributeError` at the first forward. `DeepseekV4Attention.forward` (every
  NVIDIA attention class inherits it) sends a `wo_a` with EXL3 linears through
  inverse RoPE, the rank-local `LinearEXL3` and `wo_b`; the two score closures
  of `_run_parallel_input_projections` run the EXL3 shards (wkv, then wgate).
  A module without EXL3 linears runs vLLM's own statement, unchanged.
The O-projection edit sits before the `_o_proj` call, not in `_o_proj`, so it
composes with dtype-policy (0.28/0.29), which edits `_o_proj` itself: an EXL3
`wo_a` never reaches it, a BF16 or FP8 one takes it as before. The EXL3 O
projection needs one `wo_a` group per rank (tensor parallel size = `o_groups`,
8 for DeepSeek-V4-Flash). Packs that store `wo_a` per group also need
`exl3-wo-a-slices`. Applied only when asked for (`patch-dsv4 apply --with
dense-exl3`), then kept by later applies.

Not fixed upstream in vLLM 0.28.0-0.33.0 nor in vllm-exl3 (which does not patch vLLM).
"""

from __future__ import annotations

import ast

from patch_dsv4.edits import ForeignEdit, ReplaceStatements, Variant, injected_names, mentions_injected
from patch_dsv4.patch import Context, Example, Patch, Scope
from patch_dsv4.verdicts import Outcome, Verdict

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


def _upstream_compressor_config(ctx: Context, tree: ast.Module | None) -> Outcome | None:
    scope = ctx.scope(COMPRESSOR, "DeepseekCompressor", "__init__") if tree is not None else None
    if scope is None:
        return None
    for value in _fused_wkv_wgate_quant_configs(scope):
        if mentions_injected(value):
            return None
        if not (isinstance(value, ast.Constant) and value.value is None):
            return Outcome.upstream(f"DeepseekCompressor passes quant_config={ast.unparse(value)} to fused_wkv_wgate")
    return None


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


O_PROJ_VARIANTS = (_o_proj_variant("o", "0.28.0-0.30.0"), _o_proj_variant("attn_out", "0.31.0-0.33.0"))
O_PROJ_OWN = injected_names(*(v.replacement for v in O_PROJ_VARIANTS))


def _upstream_exl3_wo_a(ctx: Context, tree: ast.Module | None) -> Outcome | None:
    """vLLM handles an EXL3 wo_a itself: its forward or the shared O-projection op knows _exl3_linears."""
    forward = ctx.scope(ATTENTION, ATTENTION_CLASS, "forward") if tree is not None else None
    if forward is not None and not mentions_injected(forward, O_PROJ_OWN) and "_exl3_linears" in ast.unparse(forward):
        return Outcome.upstream(f"{ATTENTION}: {ATTENTION_CLASS}.forward handles a wo_a with _exl3_linears")
    op = ctx.scope(O_PROJ_OP, None, "deep_gemm_fp8_o_proj")
    if op is not None and "_exl3_linears" in ast.unparse(op):
        return Outcome.upstream(f"{O_PROJ_OP}: deep_gemm_fp8_o_proj handles a wo_a with _exl3_linears")
    return None


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

    def upstream(ctx: Context, tree: ast.Module | None) -> Outcome | None:
        scope = ctx.scope(ATTENTION, ATTENTION_CLASS, "_run_parallel_input_projections") if tree is not None else None
        if scope is None or mentions_injected(scope, own) or _lna_score_calls(scope):
            return None
        if not any(ast.unparse(n) == weight for n in ast.walk(scope) if isinstance(n, ast.Attribute)):
            return Outcome.upstream(f"{ATTENTION_CLASS}.{closure} no longer reads {weight}")
        return None

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
        probe=upstream,
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
    opt_in = True
    edits = (
        ReplaceStatements(
            label="the compressor gets the quant config an EXL3 pack declares for it",
            file=COMPRESSOR,
            scope=Scope("DeepseekCompressor", "__init__"),
            variants=(Variant(QUANT_ANCHOR, QUANT_REPLACEMENT, releases="0.28.0-0.33.0"),),
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
    Example(
        "upstream-quantizes-the-compressor",
        COMPRESSOR,
        before="""\
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
