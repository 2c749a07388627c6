"""dense-exl3 and exl3-wo-a-slices: the injected code run on CPU torch, with stub EXL3 linears.

What runs here is the code the patches write (their helpers, and each replacement statement executed as vLLM
would execute it). The EXL3 linears are stubs (a dense fp16 weight behind LinearEXL3's ``forward(x, params,
out_dtype=...)``, with the input checks and output dtypes the real one showed), and vLLM's Triton inverse RoPE a
CPU stand-in. The real LinearEXL3 (exllamav3 1.4.5 and 1.6.5, quantized at 2, 3 and 6 bits) and vLLM's kernel run
in bench/dense_exl3_gpu_check.py on a GPU.
"""

from __future__ import annotations

import sys
import textwrap
import types

import pytest

from patch_dsv4.patches import dense_exl3 as D
from patch_dsv4.patches import exl3_wo_a_slices as S

torch = pytest.importorskip("torch")
ROPE_MODULE = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"


def _run(statements: str, namespace: dict, *params: str):
    """``statements`` as the body of a function of ``params``, compiled in ``namespace`` (vLLM's module)."""
    source = f"def _body({', '.join(params)}):\n" + textwrap.indent(textwrap.dedent(statements).strip("\n"), "    ")
    scope = dict(namespace)
    exec(compile(source, "<patched>", "exec"), scope)  # noqa: S102 - the patched vLLM code under test
    return scope["_body"]


HELPERS = {name: getattr(D, name) for name in dir(D) if name.startswith("_patch_dsv4_")}
HELPERS.update({name: getattr(S, name) for name in dir(S) if name.startswith("_patch_dsv4_")})


# -- E(a): the compressor's quant config ------------------------------------------------------------------------
class QuantConfig:
    def __init__(self, name, claimed=None):
        self.name = name
        if claimed is not None:
            self._matches_non_routed_exl3 = lambda prefix: any(prefix.endswith(c) for c in claimed)

    def get_name(self):
        return self.name


PREFIX = "model.layers.3.attn.compressor"


@pytest.mark.parametrize(
    "config",
    [
        None,
        QuantConfig("fp8"),
        QuantConfig("exl3"),  # vllm-exl3 without _matches_non_routed_exl3
        QuantConfig("exl3", claimed=("ffn.experts",)),  # routed-only EXL3 (the Vision pack)
        QuantConfig("fp8", claimed=("compressor.fused_wkv_wgate",)),  # another method that happens to claim
    ],
    ids=["none", "fp8", "exl3-no-claims", "exl3-routed-only", "fp8-claiming"],
)
def test_compressor_keeps_vllms_none_unless_exl3_claims_it(config):
    vllm_config = types.SimpleNamespace(quant_config=config)
    assert D._patch_dsv4_compressor_quant_config(vllm_config, f"{PREFIX}.fused_wkv_wgate") is None
    # the patched statement passes exactly what the original passes
    assert _construct(D.QUANT_REPLACEMENT, vllm_config) == _construct(D.QUANT_ANCHOR, vllm_config)


@pytest.mark.parametrize("claimed", ["compressor.fused_wkv_wgate", "compressor.wkv", "compressor.wgate"])
def test_a_claiming_exl3_config_reaches_the_compressor(claimed):
    config = QuantConfig("exl3", claimed=(claimed,))
    vllm_config = types.SimpleNamespace(quant_config=config)
    assert D._patch_dsv4_compressor_quant_config(vllm_config, f"{PREFIX}.fused_wkv_wgate") is config
    args, kwargs = _construct(D.QUANT_REPLACEMENT, vllm_config)
    assert kwargs["quant_config"] is config and kwargs["prefix"] == f"{PREFIX}.fused_wkv_wgate"


def _construct(statement: str, vllm_config):
    """Run the ``self.fused_wkv_wgate = MergedColumnParallelLinear(...)`` statement; what the linear got."""
    calls = []
    namespace = {**HELPERS, "MergedColumnParallelLinear": lambda *a, **k: calls.append((a, k)) or "linear"}
    me = types.SimpleNamespace(hidden_size=16, coff=2, head_dim=8)
    _run(statement, namespace, "self", "vllm_config", "prefix")(me, vllm_config, PREFIX)
    assert me.fused_wkv_wgate == "linear" and len(calls) == 1
    return calls[0]


# -- E(b): the EXL3 O projection --------------------------------------------------------------------------------
# DeepSeek-V4-Flash at TP 8: one wo_a group per rank, 8 heads x 512 (rope 64), rank 1024; scaled down.
T, HEADS, HEAD_DIM, ROPE, RANK, HIDDEN = 5, 8, 32, 8, 16, 24


def _inverse_rope_gptj(o, positions, cos_sin_cache, rope_head_dim):
    """A CPU stand-in for vLLM's Triton _fused_inverse_rope_gptj: rotate the last rope_head_dim lanes back."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :].to(torch.float32), sin[:, None, :].to(torch.float32)
    nope, rope = o[..., :-rope_head_dim], o[..., -rope_head_dim:].to(torch.float32)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    back = torch.stack((even * cos + odd * sin, odd * cos - even * sin), dim=-1).flatten(-2)
    return torch.cat((nope, back.to(o.dtype)), dim=-1)


class StubLinearEXL3:
    """LinearEXL3's forward(x, params, out_dtype) over a dense fp16 weight; records what it was given.

    What the real one does in exllamav3 1.4.5 and 1.6.5 (their source, and the helpers' calls run against it on an
    H200 by bench/dense_exl3_gpu_check.py), and the stub keeps: no ``.weight`` (the dense weight hides under
    another name); a non-contiguous input fails LinearEXL3.forward's assert and a non-fp16 input the kernels'
    dtype check; up to 144 rows without ``reconstruct`` the output is fp32 only for ``out_dtype=torch.float32``
    and fp16 for anything else (bf16 included); above that, or with ``reconstruct``, ``out_dtype`` or fp16.
    """

    def __init__(self, weight):
        self._dense = weight.to(torch.float16)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.seen = []

    def forward(self, x, params, out_dtype=None):
        self.seen.append((x.dtype, x.is_contiguous(), out_dtype, tuple(x.shape)))
        assert x.is_contiguous(), "LinearEXL3: non-contiguous input"
        assert x.dtype == torch.float16, "exl3_gemm: A must be half"
        out = x.to(torch.float32) @ self._dense.to(torch.float32).T
        if not params.get("reconstruct") and x.numel() // x.shape[-1] <= 144:
            return out.to(torch.float32 if out_dtype == torch.float32 else torch.float16)
        return out.to(out_dtype or torch.float16)


class Linear(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return x.to(torch.float32) @ self.weight.to(torch.float32).T


@pytest.fixture
def rope(monkeypatch):
    module = types.ModuleType(ROPE_MODULE)
    module._fused_inverse_rope_gptj = _inverse_rope_gptj
    monkeypatch.setitem(sys.modules, ROPE_MODULE, module)
    monkeypatch.delitem(sys.modules, "vllm_exl3.exl3", raising=False)


def _attention(wo_a):
    layer = types.SimpleNamespace(n_local_groups=1, rope_head_dim=ROPE, wo_a=wo_a)
    layer.rotary_emb = types.SimpleNamespace(cos_sin_cache=torch.randn(64, ROPE))
    layer.wo_b = Linear(torch.randn(HIDDEN, RANK))
    layer.o_proj_calls = []
    layer._o_proj = lambda o, positions: layer.o_proj_calls.append((o, positions)) or "vLLM's _o_proj"
    return layer


def _forward_tail(variant):
    name = "o" if "(o, positions)" in variant.anchor else "attn_out"
    return _run(variant.replacement, HELPERS, "self", name, "positions")


@pytest.mark.parametrize("variant", D.O_PROJ_VARIANTS, ids=["0.28-0.30", "0.31-0.33"])
@pytest.mark.parametrize("wo_a", ["bf16", "fp8-like", "exl3-none-shard"])
def test_o_projection_without_exl3_linears_is_vllms_call(variant, wo_a, rope):
    module = Linear(torch.randn(RANK, HEADS * HEAD_DIM).to(torch.bfloat16))
    if wo_a == "exl3-none-shard":  # the plugin kept the dense weight: nothing for us
        module._exl3_linears = [None]
    layer = _attention(module)
    o, positions = torch.randn(T, HEADS, HEAD_DIM, dtype=torch.bfloat16), torch.arange(T)
    assert _forward_tail(variant)(layer, o, positions) == "vLLM's _o_proj"
    assert len(layer.o_proj_calls) == 1 and layer.o_proj_calls[0][0] is o and layer.o_proj_calls[0][1] is positions


@pytest.mark.parametrize("variant", D.O_PROJ_VARIANTS, ids=["0.28-0.30", "0.31-0.33"])
def test_exl3_o_projection_equals_the_dense_reference(variant, rope):
    weight = torch.randn(RANK, HEADS * HEAD_DIM) / (HEADS * HEAD_DIM) ** 0.5
    linear = StubLinearEXL3(weight)
    wo_a = types.SimpleNamespace(_exl3_linears=[linear])  # vllm-exl3 deleted .weight
    layer = _attention(wo_a)
    o, positions = torch.randn(T, HEADS, HEAD_DIM, dtype=torch.bfloat16), torch.randint(0, 64, (T,))
    out = _forward_tail(variant)(layer, o, positions)
    assert layer.o_proj_calls == []  # never vLLM's _o_proj (nor dtype-policy's wo_a.weight.dtype there)
    # vLLM's BF16 path for one group: inverse RoPE, einsum("tgd,grd->tgr") with wo_a, flatten, wo_b
    o_ref = _inverse_rope_gptj(o, positions, layer.rotary_emb.cos_sin_cache, ROPE).to(torch.float64)
    z = torch.einsum("tgd,grd->tgr", o_ref.reshape(T, 1, -1), weight.to(torch.float16).to(torch.float64)[None])
    # the group's output reaches wo_b in the attention output's dtype (BF16), as in vLLM's einsum path
    reference = z.flatten(1).to(torch.bfloat16).to(torch.float64) @ layer.wo_b.weight.to(torch.float64).T
    torch.testing.assert_close(out.to(torch.float64), reference, rtol=2e-2, atol=2e-2)
    assert linear.seen == [(torch.float16, True, torch.float32, (T, HEADS * HEAD_DIM))]  # fp16 in, fp32 out


def test_exl3_o_projection_uses_the_plugins_row_policy(rope, monkeypatch):
    linear = StubLinearEXL3(torch.randn(RANK, HEADS * HEAD_DIM))
    used = []
    plugin = types.ModuleType("vllm_exl3.exl3")
    plugin._dense_forward = lambda lin, x: used.append((lin, x.dtype)) or lin.forward(x, {}, out_dtype=torch.float32)
    monkeypatch.setitem(sys.modules, "vllm_exl3.exl3", plugin)
    layer = _attention(types.SimpleNamespace(_exl3_linears=[linear]))
    out = D._patch_dsv4_exl3_o_proj(layer, torch.randn(T, HEADS, HEAD_DIM, dtype=torch.bfloat16), torch.arange(T))
    assert used == [(linear, torch.float16)] and out.shape == (T, HIDDEN)


@pytest.mark.parametrize("case", ["two-groups", "two-linears", "not-a-tensor"])
def test_exl3_o_projection_refuses_what_it_cannot_do(case, rope):
    linears = [StubLinearEXL3(torch.randn(RANK, HEADS * HEAD_DIM))]
    if case == "two-linears":
        linears.append(linears[0])
    layer = _attention(types.SimpleNamespace(_exl3_linears=linears))
    if case == "two-groups":
        layer.n_local_groups = 2
    o = torch.randn(T, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    if case == "not-a-tensor":
        o = types.SimpleNamespace(data=o)  # 0.31+'s QuantizedActivation
    with pytest.raises(NotImplementedError, match="one wo_a group per rank"):
        D._patch_dsv4_exl3_o_proj(layer, o, torch.arange(T))


# -- F: the compressor scores -----------------------------------------------------------------------------------
WKV, WGATE, DIM = 12, 12, 16


class MmRecorder:
    """torch.mm(a, b, out_dtype=...) as CUDA computes it (CPU torch lacks out_dtype): records every call."""

    def __init__(self):
        self.calls = []

    def __call__(self, a, b, out_dtype=None):
        self.calls.append((a, b, out_dtype))
        return (a.to(torch.float32) @ b.to(torch.float32)).to(out_dtype)


SCORE_EDITS = [edit for edit in D.DenseExl3.edits if edit.scope.func == "_run_parallel_input_projections"]


@pytest.mark.parametrize("edit", SCORE_EDITS, ids=["compressor", "indexer"])
def test_scores_without_exl3_linears_are_vllms_mm_bit_for_bit(edit, monkeypatch):
    recorder = MmRecorder()
    monkeypatch.setattr(torch, "mm", recorder)
    module = Linear(torch.randn(WKV + WGATE, DIM).to(torch.bfloat16))
    hidden = torch.randn(T, DIM, dtype=torch.bfloat16)
    owner = types.SimpleNamespace(fused_wkv_wgate=module)
    compressor, indexer = owner, types.SimpleNamespace(compressor=owner)
    namespace = {**HELPERS, "torch": torch}
    (variant,) = edit.variants
    original = _run(variant.anchor, namespace, "hidden_states", "compressor", "indexer")(hidden, compressor, indexer)
    patched = _run(variant.replacement, namespace, "hidden_states", "compressor", "indexer")(
        hidden, compressor, indexer
    )
    assert torch.equal(original, patched) and patched.dtype == torch.float32
    (a1, b1, d1), (a2, b2, d2) = recorder.calls
    assert a1 is a2 is hidden and torch.equal(b1, b2) and b1.data_ptr() == b2.data_ptr() and d1 == d2 == torch.float32


def test_exl3_scores_run_the_shards_in_order_in_float32():
    wkv, wgate = torch.randn(WKV, DIM), torch.randn(WGATE, DIM)
    module = types.SimpleNamespace(_exl3_linears=[StubLinearEXL3(wkv), StubLinearEXL3(wgate)])
    hidden = torch.randn(2, T, DIM, dtype=torch.bfloat16)  # leading dims are kept
    out = D._patch_dsv4_compressor_kv_score(module, hidden)
    assert out.dtype == torch.float32 and out.shape == (2, T, WKV + WGATE)
    fused = torch.cat((wkv, wgate)).to(torch.float16).to(torch.float32)  # the fused weight: wkv rows, then wgate
    reference = hidden.to(torch.float16).to(torch.float32) @ fused.T
    torch.testing.assert_close(out, reference, rtol=1e-3, atol=1e-3)
    for linear in module._exl3_linears:
        assert linear.seen == [(torch.float16, True, torch.float32, (2 * T, DIM))]
    assert torch.equal(D._patch_dsv4_indexer_kv_score(module, hidden), out)


@pytest.mark.parametrize("case", ["a-bf16-shard", "padded"])
def test_mixed_or_padded_shards_take_the_plugins_own_apply(case):
    calls = []

    class Plugin:
        _exl3_linears = [StubLinearEXL3(torch.randn(WKV, DIM)), None]

        def __call__(self, x):
            calls.append(x)
            return torch.zeros(T, WKV + WGATE, dtype=torch.bfloat16)

    module = Plugin()
    if case == "padded":
        module._exl3_linears = [StubLinearEXL3(torch.randn(WKV, DIM))] * 2
        module._exl3_linear_padded = True
    hidden = torch.randn(T, DIM, dtype=torch.bfloat16)
    out = D._patch_dsv4_kv_score(module, hidden)
    assert calls == [hidden] and out.dtype == torch.float32


# -- F on 0.34.0: DeepseekV4CompressorKVScoreLinear.forward ---------------------------------------------------------
class KVScoreLinear:
    """The projection module: its forward is the statement under test, run as vLLM's class runs it; calling the
    module (nn.Module.__call__) enters that forward, and every entry is counted."""

    def __init__(self, statements, weight=None, linears=None, apply=None):
        self._forward = _run(statements, {**HELPERS, "torch": torch}, "self", "input_")
        self.entered = 0
        if weight is not None:
            self.weight = weight
        if linears is not None:
            self._exl3_linears = linears
        if apply is not None:
            self.quant_method = types.SimpleNamespace(apply=apply)

    def __call__(self, input_):
        self.entered += 1
        return self._forward(self, input_)


def test_034_forward_without_exl3_linears_is_vllms_mm_bit_for_bit(monkeypatch):
    recorder = MmRecorder()
    monkeypatch.setattr(torch, "mm", recorder)
    weight = torch.randn(WKV + WGATE, DIM).to(torch.bfloat16)
    hidden = torch.randn(T, DIM, dtype=torch.bfloat16)
    original = KVScoreLinear(D.KV_SCORE_VARIANT.anchor, weight=weight)(hidden)
    for linears in (None, [], [None, None]):  # unquantized, or the plugin kept every dense shard
        patched = KVScoreLinear(D.KV_SCORE_VARIANT.replacement, weight=weight, linears=linears)(hidden)
        assert torch.equal(original, patched) and patched.dtype == torch.float32
    first = recorder.calls[0]
    for a, b, out_dtype in recorder.calls[1:]:
        assert a is first[0] and b.data_ptr() == first[1].data_ptr() and out_dtype is torch.float32


@pytest.mark.parametrize("plugin", [False, True], ids=["forward", "_dense_forward"])
def test_034_forward_runs_the_exl3_shards_in_order_in_float32(plugin, monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm_exl3.exl3", raising=False)
    used = []
    if plugin:
        module = types.ModuleType("vllm_exl3.exl3")
        module._dense_forward = lambda lin, x: used.append(lin) or lin.forward(x, {}, out_dtype=torch.float32)
        monkeypatch.setitem(sys.modules, "vllm_exl3.exl3", module)
    wkv, wgate = torch.randn(WKV, DIM), torch.randn(WGATE, DIM)
    linears = [StubLinearEXL3(wkv), StubLinearEXL3(wgate)]
    layer = KVScoreLinear(D.KV_SCORE_VARIANT.replacement, linears=linears)  # vllm-exl3 deleted .weight
    hidden = torch.randn(T, DIM, dtype=torch.bfloat16)
    out = layer(hidden)
    assert out.dtype == torch.float32 and out.shape == (T, WKV + WGATE) and layer.entered == 1
    fused = torch.cat((wkv, wgate)).to(torch.float16).to(torch.float32)  # wkv rows, then wgate
    torch.testing.assert_close(out, hidden.to(torch.float16).to(torch.float32) @ fused.T, rtol=1e-3, atol=1e-3)
    for linear in linears:
        assert linear.seen == [(torch.float16, True, torch.float32, (T, DIM))]
    assert used == (linears if plugin else [])
    # V4.1's compressor at ratio 1 has no gate: one shard, the same class and forward
    single = KVScoreLinear(D.KV_SCORE_VARIANT.replacement, linears=[StubLinearEXL3(wkv)])
    torch.testing.assert_close(single(hidden), out[:, :WKV], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case", ["a-bf16-shard", "padded"])
def test_034_fallback_calls_quant_method_apply_and_never_the_module(case):
    applied = []

    def apply(layer, x, bias):
        applied.append((layer, x, bias))
        return torch.ones(T, WKV + WGATE, dtype=torch.bfloat16)

    linears = [StubLinearEXL3(torch.randn(WKV, DIM)), None]
    layer = KVScoreLinear(D.KV_SCORE_VARIANT.replacement, linears=linears, apply=apply)
    if case == "padded":
        layer._exl3_linears = [StubLinearEXL3(torch.randn(WKV, DIM))] * 2
        layer._exl3_linear_padded = True
    hidden = torch.randn(T, DIM, dtype=torch.bfloat16)
    out = layer(hidden)
    assert layer.entered == 1  # the 0.28-0.33 helper's module(x) would have come back into this forward
    assert len(applied) == 1 and applied[0][0] is layer and applied[0][1] is hidden and applied[0][2] is None
    assert out.dtype == torch.float32 and torch.equal(out, torch.ones(T, WKV + WGATE))


def test_the_old_fallback_would_reenter_0_34_forward():
    """Why 0.34.0 has a helper of its own: the closures' helper calls the module, which is now the patched class."""
    layer = KVScoreLinear(
        "return _patch_dsv4_kv_score(self, input_)",  # the 0.28-0.33 helper put where 0.34.0 reads .weight
        linears=[StubLinearEXL3(torch.randn(WKV, DIM)), None],
        apply=lambda *a: torch.zeros(T, WKV + WGATE),
    )
    with pytest.raises(RecursionError):
        layer(torch.randn(T, DIM, dtype=torch.bfloat16))


# -- exl3-wo-a-slices: the loader's mapping ---------------------------------------------------------------------
VLLM_MAPPING = [
    ("gate_up_proj", "w1", 0),
    ("gate_up_proj", "w3", 1),
    ("attn.fused_wqa_wkv", "attn.wq_a", 0),
    ("attn.fused_wqa_wkv", "attn.wkv", 1),
    ("compressor.fused_wkv_wgate", "compressor.wkv", 0),
    ("compressor.fused_wkv_wgate", "compressor.wgate", 1),
]


def _model(quant, groups=8):
    config = None if quant is None else QuantConfig(quant)
    return types.SimpleNamespace(quant_config=config, config=types.SimpleNamespace(o_groups=groups))


def _load_name(mapping, name):
    """vLLM's loop (DeepseekV4Model.load_weights): the first entry whose shard name is in the name wins."""
    for param_name, weight_name, shard_id in mapping:
        if ".experts." in name or weight_name not in name:
            continue
        return name.replace(weight_name, param_name), shard_id
    return name, None


@pytest.mark.parametrize("quant", [None, "fp8", "compressed-tensors"])
def test_no_slice_entries_unless_exl3(quant):
    assert S._patch_dsv4_wo_a_slice_mapping(_model(quant)) == []
    assert S._patch_dsv4_wo_a_slice_mapping(types.SimpleNamespace(config=None)) == []


def test_the_patched_statements_extend_vllms_mapping():
    mapping = _run(S.REPLACEMENT + "\nreturn stacked_params_mapping", HELPERS, "self")(_model("exl3"))
    assert mapping[: len(VLLM_MAPPING)] == VLLM_MAPPING
    assert mapping[len(VLLM_MAPPING) :] == [("attn.wo_a.", f"attn.wo_a.slice.{g}.", g) for g in range(8)]
    assert _run(S.REPLACEMENT + "\nreturn stacked_params_mapping", HELPERS, "self")(_model("fp8")) == VLLM_MAPPING


@pytest.mark.parametrize("groups", [8, 16])
def test_slice_names_map_to_wo_a_with_the_group_as_shard(groups):
    mapping = VLLM_MAPPING + S._patch_dsv4_wo_a_slice_mapping(_model("exl3", groups))
    for g in range(groups):
        for leaf in ("trellis", "suh", "svh", "mcg"):
            assert _load_name(mapping, f"layers.7.attn.wo_a.slice.{g}.{leaf}") == (f"layers.7.attn.wo_a.{leaf}", g)
    assert _load_name(mapping, "layers.7.attn.wo_a.weight") == ("layers.7.attn.wo_a.weight", None)
    assert _load_name(mapping, "layers.7.attn.compressor.wkv.trellis")[1] == 0  # vLLM's own entries still win


def test_slice_1_never_takes_slice_10():
    mapping = VLLM_MAPPING + S._patch_dsv4_wo_a_slice_mapping(_model("exl3", 16))
    assert _load_name(mapping, "layers.0.attn.wo_a.slice.10.trellis") == ("layers.0.attn.wo_a.trellis", 10)
    assert _load_name(mapping, "layers.0.attn.wo_a.slice.15.suh") == ("layers.0.attn.wo_a.suh", 15)
    # lna-lab's entries, without the trailing dot, would send slice.10 to shard 1
    lna = VLLM_MAPPING + [("attn.wo_a", f"attn.wo_a.slice.{g}", g) for g in range(16)]
    assert _load_name(lna, "layers.0.attn.wo_a.slice.10.trellis") == ("layers.0.attn.wo_a0.trellis", 1)
