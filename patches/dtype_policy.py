"""Give a BF16 `wo_a` the BF16 output projection instead of the FP8-only deep-GEMM einsum.

DeepSeek-V4-Flash-Vision packs keep the non-routed weights, `wo_a` among them, in
BF16. On vLLM 0.28.0 and 0.29.0 every NVIDIA attention class (SM100 and SM120
FlashInfer in `nvidia/flashinfer_sparse.py`, FlashMLA in `nvidia/flashmla.py`)
hands `wo_a` to `deep_gemm_fp8_o_proj` (`nvidia/ops/o_proj.py`), which quantizes
the attention output to FP8 and runs `fp8_einsum` with `wo_a`'s block scales: a
BF16 `wo_a` has none, and the first forward fails. The patch sends a `wo_a` that
is not `torch.float8_e4m3fn` through vLLM's own BF16 path, `rocm_inv_rope_einsum`
(`vllm/v1/attention/ops/rocm_aiter_mla_sparse.py`, a Triton kernel that runs on
NVIDIA GPUs too): inverse RoPE, the grouped einsum with `wo_a`, then `wo_b`, as
the ROCm class does. FP8 `wo_a` keeps the original call. Each class is edited in
its own `_o_proj`, so a class that stops routing through the shared op is
reported as drifted instead of silently left on the FP8-only path.

Fixed upstream in vLLM 0.30.0: `deep_gemm_fp8_o_proj` checks
`wo_a.weight.dtype == torch.float8_e4m3fn` and takes a BF16 `torch.bmm` path
otherwise (same math; 0.30's `fused_inv_rope_fp8_quant(quantize=False)` does not
exist before 0.30, so that path cannot be backported as is).
"""

from __future__ import annotations

import ast
import textwrap

from patch_dsv4.edits import ReplaceStatements, Scope
from patch_dsv4.fingerprint import find_scope
from patch_dsv4.patch import Context, Example, Patch, injected_names_prefix
from patch_dsv4.verdicts import Outcome, Verdict

FLASHINFER = "vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py"
FLASHMLA = "vllm/models/deepseek_v4/nvidia/flashmla.py"
O_PROJ = "vllm/models/deepseek_v4/nvidia/ops/o_proj.py"
SHARED_OP = "deep_gemm_fp8_o_proj"

# (what the class is, file, class): every NVIDIA class whose _o_proj reaches the FP8-only op.
ATTENTION_CLASSES = (
    ("SM100 FlashInfer", FLASHINFER, "DeepseekV4FlashInferMLAAttention"),
    ("SM120 FlashInfer", FLASHINFER, "DeepseekV4FlashInferSM120Attention"),
    ("FlashMLA", FLASHMLA, "DeepseekV4FlashMLAAttention"),
)

ANCHOR = """
return deep_gemm_fp8_o_proj(
    o,
    positions,
    self.rotary_emb.cos_sin_cache,
    self.wo_a,
    self.wo_b,
    n_groups=self.n_local_groups,
    heads_per_group=self.n_local_heads // self.n_local_groups,
    nope_dim=self.nope_head_dim,
    rope_dim=self.rope_head_dim,
    o_lora_rank=self.o_lora_rank,
    einsum_recipe=self._einsum_recipe,
    tma_aligned_scales=self._tma_aligned_scales,
)
"""

REPLACEMENT = """
if self.wo_a.weight.dtype != torch.float8_e4m3fn:
    # patch-dsv4 (dtype-policy): a wo_a kept in BF16 has no FP8 block scales.
    return _patch_dsv4_bf16_o_proj(self, o, positions)
""" + ANCHOR.lstrip("\n")

HELPER = '''
def _patch_dsv4_bf16_o_proj(layer, o, positions):
    """O projection for a wo_a that is not FP8: inverse RoPE, grouped einsum, wo_b.

    Written by patch-dsv4 (dtype-policy). deep_gemm_fp8_o_proj reads FP8 block
    scales that a BF16 wo_a does not have; this is vLLM's own BF16 path, the
    one its ROCm attention class takes.
    """
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import rocm_inv_rope_einsum

    z = rocm_inv_rope_einsum(
        layer.rotary_emb,
        o,
        positions,
        layer.rope_head_dim,
        layer.n_local_groups,
        layer.o_lora_rank,
        layer.wo_a,
    )
    return layer.wo_b(z.flatten(1))
'''


def _compares_wo_a_dtype_with_fp8(node: ast.AST) -> bool:
    """Whether ``node`` holds a comparison of some ``wo_a``'s weight dtype with FP8."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Compare):
            sides = [ast.unparse(side) for side in (sub.left, *sub.comparators)]
            if any(s.endswith("wo_a.weight.dtype") for s in sides) and "torch.float8_e4m3fn" in sides:
                return True
    return False


def _mentions_ours(node: ast.AST) -> bool:
    prefix = injected_names_prefix()
    return any(
        (isinstance(sub, ast.Name) and sub.id.startswith(prefix))
        or (isinstance(sub, ast.FunctionDef) and sub.name.startswith(prefix))
        for sub in ast.walk(node)
    )


def _calls(node: ast.AST, name: str) -> bool:
    return any(
        isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == name for sub in ast.walk(node)
    )


def _probe_for(cls: str):
    def probe(ctx: Context, text: str | None) -> Outcome | None:
        if text is None:
            return None
        try:
            method = find_scope(ctx.parse(text), cls, "_o_proj")
        except SyntaxError:
            return None
        if method is None:
            return None
        if _compares_wo_a_dtype_with_fp8(method) and not _mentions_ours(method):
            return Outcome.upstream(f"{cls}._o_proj checks wo_a.weight.dtype against torch.float8_e4m3fn itself")
        if not _calls(method, SHARED_OP):
            return None
        op_tree = ctx.ast(O_PROJ)
        op = find_scope(op_tree, None, SHARED_OP) if op_tree is not None else None
        if op is not None and _compares_wo_a_dtype_with_fp8(op):
            return Outcome.upstream(
                f"{O_PROJ}: {SHARED_OP} checks wo_a.weight.dtype == torch.float8_e4m3fn and has a BF16 path; "
                f"{cls}._o_proj routes through it"
            )
        return None

    return probe


class DtypePolicy(Patch):
    __doc__ = __doc__
    id = "dtype-policy"
    title = "NVIDIA attention: a BF16 wo_a takes the BF16 output projection, not the FP8-only einsum"

    def edits(self, ctx: Context) -> list[ReplaceStatements]:
        return [
            ReplaceStatements(
                label=f"{what} O projection honours wo_a's dtype",
                file=file,
                scope=Scope(cls, "_o_proj"),
                anchor=ANCHOR,
                replacement=REPLACEMENT,
                helpers=(HELPER,),
                probe=_probe_for(cls),
            )
            for what, file, cls in ATTENTION_CLASSES
        ]


_CALL = ANCHOR.strip()
_BEFORE = f'''
import torch

from vllm.models.deepseek_v4.nvidia.ops.o_proj import deep_gemm_fp8_o_proj


class DeepseekV4FlashMLAAttention(DeepseekV4Attention):
    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
{textwrap.indent(_CALL, " " * 8)}


class DeepseekV41FlashMLAAttention(DeepseekV4Attention):
    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
{textwrap.indent(_CALL, " " * 8)}
'''
_AFTER = _BEFORE.replace(
    "\n\n\nclass DeepseekV4FlashMLAAttention(",
    "\n\n\n" + HELPER.strip() + "\n\n\nclass DeepseekV4FlashMLAAttention(",
).replace(
    "    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:\n        return",
    "    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:\n"
    + textwrap.indent(REPLACEMENT.strip().split("\nreturn deep_gemm_fp8_o_proj(")[0], " " * 8)
    + "\n        return",
    1,
)

EXAMPLES = (
    # the V4.1 look-alike below the FlashMLA class keeps its projection
    Example("fp8-only-projection", FLASHMLA, _BEFORE, _AFTER),
    Example(
        "reformatted-call",
        FLASHMLA,
        _BEFORE.replace(
            "            n_groups=self.n_local_groups,\n",
            "            n_groups=(self.n_local_groups),  # groups on this rank\n",
            1,
        ),
        _AFTER,
    ),
    Example(
        "class-checks-dtype-itself",
        FLASHMLA,
        _BEFORE.replace(
            "        return deep_gemm_fp8_o_proj(\n",
            "        if self.wo_a.weight.dtype == torch.float8_e4m3fn:\n            return bf16_o_proj(o)\n"
            "        return deep_gemm_fp8_o_proj(\n",
            1,
        ),
        None,
        Verdict.UPSTREAM,
    ),
    Example(
        "changed-call-drifts",
        FLASHMLA,
        _BEFORE.replace("tma_aligned_scales=self._tma_aligned_scales", "tma_aligned_scales=True", 1),
        None,
        Verdict.DRIFTED,
    ),
)
