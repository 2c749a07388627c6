"""GPU check of the dtype-policy BF16 path: vLLM 0.28.0's rocm_inv_rope_einsum (where the
patch routes a BF16 wo_a) and the injected helper, against plain torch and against the
0.30.0 upstream NVIDIA BF16 path (fused_inv_rope_fp8_quant(quantize=False) + bmm).

No vLLM install (its wheel, compiled ops and dependencies do not fit a GPU box without
network): the Triton kernels and their wrappers are taken from the release sources by
ast and run with the machine's torch and triton.

    python bench/dtype_policy_gpu_check.py prepare DIR   # here: copy the two vLLM sources
                                                         # out of the cached wheels into DIR
    python3 bench/dtype_policy_gpu_check.py DIR          # on a CUDA machine
"""

import ast
import functools
import importlib.util
import math
import sys
import textwrap

if not (len(sys.argv) > 2 and sys.argv[1] == "prepare"):
    import torch
    import triton

HERE = sys.argv[-1] if len(sys.argv) > 1 else "."
SOURCES = {
    "rocm_aiter_mla_sparse_0280.py": ("0.28.0", "vllm/v1/attention/ops/rocm_aiter_mla_sparse.py"),
    "fused_inv_rope_0300.py": ("0.30.0", "vllm/models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py"),
}


def prepare(directory: str) -> None:
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.releases import wheel_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name, (version, relpath) in SOURCES.items():
        (out / name).write_bytes(wheel_file(version, relpath))
    # the helper exactly as patches/dtype_policy.py injects it (a real function there, no longer a HELPER string)
    from patch_dsv4.patches.dtype_policy import _patch_dsv4_bf16_o_proj
    from patch_dsv4.patching.edits import helper_source

    (out / "helper.py").write_text(helper_source(_patch_dsv4_bf16_o_proj))


if len(sys.argv) > 2 and sys.argv[1] == "prepare":
    prepare(sys.argv[2])
    sys.exit(0)


def extract(path, names, cls=None):
    src = open(path).read()
    tree = ast.parse(src)
    body = tree.body
    if cls:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    out = []
    for n in body:
        if isinstance(n, ast.FunctionDef) and n.name in names:
            out.append(ast.get_source_segment(src, n, padded=False))
            if n.decorator_list:
                decos = "\n".join("@" + ast.get_source_segment(src, d) for d in n.decorator_list)
                out[-1] = decos + "\n" + out[-1]
    return out


def load_as_module(name, codes):
    path = f"{HERE}/_{name}.py"
    with open(path, "w") as f:
        f.write("import math\nimport torch\nimport triton\nimport triton.language as tl\n\n")
        f.write("\n\n".join(textwrap.dedent(c) for c in codes) + "\n")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rocm_mod = load_as_module(
    "extracted_rocm_0280",
    extract(
        f"{HERE}/rocm_aiter_mla_sparse_0280.py",
        {
            "_decode_e8m0_scales",
            "_expand_2d_block_scales",
            "_inverse_rope_gptj_kernel",
            "_fused_inverse_rope_gptj",
            "_get_cached_wo_a_bf16",
            "rocm_inv_rope_einsum",
        },
    ),
)
rocm_inv_rope_einsum = rocm_mod.rocm_inv_rope_einsum

# 0.30.0 upstream NVIDIA kernel (the raw Triton function, QUANTIZE=False path).
(kern_src,) = extract(f"{HERE}/fused_inv_rope_0300.py", {"kernel"}, cls="FusedInvRopeFP8QuantKernel")
kern_src = "\n".join(line for line in textwrap.dedent(kern_src).splitlines() if line.strip() != "@staticmethod")
kernel30 = load_as_module("extracted_fused_inv_rope_0300", [kern_src]).kernel


def upstream30_z(o, positions, cos_sin_cache, G, hpg, nope, rope, W, R):
    T, H, D = o.shape
    d = hpg * D
    out = torch.empty((G, T, d), dtype=o.dtype, device=o.device)
    scale = torch.empty(0, dtype=torch.float32, device=o.device)
    kernel30[(T, G * hpg)](
        o,
        positions,
        cos_sin_cache,
        out,
        scale,
        T,
        hpg,
        o.stride(0),
        o.stride(1),
        cos_sin_cache.stride(0),
        out.stride(0),
        out.stride(1),
        0,
        0,
        float(torch.finfo(torch.float8_e4m3fn).max),
        1e-10,
        QUANT_GROUP_SIZE=128,
        CHUNKS_PER_HEAD=D // 128,
        NOPE_DIM=nope,
        HALF_ROPE=rope // 2,
        QUANTIZE=False,
        TMA_ALIGNED_SCALES=False,
        launch_pdl=False,
    )
    o_in = out.transpose(0, 1)  # [T, G, d]
    z = torch.empty((T, G, R), dtype=torch.bfloat16, device=o.device)
    torch.bmm(o_in.transpose(0, 1), W.view(G, R, -1).transpose(1, 2), out=z.transpose(0, 1))
    return z


def torch_reference(o, positions, cos_sin_cache, G, nope, rope, W, R):
    """fp32 inverse GPT-J RoPE on the trailing rope dims, cast to bf16 like the
    kernel, then the grouped product in fp32."""
    x = o.float()
    T, H, D = x.shape
    cs = cos_sin_cache[positions]
    cos, sin = cs[:, None, : rope // 2], cs[:, None, rope // 2 :]
    a, b = x[..., nope::2], x[..., nope + 1 :: 2]
    rot = torch.stack([a * cos + b * sin, b * cos - a * sin], -1).flatten(-2)
    y = torch.cat([x[..., :nope], rot], -1).to(torch.bfloat16).float()
    return torch.einsum("tgd,grd->tgr", y.view(T, G, -1), W.float().view(G, R, -1))


def forward_rope(x, positions, cos_sin_cache, nope, rope):
    cs = cos_sin_cache[positions]
    cos, sin = cs[:, None, : rope // 2], cs[:, None, rope // 2 :]
    a, b = x[..., nope::2], x[..., nope + 1 :: 2]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
    return torch.cat([x[..., :nope], rot], -1)


class Rotary:
    def __init__(self, cache):
        self.cos_sin_cache = cache


class Layer:
    pass


HELPER = open(f"{HERE}/helper.py").read()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main():
    dev = "cuda"
    torch.manual_seed(0)
    print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
    D, rope, R, hidden = 512, 64, 1024, 4096
    nope = D - rope
    max_pos = 65536
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope))
    t = torch.arange(max_pos, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], -1).to(dev)  # [P, rope] cos | sin
    worst = {}
    # (heads, groups, padded heads) for TP 1, 2, 8 of DeepSeek-V4-Flash (64 heads, 8 groups)
    for H, G, Hp in [(64, 8, 128), (32, 4, 64), (8, 1, 64)]:
        hpg = H // G
        K = hpg * D
        W = (torch.randn(G * R, K, device=dev) / math.sqrt(K)).to(torch.bfloat16)
        wo_a = torch.nn.Module()
        wo_a.weight = torch.nn.Parameter(W, requires_grad=False)
        wo_b = torch.nn.Linear(G * R, hidden, bias=False, device=dev, dtype=torch.bfloat16)
        layer = Layer()
        layer.rotary_emb, layer.rope_head_dim, layer.n_local_groups = Rotary(cache), rope, G
        layer.o_lora_rank, layer.wo_a, layer.wo_b = R, wo_a, wo_b
        hns = {}
        exec(compile(HELPER, "helper", "exec"), hns)
        helper = hns["_patch_dsv4_bf16_o_proj"]
        import types

        fake_mod = types.ModuleType("vllm.v1.attention.ops.rocm_aiter_mla_sparse")
        fake_mod.rocm_inv_rope_einsum = rocm_inv_rope_einsum
        sys.modules["vllm.v1.attention.ops.rocm_aiter_mla_sparse"] = fake_mod
        for T in [1, 7, 256, 2048]:
            o_pad = torch.randn(T, Hp, D, device=dev).to(torch.bfloat16)
            o = o_pad[:, :H, :]  # the slice the attention layer hands _o_proj
            pos = torch.randint(0, max_pos, (T,), device=dev)
            z = rocm_inv_rope_einsum(layer.rotary_emb, o, pos, rope, G, R, wo_a)
            ref = torch_reference(o, pos, cache, G, nope, rope, W, R)
            up = upstream30_z(o, pos, cache, G, hpg, nope, rope, W, R)
            out = helper(layer, o, pos)
            ref_out = wo_b(ref.to(torch.bfloat16).flatten(1))
            # inverse of the forward rotation gives back the input
            x = torch.randn(T, H, D, device=dev)
            x_rot = forward_rope(x, pos, cache, nope, rope).to(torch.bfloat16)
            eye = torch.eye(K, device=dev).to(torch.bfloat16).repeat(G, 1)  # W[g] = I
            back = rocm_inv_rope_einsum(layer.rotary_emb, x_rot, pos, rope, G, K, _w(eye))
            r = {
                "z_vs_torch": rel(z, ref),
                "z_vs_upstream030": rel(z, up),
                "helper_vs_torch_out": rel(out, ref_out),
                "inverse_roundtrip": rel(back.reshape(T, H, D), x),
            }
            print(f"H={H} G={G} Hpad={Hp} T={T}: " + ", ".join(f"{k}={v:.2e}" for k, v in r.items()))
            for k, v in r.items():
                worst[k] = max(worst.get(k, 0.0), v)
        # timing, T=2048
        T = 2048
        o = torch.randn(T, Hp, D, device=dev).to(torch.bfloat16)[:, :H, :]
        pos = torch.randint(0, max_pos, (T,), device=dev)
        # functools.partial binds this iteration's layer, weights and inputs now (a lambda would look them up later).
        ms = triton.testing.do_bench(
            functools.partial(rocm_inv_rope_einsum, layer.rotary_emb, o, pos, rope, G, R, wo_a)
        )
        ms30 = triton.testing.do_bench(functools.partial(upstream30_z, o, pos, cache, G, hpg, nope, rope, W, R))
        print(f"  T=2048 time: rocm_inv_rope_einsum {ms * 1e3:.1f} us, 0.30 upstream bf16 path {ms30 * 1e3:.1f} us")
    print("WORST", worst)


def _w(weight):
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(weight, requires_grad=False)
    return m


if __name__ == "__main__":
    main()
