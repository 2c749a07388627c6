"""dtype-policy: the patched code run on CPU torch (skipped alone without torch)."""

from __future__ import annotations

import ast
import sys
import types

import pytest

from patch_dsv4.patches import dtype_policy
from patch_dsv4.patches.dtype_policy import ATTENTION_CLASSES
from tests.injected import load_method
from tests.records import releases_needing

torch = pytest.importorskip("torch")
NEEDED = releases_needing("dtype-policy")
BF16_KERNEL_MODULE = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"


class Recorder:
    """A stand-in for a GPU-only vLLM function: records its calls, returns ``result(*args)``."""

    def __init__(self, result):
        self.calls = []
        self.result = result

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result(*args, **kwargs)


class FakeLinear(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return x.float() @ self.weight.float().t()


T, HEADS, GROUPS, HEAD_DIM, ROPE, RANK, HIDDEN = 3, 8, 2, 16, 4, 6, 5


def _layer(wo_a_dtype):
    layer = types.SimpleNamespace()
    layer.rotary_emb = types.SimpleNamespace(cos_sin_cache=torch.randn(32, ROPE))
    layer.n_local_heads, layer.n_local_groups = HEADS, GROUPS
    layer.nope_head_dim, layer.rope_head_dim = HEAD_DIM - ROPE, ROPE
    layer.o_lora_rank = RANK
    layer._einsum_recipe, layer._tma_aligned_scales = (1, 128, 128), False
    wo_a = torch.randn(GROUPS * RANK, HEADS * HEAD_DIM // GROUPS).to(wo_a_dtype)
    layer.wo_a = FakeLinear(wo_a)
    layer.wo_b = FakeLinear(torch.randn(HIDDEN, GROUPS * RANK))
    return layer


@pytest.fixture(scope="module", params=NEEDED)
def patched_tree(request, tmp_path_factory):
    from tests.conftest import run_cli
    from tests.releases import copy_tree, pristine_tree

    tree = copy_tree(pristine_tree(request.param), tmp_path_factory.mktemp("dtype") / "sp")
    assert run_cli("apply", "--site-packages", tree, "--only", "dtype-policy").code == 0
    return tree


@pytest.fixture
def fakes(monkeypatch):
    """The BF16 kernel (Triton, GPU only) and the FP8 deep-GEMM op, both replaced by recorders."""
    z = torch.randn(T, GROUPS, RANK)
    bf16 = Recorder(lambda *args: z)
    fp8 = Recorder(lambda *args, **kwargs: "fp8 result")
    kernel_module = types.ModuleType(BF16_KERNEL_MODULE)
    kernel_module.rocm_inv_rope_einsum = bf16
    monkeypatch.setitem(sys.modules, BF16_KERNEL_MODULE, kernel_module)
    return types.SimpleNamespace(bf16=bf16, fp8=fp8, z=z)


def _o_proj(tree, file, cls, fakes):
    """The patched ``_o_proj`` as the patched file has it, with our helper from the patch module."""
    helper = dtype_policy._patch_dsv4_bf16_o_proj
    return load_method(
        tree / file, cls, "_o_proj", {"torch": torch, "deep_gemm_fp8_o_proj": fakes.fp8, helper.__name__: helper}
    )


@pytest.mark.parametrize("what,file,cls", ATTENTION_CLASSES, ids=[c[2] for c in ATTENTION_CLASSES])
def test_bf16_wo_a_takes_the_bf16_path(patched_tree, what, file, cls, fakes):
    o_proj = _o_proj(patched_tree, file, cls, fakes)
    layer = _layer(torch.bfloat16)
    o, positions = torch.randn(T, HEADS, HEAD_DIM).to(torch.bfloat16), torch.arange(T)

    out = o_proj(layer, o, positions)

    assert fakes.fp8.calls == []
    ((args, kwargs),) = fakes.bf16.calls
    assert kwargs == {}
    expected = (layer.rotary_emb, o, positions, ROPE, GROUPS, RANK, layer.wo_a)
    assert len(args) == len(expected) and all(a is e for a, e in zip(args, expected, strict=True)), args
    torch.testing.assert_close(out, layer.wo_b(fakes.z.flatten(1)))


@pytest.mark.parametrize("what,file,cls", ATTENTION_CLASSES, ids=[c[2] for c in ATTENTION_CLASSES])
def test_fp8_wo_a_keeps_the_original_call(patched_tree, what, file, cls, fakes):
    o_proj = _o_proj(patched_tree, file, cls, fakes)
    layer = _layer(torch.float8_e4m3fn)
    o, positions = torch.randn(T, HEADS, HEAD_DIM).to(torch.bfloat16), torch.arange(T)

    assert o_proj(layer, o, positions) == "fp8 result"

    assert fakes.bf16.calls == []
    ((args, kwargs),) = fakes.fp8.calls
    expected = (o, positions, layer.rotary_emb.cos_sin_cache, layer.wo_a, layer.wo_b)
    assert len(args) == len(expected) and all(a is e for a, e in zip(args, expected, strict=True)), args
    assert kwargs == {
        "n_groups": GROUPS,
        "heads_per_group": HEADS // GROUPS,
        "nope_dim": HEAD_DIM - ROPE,
        "rope_dim": ROPE,
        "o_lora_rank": RANK,
        "einsum_recipe": (1, 128, 128),
        "tma_aligned_scales": False,
    }


def test_bf16_kernel_signature_matches_the_release(patched_tree):
    """The helper calls rocm_inv_rope_einsum with 7 positional arguments: the release's own."""
    source = (patched_tree / (BF16_KERNEL_MODULE.replace(".", "/") + ".py")).read_text()
    (func,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "rocm_inv_rope_einsum"]
    required = [a.arg for a in func.args.args[: len(func.args.args) - len(func.args.defaults)]]
    assert required == ["rotary_emb", "o", "positions", "rope_head_dim", "n_local_groups", "o_lora_rank", "wo_a"]
