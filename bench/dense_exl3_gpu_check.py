"""GPU check of the dense-exl3 and exl3-wo-a-slices injected code against real exllamav3 LinearEXL3 objects.

The helpers and replacement statements the two patches write into vLLM run here with LinearEXL3 objects that
exllamav3's own quantizer made (quantize_exl3, mcg codebook, a random calibration Hessian) at 2, 3 and 6 bits,
on the real DeepSeek-V4-Flash shapes at TP 8 (nothing scaled down):
- wo_a, one group per rank: 8 heads x 512 = 4096 in, o_lora_rank 1024 out (attention output bf16, rope 64);
- the attention compressor's wkv / wgate (compress ratio 4): 4096 in, 2 x 512 = 1024 out each;
- the indexer compressor's wkv / wgate: 4096 in, 2 x 128 = 256 out each.
The scores run as each release calls them: the closures of 0.28.0-0.33.0, and 0.34.0's
DeepseekV4CompressorKVScoreLinear.forward (called as the module), with its fallback for a layer with a BF16 shard
(the plugin's quant_method.apply, called once, the forward never entered again).
Each path the helpers take runs: without `vllm_exl3.exl3` (LinearEXL3.forward(x, {}, out_dtype=float32)) and with
a stand-in `vllm_exl3.exl3._dense_forward` that follows vllm-exl3's documented dispatch (rows 17-144 through
exllamav3's reconstruct path, other rows through exllamav3's own dispatch, float32 out). Every output is compared
with a float64 reference computed from the same linear's dequantized weight (exllamav3's reconstruct, then its
Hadamard and sign transforms, get_weight_tensor without the fp16 rounding); the tolerance comes from exllamav3's
own forward against that reference. vLLM's inverse RoPE is its Triton kernel, taken from the 0.34.0 wheel's source
(the same as 0.33.0's).

    python bench/dense_exl3_gpu_check.py prepare DIR/prep  # here: helpers, statements, vLLM's RoPE kernel
    bash DIR/dense_exl3_gpu_run.sh DIR                     # there: install, build, check, the capture hazard
    python3 bench/dense_exl3_gpu_check.py run DIR/prep     # one version (PYTHONPATH selects the exllamav3)
    python3 bench/dense_exl3_gpu_check.py hazard DIR/prep N  # capture a never-run 6-bit wo_a at N rows

DIR also holds this script, bench/dense_exl3_gpu_run.sh and DIR/whl: the exllamav3 wheels to check and the
packages the device lacks (pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions,
llguidance, marisa-trie), fetched with pip download for manylinux x86_64, CPython 3.12 (about 11 MB with one
exllamav3). On the device the tree is the session's main checkout: DIR is a folder of it that .git/info/exclude
ignores, named in the run's carry.

Measured on 2026-12-02, one H200 (torch 2.11.0+cu130, nvcc 13.0), TORCH_CUDA_ARCH_LIST=9.0: the builds took 452 s
(1.6.5, MAX_JOBS=10) and 420 s (1.4.5, MAX_JOBS=6) side by side; quantizing the five linears took 4-5 s per bit
width. On both versions all 248 checks passed: the O projection (both variants, both paths, 1-200 rows) within
1.01x of exllamav3's own forward inside vLLM's casts (2.6e-3 relative, bf16 output); the scores float32, wkv then
wgate, bitwise equal to the plain forward without the plugin, and with it within 1.1x of the forward's own error
(3e-4 to 5e-4; that run measured it on another random input); each rank's wo_a slice loaded the group it reads;
graph capture after warm-up at 1, 2, 4 and 8 rows replayed new inputs bitwise equal to eager. A first hazard run
(3 bits, 8 rows) took exllamav3's GEMV (K 2-4, up to 8 rows), which has no autotuner, so it did not exercise the
autotuner inside a capture.

Measured on 2026-12-03, one H200 (the same software), exllamav3 1.6.5 only: all 386 checks passed (the 248 above
and the 0.34.0 forward: 72 on the EXL3 shards, bitwise equal to the plain forward without the plugin and at its
own error with it, 4.6e-4 to 5.0e-4; 18 through the fallback, equal to the plugin's apply and never re-entering
the forward; 48 graph captures after warm-up, replay bitwise equal to eager). The check itself ran in 33 s; the
whole device call (install, build with 16 jobs, check, six hazard processes) in 308 s.

The capture hazard (this `hazard` mode: a fresh process captures a 6-bit wo_a it never ran, at 1 and 16 rows)
holds exactly when exllamav3's autotuner has no record for that GEMM: not in the process (an eager call at the
size tunes it) and not in its disk cache (EXLLAMAV3_TUNE_CACHE, by default
~/.cache/exllamav3/autotune/coop_autotune_v1.bin; the key is the row bucket, the shape, K, the codebook, fp32
output and the device). With an empty cache file the process dies at both sizes: 1.6.5 segfaults in
LinearEXL3.forward (exllamav3/modules/quant/exl3.py:142) called from _patch_dsv4_exl3_o_proj inside the capture
(2026-12-02 and 2026-12-03); 1.4.5 stops on "GPU assert: operation not permitted when stream is capturing"
(quant/coop_autotune.cu:464, 2026-12-02). Having run the check on the same machine does not help (a new empty
cache file after it: the same segfault at both sizes); the check's own cache file (592 bytes) does: both sizes
captured and replayed bitwise equal to eager (rel err 2.4e-3, 2.6e-3). The 2026-12-02 rerun that captured both
had the check's records in the default cache file. So a 6-bit EXL3 linear must run eagerly at each captured size
before the capture (vLLM's warm-up runs before it captures do this), or find its records in the tune cache (a
cache made on another GPU model or device index does not match); the run script records each probe's exit status, last
lines and cache file size.
"""

import ast
import contextlib
import json
import os
import sys
import tempfile
import textwrap
import time
import types

MODE = sys.argv[1] if len(sys.argv) > 1 else ""
HERE = sys.argv[2] if len(sys.argv) > 2 else "."
OUT = os.environ.get("OUT", ".")
DEV = "cuda"
ROPE_MODULE = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"
ROPE_SOURCE = ("0.34.0", "vllm/v1/attention/ops/rocm_aiter_mla_sparse.py")  # the kernel is 0.33.0's, unchanged

# DeepSeek-V4-Flash at TP 8 (tests/doctor/synthetic.py FULL): 64 heads of 512 (rope 64) in 8 wo_a groups.
HIDDEN, HEAD_DIM, ROPE, RANK, LOCAL_HEADS, PADDED_HEADS, GROUPS = 4096, 512, 64, 1024, 8, 64, 8
WO_A_IN = LOCAL_HEADS * HEAD_DIM
SCORE_SHAPES = {"compressor": (2 * HEAD_DIM, HIDDEN), "indexer": (2 * 128, HIDDEN)}  # (out, in) of wkv and wgate
BITS = (2, 3, 6)
ROWS = (1, 2, 8, 16, 64, 200)  # GEMV, cooperative GEMM buckets, 17-144 (the plugin reconstructs), > 144
GRAPH_ROWS = (1, 2, 4, 8)  # vLLM's decode capture sizes in the lna-lab recipe ([1, 2, 4]) and one more bucket
SLICE_BITS = 6


def prepare(directory: str) -> None:
    """Here, with patch_dsv4 importable: the injected code of both patches and vLLM's kernel source, into DIR."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from patch_dsv4.patches import dense_exl3, exl3_wo_a_slices
    from tests.releases import wheel_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    helpers, seen = [], set()
    for patch in (dense_exl3.DenseExl3, exl3_wo_a_slices.Exl3WoASlices):
        for edit in patch.edits:
            for source in edit.helper_sources():  # what the patch writes into vLLM, byte for byte
                if source not in seen:
                    seen.add(source)
                    helpers.append(source)
    (out / "helpers.py").write_text("\n\n".join(helpers))
    score_edits = [e for e in dense_exl3.DenseExl3.edits if e.scope.func == "_run_parallel_input_projections"]
    statements = {
        "o_proj": {v.releases: v.replacement for v in dense_exl3.O_PROJ_VARIANTS},
        "scores": {e.label: e.variants[0].replacement for e in score_edits},
        "kv_score_linear": dense_exl3.KV_SCORE_VARIANT.replacement,  # 0.34.0: the projection class's forward
        "slices": exl3_wo_a_slices.REPLACEMENT,
        "slices_anchor": exl3_wo_a_slices.ANCHOR,
    }
    (out / "statements.json").write_text(json.dumps(statements, indent=1))
    version, relpath = ROPE_SOURCE
    (out / "rocm_aiter_mla_sparse.py").write_bytes(wheel_file(version, relpath))


def body(statements: str, namespace: dict, *params: str):
    """``statements`` as the body of a function of ``params``, compiled in ``namespace`` (the patched module)."""
    source = f"def _body({', '.join(params)}):\n" + textwrap.indent(textwrap.dedent(statements).strip("\n"), "    ")
    scope = dict(namespace)
    exec(compile(source, "<patched>", "exec"), scope)  # noqa: S102 - the patched vLLM code under test
    return scope["_body"]


def rope_module():
    """vLLM's _fused_inverse_rope_gptj and its Triton kernel, out of the release source."""
    path = os.path.join(HERE, "rocm_aiter_mla_sparse.py")
    src = open(path).read()
    wanted = {"_inverse_rope_gptj_kernel", "_fused_inverse_rope_gptj"}
    nodes = [n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    code = "import torch\nimport triton\nimport triton.language as tl\n\n"
    for n in nodes:
        decorators = "".join(f"@{ast.get_source_segment(src, d)}\n" for d in n.decorator_list)
        code += decorators + ast.get_source_segment(src, n) + "\n\n"
    # Triton needs the kernel's source in a file it can read
    file = os.path.join(tempfile.mkdtemp(), "_vllm_inverse_rope.py")
    with open(file, "w") as f:
        f.write(code)
    import importlib.util

    spec = importlib.util.spec_from_file_location(ROPE_MODULE, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def setup():
    global torch, LinearEXL3, quantize_exl3, preapply_had_l, preapply_had_r, had_k, had_n, VERSION
    import importlib.metadata

    import torch
    from exllamav3.modules.quant.exl3 import LinearEXL3
    from exllamav3.modules.quant.exl3_lib.quantize import had_k, had_n, preapply_had_l, preapply_had_r, quantize_exl3

    VERSION = importlib.metadata.version("exllamav3")
    sys.modules[ROPE_MODULE] = rope_module()
    namespace = {}
    exec(compile(open(os.path.join(HERE, "helpers.py")).read(), "<helpers>", "exec"), namespace)  # noqa: S102
    statements = json.load(open(os.path.join(HERE, "statements.json")))
    return namespace, statements


# -- exllamav3 ---------------------------------------------------------------------------------------------------
def quantize(out_features, in_features, bits, seed, key):
    """A random linear (torch layout: out x in) through exllamav3's quantizer; the LinearEXL3 and its float64 weight."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen, device=DEV) / in_features**0.5
    calib = torch.randn(4096, in_features, generator=gen, device=DEV)
    calib *= 0.5 + torch.rand(in_features, generator=gen, device=DEV)  # uneven input channels
    H_data = {
        "H": calib.T @ calib,
        "first_key": key,
        "count": calib.shape[0],
        "finalized": False,
        "num_total": calib.numel(),
        "inf_nan": torch.zeros(2, dtype=torch.long, device=DEV),
        "device": torch.device(DEV, 0),
    }
    quant_args = {"seed": seed, "K": bits, "devices": [0], "apply_out_scales": None, "mcg": True}
    _, proxy_err, t = quantize_exl3(weight.T.contiguous(), H_data, quant_args, False)
    linear = LinearEXL3(
        config=None,
        in_features=in_features,
        out_features=out_features,
        suh=t["suh"],
        svh=t["svh"],
        trellis=t["trellis"],
        mcg=t.get("mcg"),
        mul1=t.get("mul1"),
        key=key,
    )
    dense = dequantized(linear)
    quant_err = rel(dense.T, weight.double())
    return linear, dense, quant_err


def dequantized(linear):
    """(in, out) float64: exllamav3's get_weight_tensor without its fp16 rounding (its transforms run in fp32)."""
    w = linear.get_inner_weight_tensor().double()
    w = preapply_had_l(w, had_k)
    w *= linear.suh.double().unsqueeze(1)
    w = preapply_had_r(w, had_n)
    w *= linear.svh.double().unsqueeze(0)
    return w


def rel(out, ref):
    """max over rows of |out - ref| / |ref| (float64); NaN and inf count as failures."""
    out, ref = out.double().reshape(-1, out.shape[-1]), ref.double().reshape(-1, ref.shape[-1])
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max().item()


def own_error(linear, dense, x):
    """exllamav3's plain forward of ``x`` against the float64 reference: its own dispatch and its reconstruct path."""
    ref = x.double() @ dense
    plain = linear.forward(x, {}, out_dtype=torch.float32)
    recon = linear.forward(x, {"reconstruct": True}, out_dtype=torch.float32)
    assert plain.dtype == torch.float32 and recon.dtype == torch.float32
    return max(rel(plain, ref), rel(recon, ref))


class Plugin:
    """vllm_exl3.exl3 as the helpers look it up: a stand-in _dense_forward with vllm-exl3's documented dispatch."""

    def __init__(self):
        self.calls = 0
        self.module = types.ModuleType("vllm_exl3.exl3")
        self.module._dense_forward = self._dense_forward

    def _dense_forward(self, linear, x):
        self.calls += 1
        rows = x.numel() // x.shape[-1]
        params = {"reconstruct": True} if 17 <= rows <= 144 else {}
        return linear.forward(x, params, out_dtype=torch.float32).to(torch.float32)

    def __enter__(self):
        sys.modules["vllm_exl3.exl3"] = self.module
        return self

    def __exit__(self, *exc):
        del sys.modules["vllm_exl3.exl3"]


class NoPlugin:
    calls = 0

    def __enter__(self):
        sys.modules.pop("vllm_exl3.exl3", None)
        return self

    def __exit__(self, *exc):
        pass


PATHS = {"forward": NoPlugin, "_dense_forward": Plugin}


# -- the O projection (dense-exl3 E(b)) --------------------------------------------------------------------------
def rope_cache():
    inv = 1.0 / (10000 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE))
    freqs = torch.outer(torch.arange(65536, dtype=torch.float32), inv)
    return torch.cat([freqs.cos(), freqs.sin()], -1).to(DEV)  # [P, rope] = cos | sin, fp32


def inverse_rope64(o, positions, cache):
    """GPT-J inverse RoPE on the trailing ROPE lanes, in float64."""
    x = o.double()
    cs = cache[positions].double()
    cos, sin = cs[:, None, : ROPE // 2], cs[:, None, ROPE // 2 :]
    nope = x.shape[-1] - ROPE
    a, b = x[..., nope::2], x[..., nope + 1 :: 2]
    rot = torch.stack([a * cos + b * sin, b * cos - a * sin], -1).flatten(-2)
    return torch.cat([x[..., :nope], rot], -1)


def attention_layer(linear, cache, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    wo_b = torch.nn.Linear(RANK, HIDDEN, bias=False, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        wo_b.weight.copy_(torch.randn(HIDDEN, RANK, generator=gen, device=DEV) / RANK**0.5)
    layer = types.SimpleNamespace(n_local_groups=1, rope_head_dim=ROPE, wo_b=wo_b)
    layer.wo_a = types.SimpleNamespace(_exl3_linears=[linear])  # vllm-exl3 deleted wo_a.weight
    layer.rotary_emb = types.SimpleNamespace(cos_sin_cache=cache)

    def o_proj(*args):
        raise AssertionError("vLLM's _o_proj ran for an EXL3 wo_a")

    layer._o_proj = o_proj
    return layer


def attention_output(rows):
    o_pad = torch.randn(rows, PADDED_HEADS, HEAD_DIM, device=DEV).to(torch.bfloat16)
    positions = torch.randint(0, 65536, (rows,), device=DEV)
    return o_pad, o_pad[:, :LOCAL_HEADS, :], positions  # the local heads' slice vLLM hands _o_proj


def o_proj_references(layer, dense, o, positions, cache):
    """float64 reference, and exllamav3's plain forward inside vLLM's own casts (bf16 RoPE out, fp16 in, bf16 z)."""
    o_ref = inverse_rope64(o, positions, cache)
    w_b = layer.wo_b.weight.double()
    ref = (o_ref.reshape(o.shape[0], -1) @ dense) @ w_b.T
    linear = layer.wo_a._exl3_linears[0]
    x = o_ref.to(torch.bfloat16).reshape(o.shape[0], -1).half().contiguous()
    z = linear.forward(x, {}, out_dtype=torch.float32)
    plain = layer.wo_b(z.to(torch.bfloat16))
    return ref, plain


def check_o_proj(ns, statements, linear, dense, bits, cache, rows_list, results):
    tails = {
        r: body(s, ns, "self", "o" if "(o, positions)" in s else "attn_out", "positions")
        for r, s in statements["o_proj"].items()
    }
    layer = attention_layer(linear, cache, seed=bits)
    for path, context in PATHS.items():
        for rows in rows_list:
            for releases, tail in tails.items():
                with (
                    context() as plugin,
                    failure(results, bits, f"{WO_A_IN}->{RANK}", f"o_proj {releases}", path, rows),
                ):
                    _, o, positions = attention_output(rows)
                    ref, plain = o_proj_references(layer, dense, o, positions, cache)
                    out = tail(layer, o, positions)
                    own = rel(plain, ref)
                    err = rel(out, ref)
                    tol = 1.1 * own + 1e-4
                    ok = out.dtype == torch.bfloat16 and out.shape == (rows, HIDDEN) and err <= tol
                    ok = ok and (plugin.calls == 1 if path == "_dense_forward" else True)
                    results.append(row(bits, f"{WO_A_IN}->{RANK}", f"o_proj {releases}", path, rows, err, own, tol, ok))


# -- the compressor scores (dense-exl3 F) -----------------------------------------------------------------------
def check_scores(ns, statements, pair, dense_pair, bits, kind, rows_list, results):
    wkv, wgate = pair
    module = types.SimpleNamespace(_exl3_linears=[wkv, wgate])  # vllm-exl3 deleted fused_wkv_wgate.weight
    owner = types.SimpleNamespace(fused_wkv_wgate=module)
    closures = {
        label: body(s, ns, "hidden_states", "compressor", "indexer") for label, s in statements["scores"].items()
    }
    width = wkv.out_features
    for path, context in PATHS.items():
        for rows in rows_list:
            with failure(results, bits, f"{HIDDEN}->{wkv.out_features}x2", f"{kind} scores", path, rows):
                hidden = torch.randn(rows, HIDDEN, device=DEV).to(torch.bfloat16)
                x = hidden.half()
                own = max(own_error(lin, dense, x) for lin, dense in zip(pair, dense_pair, strict=True))
                tol = 1.1 * own + 1e-5
                plain = torch.cat([lin.forward(x, {}, out_dtype=torch.float32) for lin in pair], dim=-1)
                for label, closure in closures.items():
                    with context() as plugin:
                        out = closure(hidden, owner, types.SimpleNamespace(compressor=owner))
                        ref_kv, ref_gate = (x.double() @ d for d in dense_pair)
                        err = max(rel(out[:, :width], ref_kv), rel(out[:, width:], ref_gate))
                        swapped = rel(out[:, :width], ref_gate) if ref_gate.shape == ref_kv.shape else float("inf")
                        ok = out.dtype == torch.float32 and out.shape == (rows, 2 * width) and err <= tol
                        ok = ok and swapped > 0.5  # wkv first, then wgate: never the other order
                        if path == "forward":
                            note = (
                                "bitwise = plain forward" if torch.equal(out, plain) else "differs from plain forward"
                            )
                            ok = ok and torch.equal(out, plain)
                        else:
                            ok = ok and plugin.calls == 2
                            note = "2 _dense_forward calls"
                        shape = f"{HIDDEN}->{width}x2"
                        results.append(
                            row(bits, shape, f"{kind} {label.split()[0]}", path, rows, err, own, tol, ok, note)
                        )


# -- the compressor's projection class on 0.34.0 (dense-exl3 F, DeepseekV4CompressorKVScoreLinear.forward) -------
class KVScoreLinear(types.SimpleNamespace):
    """The projection module as vllm-exl3 leaves it (``_exl3_linears``, no ``.weight``), its forward the patched
    0.34.0 body; calling the module runs that forward, so a fallback that called the module would be seen."""

    def __call__(self, input_):
        self.calls_into_forward += 1
        return self.patched_forward(self, input_)


def kv_score_module(ns, statements, linears, quant_apply=None):
    forward = body(statements["kv_score_linear"], {**ns, "torch": torch}, "self", "input_")
    module = KVScoreLinear(_exl3_linears=list(linears), patched_forward=forward, calls_into_forward=0)
    if quant_apply is not None:
        module.quant_method = types.SimpleNamespace(apply=quant_apply)
    return module


def check_kv_score_linear(ns, statements, pair, dense_pair, bits, kind, rows_list, results):
    """The patched forward on the EXL3 shards (both paths), and its fallback for a layer with a BF16 shard: the
    plugin's quant_method.apply, called once and directly (the module's forward is never entered again)."""
    wkv = pair[0]
    width = wkv.out_features
    shape = f"{HIDDEN}->{width}x2"
    for path, context in PATHS.items():
        for rows in rows_list:
            with failure(results, bits, shape, f"{kind} kv_score_linear 0.34.0", path, rows):
                module = kv_score_module(ns, statements, pair)
                hidden = torch.randn(rows, HIDDEN, device=DEV).to(torch.bfloat16)
                x = hidden.half()
                own = max(own_error(lin, dense, x) for lin, dense in zip(pair, dense_pair, strict=True))
                tol = 1.1 * own + 1e-5
                plain = torch.cat([lin.forward(x, {}, out_dtype=torch.float32) for lin in pair], dim=-1)
                with context() as plugin:
                    out = module(hidden)
                ref_kv, ref_gate = (x.double() @ d for d in dense_pair)
                err = max(rel(out[:, :width], ref_kv), rel(out[:, width:], ref_gate))
                swapped = rel(out[:, :width], ref_gate) if ref_gate.shape == ref_kv.shape else float("inf")
                ok = out.dtype == torch.float32 and out.shape == (rows, 2 * width) and err <= tol and swapped > 0.5
                ok = ok and module.calls_into_forward == 1
                if path == "forward":
                    same = torch.equal(out, plain)
                    note, ok = ("bitwise = plain forward" if same else "differs from plain forward"), ok and same
                else:
                    note, ok = "2 _dense_forward calls", ok and plugin.calls == 2
                results.append(row(bits, shape, f"{kind} kv_score_linear 0.34.0", path, rows, err, own, tol, ok, note))
    # a BF16 wgate beside the EXL3 wkv: the plugin's own apply (a stand-in: EXL3 wkv, dense bf16 wgate, bf16 out)
    w_gate = (dense_pair[1].T.contiguous()).to(torch.bfloat16)
    applied = []

    def quant_apply(layer, input_, bias):
        applied.append((layer, bias))
        kv = wkv.forward(input_.half().contiguous(), {}, out_dtype=torch.float32)
        return torch.cat([kv, input_.float() @ w_gate.float().T], dim=-1).to(torch.bfloat16)

    for rows in (1, 16, 200):
        with failure(results, bits, shape, f"{kind} kv_score_linear fallback", "quant_method.apply", rows):
            module = kv_score_module(ns, statements, [wkv, None], quant_apply)
            applied.clear()
            hidden = torch.randn(rows, HIDDEN, device=DEV).to(torch.bfloat16)
            out = module(hidden)
            x = hidden.double()
            ref = torch.cat([x @ dense_pair[0], x @ w_gate.double().T], dim=-1)
            err = rel(out, ref)
            direct = quant_apply(module, hidden, None)  # what the plugin's apply returns, called here
            applied.pop()
            own = rel(direct, ref)
            tol = 1.1 * own + 1e-4
            ok = out.dtype == torch.float32 and torch.equal(out, direct.to(torch.float32)) and err <= tol
            ok = ok and module.calls_into_forward == 1
            ok = ok and len(applied) == 1 and applied[0][0] is module and applied[0][1] is None
            note = f"quant_method.apply called {len(applied)}x, forward entered {module.calls_into_forward}x"
            results.append(
                row(
                    bits, shape, f"{kind} kv_score_linear fallback", "quant_method.apply", rows, err, own, tol, ok, note
                )
            )


def check_kv_score_graph(ns, statements, pair, bits, kind, results):
    """The patched 0.34.0 forward captured after warm-up, as vLLM captures the compressor's projection."""
    for path, context in PATHS.items():
        for rows in GRAPH_ROWS:
            with context():
                module = kv_score_module(ns, statements, pair)
                hidden = torch.randn(rows, HIDDEN, device=DEV).to(torch.bfloat16)
                try:
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for _ in range(3):
                            module(hidden)
                    torch.cuda.current_stream().wait_stream(stream)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        static_out = module(hidden)
                    same = True
                    for _ in range(3):
                        hidden.copy_(torch.randn_like(hidden, dtype=torch.float32).to(torch.bfloat16))
                        graph.replay()
                        torch.cuda.synchronize()
                        same = same and torch.equal(static_out, module(hidden))
                    result, ok = f"replay == eager: {same}", same
                except Exception as exc:  # noqa: BLE001 - what the capture does is the result
                    result, ok = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}", False
                results.append(
                    {
                        "exllamav3": VERSION,
                        "bits": bits,
                        "helper": f"{kind} kv_score_linear graph",
                        "shape": f"{HIDDEN}->{pair[0].out_features}x2",
                        "path": path,
                        "rows": rows,
                        "graph": result,
                        "ok": ok,
                    }
                )


# -- CUDA graph ---------------------------------------------------------------------------------------------------
def check_graph(ns, statements, linear, dense, bits, cache, results):
    (tail, *_) = [
        body(s, ns, "self", "attn_out", "positions") for r, s in statements["o_proj"].items() if "attn_out" in s
    ]
    layer = attention_layer(linear, cache, seed=bits)
    for path, context in PATHS.items():
        for rows in GRAPH_ROWS:
            with context():
                o_pad, o, positions = attention_output(rows)
                try:
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for _ in range(3):
                            tail(layer, o, positions)
                    torch.cuda.current_stream().wait_stream(stream)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        static_out = tail(layer, o, positions)
                    same, errs = True, []
                    for _ in range(3):
                        o_pad.copy_(torch.randn_like(o_pad, dtype=torch.float32).to(torch.bfloat16))
                        positions.copy_(torch.randint(0, 65536, positions.shape, device=DEV))
                        graph.replay()
                        torch.cuda.synchronize()
                        eager = tail(layer, o, positions)
                        ref, _ = o_proj_references(layer, dense, o, positions, cache)
                        same = same and torch.equal(static_out, eager)
                        errs.append(rel(static_out, ref))
                    result = f"replay == eager: {same}, max rel err {max(errs):.2e}"
                    ok = same
                except Exception as exc:  # noqa: BLE001 - what the capture does is the result
                    result, ok = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}", False
                results.append(
                    {
                        "exllamav3": VERSION,
                        "bits": bits,
                        "helper": "o_proj graph",
                        "path": path,
                        "rows": rows,
                        "graph": result,
                        "ok": ok,
                    }
                )


def tune_cache():
    """exllamav3's autotuner disk cache as this process finds it (coop_autotune.cu disk_cache_path): path, bytes."""
    path = os.environ.get("EXLLAMAV3_TUNE_CACHE") or ""
    if not path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(base, "exllamav3", "autotune", "coop_autotune_v1.bin")
    elif os.path.isdir(path):
        path = os.path.join(path, "coop_autotune_v1.bin")
    return {"path": path, "bytes": os.path.getsize(path) if os.path.exists(path) else None}


def hazard(rows):
    """A fresh process (the autotuner's memory is empty; its disk cache is what EXLLAMAV3_TUNE_CACHE names): capture
    the O projection of a 6-bit wo_a at ``rows`` rows with no eager call of that linear before. exllamav3's GEMV
    takes K 2-4 only, so K=6 reaches the cooperative GEMM and its autotuner at every row count (1.4.5 and 1.6.5
    source), as a Dense6 pack's wo_a would. Inverse RoPE and wo_b are warmed through a 3-bit linear of the same shape
    at 1 row (GEMV: no autotuner). What happens is the result. The first run (exllamav3 1.4.5 and 1.6.5, 3 bits at
    8 rows) went through the GEMV and did not reach the autotuner.
    """
    ns, statements = setup()
    cache = rope_cache()
    warm, _, _ = quantize(RANK, WO_A_IN, 3, seed=7, key="hazard.warm")
    linear, dense, _ = quantize(RANK, WO_A_IN, 6, seed=8, key="hazard.wo_a")
    (tail, *_) = [
        body(s, ns, "self", "attn_out", "positions") for s in statements["o_proj"].values() if "attn_out" in s
    ]
    _, o1, p1 = attention_output(1)
    tail(attention_layer(warm, cache, seed=7), o1, p1)
    torch.cuda.synchronize()
    layer = attention_layer(linear, cache, seed=7)
    o_pad, o, positions = attention_output(rows)
    report = {"exllamav3": VERSION, "bits": 6, "rows": rows, "tune_cache": tune_cache(), "capture": None}
    print("HAZARD-START", json.dumps(report), flush=True)  # a process the capture kills prints no more
    report["replay"] = None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = tail(layer, o, positions)
        report["capture"] = "ok"
        o_pad.copy_(torch.randn_like(o_pad, dtype=torch.float32).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        eager = tail(layer, o, positions)
        ref, _ = o_proj_references(layer, dense, o, positions, cache)
        report["replay"] = f"replay == eager: {torch.equal(static_out, eager)}, rel err {rel(static_out, ref):.2e}"
    except Exception as exc:  # noqa: BLE001 - what the capture does is the result
        report["capture"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        try:
            torch.cuda.synchronize()
            eager = tail(layer, o, positions)
            ref, _ = o_proj_references(layer, dense, o, positions, cache)
            report["after"] = f"eager after the failed capture: rel err {rel(eager, ref):.2e}"
        except Exception as exc2:  # noqa: BLE001
            report["after"] = f"eager after the failed capture: {type(exc2).__name__}: {str(exc2)[:160]}"
    print("HAZARD", json.dumps(report), flush=True)


# -- exl3-wo-a-slices: the loader mapping against the real tensors -----------------------------------------------
def check_slices(ns, statements, cache, results):
    """Bake wo_a as 8 per-group EXL3 tensor sets (lna-lab's names), load each rank through vLLM's loop with the
    patched mapping and the plugin fork's rule (an int shard id of wo_a is the owning rank), then run the O projection
    with the LinearEXL3 built from what the rank loaded."""
    prefix = "model.layers.0.attn.wo_a"
    bake, dense = {}, []
    for g in range(GROUPS):
        lin, d, _ = quantize(RANK, WO_A_IN, SLICE_BITS, seed=100 + g, key=f"{prefix}.slice.{g}")
        bake.update(lin.get_tensors(f"{prefix}.slice.{g}"))
        dense.append(d)
    config = types.SimpleNamespace(get_name=lambda: "exl3")
    model = types.SimpleNamespace(quant_config=config, config=types.SimpleNamespace(o_groups=GROUPS))
    mapping = body(statements["slices"] + "\nreturn stacked_params_mapping", ns, "self")(model)
    for rank in range(GROUPS):
        params, unmapped = {}, []
        for name, tensor in bake.items():
            for param_name, weight_name, shard_id in mapping:  # DeepseekV4Model.load_weights' loop
                if weight_name not in name:
                    continue
                if shard_id == rank:  # the fork's wo_a loader keeps the rank's own group only
                    params[name.replace(weight_name, param_name)] = tensor
                break
            else:
                unmapped.append(name)
        leaf = {k.rsplit(".", 1)[1]: v for k, v in params.items()}
        linear = LinearEXL3(
            config=None,
            in_features=WO_A_IN,
            out_features=RANK,
            suh=leaf["suh"],
            svh=leaf["svh"],
            trellis=leaf["trellis"],
            mcg=leaf.get("mcg"),
            mul1=leaf.get("mul1"),
            key=prefix,
        )
        layer = attention_layer(linear, cache, seed=rank)
        _, o, positions = attention_output(8)
        out = ns["_patch_dsv4_exl3_o_proj"](layer, o, positions)
        o_ref = inverse_rope64(o, positions, cache).reshape(8, -1)
        errs = [rel(out, (o_ref @ d) @ layer.wo_b.weight.double().T) for d in dense]
        own = rel(
            o_proj_references(layer, dense[rank], o, positions, cache)[1],
            (o_ref @ dense[rank]) @ layer.wo_b.weight.double().T,
        )
        tol = 1.1 * own + 1e-4
        best = min(range(GROUPS), key=errs.__getitem__)
        ok = (
            not unmapped
            and sorted(params) == [f"{prefix}.{k}" for k in sorted(leaf)]
            and best == rank
            and errs[rank] <= tol
        )
        note = f"rank {rank} loaded {sorted(leaf)} -> group {best}; next-best group err {sorted(errs)[1]:.2f}"
        if unmapped:
            note += f"; unmapped: {unmapped[:2]}"
        results.append(
            row(
                SLICE_BITS,
                f"{WO_A_IN}->{RANK} x{GROUPS}",
                "wo_a slice map",
                "forward",
                8,
                errs[rank],
                own,
                tol,
                ok,
                note,
            )
        )


@contextlib.contextmanager
def failure(results, bits, shape, helper, path, rows):
    """An exception inside is a failed row of the table (its type and first line), not the end of the run."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - reported, and counted as a failure
        note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        results.append(row(bits, shape, helper, path, rows, float("inf"), float("nan"), 0.0, False, note))


def row(bits, shape, helper, path, rows, err, own, tol, ok, note=""):
    return {
        "exllamav3": VERSION,
        "bits": bits,
        "shape": shape,
        "helper": helper,
        "path": path,
        "rows": rows,
        "err": err,
        "own": own,
        "tol": tol,
        "ok": bool(ok),
        "note": note,
    }


def run():
    ns, statements = setup()
    name = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print("exllamav3", VERSION, "torch", torch.__version__, name, flush=True)
    torch.manual_seed(0)
    cache = rope_cache()
    results, timings = [], {}
    for bits in BITS:
        start = time.time()
        wo_a, wo_a_dense, q_err = quantize(RANK, WO_A_IN, bits, seed=bits, key="wo_a")
        pairs = {}
        for kind, (out_f, in_f) in SCORE_SHAPES.items():
            made = [
                quantize(out_f, in_f, bits, seed=10 * bits + i, key=f"{kind}.{n}")
                for i, n in enumerate(("wkv", "wgate"))
            ]
            pairs[kind] = ([m[0] for m in made], [m[1] for m in made])
        timings[bits] = time.time() - start
        print(f"{bits} bits: quantized 5 linears in {timings[bits]:.1f} s; wo_a weight error {q_err:.3f}", flush=True)
        check_o_proj(ns, statements, wo_a, wo_a_dense, bits, cache, ROWS, results)
        for kind, (pair, dense_pair) in pairs.items():
            check_scores(ns, statements, pair, dense_pair, bits, kind, ROWS, results)
            check_kv_score_linear(ns, statements, pair, dense_pair, bits, kind, ROWS, results)
            check_kv_score_graph(ns, statements, pair, bits, kind, results)
        check_graph(ns, statements, wo_a, wo_a_dense, bits, cache, results)
    with failure(results, SLICE_BITS, f"{WO_A_IN}->{RANK} x{GROUPS}", "wo_a slice map", "forward", 8):
        check_slices(ns, statements, cache, results)
    with open(os.path.join(OUT, f"dense_exl3_{VERSION}.json"), "w") as f:
        json.dump({"exllamav3": VERSION, "quantize_s": timings, "results": results}, f, indent=1)
    print_table(results)


def print_table(results):
    """One line per (bits, shape, helper, path): worst error over the row counts, and the graph lines."""
    groups = {}
    for r in results:
        if "graph" in r:
            continue
        key = (r["exllamav3"], r["bits"], r["shape"], r["helper"], r["path"])
        g = groups.setdefault(key, {"err": 0.0, "own": 0.0, "ok": True, "rows": [], "notes": set()})
        g["err"], g["own"] = max(g["err"], r["err"]), max(g["own"], r["own"])
        g["ok"] &= r["ok"]
        g["rows"].append(r["rows"])
        if r["note"] and "slice" not in r["helper"]:
            g["notes"].add(r["note"])
    print("| exllamav3 | bits | shape | helper | path | rows | max rel err | plain forward's own err | ok | note |")
    for (v, bits, shape, helper, path), g in groups.items():
        rows = ",".join(map(str, sorted(set(g["rows"]))))
        cells = (v, bits, shape, helper, path, rows, f"{g['err']:.2e}", f"{g['own']:.2e}", g["ok"])
        print("| " + " | ".join(map(str, cells)) + f" | {'; '.join(sorted(g['notes']))} |")
    for r in results:
        if "graph" in r:
            shape = r.get("shape", f"{WO_A_IN}->{RANK}")
            cells = (r["exllamav3"], r["bits"], shape, r["helper"], r["path"], r["rows"], "", "")
            print("| " + " | ".join(map(str, cells)) + f" | {r['ok']} | {r['graph']} |")
    for r in results:
        if "slice" in r["helper"] and r["note"]:
            print("  slice:", r["note"])
    bad = [r for r in results if not r["ok"]]
    print(f"RESULT {VERSION}: {len(results) - len(bad)} ok, {len(bad)} failed")


if __name__ == "__main__":
    if MODE == "prepare":
        prepare(HERE)
    elif MODE == "run":
        run()
    elif MODE == "hazard":
        hazard(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    else:
        sys.exit(__doc__)
