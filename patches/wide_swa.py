"""Run wide sliding-window prefill rows through FlashInfer 0.6.x as 128-wide slices.

The vision class widens prefill sliding-window index rows from `sliding_window`
(128) to `sliding_window + vision_max_n_token` (512)
(`vllm/v1/attention/backends/mla/sparse_swa.py`, `prefill_index_width`, vLLM
0.30.0 on). On SM120/SM121 (DGX Spark, RTX PRO) the compressed layers' prefill
goes to FlashInfer's dual-cache kernel (window plus compressed segment), which
in FlashInfer 0.6.x takes 128-wide window rows only (`if (topk != 128) return
false` in `dispatch_dsv4_dual`, csrc/sparse_mla_sm120_prefill.cu), so the engine
dies in warm-up with "Unsupported sparse-MLA prefill configuration ...
topk=512".

The patch routes exactly those calls (compressed segment present, rows wider
than 128, more tokens than FlashInfer's decode kernels serve) through 128-wide
slices: slice s takes columns [128 s, 128 s + 128) with lengths
clamp(len - 128 s, 0, 128); slice 0 alone carries the compressed segment and the
attention sink, so each is counted once; the partial results are merged exactly
by their log-sum-exp, in the kernel's base 2. Everything else takes the
unchanged call, and the injected code checks the installed FlashInfer again at
run time, so upgrading FlashInfer after patching takes the kernel's own path.

Fixed upstream in FlashInfer 0.7.0 (dual-cache prefill takes any row width
with topk % 64 == 0), pinned by vLLM 0.31.0 and later.
No wide rows before vLLM 0.30.0.

DeepSeek-V4.1 on vLLM 0.30.0: the same builder widens V4.1's rows to
128 + 1024 = 1152 (its config sets `vision_n_layers`), and V4.1's own
`DeepseekV4FlashInferSM120Attention._forward_prefill`
(`deepseek_v41/nvidia/flashinfer_sparse.py`; `deepseek_v4_1/` in the nightlies)
makes the same call. At 1152 FlashInfer 0.6.x has a kernel on no path: not the
dual-cache prefill (128 only), not the single-cache prefill of SWA-only layers
(`compress_ratio` 0: 128, 192, 256, 512, 1024, 2048), not the decode kernels
that serve calls of 64 tokens or fewer (`_DECODE_DSV4_DISPATCH`: 128 to 1024).
So V4.1's edit slices every call with rows wider than 128, with or without a
compressed segment, whatever its token count. From vLLM 0.31.0 the builder
widens rows only for V4's config (`mm_prefix_clamp_sliding_window`, which only
V4's config sets; 0.33.0: `isinstance(hf_config, DeepseekV4Config)`): V4.1's
rows stay 128 wide there, and the edit is not applicable.
"""

from __future__ import annotations

import ast
import re

from packaging.version import InvalidVersion, Version

from patch_dsv4.output.verdicts import Outcome, Verdict
from patch_dsv4.patches import miaai_kit
from patch_dsv4.patches._v41 import V41_CONFIG, in_layouts
from patch_dsv4.patching.edits import ForeignEdit, ReplaceStatements, Variant, helper_source, indent, mentions_injected
from patch_dsv4.patching.evaluate import Evaluator, attribute_value, cases
from patch_dsv4.patching.evaluate.values import Const, Inst, describe
from patch_dsv4.patching.fingerprint import find_scope
from patch_dsv4.patching.patch import Context, Example, Patch, Scope

FLASHINFER_SPARSE = "vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py"
SPARSE_SWA = "vllm/v1/attention/backends/mla/sparse_swa.py"
SM120_CLASS = "DeepseekV4FlashInferSM120Attention"
SWA_BUILDER = "DeepseekSparseSWAMetadataBuilder"

#: The first FlashInfer release whose SM120 dual-cache prefill takes wide rows.
FIXED_IN_FLASHINFER = Version("0.7.0")
#: Where FlashInfer 0.6.x states the limit, and the limit itself.
FLASHINFER_PREFILL_CU = "flashinfer/data/csrc/sparse_mla_sm120_prefill.cu"
FLASHINFER_PREFILL_DISPATCH_07 = "flashinfer/data/csrc/sparse_mla_sm120/prefill_dispatch.cu"
_DUAL_DISPATCH = re.compile(r"\bbool\s+dispatch_dsv4_dual\s*\(")
_ROW_LIMIT = re.compile(r"if\s*\(\s*topk\s*!=\s*128\s*\)\s*return\s+false\s*;")

ANCHOR = """
flashinfer_trtllm_batch_decode_sparse_mla_dsv4(
    query=q_chunk,
    swa_kv_cache=swa_kv_paged,
    workspace_buffer=self._get_workspace(q.device),
    sparse_indices=swa_indices_chunk,
    compressed_kv_cache=extra_kv_paged,
    out=output[query_start:query_end],
    bmm1_scale=self.scale,
    sinks=self.attn_sink,
    kv_layout="NHD",
    swa_topk_lens=swa_lens_chunk,
    extra_sparse_indices=extra_sparse_indices_chunk,
    extra_sparse_topk_lens=extra_sparse_lengths_chunk,
)
"""

REPLACEMENT = """
# patch-dsv4 (wide-swa): FlashInfer 0.6.x dual-cache prefill takes 128-wide rows only.
if _patch_dsv4_wide_swa_takes_sliced_path(
    q_chunk, swa_indices_chunk, extra_sparse_indices_chunk
):
    _patch_dsv4_wide_swa_sliced_prefill(
        query=q_chunk,
        swa_kv_cache=swa_kv_paged,
        workspace_buffer=self._get_workspace(q.device),
        sparse_indices=swa_indices_chunk,
        compressed_kv_cache=extra_kv_paged,
        out=output[query_start:query_end],
        bmm1_scale=self.scale,
        sinks=self.attn_sink,
        swa_topk_lens=swa_lens_chunk,
        extra_sparse_indices=extra_sparse_indices_chunk,
        extra_sparse_topk_lens=extra_sparse_lengths_chunk,
    )
else:
""" + indent(ANCHOR, 4)


V41_REPLACEMENT = """
# patch-dsv4 (wide-swa): FlashInfer 0.6.x SM120 kernels take 128-wide rows, not V4.1's.
if _patch_dsv4_wide_swa_v41_takes_sliced_path(swa_indices_chunk):
    _patch_dsv4_wide_swa_v41_sliced_prefill(
        query=q_chunk,
        swa_kv_cache=swa_kv_paged,
        workspace_buffer=self._get_workspace(q.device),
        sparse_indices=swa_indices_chunk,
        compressed_kv_cache=extra_kv_paged,
        out=output[query_start:query_end],
        bmm1_scale=self.scale,
        sinks=self.attn_sink,
        swa_topk_lens=swa_lens_chunk,
        extra_sparse_indices=extra_sparse_indices_chunk,
        extra_sparse_topk_lens=extra_sparse_lengths_chunk,
    )
else:
""" + indent(ANCHOR, 4)


# The helpers below are written into vLLM as they stand here (edits.helper_source): not formatted.
# fmt: off
def _patch_dsv4_wide_swa_takes_sliced_path(query, sparse_indices, extra_sparse_indices):
    """Whether this SM120 prefill call needs 128-wide slices.

    Written by patch-dsv4 (wide-swa). True for calls that would reach
    FlashInfer's dual-cache prefill kernel (a compressed segment, more tokens
    than its decode kernels serve: 64) with window rows wider than 128, where
    the installed FlashInfer is older than 0.7.0, whose kernel takes them.
    Checked at run time, so upgrading FlashInfer after patching takes the
    kernel's own path.
    """
    if (
        extra_sparse_indices is None
        or sparse_indices.shape[-1] <= 128
        or query.shape[0] <= 64
    ):
        return False
    import re

    import flashinfer

    found = re.match(r"(\d+)\.(\d+)", str(getattr(flashinfer, "__version__", "")))
    return found is not None and (int(found[1]), int(found[2])) < (0, 7)


def _patch_dsv4_wide_swa_flashinfer_api():
    """FlashInfer 0.6.x's private SM120 sparse-MLA entry point and segment type.

    Written by patch-dsv4 (wide-swa). The public wrapper returns no LSE, which
    the merge needs. Bound to the 0.6.x signature, and checked against it here.
    """
    import inspect

    from flashinfer.mla import _core

    run = getattr(_core, "_trtllm_batch_decode_sparse_mla_sm120", None)
    segment = getattr(_core, "_SparseMLASegment", None)
    bound = (
        "query",
        "kv_cache",
        "workspace_buffer",
        "sparse_mla_segments",
        "out",
        "sm_scale",
        "sinks",
        "lse",
        "return_lse",
        "kv_scale_format",
    )
    params = inspect.signature(run).parameters if callable(run) else {}
    if segment is None or any(name not in params for name in bound) or any(
        name not in bound and p.default is inspect.Parameter.empty
        for name, p in params.items()
    ):
        raise RuntimeError(
            "patch-dsv4 wide-swa: this FlashInfer's SM120 sparse-MLA API is not "
            "the 0.6.x one the sliced prefill is bound to; install FlashInfer "
            ">= 0.7.0, whose kernel takes wide rows, and run `patch-dsv4 status`"
        )
    return run, segment


def _patch_dsv4_wide_swa_merge(out_acc, lse_acc, part_out, part_lse):
    """Fold one slice's result into the running one, exactly, in base 2.

    Written by patch-dsv4 (wide-swa). FlashInfer's SM120 kernels write a
    base-2 LSE (log2 of the softmax denominator, sink included), so
    out = sum_s 2^(lse_s - lse) out_s and lse = log2(sum_s 2^lse_s). An empty
    slice carries the kernel's sentinel LSE, -1e30, and weighs nothing; a row
    empty in every slice keeps output 0 and the sentinel, as the kernel writes.
    """
    import torch

    part_lse = part_lse.clamp_min(-1e30)
    new_lse = torch.maximum(lse_acc, part_lse)
    keep = torch.exp2(lse_acc - new_lse)
    take = torch.exp2(part_lse - new_lse)
    total = keep + take
    out_acc.mul_((keep / total).unsqueeze(-1))
    out_acc.add_(part_out.float() * (take / total).unsqueeze(-1))
    lse_acc.copy_(torch.where(new_lse <= -1e30, new_lse, new_lse + torch.log2(total)))


def _patch_dsv4_wide_swa_sliced_prefill(
    *,
    query,
    swa_kv_cache,
    workspace_buffer,
    sparse_indices,
    compressed_kv_cache,
    out,
    bmm1_scale,
    sinks,
    swa_topk_lens,
    extra_sparse_indices,
    extra_sparse_topk_lens,
):
    """SM120 dual-cache prefill with window rows wider than 128, as 128-wide slices.

    Written by patch-dsv4 (wide-swa). Slice s takes window columns
    [128 s, 128 s + 128), each slice contiguous, with lengths
    clamp(len - 128 s, 0, 128); slice 0 alone carries the compressed segment
    and the sink, so each is counted once. The partial results are merged by
    their base-2 LSE, in float32, 2048 tokens at a time to bound the extra
    memory. Writes ``out`` and returns the merged LSE, [tokens, heads].
    """
    import torch

    run, segment = _patch_dsv4_wide_swa_flashinfer_api()
    num_tokens = query.shape[0]
    indices = sparse_indices.reshape(num_tokens, -1)
    num_slices = (indices.shape[-1] + 127) // 128
    if indices.shape[-1] % 128:
        indices = torch.nn.functional.pad(
            indices, (0, num_slices * 128 - indices.shape[-1]), value=-1
        )
    extra_indices = extra_sparse_indices.reshape(num_tokens, -1)
    query4 = query if query.dim() == 4 else query.unsqueeze(1)
    out4 = out if out.dim() == 4 else out.unsqueeze(1)
    merged_lse = torch.empty(
        (num_tokens, query4.shape[-2]), dtype=torch.float32, device=query.device
    )
    for start in range(0, num_tokens, 2048):
        stop = min(start + 2048, num_tokens)
        part_out = torch.empty_like(out4[start:stop])
        part_lse = torch.empty_like(merged_lse[start:stop])
        out_acc = lse_acc = None
        for s in range(num_slices):
            segments = [
                segment(
                    indices=indices[start:stop, 128 * s : 128 * (s + 1)].contiguous(),
                    lengths=(swa_topk_lens[start:stop] - 128 * s).clamp(0, 128),
                )
            ]
            if s == 0:
                segments.append(
                    segment(
                        indices=extra_indices[start:stop],
                        lengths=extra_sparse_topk_lens[start:stop],
                        kv_cache=compressed_kv_cache,
                    )
                )
            run(
                query=query4[start:stop],
                kv_cache=swa_kv_cache,
                workspace_buffer=workspace_buffer,
                sparse_mla_segments=segments,
                out=part_out,
                sm_scale=float(bmm1_scale),
                sinks=sinks if s == 0 else None,
                lse=part_lse,
                return_lse=True,
                kv_scale_format="auto",
            )
            if s == 0:
                out_acc = part_out[:, 0].to(torch.float32, copy=True)
                lse_acc = part_lse.clamp_min(-1e30)
            else:
                _patch_dsv4_wide_swa_merge(out_acc, lse_acc, part_out[:, 0], part_lse)
        out4[start:stop, 0].copy_(out_acc)
        merged_lse[start:stop] = lse_acc
    return merged_lse


def _patch_dsv4_wide_swa_v41_takes_sliced_path(sparse_indices):
    """Whether this DeepSeek-V4.1 SM120 prefill call needs 128-wide slices.

    Written by patch-dsv4 (wide-swa). True for window rows wider than 128 where
    the installed FlashInfer is older than 0.7.0: at V4.1's width (1152) no
    FlashInfer 0.6.x kernel takes them, with or without a compressed segment,
    for any number of tokens. Checked at run time, so upgrading FlashInfer
    after patching takes the kernel's own path.
    """
    if sparse_indices.shape[-1] <= 128:
        return False
    import re

    import flashinfer

    found = re.match(r"(\d+)\.(\d+)", str(getattr(flashinfer, "__version__", "")))
    return found is not None and (int(found[1]), int(found[2])) < (0, 7)


def _patch_dsv4_wide_swa_v41_sliced_prefill(
    *,
    query,
    swa_kv_cache,
    workspace_buffer,
    sparse_indices,
    compressed_kv_cache,
    out,
    bmm1_scale,
    sinks,
    swa_topk_lens,
    extra_sparse_indices,
    extra_sparse_topk_lens,
):
    """SM120 prefill with window rows wider than 128, as 128-wide slices (DeepSeek-V4.1).

    Written by patch-dsv4 (wide-swa). Slice s takes window columns
    [128 s, 128 s + 128), each slice contiguous, with lengths
    clamp(len - 128 s, 0, 128); slice 0 alone carries the compressed segment
    (when the layer has one: SWA-only layers have none) and the sink, so each
    is counted once. The partial results are merged by their base-2 LSE, in
    float32, 2048 tokens at a time to bound the extra memory. Writes ``out``
    and returns the merged LSE, [tokens, heads].
    """
    import torch

    run, segment = _patch_dsv4_wide_swa_flashinfer_api()
    num_tokens = query.shape[0]
    indices = sparse_indices.reshape(num_tokens, -1)
    num_slices = (indices.shape[-1] + 127) // 128
    if indices.shape[-1] % 128:
        indices = torch.nn.functional.pad(
            indices, (0, num_slices * 128 - indices.shape[-1]), value=-1
        )
    extra_indices = (
        None
        if extra_sparse_indices is None
        else extra_sparse_indices.reshape(num_tokens, -1)
    )
    query4 = query if query.dim() == 4 else query.unsqueeze(1)
    out4 = out if out.dim() == 4 else out.unsqueeze(1)
    merged_lse = torch.empty(
        (num_tokens, query4.shape[-2]), dtype=torch.float32, device=query.device
    )
    for start in range(0, num_tokens, 2048):
        stop = min(start + 2048, num_tokens)
        part_out = torch.empty_like(out4[start:stop])
        part_lse = torch.empty_like(merged_lse[start:stop])
        out_acc = lse_acc = None
        for s in range(num_slices):
            segments = [
                segment(
                    indices=indices[start:stop, 128 * s : 128 * (s + 1)].contiguous(),
                    lengths=(swa_topk_lens[start:stop] - 128 * s).clamp(0, 128),
                )
            ]
            if s == 0 and extra_indices is not None:
                segments.append(
                    segment(
                        indices=extra_indices[start:stop],
                        lengths=extra_sparse_topk_lens[start:stop],
                        kv_cache=compressed_kv_cache,
                    )
                )
            run(
                query=query4[start:stop],
                kv_cache=swa_kv_cache,
                workspace_buffer=workspace_buffer,
                sparse_mla_segments=segments,
                out=part_out,
                sm_scale=float(bmm1_scale),
                sinks=sinks if s == 0 else None,
                lse=part_lse,
                return_lse=True,
                kv_scale_format="auto",
            )
            if s == 0:
                out_acc = part_out[:, 0].to(torch.float32, copy=True)
                lse_acc = part_lse.clamp_min(-1e30)
            else:
                _patch_dsv4_wide_swa_merge(out_acc, lse_acc, part_out[:, 0], part_lse)
        out4[start:stop, 0].copy_(out_acc)
        merged_lse[start:stop] = lse_acc
    return merged_lse
# fmt: on


HELPERS = (
    _patch_dsv4_wide_swa_takes_sliced_path,
    _patch_dsv4_wide_swa_flashinfer_api,
    _patch_dsv4_wide_swa_merge,
    _patch_dsv4_wide_swa_sliced_prefill,
)
V41_HELPERS = (
    _patch_dsv4_wide_swa_v41_takes_sliced_path,
    _patch_dsv4_wide_swa_flashinfer_api,
    _patch_dsv4_wide_swa_merge,
    _patch_dsv4_wide_swa_v41_sliced_prefill,
)


def _narrow_prefill_rows(ctx: Context) -> bool:
    """Whether this vLLM keeps prefill window rows window_size (128) wide: its SWA builder never sets
    ``prefill_index_width`` (the vision variant's widening, 0.30.0 on). A tree without the builder says nothing
    either way."""
    if ctx.read(SPARSE_SWA) is None:
        return False
    ev = Evaluator.of(ctx)
    builder = ev.follower.class_def(SPARSE_SWA, SWA_BUILDER)
    widened = builder is not None and ev.follower.sets_attribute(builder, "prefill_index_width")
    ctx.looked_up(SPARSE_SWA, "prefill_index_width", widened)
    return builder is not None and not widened


def flashinfer_row_limit(ctx: Context) -> tuple[bool, str]:
    """(whether FlashInfer's SM120 dual-cache prefill takes 128-wide window rows only, evidence).

    An installed FlashInfer is judged by the kernel source its wheel ships for
    JIT builds, a pinned one (or an installed one without that source) by its
    release.
    """
    version = ctx.flashinfer_version
    if ctx.flashinfer_source == "installed":
        where = f"installed FlashInfer {version}"
        cu = ctx.read_flashinfer(FLASHINFER_PREFILL_CU)
        if cu is not None:
            found = _DUAL_DISPATCH.search(cu)
            if found is not None:
                body = cu[found.end() : cu.find("\n}\n", found.end())]
                limit = _ROW_LIMIT.search(body)
                if limit is not None:
                    return True, f"{where}: {FLASHINFER_PREFILL_CU} dispatch_dsv4_dual has `{limit[0]}`"
                return False, f"{where}: {FLASHINFER_PREFILL_CU} dispatch_dsv4_dual takes the row width at run time"
        elif ctx.read_flashinfer(FLASHINFER_PREFILL_DISPATCH_07) is not None:
            return False, f"{where}: SM120 prefill is planned at run time ({FLASHINFER_PREFILL_DISPATCH_07})"
    elif ctx.flashinfer_given:
        where = f"FlashInfer {version}, as given (--flashinfer-version)"
    elif ctx.flashinfer_source == "pinned":
        where = f"FlashInfer {version}, pinned by vLLM {ctx.vllm_version} (none installed: the verdict rests on the pin"
        if ctx.flashinfer_pin_served is None:
            where += ", not checked against pip's index here; drift --vllm-version checks it)"
        elif ctx.flashinfer_pin_served:
            where += ", which pip's index serves)"
        else:
            where += ", which pip's index does not serve: a user runs another FlashInfer; install it, then judge it)"
    else:
        return True, "no FlashInfer installed or pinned: the injected code checks the one it finds at run time"
    try:
        fixed = version is not None and Version(version) >= FIXED_IN_FLASHINFER
    except InvalidVersion:
        fixed = False
    if fixed:
        return False, f"{where}: release {FIXED_IN_FLASHINFER} and later take wide dual-cache rows"
    return True, f"{where}: releases before {FIXED_IN_FLASHINFER} take 128-wide dual-cache rows only"


def _upstream_or_narrow(ctx: Context, tree: ast.Module | None) -> Outcome | None:
    prefill = find_scope(tree, SM120_CLASS, "_forward_prefill") if tree is not None else None
    if prefill is not None and mentions_injected(prefill):
        return None  # ours is in place: the anchors tell applied from modified
    if _narrow_prefill_rows(ctx):
        return Outcome.not_applicable(
            f"prefill window rows stay window_size (128) wide in this release: {SPARSE_SWA} has no prefill_index_width"
        )
    limited, evidence = flashinfer_row_limit(ctx)
    if not limited:
        return Outcome.upstream(f"fixed in FlashInfer {FIXED_IN_FLASHINFER}: {evidence}")
    return None


def v41_rows_widen(ctx: Context) -> tuple[bool, str]:
    """(whether the SWA builder widens DeepSeek-V4.1's prefill rows, evidence): the builder built for a V4.1
    vision checkpoint (its config an instance of V4.1's config class, with no attribute that class never sets), and
    the image tokens it widens rows by (``max_image_tokens``), evaluated. Rows stay 128 wide where that is 0; where
    it cannot be told they count as widened (the injected code checks the rows at run time)."""
    if _narrow_prefill_rows(ctx):
        return False, f"prefill window rows stay window_size (128) wide: {SPARSE_SWA} has no prefill_index_width"
    ev = Evaluator.of(ctx)
    builder = ev.follower.class_def(SPARSE_SWA, SWA_BUILDER)
    module = V41_CONFIG.removesuffix(".py").replace("/", ".")
    config = next((d for d in ev.follower.resolve(module, "DeepseekV41Config") if d.kind == "class"), None)
    ctx.looked_up(V41_CONFIG, "DeepseekV41Config", config is not None)
    if builder is None or config is None:
        return True, f"{SPARSE_SWA}: {SWA_BUILDER} widens prefill rows by max_image_tokens"
    case = cases.v41_checkpoint(Inst(config, closed=True))
    value = attribute_value(ev, builder, "max_image_tokens", case)
    where = f"{SPARSE_SWA}: {SWA_BUILDER}.__init__"
    if isinstance(value, Const) and value.value == 0:
        return False, f"{where} sets max_image_tokens to 0 for {case} ({V41_CONFIG}): V4.1's rows stay 128 wide"
    return True, f"{where} widens prefill rows by max_image_tokens ({describe(value)}) for {case}"


def _v41_upstream_or_narrow(ctx: Context, tree: ast.Module | None) -> Outcome | None:
    prefill = find_scope(tree, SM120_CLASS, "_forward_prefill") if tree is not None else None
    if prefill is not None and mentions_injected(prefill):
        return None  # ours is in place: the anchors tell applied from modified
    wide, evidence = v41_rows_widen(ctx)
    if not wide:
        return Outcome.not_applicable(evidence)
    limited, fi_evidence = flashinfer_row_limit(ctx)
    if not limited:
        return Outcome.upstream(f"fixed in FlashInfer {FIXED_IN_FLASHINFER}: {fi_evidence}")
    return None


RECIPE_SLICER = "_sm120_sparse_mla_sliced_prefill"


def _recipe_wide_swa(tree: ast.Module, scope: ast.AST | None) -> str | None:
    """The DGX-Spark recipe's patch_dsv4_vl_sm120_wide_swa.py: the prefill loop calls its slicer, appended to the
    file."""
    calls = scope is not None and any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == RECIPE_SLICER
        for node in ast.walk(scope)
    )
    defined = any(isinstance(node, ast.FunctionDef) and node.name == RECIPE_SLICER for node in tree.body)
    if calls:
        return f"_forward_prefill sends rows wider than 128 to {RECIPE_SLICER}()"
    if defined:
        return f"the file defines {RECIPE_SLICER}()"
    return None


RECIPE_WIDE_SWA = ForeignEdit(
    script="patch_dsv4_vl_sm120_wide_swa.py",
    recipe="DGX-Spark recipe",
    meaning=(
        "its merge weights the slices by exp(lse), but FlashInfer's SM120 LSE is base 2 (relative error about 0.18 "
        "on wide rows), and it slices through FlashInfer 0.6's private API whatever FlashInfer is installed: "
        "it must be replaced"
    ),
    found=_recipe_wide_swa,
)


class WideSwa(Patch):
    id = "wide-swa"
    title = "SM120 prefill runs window rows wider than 128 as 128-wide slices merged by base-2 LSE"
    serve_impact = (
        "vision prefill fails at warm-up with 'Unsupported sparse-MLA prefill configuration ... topk=512' "
        "(text works, images return 500)"
    )
    edits = (
        ReplaceStatements(
            label="slice wide SM120 dual-cache prefill rows",
            file=FLASHINFER_SPARSE,
            scope=Scope(SM120_CLASS, "_forward_prefill"),
            variants=(Variant(ANCHOR, REPLACEMENT, releases="0.30.0 with FlashInfer 0.6.x"),),
            helpers=HELPERS,
            probe=_upstream_or_narrow,
            foreign=(RECIPE_WIDE_SWA,),
            kept=(miaai_kit.TEXT_ONLY_WINDOW,),
            recallable=False,  # its probe reads FlashInfer's release too
        ),
        *(
            ReplaceStatements(
                label=f"slice wide SM120 prefill rows ({tag})",
                file=file,
                scope=Scope(SM120_CLASS, "_forward_prefill"),
                variants=(Variant(ANCHOR, V41_REPLACEMENT, releases="V4.1: 0.30.0 with FlashInfer 0.6.x"),),
                helpers=V41_HELPERS,
                probe=_v41_upstream_or_narrow,
                foreign=(RECIPE_WIDE_SWA,),
                kept=(miaai_kit.TEXT_ONLY_WINDOW,),
                recallable=False,
            )
            for file, tag in in_layouts("nvidia/flashinfer_sparse.py")
        ),
    )


_SM120_PREFILL = """\
import torch

from vllm.utils.flashinfer import flashinfer_trtllm_batch_decode_sparse_mla_dsv4


class DeepseekV4FlashInferSM120Attention:
    def _forward_decode(self, q, output):
        # a look-alike in the decode method: left alone
        flashinfer_trtllm_batch_decode_sparse_mla_dsv4(
            query=q_chunk,
            swa_kv_cache=swa_kv_paged,
            workspace_buffer=self._get_workspace(q.device),
            sparse_indices=swa_indices_chunk,
            compressed_kv_cache=extra_kv_paged,
            out=output[query_start:query_end],
            bmm1_scale=self.scale,
            sinks=self.attn_sink,
            kv_layout="NHD",
            swa_topk_lens=swa_lens_chunk,
            extra_sparse_indices=extra_sparse_indices_chunk,
            extra_sparse_topk_lens=extra_sparse_lengths_chunk,
        )

    def _forward_prefill(self, q, output, chunks):
        for query_start, query_end in chunks:
            q_chunk = q[query_start:query_end]
            flashinfer_trtllm_batch_decode_sparse_mla_dsv4(
                query=q_chunk,
                swa_kv_cache=swa_kv_paged,
                workspace_buffer=self._get_workspace(q.device),
                sparse_indices=swa_indices_chunk,
                compressed_kv_cache=extra_kv_paged,
                out=output[query_start:query_end],
                bmm1_scale=self.scale,
                sinks=self.attn_sink,
                kv_layout="NHD",
                swa_topk_lens=swa_lens_chunk,
                extra_sparse_indices=extra_sparse_indices_chunk,
                extra_sparse_topk_lens=extra_sparse_lengths_chunk,
            )
"""

_SLICED_CALL = """\
import torch

from vllm.utils.flashinfer import flashinfer_trtllm_batch_decode_sparse_mla_dsv4


class DeepseekV4FlashInferSM120Attention:
    def _forward_decode(self, q, output):
        # a look-alike in the decode method: left alone
        flashinfer_trtllm_batch_decode_sparse_mla_dsv4(
            query=q_chunk,
            swa_kv_cache=swa_kv_paged,
            workspace_buffer=self._get_workspace(q.device),
            sparse_indices=swa_indices_chunk,
            compressed_kv_cache=extra_kv_paged,
            out=output[query_start:query_end],
            bmm1_scale=self.scale,
            sinks=self.attn_sink,
            kv_layout="NHD",
            swa_topk_lens=swa_lens_chunk,
            extra_sparse_indices=extra_sparse_indices_chunk,
            extra_sparse_topk_lens=extra_sparse_lengths_chunk,
        )

    def _forward_prefill(self, q, output, chunks):
        for query_start, query_end in chunks:
            q_chunk = q[query_start:query_end]
            # patch-dsv4 (wide-swa): FlashInfer 0.6.x dual-cache prefill takes 128-wide rows only.
            if _patch_dsv4_wide_swa_takes_sliced_path(
                q_chunk, swa_indices_chunk, extra_sparse_indices_chunk
            ):
                _patch_dsv4_wide_swa_sliced_prefill(
                    query=q_chunk,
                    swa_kv_cache=swa_kv_paged,
                    workspace_buffer=self._get_workspace(q.device),
                    sparse_indices=swa_indices_chunk,
                    compressed_kv_cache=extra_kv_paged,
                    out=output[query_start:query_end],
                    bmm1_scale=self.scale,
                    sinks=self.attn_sink,
                    swa_topk_lens=swa_lens_chunk,
                    extra_sparse_indices=extra_sparse_indices_chunk,
                    extra_sparse_topk_lens=extra_sparse_lengths_chunk,
                )
            else:
                flashinfer_trtllm_batch_decode_sparse_mla_dsv4(
                    query=q_chunk,
                    swa_kv_cache=swa_kv_paged,
                    workspace_buffer=self._get_workspace(q.device),
                    sparse_indices=swa_indices_chunk,
                    compressed_kv_cache=extra_kv_paged,
                    out=output[query_start:query_end],
                    bmm1_scale=self.scale,
                    sinks=self.attn_sink,
                    kv_layout="NHD",
                    swa_topk_lens=swa_lens_chunk,
                    extra_sparse_indices=extra_sparse_indices_chunk,
                    extra_sparse_topk_lens=extra_sparse_lengths_chunk,
                )
"""

EXAMPLES = (
    Example(
        "wide-rows-flashinfer-0.6",
        FLASHINFER_SPARSE,
        before=_SM120_PREFILL,
        after=_SLICED_CALL,
        flashinfer_version="0.6.18.post1",
        with_helpers=False,
    ),
    Example(
        "helpers-before-the-class",
        FLASHINFER_SPARSE,
        before=_SM120_PREFILL,
        after=_SLICED_CALL.replace(
            "\n\n\nclass DeepseekV4FlashInferSM120Attention:",
            "".join("\n\n\n" + helper_source(h).rstrip("\n") for h in HELPERS)
            + "\n\n\nclass DeepseekV4FlashInferSM120Attention:",
        ),
        flashinfer_version="0.6.18.post1",
        derived=True,
    ),
    Example(
        "flashinfer-0.7-takes-wide-rows",
        FLASHINFER_SPARSE,
        before=_SM120_PREFILL,
        after=None,
        verdict=Verdict.UPSTREAM,
        flashinfer_version="0.7.0.post1",
    ),
    Example(
        "changed-call-drifts",
        FLASHINFER_SPARSE,
        before=_SM120_PREFILL.replace(
            "q_chunk = q[query_start:query_end]\n            flashinfer_trtllm_batch_decode_sparse_mla_dsv4(\n",
            "q_chunk = q[query_start:query_end]\n            flashinfer_trtllm_batch_decode_sparse_mla_dsv4(\n"
            '                kv_layout="HND",\n',
        ).replace('                kv_layout="NHD",\n                swa_topk_lens', "                swa_topk_lens"),
        after=None,
        verdict=Verdict.DRIFTED,
        flashinfer_version="0.6.18.post1",
        derived=True,
    ),
)
