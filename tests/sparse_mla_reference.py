"""A torch stand-in for FlashInfer 0.6.x's SM120 sparse-MLA entry point.

``sparse_mla_sm120(...)`` takes the keyword arguments of FlashInfer's private
``flashinfer.mla._core._trtllm_batch_decode_sparse_mla_sm120`` and behaves as its
kernels do (sparse_mla_sm120/prefill_kernel.cuh, common/online_softmax.cuh):

- every segment gathers its entries by slot index from a paged cache
  (``[pages, page_size, 1, dim]`` or ``[pages, page_size, dim]``; key and value
  are the same latent), the first segment from ``kv_cache``, the second from
  its own ``kv_cache``;
- an entry counts when its index is >= 0 and its column is below the row's
  length, lengths clamped to ``[0, width]``;
- one softmax over all counted entries of all segments, in base 2: scores
  scaled by ``sm_scale * log2(e)``, LSE = ``log2(sum) + max``;
- the sink (natural-log logits, one per head) adds ``2^(sink * log2(e))`` to the
  denominator only, and the LSE becomes ``lse + log2(1 + 2^(sink_log2 - lse))``;
- a row with no counted entry writes output 0 and LSE -1e30, or the sink's
  ``sink * log2(e)`` where there is one.

The real kernel takes a packed FP8 cache and writes BF16; this one takes float
caches and writes ``out`` in its own dtype, so that merges can be checked to
float32 precision. ``compute_dtype`` (float32 like the kernel, or float64 for a
tighter reference) sets the arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG2E = math.log2(math.e)
EMPTY_LSE = -1e30


@dataclass(frozen=True)
class SparseMLASegment:
    """FlashInfer's ``_SparseMLASegment``: one segment of index rows."""

    indices: torch.Tensor
    lengths: torch.Tensor | None = None
    kv_cache: torch.Tensor | None = None


def _flat_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    if kv_cache.dim() == 4:  # NHD [pages, page_size, 1, dim]
        return kv_cache.reshape(-1, kv_cache.shape[-1])
    if kv_cache.dim() == 3:  # [pages, page_size, dim]
        return kv_cache.reshape(-1, kv_cache.shape[-1])
    raise ValueError(f"kv_cache must be 3-D or 4-D, got {tuple(kv_cache.shape)}")


def sparse_mla_sm120(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    workspace_buffer: torch.Tensor | None,
    sparse_mla_segments,
    out: torch.Tensor | None,
    sm_scale: float,
    sinks: torch.Tensor | None,
    lse: torch.Tensor | None,
    return_lse: bool,
    kv_scale_format: str = "auto",
    *,
    compute_dtype: torch.dtype = torch.float32,
    tokens_per_block: int = 256,
):
    """Reference sparse MLA with FlashInfer 0.6.x's private SM120 signature."""
    del workspace_buffer, kv_scale_format
    if query.dim() != 4:
        raise ValueError(f"query must be [batch, q_len, heads, dim], got {query.dim()}-D")
    batch, q_len, num_heads, dim = query.shape
    num_tokens = batch * q_len
    q = query.reshape(num_tokens, num_heads, dim)
    if out is None:
        out = query.new_empty((batch, q_len, num_heads, dim))
    out_flat = out.view(num_tokens, num_heads, out.shape[-1])
    lse_flat = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=query.device)

    segments = []
    for i, segment in enumerate(sparse_mla_segments):
        cache = kv_cache if i == 0 else segment.kv_cache
        if cache is None:
            raise ValueError(f"segment {i} has no kv_cache")
        indices = segment.indices.reshape(num_tokens, -1)
        width = indices.shape[-1]
        if segment.lengths is None:
            lengths = torch.full((num_tokens,), width, dtype=torch.int64)
        else:
            lengths = segment.lengths.reshape(num_tokens).to(torch.int64)
        lengths = lengths.clamp(0, width)
        segments.append((_flat_cache(cache), indices, lengths))

    sink_log2 = None
    if sinks is not None:
        sink_log2 = sinks.to(compute_dtype) * LOG2E

    for start in range(0, num_tokens, tokens_per_block):
        stop = min(start + tokens_per_block, num_tokens)
        qb = q[start:stop].to(compute_dtype)
        scores, values, valid = [], [], []
        for cache, indices, lengths in segments:
            idx = indices[start:stop].to(torch.int64)
            columns = torch.arange(idx.shape[-1], device=idx.device)
            ok = (idx >= 0) & (columns < lengths[start:stop, None].to(idx.device))
            kv = cache[idx.clamp_min(0)].to(compute_dtype)  # [t, k, dim]
            scores.append(torch.einsum("thd,tkd->thk", qb, kv))
            values.append(kv)
            valid.append(ok)
        s = torch.cat(scores, dim=-1) * (sm_scale * LOG2E)
        v = torch.cat(values, dim=1)
        ok = torch.cat(valid, dim=-1)[:, None, :]  # [t, 1, k]
        s = s.masked_fill(~ok, -math.inf)
        m = s.amax(dim=-1)  # [t, h]; -inf on empty rows
        empty = ~ok.any(dim=-1).expand_as(m)
        m_safe = torch.where(empty, torch.zeros_like(m), m)
        p = torch.exp2(s - m_safe[..., None]).masked_fill(~ok, 0.0)
        total = p.sum(dim=-1)
        denom = total
        if sink_log2 is not None:
            denom = total + torch.exp2(sink_log2[None, :] - m_safe)
        o = torch.einsum("thk,tkd->thd", p, v) / torch.where(empty, torch.ones_like(denom), denom)[..., None]
        o = torch.where(empty[..., None], torch.zeros_like(o), o)
        row_lse = torch.log2(torch.where(empty, torch.ones_like(total), total)) + m_safe
        if sink_log2 is not None:
            row_lse = torch.logaddexp2(row_lse, sink_log2[None, :].expand_as(row_lse))
            empty_lse = sink_log2[None, :].expand_as(row_lse)
        else:
            empty_lse = torch.full_like(row_lse, EMPTY_LSE)
        row_lse = torch.where(empty, empty_lse, row_lse)
        out_flat[start:stop] = o.to(out_flat.dtype)
        lse_flat[start:stop] = row_lse.to(torch.float32)

    if lse is not None:
        lse.view(num_tokens, num_heads).copy_(lse_flat)
        lse_flat = lse
    if return_lse:
        return out, lse_flat
    return out


def one_softmax_over_the_row(inputs: dict, out: torch.Tensor, compute_dtype=torch.float32, return_lse=True):
    """One full-width call over a whole row: window and compressed segment, sink, as FlashInfer 0.7 does.

    ``inputs`` holds the keyword arguments of the sliced path (query [T, H, D],
    window and compressed indices, lengths, caches, scale, sinks); ``out`` is [T, H, D].
    """
    return sparse_mla_sm120(
        query=inputs["query"].unsqueeze(1),
        kv_cache=inputs["swa_kv_cache"],
        workspace_buffer=None,
        sparse_mla_segments=[
            SparseMLASegment(inputs["sparse_indices"], inputs["swa_topk_lens"]),
            SparseMLASegment(
                inputs["extra_sparse_indices"], inputs["extra_sparse_topk_lens"], inputs["compressed_kv_cache"]
            ),
        ],
        out=out.unsqueeze(1),
        sm_scale=inputs["bmm1_scale"],
        sinks=inputs["sinks"],
        lse=None,
        return_lse=return_lse,
        compute_dtype=compute_dtype,
    )
