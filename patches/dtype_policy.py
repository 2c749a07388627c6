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
on) has the same three NVIDIA classes; their `_o_proj` reaches the same op,
directly or through V4.1's `dsv41_o_proj` (`nvidia/ops/o_proj.py`).

Fixed upstream in vLLM 0.30.0: `deep_gemm_fp8_o_proj` checks
`wo_a.weight.dtype == torch.float8_e4m3fn` and takes a BF16 `torch.bmm` path
otherwise (same math; 0.30's `fused_inv_rope_fp8_quant(quantize=False)` does not
exist before 0.30, so that path cannot be backported as is). vLLM 0.34.0 moves
the call one hop further: `_o_proj` calls `self.wo_a.grouped_forward(...)`
(`DeepseekV4GroupedWoA`, `common/grouped_wo_a.py`), which imports the op inside
the function and passes itself as `wo_a`.

What the probes check, through the evaluator (patcher/patching/evaluate), whatever
the code is called: `guarded_by(_o_proj, fp8_einsum, allowed=wo_a FP8,
forbidden=wo_a BF16)`. `_o_proj` runs under each case (`self.wo_a` the case's,
built as the classes vLLM assigns it), following every call that carries it (a
receiver, an argument, the layer holding it; helpers and flags followed). The
defect: deep-GEMM's `fp8_einsum` (the FP8-only GEMM with block scales) reached with
a BF16 `wo_a`. The fix: reached with an FP8 one only, nothing unknown met with BF16.
"""

from __future__ import annotations

import ast

from patch_dsv4.output.verdicts import Outcome, Verdict
from patch_dsv4.patches import miaai_kit
from patch_dsv4.patches._v41 import in_layouts
from patch_dsv4.patching.edits import ForeignEdit, NotProven, ReplaceStatements, Variant
from patch_dsv4.patching.evaluate import Evaluator, callee, cases, guarded_by, unknowns
from patch_dsv4.patching.evaluate.predicates import path_frames
from patch_dsv4.patching.evaluate.values import Inst
from patch_dsv4.patching.fingerprint import find_scope
from patch_dsv4.patching.patch import INJECTED_PREFIX, Context, Example, Patch, Scope

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


#: The FP8-only step: deep-GEMM's grouped einsum with wo_a's block scales (a BF16 wo_a has none).
FP8_GEMM = "fp8_einsum"


def _is_fp8_gemm(call: ast.Call, _args) -> bool:
    return callee(call)[1] == FP8_GEMM


def wo_a_dtype_gate(ctx: Context, file: str, cls: str, method: str = "_o_proj") -> tuple[str | None, str]:
    """Whether ``cls.method`` of ``file`` keeps the FP8-only GEMM to an FP8 ``wo_a``: (evidence of the fix or
    None, why not).

    The method runs under the cases ``wo_a FP8`` and ``wo_a BF16`` (``self.wo_a`` is the case's, built as the
    classes vLLM assigns it), following every call that carries it. The fix: the GEMM reached for FP8 and not for
    BF16, and nothing unknown met with BF16. No GEMM reached at all: the fix is there only where the method itself
    takes another path for BF16 than for FP8.
    """
    ev = Evaluator.of(ctx)
    owner = ev.follower.class_def(file, cls)
    start = ev.follower.method(owner, method) if owner is not None else None
    if start is None:
        return None, f"{cls}.{method} not found in {file}"
    guard = guarded_by(ev, start, _is_fp8_gemm, (cases.WO_A_FP8,), (cases.WO_A_BF16,), bind={"self.wo_a": "wo_a"},
                       self_value=Inst(owner))  # fmt: skip
    if guard.proven:
        site = guard.sites(cases.WO_A_FP8)[0]
        frames = path_frames(site)
        tests = guard.deciding(frames)
        if not tests:
            return None, f"{site.where.names()} calls {FP8_GEMM}, and no test of wo_a's dtype decides it"
        middle = [h.callee.qualname for h in site.where.path[:-1]]
        how = f"through {' -> '.join(middle)}" if middle else "directly"
        return (
            # no line numbers: a reformatted release gives the same evidence
            f"{site.where.defn.file}: {site.where.defn.qualname} runs {FP8_GEMM} only when `{ast.unparse(tests[0])}`,"
            f" otherwise a BF16 path; {method} reaches it {how}",
            "",
        )
    reached = guard.sites(cases.WO_A_BF16)
    if reached:
        site = reached[0]
        frames = path_frames(site)
        head = f"{site.where.names()} calls {FP8_GEMM} at line {site.where.line}"
        tests = guard.deciding(frames)
        if tests:  # a test of the dtype is there, but its sense lets a BF16 wo_a reach the call
            return (
                None,
                f"{head} on a path a BF16 wo_a takes too: `{ast.unparse(tests[0])}` does not keep it to an FP8 wo_a",
            )
        unknown = guard.unknown_tests(cases.WO_A_BF16, frames)
        return None, f"{head} whatever wo_a's dtype" + (f" (unknown: {unknown[0]})" if unknown else "")
    found = unknowns(guard.runs[cases.WO_A_BF16])
    if found:
        return None, found[0]
    differs = guard.deciding([start])
    if differs:
        return f"{start.where()} branches on wo_a's dtype itself (`{ast.unparse(differs[0])}`)", ""
    return None, f"no call of {FP8_GEMM} reached from {start.qualname} for an FP8 wo_a"


def _upstream_checks_dtype(cls: str, file: str):
    """Upstream where the code ``cls._o_proj`` reaches runs the FP8-only GEMM only for an FP8 wo_a."""

    def probe(ctx: Context, tree: ast.Module | None) -> Outcome | NotProven | None:
        if tree is None:
            return None
        method = find_scope(tree, cls, "_o_proj")
        if method is not None and _names_injected(method):
            return None  # ours: the anchors tell applied from modified
        # the method as Python finds it (the class, a base, a mixin in another module)
        evidence, seen = wo_a_dtype_gate(ctx, file, cls)
        return Outcome.upstream(evidence) if evidence else NotProven(seen)

    return probe


def _names_injected(node: ast.AST) -> bool:
    return any(isinstance(sub, ast.Name) and sub.id.startswith(INJECTED_PREFIX) for sub in ast.walk(node))


# -- foreign edits, recognised by their shape (not verdicts) -------------------------------------------
def _wo_a_weights(node: ast.AST, aliases: frozenset[str]) -> set[str]:
    """The expressions that read ``wo_a``'s weight in ``node``: ``<alias>.weight`` for every expression ``aliases``
    names as the attention's ``wo_a``, and a name bound to it or to ``getattr(<alias>, "weight", ...)`` (MiaAI's kit
    reads it so)."""
    weights = {f"{alias}.weight" for alias in aliases}
    getattrs = {f"getattr({alias}, 'weight'" for alias in aliases}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assign) and len(sub.targets) == 1 and isinstance(sub.targets[0], ast.Name):
            value = ast.unparse(sub.value)
            if value in weights or any(value.startswith(g) for g in getattrs):
                weights.add(sub.targets[0].id)
    return weights


def _dtype_tests(node: ast.AST, aliases: frozenset[str] = frozenset({"wo_a", "self.wo_a"})) -> list[ast.Compare]:
    """The comparisons in ``node`` of ``wo_a``'s weight dtype with ``torch.float8_e4m3fn``."""
    weights = _wo_a_weights(node, aliases)
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Compare):
            sides = [ast.unparse(side) for side in (sub.left, *sub.comparators)]
            if any(s == f"{w}.dtype" for s in sides for w in weights) and "torch.float8_e4m3fn" in sides:
                found.append(sub)
    return found


def _compares_wo_a_dtype_with_fp8(node: ast.AST) -> bool:
    """Whether ``node`` holds a comparison of some ``wo_a``'s weight dtype with FP8 (the foreign edits' shape)."""
    return bool(_dtype_tests(node))


def _calls(node: ast.AST, name: str) -> bool:
    return any(
        isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == name for sub in ast.walk(node)
    )


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
    serve_impact = (
        "the BF16 wo_a reaches the FP8-only O projection: AttributeError ... weight_scale_inv at the first "
        "forward, or empty text"
    )
    edits = tuple(
        ReplaceStatements(
            label=f"{what} O projection honours wo_a's dtype",
            file=file,
            scope=Scope(cls, "_o_proj"),
            variants=(Variant(ANCHOR, REPLACEMENT, releases="0.28.0, 0.29.0"),),
            helpers=(_patch_dsv4_bf16_o_proj,),
            probe=_upstream_checks_dtype(cls, file),
            foreign=(LNA_DENSE_EXL3, RECIPE_STOCK028),
            kept=(miaai_kit.EXL3_O_PROJ,),
        )
        for what, file, cls in (*ATTENTION_CLASSES, *V41_ATTENTION_CLASSES)
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
    # 0.34.0's fix, spelled anew: the class of wo_a (picked by a conditional expression in the base class)
    # reaches the FP8 GEMM through a helper that branches on wo_a's weight dtype first
    Example(
        "upstream-through-the-attribute-class",
        FLASHMLA,
        before="""\
def _grouped_gemm(x, weight_owner):
    is_fp8 = weight_owner.weight.dtype == torch.float8_e4m3fn
    if not is_fp8:
        return torch.bmm(x, weight_owner.weight)
    return fp8_einsum("bhr,hdr->bhd", x, weight_owner.weight)


class GroupedProjection:
    def run(self, x):
        return _grouped_gemm(x, self)


class DeepseekV4Attention:
    def __init__(self, cpu):
        projection = Linear if cpu else GroupedProjection
        self.wo_a = projection(1, 2)


class DeepseekV4FlashMLAAttention(DeepseekV4Attention):
    def _o_proj(self, o, positions):
        return self.wo_b(self.wo_a.run(o))
""",
        after=None,
        verdict=Verdict.UPSTREAM,
    ),
    # the same path with the dtype branch missing: the FP8 GEMM runs for any wo_a
    Example(
        "dtype-branch-missing-drifts",
        FLASHMLA,
        before="""\
def _grouped_gemm(x, weight_owner):
    return fp8_einsum("bhr,hdr->bhd", x, weight_owner.weight)


class GroupedProjection:
    def run(self, x):
        return _grouped_gemm(x, self)


class DeepseekV4Attention:
    def __init__(self):
        self.wo_a = GroupedProjection(1, 2)


class DeepseekV4FlashMLAAttention(DeepseekV4Attention):
    def _o_proj(self, o, positions):
        return self.wo_b(self.wo_a.run(o))
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
    # a dtype branch on the wrong module (wo_b) does not make wo_a's GEMM safe
    Example(
        "branch-on-another-weight-drifts",
        FLASHMLA,
        before="""\
def _grouped_gemm(x, wo_a, wo_b):
    if wo_b.weight.dtype == torch.float8_e4m3fn:
        return fp8_einsum("bhr,hdr->bhd", x, wo_a.weight)
    return fp8_einsum("bhr,hdr->bhd", x, wo_a.weight)


class DeepseekV4FlashMLAAttention:
    def _o_proj(self, o, positions):
        return _grouped_gemm(o, self.wo_a, self.wo_b)
""",
        after=None,
        verdict=Verdict.DRIFTED,
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
