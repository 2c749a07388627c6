"""The patched code itself, run in real, fully installed vLLM 0.30.0 and 0.28.0 venvs (CPU only).

Per release, two fresh processes of the venv: one on the tree as this checkout's
``patch-dsv4 apply --python <venv python>`` left it, one after the venv's own
``patch-dsv4 revert``. Each process runs several parts (imports, then the code
under test); every test below asserts on one part.

What runs for real and what is faked:

- Imports (both releases): nothing faked; every patched module and the modules
  around it are imported by the venv's interpreter.
- Stream load (0.30.0): the real ``DeepseekV4ForConditionalGeneration.load_weights``
  (patched or not) with the real ``AutoWeightsLoader``, the real vision tower
  (``DeepseekV4ViT``) and aligner built at tiny size (one-process gloo group,
  ``initialize_model_parallel(1, 1)``, inside ``set_current_vllm_config``), and the
  real weight mapper (``_make_deepseek_v4_vl_weights_mapper`` over
  ``DeepseekV4ForCausalLM.hf_to_vllm_mapper``). Faked: the class's ``__init__`` is
  not run (it builds the NVIDIA language model, which needs CUDA); the instance is
  made with ``object.__new__`` and given the attributes ``load_weights`` reads, and
  its language model is a recorder (an ``nn.Module`` with
  ``finalizes_weights_during_load = True`` whose ``load_weights`` consumes the
  iterator and records names).
- Loader skips (0.28.0): the real ``DeepseekV4ForCausalLM.load_weights`` and
  ``DeepseekV4Model.load_weights`` (patched or not), the real ``AutoWeightsLoader``,
  ``hf_to_vllm_mapper`` and ``get_expert_mapping``, over a module tree whose
  parameter names are the model's own. Real: ``DeepseekV4DecoderLayer.__init__``
  and ``DeepseekV4MoE.__init__`` (``GateLinear``, ``tid2eid`` on hash layers,
  ``e_score_correction_bias`` on the others, the ``DeepseekV4MLP`` shared experts),
  ``VocabParallelEmbedding``, ``RMSNorm``, ``ParallelLMHead``. Faked:
  (1) the attention (``_select_dsv4_attn_cls`` returns ``TinyAttention``: the
  weights of ``DeepseekV4Attention.__init__`` built with the same layer classes,
  names and shapes, without its kernels, backend and KV-cache registration, which
  need CUDA; no compressor or indexer: every layer has compress ratio 1);
  (2) the routed experts (``FusedMoEFactory`` returns ``TinyFusedMoE``: the
  ``experts.routed_experts.w13_weight`` / ``w2_weight`` parameters of vLLM's
  ``RoutedExperts`` and a weight loader with its contract; the real factory picks
  a kernel backend at construction and vLLM 0.28 has none without a GPU:
  ``UnboundLocalError`` in ``select_unquantized_moe_backend``);
  (3) ``DeepseekV4Model`` and ``DeepseekV4ForCausalLM`` are made with
  ``object.__new__`` (their ``__init__`` creates CUDA streams and a device scratch
  pool) and given what ``load_weights`` reads: the tiny config, ``quant_config=None``,
  the real child modules above and the ``hc_head_*`` parameters as ``__init__``
  shapes them; (4) the ``vllm_config`` handed to the layers is a namespace holding
  the tiny HF config, ``quant_config=None`` and the real kernel, parallel and cache
  configs of ``VllmConfig(device_config=DeviceConfig(device="cpu"))``. The model is
  unquantized, so the checkpoint carries no ``.scale`` tensors.
- Wide SWA (0.30.0): nothing faked; the binder runs against the installed
  FlashInfer, the predicate on CPU tensors of the shapes a prefill call passes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from tests.integration.conftest import Parts, RealVenv

pytestmark = pytest.mark.real_vllm

DSV4 = "vllm.models.deepseek_v4"
MODULES = {
    "0.30.0": [
        f"{DSV4}.common.vl_model",
        f"{DSV4}.nvidia.flashinfer_sparse",
        f"{DSV4}.nvidia.model",
        f"{DSV4}.nvidia.dspark",
        f"{DSV4}.nvidia.flashmla",
        f"{DSV4}.nvidia.ops.o_proj",
    ],
    "0.28.0": [
        f"{DSV4}.nvidia.flashinfer_sparse",
        f"{DSV4}.nvidia.flashmla",
        f"{DSV4}.nvidia.model",
        f"{DSV4}.nvidia.dspark",
    ],
}
# What the patches this release needs must have injected, at least (apply's report gives the rest).
MUST_INJECT = {
    "0.30.0": {
        f"{DSV4}.common.vl_model": {"_patch_dsv4_stream_language_model_first"},
        f"{DSV4}.nvidia.flashinfer_sparse": {
            "_patch_dsv4_wide_swa_takes_sliced_path",
            "_patch_dsv4_wide_swa_flashinfer_api",
            "_patch_dsv4_wide_swa_merge",
            "_patch_dsv4_wide_swa_sliced_prefill",
        },
    },
    "0.28.0": {
        f"{DSV4}.nvidia.model": {"_patch_dsv4_vision_tower_prefixes", "_patch_dsv4_gate_bias_without_home"},
        f"{DSV4}.nvidia.dspark": {"_patch_dsv4_gate_bias_without_home"},
    },
}
NEEDED = {"0.30.0": {"stream-load", "wide-swa"}, "0.28.0": {"dtype-policy", "loader-skips"}}

# -- parts run in the venv's process (PARAMS and @part come from the runner's prelude) ----------------------
IMPORTS = """
@part("imports")
def _():
    import ast, importlib, time
    found = {}
    for name in PARAMS["modules"]:
        started = time.perf_counter()
        module = importlib.import_module(name)
        with open(module.__file__, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        found[name] = {
            "file": module.__file__,
            "seconds": round(time.perf_counter() - started, 2),
            "injected": sorted(n for n in vars(module) if n.startswith("_patch_dsv4_")),
            "defined_in_source": sorted(
                n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_patch_dsv4_")
            ),
        }
    return found
"""

VISION_LOAD = """
@part("vision_load")
def _():
    import inspect, socket, types, weakref
    import torch
    from torch import nn
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models import utils as model_utils
    from vllm.models.deepseek_v4.common import vl_model
    from vllm.models.deepseek_v4.common.vision import DeepseekV4Aligner, DeepseekV4ViT
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4ForCausalLM

    seen = {"produced": 0, "peak": 0}
    live = {}  # id -> weakref of the language-side checkpoint tensors still alive

    def observe():
        seen["peak"] = max(seen["peak"], len(live))

    def track(tensor):
        key = id(tensor)
        live[key] = weakref.ref(tensor, lambda _ref, key=key: live.pop(key, None))

    class RecordingLM(nn.Module):
        finalizes_weights_during_load = True

        def __init__(self):
            super().__init__()
            self.calls, self.names = [], []

        def load_weights(self, weights):
            caller = inspect.stack()[1]
            where = [caller.filename.rsplit("/vllm/", 1)[-1], caller.function]
            self.calls.append({"produced": seen["produced"], "caller": where})
            for name, tensor in weights:
                self.names.append(name)
                observe()
                del tensor
            return set(self.names)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = types.SimpleNamespace(vision_patch_size=2, vision_dim=16, vision_n_heads=2, vision_inter_dim=32,
                                vision_n_layers=2, vision_rope_theta=10000.0, vision_downsample_ratio=2, hidden_size=8)
    torch.manual_seed(0)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)
        model = object.__new__(vl_model.DeepseekV4ForConditionalGeneration)
        nn.Module.__init__(model)
        model.vision = DeepseekV4ViT(cfg)
        model.aligner = DeepseekV4Aligner(cfg)
        for name in ("image_start", "image_end", "image_newline", "image_pad"):
            setattr(model, name, nn.Parameter(torch.zeros(cfg.hidden_size)))
        model.language_model = RecordingLM()
        model.hf_to_vllm_mapper = vl_model._make_deepseek_v4_vl_weights_mapper(
            DeepseekV4ForCausalLM.hf_to_vllm_mapper, True)
        tower = {n: torch.randn(p.shape).to(p.dtype) for n, p in model.named_parameters()}
        language = ["embed.weight"]
        for i in range(4):
            language += [f"layers.{i}.attn.wq_a.weight", f"layers.{i}.attn.wq_a.scale", f"layers.{i}.ffn.gate.bias",
                         f"layers.{i}.ffn.gate.bias_vl", f"layers.{i}.ffn.experts.0.w1.scale",
                         f"layers.{i}.ffn.shared_experts.w2.weight"]
        language += ["norm.weight", "hc_head_fn", "head.weight"]
        mtp = ["mtp.0.attn.wq_a.weight", "mtp.0.ffn.gate.bias"]
        half = len(language) // 2
        order = language[:half] + list(tower) + mtp + language[half:]  # the tower mid-stream, as a shard order puts it

        def checkpoint():
            for name in order:
                tensor = tower[name].clone() if name in tower else torch.randn(64)
                seen["produced"] += 1
                if name in language:
                    track(tensor)
                observe()
                yield name, tensor
                del tensor

        loaded = model.load_weights(checkpoint())
        source = inspect.getsource(vl_model.DeepseekV4ForConditionalGeneration.load_weights)
        return {
            "checkpoint": len(order),
            "language": len(language),
            "calls": model.language_model.calls,
            "peak_language_alive": seen["peak"],
            "tower_params": len(tower),
            "tower_loaded": sorted(n for n, p in model.named_parameters() if torch.equal(p.detach(), tower[n])),
            "lm_names": model.language_model.names,
            "returned": sorted(loaded),
            "real_loader": vl_model.AutoWeightsLoader is model_utils.AutoWeightsLoader,
            "finalized": model._weights_finalized,
            "streams": "_patch_dsv4_stream_language_model_first" in source,
        }
"""

WIDE_SWA = """
@part("wide_swa")
def _():
    import torch, flashinfer
    from vllm.models.deepseek_v4.nvidia import flashinfer_sparse as fs
    run, segment = fs._patch_dsv4_wide_swa_flashinfer_api()
    takes = fs._patch_dsv4_wide_swa_takes_sliced_path

    def call(tokens, width, compressed):
        query = torch.zeros(tokens, 4, 8)
        rows = torch.zeros(tokens, width, dtype=torch.int32)
        extra = torch.zeros(tokens, 128, dtype=torch.int32) if compressed else None
        return takes(query, rows, extra)

    return {
        "flashinfer": flashinfer.__version__,
        "run": f"{run.__module__}.{run.__qualname__}",
        "segment": f"{segment.__module__}.{segment.__qualname__}",
        "65 tokens, 512 wide, compressed": call(65, 512, True),
        "128 wide": call(65, 128, True),
        "no compressed segment": call(65, 512, False),
        "64 tokens": call(64, 512, True),
    }
"""

LOADER_SKIPS = '''
@part("loader_skips")
def _():
    import socket, types
    import torch
    from torch import nn
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.models.deepseek_v4.nvidia import model as M

    C = types.SimpleNamespace(
        hidden_size=16, rms_norm_eps=1e-6, hc_mult=2, hc_sinkhorn_iters=1, hc_eps=1e-6, vocab_size=32,
        num_hidden_layers=3, num_hash_layers=1, compress_ratios=[0, 0, 0],
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, n_shared_experts=1, swiglu_limit=10.0,
        norm_topk_prob=True, scoring_func="sqrtsoftplus", topk_method="noaux_tc", hidden_act="silu",
        routed_scaling_factor=1.0, num_attention_heads=2, q_lora_rank=8, head_dim=8, o_groups=1, o_lora_rank=8,
    )
    H = C.hidden_size

    class TinyAttention(nn.Module):
        """DeepseekV4Attention.__init__'s weights: the same layers, names and shapes (its kernels need CUDA)."""

        def __init__(self, vllm_config, prefix, **_):
            super().__init__()
            c = vllm_config.model_config.hf_config
            heads = c.num_attention_heads
            self.attn_sink = nn.Parameter(torch.full((heads,), -float("inf")), requires_grad=False)
            self.fused_wqa_wkv = MergedColumnParallelLinear(c.hidden_size, [c.q_lora_rank, c.head_dim], bias=False,
                                                            quant_config=None, prefix=f"{prefix}.fused_wqa_wkv",
                                                            disable_tp=True)
            self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.wq_b = ColumnParallelLinear(c.q_lora_rank, heads * c.head_dim, bias=False, quant_config=None,
                                             return_bias=False, prefix=f"{prefix}.wq_b")
            self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.wo_a = ColumnParallelLinear(heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank, bias=False,
                                             quant_config=None, return_bias=False, prefix=f"{prefix}.wo_a")
            self.wo_b = RowParallelLinear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False, quant_config=None,
                                          return_bias=False, prefix=f"{prefix}.wo_b")

    class TinyRoutedExperts(nn.Module):
        """RoutedExperts' w13_weight / w2_weight and its weight_loader contract."""

        def __init__(self, num_experts, hidden_size, intermediate_size):
            super().__init__()
            self.inter = intermediate_size
            self.w13_weight = nn.Parameter(
                torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
            )
            self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
            for p in (self.w13_weight, self.w2_weight):
                p.weight_loader = self.weight_loader

        def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            if shard_id == "w2":
                param.data[expert_id].copy_(loaded_weight)
            else:
                rows = slice(0, self.inter) if shard_id == "w1" else slice(self.inter, 2 * self.inter)
                param.data[expert_id, rows].copy_(loaded_weight)
            return True if return_success else None

    class TinyFusedMoE(nn.Module):
        def __init__(self, *, num_experts, hidden_size, intermediate_size, **_):
            super().__init__()
            self.routed_experts = TinyRoutedExperts(num_experts, hidden_size, intermediate_size)

    def build(vc):
        layer_config = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=C), quant_config=None,
                                             kernel_config=vc.kernel_config, parallel_config=vc.parallel_config,
                                             cache_config=vc.cache_config)
        saved = M._select_dsv4_attn_cls, M.FusedMoEFactory
        M._select_dsv4_attn_cls, M.FusedMoEFactory = (lambda _config: TinyAttention), TinyFusedMoE
        try:
            layers = nn.ModuleList(
                [M.DeepseekV4DecoderLayer(layer_config, prefix=f"model.layers.{i}") for i in range(C.num_hidden_layers)]
            )
        finally:
            M._select_dsv4_attn_cls, M.FusedMoEFactory = saved
        model = object.__new__(M.DeepseekV4Model)
        nn.Module.__init__(model)
        model.config, model.quant_config, model.use_sequence_parallel = C, None, False
        model.hc_mult, model.hc_dim = C.hc_mult, C.hc_mult * H
        model.embed_tokens = VocabParallelEmbedding(C.vocab_size, H, prefix="model.embed_tokens")
        model.start_layer, model.end_layer, model.layers = 0, C.num_hidden_layers, layers
        model.norm = RMSNorm(H, C.rms_norm_eps)
        model.hc_head_fn = nn.Parameter(torch.empty(model.hc_mult, model.hc_dim), requires_grad=False)
        model.hc_head_base = nn.Parameter(torch.empty(model.hc_mult), requires_grad=False)
        model.hc_head_scale = nn.Parameter(torch.empty(1), requires_grad=False)
        lm = object.__new__(M.DeepseekV4ForCausalLM)
        nn.Module.__init__(lm)
        lm.config, lm.model = C, model
        lm.lm_head = ParallelLMHead(C.vocab_size, H, prefix="lm_head")
        return lm

    def shapes():
        mix, hc = (2 + C.hc_mult) * C.hc_mult, C.hc_mult * H
        heads, inter = C.num_attention_heads, C.moe_intermediate_size
        out = {"embed.weight": (C.vocab_size, H), "norm.weight": (H,), "head.weight": (C.vocab_size, H),
               "hc_head_fn": (C.hc_mult, hc), "hc_head_base": (C.hc_mult,), "hc_head_scale": (1,)}
        for n in range(C.num_hidden_layers):
            p = f"layers.{n}."
            out.update({
                p + "attn.attn_sink": (heads,), p + "attn.wq_a.weight": (C.q_lora_rank, H),
                p + "attn.wkv.weight": (C.head_dim, H), p + "attn.q_norm.weight": (C.q_lora_rank,),
                p + "attn.kv_norm.weight": (C.head_dim,), p + "attn.wq_b.weight": (heads * C.head_dim, C.q_lora_rank),
                p + "attn.wo_a.weight": (C.o_groups * C.o_lora_rank, heads * C.head_dim // C.o_groups),
                p + "attn.wo_b.weight": (H, C.o_groups * C.o_lora_rank),
                p + "attn_norm.weight": (H,), p + "ffn_norm.weight": (H,),
                p + "hc_attn_fn": (mix, hc), p + "hc_ffn_fn": (mix, hc), p + "hc_attn_base": (mix,),
                p + "hc_ffn_base": (mix,), p + "hc_attn_scale": (3,), p + "hc_ffn_scale": (3,),
                p + "ffn.gate.weight": (C.n_routed_experts, H),
                p + "ffn.gate.bias": (C.n_routed_experts,),
                p + "ffn.gate.bias_vl": (C.n_routed_experts,),
                p + "ffn.shared_experts.w1.weight": (inter, H), p + "ffn.shared_experts.w3.weight": (inter, H),
                p + "ffn.shared_experts.w2.weight": (H, inter),
            })
            if n < C.num_hash_layers:
                out[p + "ffn.gate.tid2eid"] = (C.vocab_size, C.num_experts_per_tok)
            for e in range(C.n_routed_experts):
                out.update({p + f"ffn.experts.{e}.w1.weight": (inter, H), p + f"ffn.experts.{e}.w3.weight": (inter, H),
                            p + f"ffn.experts.{e}.w2.weight": (H, inter)})
        out.update({"mtp.0.attn.wq_a.weight": (C.q_lora_rank, H), "mtp.0.ffn.gate.bias_vl": (C.n_routed_experts,),
                    "vision.patch_embed.proj.weight": (8, 12), "vision.blocks.0.attn.wqkv.weight": (24, 8),
                    "aligner.w1.weight": (H, 32), "image_newline": (H,), "image_start": (H,)})
        return out

    SHAPES = shapes()
    SENTINEL = -7

    def load(vc, names):
        """Each tensor filled with its own id: after the load, the ids found in no parameter are the dropped tensors."""
        lm = build(vc)
        ids = {name: i + 1 for i, name in enumerate(names)}

        def tensors():
            for name in names:
                dtype = torch.int32 if name.endswith("tid2eid") else torch.float32
                yield name, torch.full(SHAPES[name], ids[name], dtype=dtype)

        for p in lm.parameters():
            p.data.fill_(SENTINEL)
        try:
            returned = lm.load_weights(tensors())
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        present = set()
        for p in lm.parameters():
            present |= {int(v) for v in torch.unique(p.data.float()).tolist()}
        return {
            "error": None,
            "params": sorted(n for n, _ in lm.named_parameters()),
            "returned": sorted(returned),
            "never_filled": sorted(n for n, p in lm.named_parameters() if (p.data == SENTINEL).any()),
            "dropped": sorted(n for n, i in ids.items() if i not in present),
        }

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    vc = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)
        pack = list(SHAPES)
        tower = [n for n in pack if n.startswith(("vision.", "aligner.", "image_"))]
        bias_vl = [n for n in pack if n.startswith("layers.") and n.endswith(".ffn.gate.bias_vl")]
        hash_bias = [f"layers.{n}.ffn.gate.bias" for n in range(C.num_hash_layers)]
        text = [n for n in pack if n not in {*tower, *bias_vl, *hash_bias}]
        return {
            "checkpoint": pack,
            "tower": tower, "bias_vl": bias_vl, "hash_bias": hash_bias,
            "runs": {
                "pack": load(vc, pack),
                "text": load(vc, text),
                "text+tower": load(vc, text + tower),
                "text+bias_vl": load(vc, text + bias_vl),
                "text+hash_bias": load(vc, text + hash_bias),
            },
        }
'''


@dataclass
class Probe:
    venv: RealVenv
    apply: dict
    revert: dict
    applied: Parts
    reverted: Parts


def _injected_by_module(apply_report: dict) -> dict[str, set[str]]:
    """The helpers apply's applied patches inject, by module (from this checkout's patch definitions)."""
    from patch_dsv4.patching.registry import discover_patches

    applied = {p["id"] for p in apply_report["patches"] if p["verdict"] == "applied"}
    found: dict[str, set[str]] = {}
    for patch in discover_patches():
        if patch.id in applied:
            for edit in patch.edits:
                module = edit.file.removesuffix(".py").replace("/", ".")
                found.setdefault(module, set()).update(h.__name__ for h in getattr(edit, "helpers", ()))
    return found


def _probe(venv: RealVenv, parts_applied: list[str], parts_reverted: list[str]) -> Probe:
    venv.ensure_pristine()
    apply = venv.cli("apply")  # this checkout's CLI, --python <venv python>
    assert apply["exit_code"] == 0, apply
    params = {"modules": MODULES[venv.version]}
    try:
        applied = venv.run_parts(parts_applied, params=params)
    finally:
        # the venv's own installed CLI, on its own interpreter's environment
        done = venv.run([venv.bin("patch-dsv4"), "revert", "--json"], merge=False)
    revert = json.loads(done.output)
    assert done.rc == 0 and venv.dsv4_differences() == [] and not venv.state_dir.exists(), done.output
    reverted = venv.run_parts(parts_reverted, params=params)
    return Probe(venv, apply, revert, applied, reverted)


@pytest.fixture(scope="module")
def v030(venv030) -> Probe:
    return _probe(venv030, [IMPORTS, WIDE_SWA, VISION_LOAD], [IMPORTS, VISION_LOAD])


@pytest.fixture(scope="module")
def v028(venv028) -> Probe:
    return _probe(venv028, [IMPORTS, LOADER_SKIPS], [IMPORTS, LOADER_SKIPS])


@pytest.fixture(params=["0.30.0", "0.28.0"])
def probe(request) -> Probe:
    return request.getfixturevalue({"0.30.0": "v030", "0.28.0": "v028"}[request.param])


# -- 1. imports ------------------------------------------------------------------------------------------
def test_apply_patches_what_the_release_needs_and_revert_restores_it(probe):
    verdicts = {p["id"]: p["verdict"] for p in probe.apply["patches"]}
    assert {pid for pid, v in verdicts.items() if v == "applied"} == NEEDED[probe.venv.version], verdicts
    assert probe.apply["changed_files"], probe.apply
    assert sorted(probe.revert["changed_files"]) == sorted(probe.apply["changed_files"])
    assert probe.revert["state"] == "none"


def test_every_patched_module_imports_with_its_injected_names(probe):
    imports = probe.applied["imports"]
    assert sorted(imports) == sorted(MODULES[probe.venv.version])
    expected = _injected_by_module(probe.apply)
    for module, needed in MUST_INJECT[probe.venv.version].items():
        assert needed <= expected.get(module, set()), (module, expected)
    for module, info in imports.items():
        assert info["file"].startswith(str(probe.venv.site)), info["file"]
        assert set(info["injected"]) == expected.get(module, set()) == set(info["defined_in_source"]), (module, info)


def test_the_reverted_modules_import_without_injected_names(probe):
    imports = probe.reverted["imports"]
    assert sorted(imports) == sorted(MODULES[probe.venv.version])
    for module, info in imports.items():
        assert info["injected"] == [] and info["defined_in_source"] == [], (module, info)


# -- 3. stream load (0.30.0) -------------------------------------------------------------------------------
def _check_vision_load(result: dict):
    assert result["real_loader"] and result["finalized"]
    assert len(result["calls"]) == 1, result["calls"]  # one contiguous delegation, as the child needs
    (call,) = result["calls"]
    assert call["caller"] == ["model_executor/models/utils.py", "_load_module"], call  # AutoWeightsLoader delegated
    assert result["tower_loaded"] and len(result["tower_loaded"]) == result["tower_params"]
    assert len(result["lm_names"]) == result["language"]  # mtp.* dropped by the mapper, nothing else
    assert "model.embed_tokens.weight" in result["lm_names"]
    assert "model.layers.0.attn.wq_a.weight_scale_inv" in result["lm_names"]
    assert "model.layers.0.ffn.gate.e_score_correction_bias" in result["lm_names"]
    assert not any("mtp" in n for n in result["returned"])
    assert {f"language_model.{n}" for n in result["lm_names"]} | set(result["tower_loaded"]) == set(result["returned"])


def test_patched_vision_class_streams_the_language_model_through_the_real_loader(v030):
    result = v030.applied["vision_load"]
    assert result["streams"]
    _check_vision_load(result)
    (call,) = result["calls"]
    assert call["produced"] < result["checkpoint"], call  # delegated before the last tensor was produced
    assert result["peak_language_alive"] <= 2, result["peak_language_alive"]


def test_unpatched_vision_class_holds_every_language_tensor(v030):
    result = v030.reverted["vision_load"]
    assert not result["streams"]
    _check_vision_load(result)
    (call,) = result["calls"]
    assert call["produced"] == result["checkpoint"]
    assert result["peak_language_alive"] == result["language"]


# -- 4. loader skips (0.28.0) ------------------------------------------------------------------------------
def test_patched_text_class_loads_a_vision_pack_and_drops_only_what_has_no_parameter(v028):
    result = v028.applied["loader_skips"]
    pack = result["runs"]["pack"]
    assert pack["error"] is None, pack["error"]
    params = set(pack["params"])
    assert set(pack["returned"]) == params and pack["never_filled"] == []  # every parameter got its tensor
    homeless = {*result["tower"], *result["bias_vl"], *result["hash_bias"]}
    mtp = {n for n in result["checkpoint"] if n.startswith("mtp.")}  # skipped by upstream's skip_substrs
    assert set(pack["dropped"]) == homeless | mtp
    # ... and none of the dropped ones has a parameter here
    assert not any("bias_vl" in p or p.startswith(("vision.", "aligner.", "image_")) for p in params)
    assert "model.layers.0.ffn.gate.e_score_correction_bias" not in params  # hash layer
    assert "model.layers.1.ffn.gate.e_score_correction_bias" in params  # a non-hash layer keeps its bias
    for label in ("text", "text+tower", "text+bias_vl", "text+hash_bias"):
        assert result["runs"][label]["error"] is None, (label, result["runs"][label])
        assert result["runs"][label]["never_filled"] == []


def test_unpatched_text_class_fails_on_a_vision_pack(v028):
    runs = v028.reverted["loader_skips"]["runs"]
    text = runs["text"]
    assert text["error"] is None and text["never_filled"] == []  # a text checkpoint loads: the pack's tensors fail
    assert "ValueError: There is no module or parameter named 'vision'" in runs["text+tower"]["error"]
    assert runs["text+bias_vl"]["error"] == "KeyError: 'layers.0.ffn.gate.bias_vl'"
    assert runs["text+hash_bias"]["error"] == "KeyError: 'layers.0.ffn.gate.e_score_correction_bias'"
    assert runs["pack"]["error"] is not None


# -- 5. wide SWA (0.30.0, FlashInfer 0.6.18.post1) ----------------------------------------------------------
def test_wide_swa_binds_the_installed_flashinfer_and_picks_the_sliced_path(v030):
    r = v030.applied["wide_swa"]
    assert r["flashinfer"] == "0.6.18.post1"
    assert r["run"] == "flashinfer.mla._core._trtllm_batch_decode_sparse_mla_sm120", r
    assert r["segment"] == "flashinfer.mla._core._SparseMLASegment", r
    assert r["65 tokens, 512 wide, compressed"] is True
    assert r["128 wide"] is False and r["no compressed segment"] is False and r["64 tokens"] is False
