"""Synthetic DeepSeek-V4.1-Flash EXL3 packs for doctor's tests (v41-packs.md §1-§3).

Like :mod:`synthetic`'s V4 packs: every shard is its real safetensors header (names,
dtypes, shapes of the V4.1-Flash checkpoint, v41-packs.md §2.1-§2.3), then a sparse
``truncate()`` to the size the header promises; only the EXL3 marker tensors get real
bytes. A full-size pack (48 shards, ~188k tensors, the two Engram tables of 188.8 GiB)
costs a few tens of MB of disk.

The API (kept stable: the Hub stand-in and the bench build their packs with it):

- :func:`build_v41_pack` ``(dest, g=FLASH, *, kind="routed", engram_tables=True,
  backbone=True, vision=True, index=True, edit_config=None, edit_tensors=None) -> Path``
  writes config.json, model.safetensors.index.json and the shards into ``dest``.
  ``kind`` is ``"routed"`` (routed-only EXL3: vcruz305 / SAGE / DERISKED; dense
  linears are the source's FP8 [32, 32] blocks, draft experts source FP4) or
  ``"dense"`` (dense EXL3, Mia-AiLab's layout: attention, compressor, indexer,
  shared experts, Engram projection, head and the draft all EXL3, ``wo_a`` as
  ``o_groups`` slices).
- :func:`build_v41_variant` ``(dest, name, g=FLASH) -> Path`` builds one of
  :data:`VARIANTS` (``good``, ``no-engram``, ``no-backbone``, ``engram-shape``,
  ``dense-exl3``, ``mia``, ``text-only``, ``flat-config``, ``mismatched-type``).
- :func:`v41_shards` / :func:`v41_config` give the dicts without writing them.

``FLASH`` is the V4.1-Flash geometry (the official config, v41-packs.md §1.2); ``SMALL41``
a shrunken one (4 layers, 8 experts, small tables) for tests that need not be full size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from .synthetic import MUL1, Shards, Tensor, shard_name, write_pack
from .synthetic import vision_tower as synthetic_vision_tower


@dataclass(frozen=True)
class Geometry41:
    hidden: int = 5120
    moe_intermediate: int = 2304
    experts: int = 384
    layers: int = 40
    heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    index_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    vocab: int = 129280
    hc_mult: int = 4
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20
    kv_sources: tuple[int, ...] = (2, 8, 14, 20)
    index_sources: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source: int = 20
    engram_layers: tuple[int, ...] = (1, 14)
    engram_rows: tuple[int, ...] = (384006168, 384016682)  # the primes above engram_vocab, 24 per layer
    engram_vocab: int = 16000000
    engram_heads: int = 8
    engram_max_ngram: int = 4
    engram_head_dim: int = 256
    engram_wkv: tuple[int, int] = (25600, 6144)
    mtp_layers: int = 3
    dspark_experts: int = 128
    dspark_target_layers: tuple[int, ...] = (37, 38, 39)
    markov_rank: int = 256
    vision_layers: int = 32
    vision_dim: int = 1024
    vision_intermediate: int = 2816
    shards: int = 48
    base_k: int = 2
    k3_layers: tuple[int, ...] = (0, 1, 2, 14, 20, 39)
    dense_k: int = 5
    head_k: int = 6


FLASH = Geometry41()
# Four layers whose Engram layer (1) is also a kv source and an index source; tables of 12 primes each.
SMALL41 = replace(
    FLASH,
    hidden=256,
    moe_intermediate=128,
    experts=8,
    layers=4,
    heads=8,
    head_dim=64,
    q_lora_rank=64,
    o_lora_rank=64,
    index_heads=4,
    index_head_dim=32,
    vocab=512,
    compress_ratios=(0, 2, 2, 1),
    kv_sources=(1, 3),
    index_sources=(1, 3),
    candidate_source=3,
    engram_layers=(1,),
    engram_rows=(1201054,),  # the 12 primes above 100000 (2 orders x 6 heads)
    engram_vocab=100000,
    engram_heads=6,
    engram_max_ngram=3,
    engram_head_dim=64,
    engram_wkv=(640, 768),
    mtp_layers=3,
    dspark_experts=4,
    dspark_target_layers=(1, 2, 3),
    markov_rank=32,
    vision_layers=2,
    vision_dim=64,
    vision_intermediate=128,
    shards=8,
    k3_layers=(2,),
)


# ------------------------------------------------------------------ tensor families


def exl3(prefix: str, in_features: int, out_features: int, k: int) -> dict[str, Tensor]:
    """An EXL3 linear as the packs in circulation store it (``mul1`` codebook marker, v41-packs.md §2.2)."""
    return {
        f"{prefix}.trellis": Tensor("I16", [max(1, in_features // 16), max(1, out_features // 16), 16 * k]),
        f"{prefix}.suh": Tensor("F16", [in_features]),
        f"{prefix}.svh": Tensor("F16", [out_features]),
        f"{prefix}.mul1": Tensor("I32", [1], MUL1),
    }


def fp8(prefix: str, out_features: int, in_features: int) -> dict[str, Tensor]:
    """A source dense linear: FP8 E4M3 weight with E8M0 [32, 32] block scales."""
    return {
        f"{prefix}.weight": Tensor("F8_E4M3", [out_features, in_features]),
        f"{prefix}.scale": Tensor("F8_E8M0", [max(1, out_features // 32), max(1, in_features // 32)]),
    }


def fp4_experts(prefix: str, experts: int, hidden: int, inter: int) -> dict[str, Tensor]:
    """Source routed experts: two E2M1 per I8 byte, E8M0 scales per 32 inputs."""
    tensors = {}
    for e in range(experts):
        for proj, (out_f, in_f) in (("w1", (inter, hidden)), ("w2", (hidden, inter)), ("w3", (inter, hidden))):
            tensors[f"{prefix}.ffn.experts.{e}.{proj}.weight"] = Tensor("I8", [out_f, in_f // 2])
            tensors[f"{prefix}.ffn.experts.{e}.{proj}.scale"] = Tensor("F8_E8M0", [out_f, in_f // 32])
    return tensors


def exl3_experts(prefix: str, experts: int, hidden: int, inter: int, k: int) -> dict[str, Tensor]:
    tensors = {}
    for e in range(experts):
        for proj, (fan_in, fan_out) in (("w1", (hidden, inter)), ("w2", (inter, hidden)), ("w3", (hidden, inter))):
            tensors.update(exl3(f"{prefix}.ffn.experts.{e}.{proj}", fan_in, fan_out, k))
    return tensors


def k_of(g: Geometry41, layer: int) -> int:
    return 3 if layer in g.k3_layers else g.base_k


def attention_linears(g: Geometry41, layer: int | None) -> dict[str, tuple[int, int]]:
    """The attention linears of one block as ``suffix -> (out, in)``; ``layer`` None for a draft block
    (compress ratio 0: no compressor, no indexer)."""
    h, hd = g.hidden, g.heads * g.head_dim
    linears = {
        "attn.wq_a": (g.q_lora_rank, h),
        "attn.wq_b": (hd, g.q_lora_rank),
        "attn.wkv": (g.head_dim, h),
        "attn.wo_a": (g.o_groups * g.o_lora_rank, hd // g.o_groups),
        "attn.wo_b": (h, g.o_groups * g.o_lora_rank),
    }
    if layer is not None and layer in g.index_sources:
        linears["attn.indexer.wq_b"] = (g.index_heads * g.index_head_dim, g.q_lora_rank)
    return linears


def backbone(g: Geometry41, prefix: str, layer: int | None, dense: bool, experts: int) -> dict[str, Tensor]:
    """Everything of one decoder block but its routed experts and Engram: norms, mHC, attention,
    compressor/indexer where the layer owns them, router, shared expert."""
    h = g.hidden
    mix = (2 + g.hc_mult) * g.hc_mult
    tensors = {
        f"{prefix}.attn_norm.weight": Tensor("BF16", [h]),
        f"{prefix}.ffn_norm.weight": Tensor("BF16", [h]),
        f"{prefix}.attn.q_norm.weight": Tensor("BF16", [g.q_lora_rank]),
        f"{prefix}.attn.kv_norm.weight": Tensor("BF16", [g.head_dim]),
        f"{prefix}.attn.attn_sink": Tensor("F32", [g.heads]),
        f"{prefix}.ffn.gate.weight": Tensor("BF16", [experts, h]),
        f"{prefix}.ffn.gate.bias": Tensor("F32", [experts]),
    }
    for site in ("attn", "ffn"):
        tensors[f"{prefix}.hc_{site}_fn"] = Tensor("F32", [mix, g.hc_mult * h])
        tensors[f"{prefix}.hc_{site}_base"] = Tensor("F32", [mix])
        tensors[f"{prefix}.hc_{site}_scale"] = Tensor("F32", [3])
    linears = attention_linears(g, layer)
    linears.update(
        {
            "ffn.shared_experts.w1": (g.moe_intermediate, h),
            "ffn.shared_experts.w2": (h, g.moe_intermediate),
            "ffn.shared_experts.w3": (g.moe_intermediate, h),
        }
    )
    for suffix, (out_f, in_f) in linears.items():
        if dense and suffix == "attn.wo_a":
            for group in range(g.o_groups):
                tensors.update(exl3(f"{prefix}.attn.wo_a.slice.{group}", in_f, out_f // g.o_groups, g.dense_k))
        elif dense:
            tensors.update(exl3(f"{prefix}.{suffix}", in_f, out_f, g.dense_k))
        else:
            tensors.update(fp8(f"{prefix}.{suffix}", out_f, in_f))
    if layer is not None and layer in g.kv_sources:
        ratio = g.compress_ratios[layer]
        for part in ("wkv", "wgate") if ratio > 1 else ("wkv",):
            if dense:
                tensors.update(exl3(f"{prefix}.attn.compressor.{part}", h, g.head_dim, g.dense_k))
            else:
                tensors[f"{prefix}.attn.compressor.{part}.weight"] = Tensor("BF16", [g.head_dim, h])
        tensors[f"{prefix}.attn.compressor.norm.weight"] = Tensor("BF16", [g.head_dim])
        tensors[f"{prefix}.attn.indexer.wk.weight"] = Tensor("BF16", [g.index_head_dim, h])
        tensors[f"{prefix}.attn.indexer.k_norm.weight"] = Tensor("BF16", [g.index_head_dim])
    if layer is not None and layer in g.index_sources:
        tensors[f"{prefix}.attn.indexer.weights_proj.weight"] = Tensor("BF16", [g.index_heads, h])
    return tensors


def engram_module(g: Geometry41, layer: int, dense: bool) -> dict[str, Tensor]:
    """The Engram projection of one layer (on the GPU with the weights): wkv and the q/k weights."""
    prefix = f"layers.{layer}.engram"
    out_f, in_f = g.engram_wkv
    tensors = exl3(f"{prefix}.wkv", in_f, out_f, g.dense_k) if dense else fp8(f"{prefix}.wkv", out_f, in_f)
    tensors[f"{prefix}.q_weight"] = Tensor("BF16", [g.hc_mult, g.hidden])
    tensors[f"{prefix}.k_weight"] = Tensor("BF16", [g.hc_mult, g.hidden])
    return tensors


def engram_table(g: Geometry41, layer: int, rows: int) -> dict[str, Tensor]:
    """One layer's hashed n-gram table: FP8 E4M3 rows of head_dim bytes, E8M0 scales per 32."""
    return {
        f"layers.{layer}.engram.embed.weight": Tensor("F8_E4M3", [rows, g.engram_head_dim]),
        f"layers.{layer}.engram.embed.scale": Tensor("F8_E8M0", [rows, g.engram_head_dim // 32]),
    }


def vision_tower(g: Geometry41) -> dict[str, Tensor]:
    """V4's tower, which V4.1's vision class builds too (deepseek_v41/nvidia/vl_model.py), with V4.1's three
    image tokens (no image_pad)."""
    return synthetic_vision_tower(
        g.vision_dim, g.vision_intermediate, g.vision_layers, g.hidden, ("image_start", "image_end", "image_newline")
    )


def draft_block(g: Geometry41, m: int, dense: bool, vision: bool = True) -> dict[str, Tensor]:
    """A DSpark stage ``mtp.m``: a full decoder block with 128 (source FP4, or EXL3) experts, and the
    stage's own heads (main_proj on mtp.0, the Markov and confidence heads on the last)."""
    prefix, h = f"mtp.{m}", g.hidden
    tensors = backbone(g, prefix, None, dense, g.dspark_experts)
    if vision:  # the draft's MoE has the vision gate too: the base's 1,621 non-routed tensors count its 3 stages'
        tensors[f"{prefix}.ffn.gate.bias_vl"] = Tensor("F32", [g.dspark_experts])
    if dense:
        tensors.update(exl3_experts(prefix, g.dspark_experts, h, g.moe_intermediate, 4))
    else:
        tensors.update(fp4_experts(prefix, g.dspark_experts, h, g.moe_intermediate))
    if m == 0:
        width = len(g.dspark_target_layers) * h
        tensors.update(exl3(f"{prefix}.main_proj", width, h, 4) if dense else fp8(f"{prefix}.main_proj", h, width))
        tensors[f"{prefix}.main_norm.weight"] = Tensor("BF16", [width])
    if m == g.mtp_layers - 1:
        tensors[f"{prefix}.norm.weight"] = Tensor("BF16", [h])
        tensors[f"{prefix}.markov_head.embed.weight"] = Tensor("BF16", [g.vocab, g.markov_rank])
        tensors[f"{prefix}.markov_head.head.weight"] = Tensor("BF16", [g.vocab, g.markov_rank])
        tensors[f"{prefix}.confidence_head.proj.weight"] = Tensor("BF16", [1, h])
    return tensors


# ------------------------------------------------------------------ the pack


def v41_shards(
    g: Geometry41 = FLASH,
    *,
    kind: str = "routed",
    engram_tables: bool = True,
    backbone_tensors: bool = True,
    vision: bool = True,
) -> Shards:
    """The pack's shards: embeddings and vision, the 40 layers, head and the draft spread over the
    first shards in order; the two Engram tables alone in the last two, as in the source checkpoint
    (a pack without its tables keeps the rest under the same names, its last two shards absent)."""
    if kind not in ("routed", "dense"):
        raise ValueError(f"kind is 'routed' or 'dense', not {kind!r}")
    dense = kind == "dense"
    tables = len(g.engram_layers)
    main = g.shards - tables
    names = [shard_name(n, g.shards) for n in range(1, g.shards + 1)]
    shards: Shards = {name: {} for name in names[:main]}
    units: list[dict[str, Tensor]] = [{"embed.weight": Tensor("BF16", [g.vocab, g.hidden])}]
    if vision:
        units.append(vision_tower(g))
    for layer in range(g.layers):
        unit = exl3_experts(f"layers.{layer}", g.experts, g.hidden, g.moe_intermediate, k_of(g, layer))
        if backbone_tensors:
            unit.update(backbone(g, f"layers.{layer}", layer, dense, g.experts))
            if vision:
                unit[f"layers.{layer}.ffn.gate.bias_vl"] = Tensor("F32", [g.experts])
        if layer in g.engram_layers:
            unit.update(engram_module(g, layer, dense))
        units.append(unit)
    top = {"norm.weight": Tensor("BF16", [g.hidden])}
    if dense:
        top.update(exl3("head", g.hidden, g.vocab, g.head_k))
    else:
        top["head.weight"] = Tensor("BF16", [g.vocab, g.hidden])
    units.append(top)
    units += [draft_block(g, m, dense, vision) for m in range(g.mtp_layers)]
    while len(units) < main:  # no shard left empty: split the largest unit
        big = max(units, key=len)
        items = list(big.items())
        units[units.index(big)] = dict(items[: len(items) // 2])
        units.append(dict(items[len(items) // 2 :]))
    for i, unit in enumerate(units):
        shards[names[i * main // len(units)]].update(unit)
    if engram_tables:
        for n, (layer, rows) in enumerate(zip(g.engram_layers, g.engram_rows, strict=True)):
            shards[names[main + n]] = engram_table(g, layer, rows)
    return shards


def v41_config(g: Geometry41 = FLASH, *, kind: str = "routed", vision: bool = True) -> dict:
    """The official V4.1-Flash config (nested: ``text_config``, ``vision_config``) with the
    ``quantization_config`` of the kind's packs (v41-packs.md §1.2, §1.3)."""
    text = {
        "model_type": "deepseek_v41_text",
        "vocab_size": g.vocab,
        "hidden_size": g.hidden,
        "moe_intermediate_size": g.moe_intermediate,
        "num_hidden_layers": g.layers,
        "num_attention_heads": g.heads,
        "num_key_value_heads": 1,
        "head_dim": g.head_dim,
        "qk_rope_head_dim": g.rope_dim,
        "q_lora_rank": g.q_lora_rank,
        "o_lora_rank": g.o_lora_rank,
        "o_groups": g.o_groups,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "max_position_embeddings": 1048576,
        "rope_theta": 10000,
        "n_routed_experts": g.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 128,
        "compress_ratios": list(g.compress_ratios),
        "compress_rope_theta": 160000,
        "kv_source_layer_ids": list(g.kv_sources),
        "index_source_layer_ids": list(g.index_sources),
        "index_n_heads": g.index_heads,
        "index_head_dim": g.index_head_dim,
        "index_topk": g.index_topk,
        "candidate_source_layer_id": g.candidate_source,
        "candidate_topk_blocks": 2048,
        "candidate_block_size": 8,
        "hc_mult": g.hc_mult,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        "engram_layer_ids": list(g.engram_layers),
        "engram_num_embeddings": list(g.engram_rows),
        "engram_max_ngram_size": g.engram_max_ngram,
        "engram_vocab_size": g.engram_vocab,
        "engram_n_heads": g.engram_heads,
        "engram_head_dim": g.engram_head_dim,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092,
        "num_nextn_predict_layers": g.mtp_layers,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": list(g.dspark_target_layers),
        "dspark_markov_rank": g.markov_rank,
        "dspark_n_routed_experts": g.dspark_experts,
        "dspark_num_experts_per_tok": 3,
    }
    if kind == "dense":
        quant = {"quant_method": "exl3", "codebook": "mul1", "bits": g.base_k}
        text["engram_table_dir"] = None
    else:
        quant = {
            "quant_method": "exl3",
            "bits": g.base_k,
            "codebook": "mul1",
            "layer_bits": {str(layer): 3 for layer in g.k3_layers},
            "mtp_experts": "source",
            "mtp_experts_start_layer": g.layers,
            "non_routed_quantization": {
                "quant_method": "deepseek_v4_fp8",
                "weight_block_size": [32, 32],
                "fmt": "e4m3",
                "scale_fmt": "ue8m0",
                "activation_scheme": "dynamic",
                "expert_dtype": "fp4",
            },
            "weight_block_size": [32, 32],
        }
    config = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": 129264,
        "quantization_config": quant,
        "text_config": text,
    }
    if vision:
        config["vision_config"] = {
            "model_type": "deepseek_v41_vision",
            "num_hidden_layers": g.vision_layers,
            "hidden_size": g.vision_dim,
            "num_attention_heads": 16,
            "intermediate_size": g.vision_intermediate,
            "patch_size": 14,
            "rope_theta": 10000,
            "downsample_ratio": 3,
            "max_image_tokens": 1024,
            "min_pixels": 295936,
            "max_wh_ratio": None,
        }
    return config


EditConfig = Callable[[dict], None]
EditTensors = Callable[[Shards], None]


def build_v41_pack(
    dest: Path,
    g: Geometry41 = FLASH,
    *,
    kind: str = "routed",
    engram_tables: bool = True,
    backbone: bool = True,
    vision: bool = True,
    index: bool = True,
    edit_config: EditConfig | None = None,
    edit_tensors: EditTensors | None = None,
) -> Path:
    """Write a synthetic V4.1 pack into ``dest`` (created); ``edit_config(config)`` and
    ``edit_tensors(shards)`` change the dicts in place before anything is written."""
    shards = v41_shards(g, kind=kind, engram_tables=engram_tables, backbone_tensors=backbone, vision=vision)
    config = v41_config(g, kind=kind, vision=vision)
    if edit_config:
        edit_config(config)
    if edit_tensors:
        edit_tensors(shards)
    return write_pack(dest, shards, config, index=index)


def _engram_rows_off_by_one(shards: Shards) -> None:
    for tensors in shards.values():
        for name, tensor in tensors.items():
            if ".engram.embed." in name:
                tensors[name] = Tensor(tensor.dtype, [tensor.shape[0] - 1, *tensor.shape[1:]])
                return


def _flat(config: dict) -> None:
    text = config.pop("text_config")
    config.pop("vision_config", None)
    text.pop("model_type")
    config.update(text)


def _mismatched(config: dict) -> None:
    config["architectures"] = ["DeepseekV4ForCausalLM"]


# name -> the keyword arguments of build_v41_pack that make it
VARIANTS: dict[str, dict] = {
    "good": {},
    "no-engram": {"engram_tables": False},  # Mia's card: "you still need shards 47 and 48"
    "no-backbone": {"backbone": False},  # vcruz305's issue #13
    "engram-shape": {"edit_tensors": _engram_rows_off_by_one},
    "dense-exl3": {"kind": "dense"},
    "mia": {"kind": "dense", "engram_tables": False},
    "text-only": {"vision": False},
    "flat-config": {"edit_config": _flat},
    "mismatched-type": {"edit_config": _mismatched},
}


def build_v41_variant(dest: Path, name: str, g: Geometry41 = FLASH) -> Path:
    """One of :data:`VARIANTS`, written into ``dest``."""
    return build_v41_pack(dest, g, **VARIANTS[name])
