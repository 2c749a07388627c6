"""Synthetic DeepSeek-V4-Flash(-Vision) EXL3 packs for doctor's tests (DOCTOR-FACTS.md A.5).

Shards carry the real tensor names, dtypes and shapes but no payload: each file
is its header, then a sparse ``truncate()`` to the size the header promises, so
a 95 GB pack costs a few MB of disk. Only marker tensors get real bytes.

Two layouts:
- :func:`build_mixedk_pack`: vcruz305's MixedK vision pack (48 numbered shards,
  no index, BF16 dense weights, source-format MTP experts in shards 46-48, the
  config the recipe's fixer writes).
- :func:`build_lna_dense_pack`: lna-lab's Dense bake of it (dense linears EXL3,
  ``wo_a`` as 8 slices, ``model-dense-exl3.safetensors``, the MTP EXL3 overlay
  ``model-mtp-exl3.safetensors``, an index listing every shard).

``FULL`` is the real geometry, ``SMALL`` a shrunken one (hidden 64, moe
intermediate 32, 4 experts, 4 layers) for fast tests, ``SMALL_TP8`` the same
with an intermediate size that 8 ranks can split. Both builders take
mutation hooks: ``edit_config(config)`` and ``edit_tensors(shards)`` change the
dicts in place before anything is written.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from math import prod
from pathlib import Path

from patch_dsv4.doctor.readers.base import FAIL, DoctorContext, Row, Runtime, applies, run_checks
from patch_dsv4.doctor.readers.safetensors import DTYPE_SIZES
from patch_dsv4.doctor.run import pack_checks

MCG = -877912083
MUL1 = -2082680531


@dataclass(frozen=True)
class Geometry:
    hidden: int
    moe_intermediate: int
    experts: int
    layers: int
    hash_layers: int
    k3_layers: tuple[int, ...]
    mtp_layers: int
    shards: int
    heads: int
    head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    index_heads: int
    index_head_dim: int
    vocab: int
    vision_layers: int
    vision_dim: int
    base_k: int = 2
    dense_k: int = 6
    hc_mult: int = 4
    markov_rank: int = 256


FULL = Geometry(
    hidden=4096,
    moe_intermediate=2048,
    experts=256,
    layers=43,
    hash_layers=3,
    k3_layers=(3, 13, 21, 22, 28, 41),
    mtp_layers=3,
    shards=48,
    heads=64,
    head_dim=512,
    q_lora_rank=1024,
    o_lora_rank=1024,
    o_groups=8,
    index_heads=64,
    index_head_dim=128,
    vocab=129280,
    vision_layers=24,
    vision_dim=1024,
)
SMALL = Geometry(
    hidden=64,
    moe_intermediate=32,
    experts=4,
    layers=4,
    hash_layers=1,
    k3_layers=(2,),
    mtp_layers=3,
    shards=6,
    heads=8,
    head_dim=16,
    q_lora_rank=32,
    o_lora_rank=16,
    o_groups=8,
    index_heads=4,
    index_head_dim=16,
    vocab=256,
    vision_layers=2,
    vision_dim=32,
)
# lna-lab's Dense pack serves at TP 8 only, and 8 ranks need moe_intermediate / 16 to divide by 8.
SMALL_TP8 = replace(SMALL, moe_intermediate=128)


@dataclass
class Tensor:
    dtype: str
    shape: list[int]
    marker: int | None = None  # int32 written at the tensor's first 4 bytes

    @property
    def nbytes(self) -> int:
        return DTYPE_SIZES[self.dtype] * prod(self.shape)


Shards = dict[str, dict[str, Tensor]]  # file name -> tensor name -> Tensor


def shard_name(number: int, total: int) -> str:
    return f"model-{number:05d}-of-{total:05d}.safetensors"


def compress_ratios(g: Geometry) -> list[int]:
    """Per layer: 0 (window only), 4 (compressor and indexer) or 128 (compressor)."""
    return ([0, 0] + [4, 128] * g.layers)[: g.layers]


def k_of(g: Geometry, layer: int) -> int:
    return 3 if layer in g.k3_layers else g.base_k


# ------------------------------------------------------------------ tensor families


def exl3_linear(prefix: str, in_features: int, out_features: int, k: int, marker: int = MCG) -> dict[str, Tensor]:
    return {
        f"{prefix}.trellis": Tensor("I16", [in_features // 16, out_features // 16, 16 * k]),
        f"{prefix}.suh": Tensor("F16", [in_features]),
        f"{prefix}.svh": Tensor("F16", [out_features]),
        f"{prefix}.mcg": Tensor("I32", [1], marker),
    }


def routed_experts(g: Geometry, prefix: str, k: int) -> dict[str, Tensor]:
    h, i = g.hidden, g.moe_intermediate
    tensors = {}
    for e in range(g.experts):
        for proj, (fan_in, fan_out) in (("w1", (h, i)), ("w2", (i, h)), ("w3", (h, i))):
            tensors.update(exl3_linear(f"{prefix}.ffn.experts.{e}.{proj}", fan_in, fan_out, k))
    return tensors


def source_mtp_experts(g: Geometry, prefix: str) -> dict[str, Tensor]:
    """Packed FP4 (two values per I8) with E8M0 block-32 scales: w1/w3 [I, H/2], w2 [H, I/2]."""
    h, i = g.hidden, g.moe_intermediate
    tensors = {}
    for e in range(g.experts):
        for proj, (out_f, in_f) in (("w1", (i, h)), ("w2", (h, i)), ("w3", (i, h))):
            tensors[f"{prefix}.ffn.experts.{e}.{proj}.weight"] = Tensor("I8", [out_f, in_f // 2])
            tensors[f"{prefix}.ffn.experts.{e}.{proj}.scale"] = Tensor("F8_E8M0", [out_f, in_f // 32])
    return tensors


def dense_linears(g: Geometry, ratio: int) -> dict[str, tuple[int, int]]:
    """The dense linears of one block as ``suffix -> (out_features, in_features)``."""
    h, heads_dim = g.hidden, g.heads * g.head_dim
    linears = {
        "attn.wq_a": (g.q_lora_rank, h),
        "attn.wq_b": (heads_dim, g.q_lora_rank),
        "attn.wkv": (g.head_dim, h),
        "attn.wo_a": (g.o_groups * g.o_lora_rank, heads_dim // g.o_groups),
        "attn.wo_b": (h, g.o_groups * g.o_lora_rank),
        "ffn.shared_experts.w1": (g.moe_intermediate, h),
        "ffn.shared_experts.w2": (h, g.moe_intermediate),
        "ffn.shared_experts.w3": (g.moe_intermediate, h),
    }
    if ratio:
        width = (2 if ratio == 4 else 1) * g.head_dim
        linears.update({"attn.compressor.wkv": (width, h), "attn.compressor.wgate": (width, h)})
    if ratio == 4:
        linears.update(
            {
                "attn.indexer.wq_b": (g.index_heads * g.index_head_dim, g.q_lora_rank),
                "attn.indexer.weights_proj": (g.index_heads, h),
                "attn.indexer.compressor.wkv": (2 * g.index_head_dim, h),
                "attn.indexer.compressor.wgate": (2 * g.index_head_dim, h),
            }
        )
    return linears


def compressor(g: Geometry, prefix: str, ratio: int, head_dim: int) -> dict[str, Tensor]:
    """A compressor's parameters but its two linears: the positional table and the norm (vLLM
    deepseek_v4/compressor.py ``DeepseekCompressor``: ``ape`` [ratio, coff x head_dim])."""
    coff = 2 if ratio == 4 else 1
    return {
        f"{prefix}.ape": Tensor("F32", [ratio, coff * head_dim]),
        f"{prefix}.norm.weight": Tensor("BF16", [head_dim]),
    }


def hc_tensors(g: Geometry, prefix: str) -> dict[str, Tensor]:
    """A block's hyper-connection mixers (vLLM ``DeepseekV4DecoderLayer``: ``hc_{attn,ffn}_{fn,base,scale}``)."""
    mix = (2 + g.hc_mult) * g.hc_mult
    tensors = {}
    for site in ("attn", "ffn"):
        tensors[f"{prefix}.hc_{site}_fn"] = Tensor("F32", [mix, g.hc_mult * g.hidden])
        tensors[f"{prefix}.hc_{site}_base"] = Tensor("F32", [mix])
        tensors[f"{prefix}.hc_{site}_scale"] = Tensor("F32", [3])
    return tensors


def hc_head(g: Geometry, prefix: str = "") -> dict[str, Tensor]:
    """The hyper-connections' final collapse (``hc_head_{fn,base,scale}``: the model's, and a DSpark draft's)."""
    return {
        f"{prefix}hc_head_fn": Tensor("F32", [g.hc_mult, g.hc_mult * g.hidden]),
        f"{prefix}hc_head_base": Tensor("F32", [g.hc_mult]),
        f"{prefix}hc_head_scale": Tensor("F32", [1]),
    }


def block_tensors(g: Geometry, prefix: str, ratio: int, *, hash_layer: bool) -> dict[str, Tensor]:
    """Norms, hyper-connections, BF16 dense linears and the gate of one block (``layers.N`` or ``mtp.N``)."""
    h = g.hidden
    tensors = {
        f"{prefix}.attn_norm.weight": Tensor("BF16", [h]),
        f"{prefix}.ffn_norm.weight": Tensor("BF16", [h]),
        f"{prefix}.attn.q_norm.weight": Tensor("BF16", [g.q_lora_rank]),
        f"{prefix}.attn.kv_norm.weight": Tensor("BF16", [g.head_dim]),
        f"{prefix}.attn.attn_sink": Tensor("F32", [g.heads]),
        f"{prefix}.ffn.gate.weight": Tensor("BF16", [g.experts, h]),
        f"{prefix}.ffn.gate.bias": Tensor("F32", [g.experts]),
        f"{prefix}.ffn.gate.bias_vl": Tensor("F32", [g.experts]),
    }
    if hash_layer:
        tensors[f"{prefix}.ffn.gate.tid2eid"] = Tensor("I32", [g.vocab, 6])
    for suffix, shape in dense_linears(g, ratio).items():
        tensors[f"{prefix}.{suffix}.weight"] = Tensor("BF16", list(shape))
    tensors.update(hc_tensors(g, prefix))
    if ratio > 1:
        tensors.update(compressor(g, f"{prefix}.attn.compressor", ratio, g.head_dim))
    if ratio == 4:
        tensors.update(compressor(g, f"{prefix}.attn.indexer.compressor", ratio, g.index_head_dim))
    return tensors


def vision_tower(dim: int, inter: int, layers: int, hidden: int, tokens: tuple[str, ...]) -> dict[str, Tensor]:
    """DeepSeek's vision tower under the checkpoint's names, which vLLM's keeps (deepseek_v4/common/vision.py,
    0.30.0 on: ``DeepseekV4ViT``, ``DeepseekV4Aligner``; the vision class's image tokens)."""
    tensors = {
        "vision.patch_embed.proj.weight": Tensor("BF16", [dim, 3 * 14 * 14]),
        "vision.patch_embed.proj.bias": Tensor("BF16", [dim]),
        "vision.norm.weight": Tensor("F32", [dim]),
    }
    for b in range(layers):
        p = f"vision.blocks.{b}"
        tensors.update(
            {
                f"{p}.norm1.weight": Tensor("F32", [dim]),
                f"{p}.attn.wqkv.weight": Tensor("BF16", [3 * dim, dim]),
                f"{p}.attn.wqkv.bias": Tensor("BF16", [3 * dim]),
                f"{p}.attn.wo.weight": Tensor("BF16", [dim, dim]),
                f"{p}.attn.wo.bias": Tensor("BF16", [dim]),
                f"{p}.norm2.weight": Tensor("F32", [dim]),
                f"{p}.mlp.w1.weight": Tensor("BF16", [2 * inter, dim]),
                f"{p}.mlp.w2.weight": Tensor("BF16", [dim, inter]),
            }
        )
    tensors.update(
        {
            "aligner.w1.weight": Tensor("BF16", [hidden, 9 * dim]),
            "aligner.w1.bias": Tensor("BF16", [hidden]),
            "aligner.w2.weight": Tensor("BF16", [hidden, hidden]),
            "aligner.w2.bias": Tensor("BF16", [hidden]),
        }
    )
    tensors.update({token: Tensor("BF16", [hidden]) for token in tokens})
    return tensors


def vision_tensors(g: Geometry) -> dict[str, Tensor]:
    return vision_tower(
        g.vision_dim,
        4 * g.vision_dim,
        g.vision_layers,
        g.hidden,
        ("image_start", "image_end", "image_newline", "image_pad"),
    )


def dspark_heads(g: Geometry, stages: int) -> dict[str, Tensor]:
    """A V4 DSpark draft's own heads (vLLM deepseek_v4/nvidia/dspark.py): main_proj and main_norm on stage 0;
    the final norm, hc_head, the Markov and confidence heads on the last stage."""
    h, last = g.hidden, f"mtp.{stages - 1}"
    width = 3 * h  # dspark_target_layer_ids: three target layers
    return {
        "mtp.0.main_proj.weight": Tensor("BF16", [h, width]),
        "mtp.0.main_norm.weight": Tensor("BF16", [h]),
        f"{last}.norm.weight": Tensor("BF16", [h]),
        **hc_head(g, f"{last}."),
        f"{last}.markov_head.markov_w1.weight": Tensor("BF16", [g.vocab, g.markov_rank]),
        f"{last}.markov_head.markov_w2.weight": Tensor("BF16", [g.vocab, g.markov_rank]),
        f"{last}.confidence_head.proj.weight": Tensor("BF16", [1, h + g.markov_rank]),
    }


# ------------------------------------------------------------------ the MixedK pack


def mixedk_shards(g: Geometry) -> Shards:
    main = g.shards - g.mtp_layers
    names = [shard_name(n, g.shards) for n in range(1, g.shards + 1)]
    shards: Shards = {name: {} for name in names}
    ratios = compress_ratios(g)
    # The embeddings and vision tower, each layer, then the head: spread over the main shards in order.
    units = [{"embed.weight": Tensor("BF16", [g.vocab, g.hidden]), **vision_tensors(g)}]
    for layer in range(g.layers):
        units.append(
            {
                **block_tensors(g, f"layers.{layer}", ratios[layer], hash_layer=layer < g.hash_layers),
                **routed_experts(g, f"layers.{layer}", k_of(g, layer)),
            }
        )
    units.append(
        {"norm.weight": Tensor("BF16", [g.hidden]), "head.weight": Tensor("BF16", [g.vocab, g.hidden]), **hc_head(g)}
    )
    for i, unit in enumerate(units):
        shards[names[i * main // len(units)]].update(unit)
    for m in range(g.mtp_layers):
        target = shards[names[main + m]]
        target.update(block_tensors(g, f"mtp.{m}", 0, hash_layer=False))
        target.update(source_mtp_experts(g, f"mtp.{m}"))
    shards[names[-1]].update(dspark_heads(g, g.mtp_layers))
    return shards


def mixedk_config(g: Geometry) -> dict:
    """The model keys of A.3 (real DeepSeek-V4-Flash values) and the block the recipe's fixer writes (A.1)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "hidden_size": g.hidden,
        "moe_intermediate_size": g.moe_intermediate,
        "n_routed_experts": g.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "num_hidden_layers": g.layers,
        "num_hash_layers": g.hash_layers,
        "num_attention_heads": g.heads,
        "num_key_value_heads": 1,
        "head_dim": g.head_dim,
        "q_lora_rank": g.q_lora_rank,
        "o_lora_rank": g.o_lora_rank,
        "o_groups": g.o_groups,
        "index_n_heads": g.index_heads,
        "index_head_dim": g.index_head_dim,
        "index_topk": 192,
        "sliding_window": 128,
        "compress_ratios": compress_ratios(g) + [0] * g.mtp_layers,
        "num_nextn_predict_layers": 1,
        "dspark_target_layer_ids": list(range(g.layers - g.mtp_layers, g.layers)),
        "topk_method": "noaux_tc",
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "vocab_size": g.vocab,
        "torch_dtype": "bfloat16",
        "vision_n_layers": g.vision_layers,
        "vision_dim": g.vision_dim,
        "vision_n_heads": 16,
        "vision_inter_dim": 4 * g.vision_dim,
        "vision_patch_size": 14,
        "vision_downsample_ratio": 3,
        "vision_max_n_token": 384,
        "quantization_config": {
            "quant_method": "exl3",
            "bits": g.base_k,
            "codebook": "mcg",
            "head_bits": 16,
            "non_routed_dtype_policy": "bf16_as_stored",
            "scope": "dsv4_routed_experts_only",
            "serving_reader_qualified": False,
            "version": "0.0.43",
            "layer_bits": {str(layer): 3 for layer in sorted(g.k3_layers)},
            "mtp_experts": "source",
            "mtp_experts_start_layer": g.layers,
            "non_routed_quantization": {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128],
            },
        },
    }


# ------------------------------------------------------------------ the lna-lab Dense pack


def lna_dense_shards(g: Geometry) -> Shards:
    """The MixedK shards with the dense linears baked to EXL3 (K ``dense_k``, wo_a as o_groups slices)
    in one new shard, and the source-format draft experts replaced by the EXL3 overlay."""
    shards = mixedk_shards(g)
    dense: dict[str, Tensor] = {}
    ratios = compress_ratios(g)
    for layer in range(g.layers):
        for suffix, (out_f, in_f) in dense_linears(g, ratios[layer]).items():
            if suffix == "attn.indexer.weights_proj":
                continue  # stays BF16 by design (L README-dense-serve.md)
            for tensors in shards.values():
                tensors.pop(f"layers.{layer}.{suffix}.weight", None)
            if suffix == "attn.wo_a":
                for r in range(g.o_groups):
                    dense.update(
                        exl3_linear(f"layers.{layer}.attn.wo_a.slice.{r}", in_f, out_f // g.o_groups, g.dense_k)
                    )
            else:
                dense.update(exl3_linear(f"layers.{layer}.{suffix}", in_f, out_f, g.dense_k))
    overlay: dict[str, Tensor] = {}
    for m in range(g.mtp_layers):
        for tensors in shards.values():
            for name in [n for n in tensors if n.startswith(f"mtp.{m}.ffn.experts.")]:
                del tensors[name]
        overlay.update(routed_experts(g, f"mtp.{m}", g.base_k))
    shards["model-dense-exl3.safetensors"] = dense
    shards["model-mtp-exl3.safetensors"] = overlay
    return shards


def lna_dense_config(g: Geometry) -> dict:
    config = mixedk_config(g)
    quant = config["quantization_config"]
    del quant["mtp_experts"], quant["mtp_experts_start_layer"]
    quant["layer_bits"].update({str(g.layers + m): g.base_k for m in range(g.mtp_layers)})
    modules = [
        "attn.fused_wqa_wkv",
        "attn.wq_b",
        "attn.wo_a",
        "attn.wo_b",
        "mlp.shared_experts.gate_up_proj",
        "mlp.shared_experts.down_proj",
    ]
    layers = {}
    for layer, ratio in enumerate(compress_ratios(g)):
        names = modules + (["attn.compressor.fused_wkv_wgate"] if ratio else [])
        names += ["attn.indexer.compressor.fused_wkv_wgate", "attn.indexer.wq_b"] if ratio == 4 else []
        layers.update({f"model.layers.{layer}.{name}": {"bits": g.dense_k} for name in names})
    quant["non_routed_exl3"] = {"codebook": "mcg", "layers": layers}
    return config


# ------------------------------------------------------------------ writing


def write_shard(path: Path, tensors: dict[str, Tensor]) -> None:
    """Lay tensors out as the safetensors library does (widest dtype first, then by name), which also
    keeps every 4-byte marker in a few pages at the start of the payload."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, tensor in sorted(tensors.items(), key=lambda item: (-DTYPE_SIZES[item[1].dtype], item[0])):
        header[name] = {"dtype": tensor.dtype, "shape": tensor.shape, "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    data_start = 8 + len(blob)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, struct.pack("<Q", len(blob)) + blob)
        for name, tensor in tensors.items():
            if tensor.marker is not None:
                os.pwrite(fd, struct.pack("<i", tensor.marker), data_start + header[name]["data_offsets"][0])
        os.ftruncate(fd, data_start + offset)
    finally:
        os.close(fd)


def write_pack(dest: Path, shards: Shards, config: dict, *, index: bool) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, tensors in shards.items():
        write_shard(dest / name, tensors)
    if index:
        weight_map = {tensor: name for name, tensors in shards.items() for tensor in tensors}
        total = sum(t.nbytes for tensors in shards.values() for t in tensors.values())
        (dest / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    return dest


EditConfig = Callable[[dict], None]
EditTensors = Callable[[Shards], None]


def _build(dest: Path, shards: Shards, config: dict, edit_config, edit_tensors, index: bool) -> Path:
    if edit_config:
        edit_config(config)
    if edit_tensors:
        edit_tensors(shards)
    return write_pack(dest, shards, config, index=index)


def build_mixedk_pack(
    dest: Path, g: Geometry = SMALL, *, edit_config: EditConfig | None = None, edit_tensors: EditTensors | None = None
) -> Path:
    return _build(dest, mixedk_shards(g), mixedk_config(g), edit_config, edit_tensors, index=False)


def build_lna_dense_pack(
    dest: Path,
    g: Geometry = SMALL_TP8,
    *,
    edit_config: EditConfig | None = None,
    edit_tensors: EditTensors | None = None,
) -> Path:
    return _build(dest, lna_dense_shards(g), lna_dense_config(g), edit_config, edit_tensors, index=True)


def holder(shards: Shards, tensor: str) -> dict[str, Tensor]:
    """The tensor dict of the shard that holds ``tensor``."""
    return next(tensors for tensors in shards.values() if tensor in tensors)


# ------------------------------------------------------------------ a vLLM tree to read


QUANT_INIT = """from typing import Literal, get_args

QuantizationMethods = Literal[
    "awq",
    "fp8",
    "deepseek_v4_fp8",
    "compressed-tensors",
]
QUANTIZATION_METHODS: list[str] = list(get_args(QuantizationMethods))
"""


def fake_vllm(root: Path, *, version: str = "0.30.0", route_b: bool = False, lna_dense: bool = False) -> Runtime:
    """A site directory holding the vLLM files doctor's pack checks read (route-B and lna-lab markers on demand)."""
    nvidia = root / "vllm" / "models" / "deepseek_v4" / "nvidia"
    nvidia.mkdir(parents=True, exist_ok=True)
    model = "class DeepseekV4Model:\n    stacked_params_mapping = [\n"
    if lna_dense:
        model += "".join(f'        ("attn.wo_a", "attn.wo_a.slice.{r}", {r}),\n' for r in range(8))
    model += "    ]\n"
    if route_b:
        model += "\ndef _bf16_to_fp8_stream(weights):\n    return weights\n"
    (nvidia / "model.py").write_text(model)
    sparse = "def _o_proj(self, o, positions):\n"
    if lna_dense:
        sparse += '    exl3_linears = getattr(self.wo_a, "_exl3_linears", None)\n'
    (nvidia / "flashinfer_sparse.py").write_text(sparse + "    return o\n")
    quant = root / "vllm" / "model_executor" / "layers" / "quantization"
    quant.mkdir(parents=True, exist_ok=True)
    (quant / "__init__.py").write_text(QUANT_INIT)
    return Runtime(site_dirs=(root,), vllm_root=root, vllm_version=version)


# ------------------------------------------------------------------ running the pack checks


PACK_CHECKS = pack_checks()
DSPARK = """--speculative-config '{"method": "dspark", "num_speculative_tokens": 3}'"""


def run_pack_checks(pack: Path, serve_args: str = "", runtime: Runtime | None = None) -> dict[str, Row]:
    """Every pack row by id (those of the pack's family: V4 or V4.1); no row may be an internal error."""
    ctx = DoctorContext.from_serve_args(serve_args, pack=pack, runtime=runtime)
    rows = run_checks(ctx, PACK_CHECKS)
    assert [r.id for r in rows] == [spec.id for spec in PACK_CHECKS if applies(spec, ctx)]
    crashed = [r for r in rows if r.status == FAIL and r.detail.startswith("internal error")]
    assert not crashed, crashed
    return {row.id: row for row in rows}
