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

DeepSeek-V4.1 (`deepseek_v41/`, `deepseek_v4_1/` in the nightlies; vLLM 0.30.0
on) has the same three NVIDIA classes; their `_o_proj` calls V4's shared
`deep_gemm_fp8_o_proj` (0.30.0-0.32.0), or V4.1's `dsv41_o_proj`
(`nvidia/ops/o_proj.py`, 0.33.0), which calls it: the patch judges each of them
by that op, as it judges V4's.

Fixed upstream in vLLM 0.30.0: `deep_gemm_fp8_o_proj` checks
`wo_a.weight.dtype == torch.float8_e4m3fn` and takes a BF16 `torch.bmm` path
otherwise (same math; 0.30's `fused_inv_rope_fp8_quant(quantize=False)` does not
exist before 0.30, so that path cannot be backported as is).
"""

from __future__ import annotations

import ast

from patch_dsv4.edits import ForeignEdit, ReplaceStatements, Variant
from patch_dsv4.fingerprint import find_scope
from patch_dsv4.patch import INJECTED_PREFIX, Context, Example, Patch, Scope
from patch_dsv4.patches import miaai_kit
from patch_dsv4.patches._v41 import imported_from, in_layouts
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
#: DeepSeek-V4.1's: the same classes, in its own package (both layouts).
V41_ATTENTION_CLASSES = tuple(
    (f"{what} ({tag})", file, cls)
    for what, relpath, cls in (
        ("SM100 FlashInfer", "nvidia/flashinfer_sparse.py", "DeepseekV4FlashInferMLAAttention"),
        ("SM120 FlashInfer", "nvidia/flashinfer_sparse.py", "DeepseekV4FlashInferSM120Attention"),
        ("FlashMLA", "nvidia/flashmla.py", "DeepseekV4FlashMLAAttention"),
    )
    for file, tag in in_layouts(relpath)
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


# The helpers below are written into vLLM as they stand here (edits.helper_source): not formatted.
# fmt: off
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
# fmt: on


def _compares_wo_a_dtype_with_fp8(node: ast.AST) -> bool:
    """Whether ``node`` holds a comparison of some ``wo_a``'s weight dtype with FP8: ``wo_a.weight.dtype``, or
    the dtype of a name bound to ``wo_a.weight`` or ``getattr(wo_a, "weight", ...)`` (MiaAI's kit reads it so)."""
    weights = {"wo_a.weight"}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assign) and len(sub.targets) == 1 and isinstance(sub.targets[0], ast.Name):
            value = ast.unparse(sub.value)
            if value.endswith("wo_a.weight") or (value.startswith("getattr(") and "wo_a, 'weight'" in value):
                weights.add(sub.targets[0].id)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Compare):
            sides = [ast.unparse(side) for side in (sub.left, *sub.comparators)]
            if any(s.endswith(f"{w}.dtype") for s in sides for w in weights) and "torch.float8_e4m3fn" in sides:
                return True
    return False


def _names_injected(node: ast.AST) -> bool:
    return any(isinstance(sub, ast.Name) and sub.id.startswith(INJECTED_PREFIX) for sub in ast.walk(node))


def _calls(node: ast.AST, name: str) -> bool:
    return any(
        isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == name for sub in ast.walk(node)
    )


def _upstream_checks_dtype(cls: str, file: str | None = None):
    """Upstream where the class checks wo_a's dtype, or calls the shared op that does. With ``file`` (V4.1), a
    call of a vLLM function imported into the file that calls the shared op counts as a call of it."""

    def probe(ctx: Context, tree: ast.Module | None) -> Outcome | None:
        method = find_scope(tree, cls, "_o_proj") if tree is not None else None
        if method is None:
            return None
        if _compares_wo_a_dtype_with_fp8(method) and not _names_injected(method):
            return Outcome.upstream(f"{cls}._o_proj checks wo_a.weight.dtype against torch.float8_e4m3fn itself")
        via = ""
        if not _calls(method, SHARED_OP):
            called = [
                sub.func.id for sub in ast.walk(method) if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name)
            ]
            wrappers = [
                (name, source)
                for name in called
                if file is not None and (source := imported_from(tree, file, name)) is not None
            ]
            found = [
                (n, src) for n, src in wrappers if (f := ctx.scope(src, None, n)) is not None and _calls(f, SHARED_OP)
            ]
            if not found:
                return None
            via = f" (through {found[0][0]} of {found[0][1]})"
        op = ctx.scope(O_PROJ, None, SHARED_OP)
        if op is not None and _compares_wo_a_dtype_with_fp8(op):
            # one sentence for every class that reaches the op the same way (status prints it once)
            return Outcome.upstream(
                f"{O_PROJ}: {SHARED_OP}, which the attention classes call{via}, takes a BF16 path "
                "when wo_a.weight.dtype is not torch.float8_e4m3fn"
            )
        return None

    return probe


def _lna_dense_exl3(tree: ast.Module, scope: ast.AST | None) -> str | None:
    """lna-lab's patch_dsv4_dense_exl3.py replaces _o_proj: an EXL3 branch first, its marker statement leading."""
    if scope is None:
        return None
    for node in ast.walk(scope):
        if (
            isinstance(node, ast.Assign)
            and [ast.unparse(t) for t in node.targets] == ["exl3_linears"]
            and "_exl3_linears" in ast.unparse(node.value)
        ):
            return "_o_proj starts with exl3_linears = getattr(self.wo_a, '_exl3_linears', None), then its BF16 branch"
    return None


def _recipe_stock028(tree: ast.Module, scope: ast.AST | None) -> str | None:
    """The DGX-Spark recipe's patch_dsv4_stock028.py: a dtype test on wo_a.weight whose branch calls
    rocm_inv_rope_einsum itself, before the FP8 call."""
    if scope is None or _names_injected(scope):
        return None
    for node in ast.walk(scope):
        if (
            isinstance(node, ast.If)
            and _compares_wo_a_dtype_with_fp8(node.test)
            and _calls(node, "rocm_inv_rope_einsum")
        ):
            return "_o_proj branches on wo_a.weight.dtype into rocm_inv_rope_einsum before deep_gemm_fp8_o_proj"
    return None


LNA_DENSE_EXL3 = ForeignEdit(
    script="patch_dsv4_dense_exl3.py",
    recipe="lna-lab recipe",
    meaning=(
        "its BF16 branch does what this patch does, but patch-dsv4 can neither verify nor revert it; its EXL3 "
        "branch is what the opt-in dense-exl3 carries (in DeepseekV4Attention.forward, before _o_proj, so it "
        "composes with this patch): take it over with takeover --with dense-exl3"
    ),
    found=_lna_dense_exl3,
)
RECIPE_STOCK028 = ForeignEdit(
    script="patch_dsv4_stock028.py",
    recipe="DGX-Spark recipe",
    meaning="its BF16 branch does what this patch does, but patch-dsv4 can neither verify nor revert it: take it over",
    found=_recipe_stock028,
)


class DtypePolicy(Patch):
    id = "dtype-policy"
    title = "NVIDIA attention: a BF16 wo_a takes the BF16 output projection, not the FP8-only einsum"
    edits = tuple(
        ReplaceStatements(
            label=f"{what} O projection honours wo_a's dtype",
            file=file,
            scope=Scope(cls, "_o_proj"),
            variants=(Variant(ANCHOR, REPLACEMENT, releases="0.28.0, 0.29.0"),),
            helpers=(_patch_dsv4_bf16_o_proj,),
            probe=_upstream_checks_dtype(cls, file if v41 else None),
            foreign=(LNA_DENSE_EXL3, RECIPE_STOCK028),
            kept=(miaai_kit.EXL3_O_PROJ,),
        )
        for v41, classes in ((False, ATTENTION_CLASSES), (True, V41_ATTENTION_CLASSES))
        for what, file, cls in classes
    )


EXAMPLES = (
    # the V4.1 look-alike below the FlashMLA class keeps its projection
    Example(
        "fp8-only-projection",
        FLASHMLA,
        before="""\
import torch

from vllm.models.deepseek_v4.nvidia.ops.o_proj import deep_gemm_fp8_o_proj


class DeepseekV4FlashMLAAttention(DeepseekV4Attention):
    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
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


class DeepseekV41FlashMLAAttention(DeepseekV4Attention):
    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
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
""",
        after='''\
import torch

from vllm.models.deepseek_v4.nvidia.ops.o_proj import deep_gemm_fp8_o_proj


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


class DeepseekV4FlashMLAAttention(DeepseekV4Attention):
    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.wo_a.weight.dtype != torch.float8_e4m3fn:
            # patch-dsv4 (dtype-policy): a wo_a kept in BF16 has no FP8 block scales.
            return _patch_dsv4_bf16_o_proj(self, o, positions)
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


class DeepseekV41FlashMLAAttention(DeepseekV4Attention):
    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
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
''',
    ),
    Example(
        "class-checks-dtype-itself",
        FLASHMLA,
        before="""\
class DeepseekV4FlashMLAAttention(DeepseekV4Attention):
    def _o_proj(self, o, positions):
        if self.wo_a.weight.dtype == torch.float8_e4m3fn:
            return bf16_o_proj(o)
        return deep_gemm_fp8_o_proj(o, positions)
""",
        after=None,
        verdict=Verdict.UPSTREAM,
    ),
    Example(
        "changed-call-drifts",
        FLASHMLA,
        before="""\
class DeepseekV4FlashMLAAttention(DeepseekV4Attention):
    def _o_proj(self, o, positions):
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
            tma_aligned_scales=True,
        )
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
)
