"""wide-swa numerics on CPU torch: the injected slicing code, imported from the patch
module, against one softmax over the whole row (window, compressed entries, sink),
with FlashInfer played by the torch reference kernel. (That a patched file holds
exactly this code is tested on the real releases, in test_lifecycle.py.)"""

from __future__ import annotations

import math

import pytest

from patch_dsv4.patches import wide_swa
from patch_dsv4.patching.edits import helper_source

torch = pytest.importorskip("torch")
import tests.sparse_mla_reference as reference  # noqa: E402  (needs torch)


@pytest.fixture
def sliced(monkeypatch):
    """The injected sliced prefill, imported from the patch module, with FlashInfer played by the reference kernel."""
    monkeypatch.setattr(
        wide_swa,
        "_patch_dsv4_wide_swa_flashinfer_api",
        lambda: (reference.sparse_mla_sm120, reference.SparseMLASegment),
    )
    return wide_swa._patch_dsv4_wide_swa_sliced_prefill


@pytest.fixture
def natural_log_merge(monkeypatch):
    """The merge with exp/log in place of exp2/log2 (the wrong base), put where the sliced path calls it."""
    source = helper_source(wide_swa._patch_dsv4_wide_swa_merge)
    source = source.replace("torch.exp2", "torch.exp").replace("torch.log2", "torch.log")
    namespace: dict = {}
    exec(compile(source, "<natural-log merge>", "exec"), namespace)  # noqa: S102 - a deliberately wrong variant
    monkeypatch.setattr(wide_swa, "_patch_dsv4_wide_swa_merge", namespace["_patch_dsv4_wide_swa_merge"])


def _case(seed: int, tokens: int, width: int, sink: bool, three_d: bool, heads=8, dim=64, compressed=96):
    g = torch.Generator().manual_seed(seed)
    page = 16
    swa = torch.randn(64, page, 1, dim, generator=g)
    comp = torch.randn(32, page, 1, dim, generator=g)
    q = torch.randn(tokens, heads, dim, generator=g)
    lens = torch.randint(0, width + 1, (tokens,), generator=g, dtype=torch.int32)
    lens[: min(tokens, 6)] = torch.tensor([0, width, 1, 128, 129, 257][: min(tokens, 6)], dtype=torch.int32)
    idx = torch.randint(0, 64 * page, (tokens, width), generator=g, dtype=torch.int32)
    idx = torch.where(torch.arange(width)[None] < lens[:, None], idx, torch.full_like(idx, -1))
    cidx = torch.randint(0, 32 * page, (tokens, compressed), generator=g, dtype=torch.int32)
    clens = torch.randint(0, compressed + 1, (tokens,), generator=g, dtype=torch.int32)
    empty = torch.rand(tokens, generator=g) < 0.1
    empty[0] = True  # no window, no compressed entry
    lens[empty], clens[empty] = 0, 0
    only_compressed = torch.rand(tokens, generator=g) < 0.1
    only_compressed[-1] = True
    lens[only_compressed] = 0
    clens[only_compressed] = clens[only_compressed].clamp_min(1)
    idx = torch.where(torch.arange(width)[None] < lens[:, None], idx, torch.full_like(idx, -1))
    return {
        "query": q,
        "swa_kv_cache": swa,
        "workspace_buffer": None,
        "sparse_indices": idx.view(tokens, 1, width) if three_d else idx,
        "compressed_kv_cache": comp,
        "bmm1_scale": 2.5 / math.sqrt(dim),  # sharp softmax: a wrong weight shows
        "sinks": torch.randn(heads, generator=g) * 2 if sink else None,
        "swa_topk_lens": lens,
        "extra_sparse_indices": cidx,
        "extra_sparse_topk_lens": clens,
    }


def _one_softmax(inputs, compute_dtype=torch.float32):
    tokens, heads, dim = inputs["query"].shape
    out = torch.empty(tokens, heads, dim)
    _, lse = reference.one_softmax_over_the_row(inputs, out, compute_dtype)
    return out, lse


def _run(sliced, inputs):
    out = torch.full_like(inputs["query"], float("nan"))
    lse = sliced(out=out, **inputs)
    return out, lse


def _excess(out, ref) -> float:
    """Largest per-(token, head) error over its tolerance, 1e-5 * max(1, max |ref|)."""
    tol = 1e-5 * ref.abs().amax(dim=-1).clamp_min(1.0)
    return ((out - ref).abs().amax(dim=-1) / tol).max().item()


def _case_id(seed, tokens, width, sink, three_d) -> str:
    return f"s{seed}-T{tokens}-W{width}-{'sink' if sink else 'nosink'}-{'3d' if three_d else '2d'}"


CASES = [
    pytest.param(seed, tokens, width, sink, three_d, id=_case_id(seed, tokens, width, sink, three_d))
    for seed, (tokens, width, sink, three_d) in enumerate(
        [
            (97, 512, True, True),
            (97, 512, False, True),
            (130, 512, True, False),
            (130, 512, False, False),
            (65, 384, True, True),
            (200, 320, False, False),  # not a multiple of 128: the last slice is padded
            (3, 512, True, False),
            (2100, 512, True, True),  # more than one 2048-token piece
        ]
    )
]


@pytest.mark.parametrize("seed,tokens,width,sink,three_d", CASES)
def test_sliced_equals_one_softmax_over_the_row(seed, tokens, width, sink, three_d, sliced):
    inputs = _case(seed, tokens, width, sink, three_d, heads=8 if tokens < 1000 else 4, dim=64 if tokens < 1000 else 32)
    ref_out, ref_lse = _one_softmax(inputs)
    out, lse = _run(sliced, inputs)
    assert not torch.isnan(out).any()
    assert _excess(out, ref_out) <= 1.0
    # The merged LSE is the kernel's: base 2, the sink in it, -1e30 or the sink on empty rows.
    assert torch.allclose(lse, ref_lse, rtol=1e-5, atol=1e-4)
    empty = (inputs["swa_topk_lens"] == 0) & (inputs["extra_sparse_topk_lens"] == 0)
    assert torch.all(out[empty] == 0)
    if sink:
        assert torch.allclose(lse[empty], (inputs["sinks"] * math.log2(math.e)).expand(tokens, -1)[empty])
    else:
        assert torch.all(lse[empty] == -1e30)


def test_sliced_is_float32_exact_against_float64(sliced):
    inputs = _case(11, 130, 512, True, True)
    exact, _ = _one_softmax(inputs, compute_dtype=torch.float64)
    out, _ = _run(sliced, inputs)
    assert _excess(out.double(), exact) <= 1.0


@pytest.mark.parametrize("sink", [True, False], ids=["sink", "nosink"])
def test_natural_log_merge_exceeds_the_tolerance(sink, sliced, natural_log_merge):
    """The same slices merged with exp/log instead of exp2/log2: the error the base-2 LSE avoids."""
    inputs = _case(5, 130, 512, sink, False)
    ref_out, _ = _one_softmax(inputs)
    out, _ = _run(sliced, inputs)
    assert _excess(out, ref_out) > 1000.0


@pytest.fixture
def v41_sliced(monkeypatch):
    """V4.1's injected sliced prefill (any token count, compressed segment or none), FlashInfer played as above."""
    monkeypatch.setattr(
        wide_swa,
        "_patch_dsv4_wide_swa_flashinfer_api",
        lambda: (reference.sparse_mla_sm120, reference.SparseMLASegment),
    )
    return wide_swa._patch_dsv4_wide_swa_v41_sliced_prefill


@pytest.mark.parametrize("swa_only", [False, True], ids=["compressed", "swa-only"])
@pytest.mark.parametrize("tokens", [130, 40], ids=["prefill-130", "decode-sized-40"])
@pytest.mark.parametrize("sink", [True, False], ids=["sink", "nosink"])
def test_v41_width_1152_equals_one_softmax(tokens, swa_only, sink, v41_sliced):
    """V4.1's rows on 0.30.0 (128 + 1024 = 1152), on every path FlashInfer 0.6.x has no kernel for."""
    inputs = _case(40 + tokens, tokens, 1152, sink, True)
    if swa_only:  # compress_ratio 0: no compressed segment
        inputs["extra_sparse_topk_lens"] = torch.zeros_like(inputs["extra_sparse_topk_lens"])
        ref_out, ref_lse = _one_softmax(inputs)
        inputs["extra_sparse_indices"] = inputs["extra_sparse_topk_lens"] = inputs["compressed_kv_cache"] = None
    else:
        ref_out, ref_lse = _one_softmax(inputs)
    out, lse = _run(v41_sliced, inputs)
    assert not torch.isnan(out).any()
    assert _excess(out, ref_out) <= 1.0
    assert torch.allclose(lse, ref_lse, rtol=1e-5, atol=1e-4)


def test_v41_predicate_slices_every_wide_call(monkeypatch):
    """Rows wider than 128 take the sliced path whatever the token count and segment, on FlashInfer 0.6.x only."""
    import sys
    import types

    takes = wide_swa._patch_dsv4_wide_swa_v41_takes_sliced_path
    for version, wide in (("0.6.18.post1", True), ("0.7.0.post1", False)):
        monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__=version))
        assert takes(torch.zeros(3, 1, 1152)) is wide
        assert takes(torch.zeros(500, 1152)) is wide
        assert takes(torch.zeros(500, 1, 128)) is False
