"""Every tensor vLLM creates for a DeepSeek-V4 or V4.1 pack but its routed experts, named as the checkpoint
names them: per decoder layer, at the top, in the vision tower and in the draft's stages.

Read from vLLM's model code, releases 0.28.0-0.34.0 (backbone-tensors.md in the project's notes has each fact
with its file:line per release; ``V`` below is ``vllm/models/``):

- A decoder layer (``DeepseekV4DecoderLayer``, V4 ``deepseek_v4/nvidia/model.py``, V4.1 ``deepseek_v41/nvidia/
  model.py``): ``attn_norm``, ``ffn_norm``, six ``hc_{attn,ffn}_{fn,base,scale}`` parameters; its attention
  (``deepseek_v4{,1}/attention.py``): ``attn_sink``, ``q_norm``, ``kv_norm`` and the linears ``wq_a`` and ``wkv``
  (loaded into ``fused_wqa_wkv``), ``wq_b``, ``wo_a``, ``wo_b``; its MoE: ``ffn.gate.weight``, the shared
  experts' ``w1``/``w2``/``w3`` where ``n_shared_experts`` is set.
- V4's attention takes its layer's ``compress_ratios`` entry (1 for the draft's layers): above 1 a compressor
  (``ape``, ``wkv``, ``wgate``, ``norm``; ``compressor.py``), at 4 an indexer too (``wq_b``, ``weights_proj``
  and a compressor of its own). V4.1 keeps compressors on ``kv_source_layer_ids`` (``wgate`` only where the
  ratio is above 1, no ``ape``) and indexers on ``index_source_layer_ids`` (``wq_b``, ``weights_proj``; on a kv
  source also ``wk`` and ``k_norm``); the draft's layers have neither.
- The gate: ``tid2eid`` on V4's first ``num_hash_layers`` layers; ``bias`` (loaded as ``e_score_correction_
  bias``) where ``topk_method`` is ``noaux_tc`` and the layer is not a hash layer, or on every layer of a
  vision config from 0.30.0; ``bias_vl`` on every layer of a vision config from 0.30.0, the draft's stages
  included (0.28/0.29 have no vision class and create neither). V4.1 has no hash layers.
- V4.1's Engram layers (``engram_layer_ids``): ``engram.wkv``, ``engram.q_weight``, ``engram.k_weight`` (the
  table, ``engram.embed``, is v41.engram-tables').
- The top: ``embed.weight``, ``norm.weight``, ``head`` (a linear: BF16 ``head.weight``, or EXL3); V4 also
  ``hc_head_{fn,base,scale}`` (V4.1 has no learned hc_head).
- The vision tower (``deepseek_v4/common/vision.py``, both families from 0.30.0; names as in the checkpoint):
  ``vision.patch_embed.proj.{weight,bias}``, per block ``norm1``, ``attn.wqkv.{weight,bias}``,
  ``attn.wo.{weight,bias}``, ``norm2``, ``mlp.w1``, ``mlp.w2``; ``vision.norm``, ``aligner.w{1,2}.{weight,bias}``,
  ``image_start``, ``image_end``, ``image_newline`` and, for V4, ``image_pad``.
- The draft (``mtp.S.``): each stage a decoder layer as above (no compressor, no indexer, no hash); a DSpark
  draft (``nvidia/dspark.py``) adds ``main_proj`` and ``main_norm`` (read from stage 0), ``norm``, the Markov
  head (``markov_head.embed``/``head`` in V4.1's names, ``markov_w1``/``markov_w2`` in V4's) and
  ``confidence_head.proj`` (from the last stage), and for V4 ``hc_head_{fn,base,scale}``; V4's MTP draft
  (``nvidia/mtp.py``) has, per stage, ``enorm``, ``hnorm``, ``e_proj``, ``h_proj``, ``hc_head_*`` and ``norm``.

A linear is met by any complete storage form (:data:`FORMS`): a ``.weight`` (with its ``.scale`` when the
weight is FP8), an EXL3 ``.trellis``/``.suh``/``.svh`` with its codebook marker, or, for ``wo_a``, one EXL3 slice
per output group (``wo_a.slice.G``, lna-lab's and Mia's bakes).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from patch_dsv4.doctor.readers.family import V4, V41, Family

# The groups a missing tensor is counted in, in report order (the shape vcruz305's issue 13 was told in).
ATTENTION, SHARED, HC, GATES, FFN_NORM, ENGRAM, TOP, VISION, DRAFT = GROUPS = (
    "attention",
    "shared experts",
    "hc_*",
    "gates",
    "ffn_norm",
    "Engram projection",
    "top level",
    "vision tower",
    "draft",
)
HC_PARAMS = tuple(f"hc_{site}_{part}" for site in ("attn", "ffn") for part in ("fn", "base", "scale"))
HC_HEAD = ("hc_head_fn", "hc_head_base", "hc_head_scale")
MARKERS = ("mcg", "mul1")
EXL3_PARTS = ("trellis", "suh", "svh")
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})
SCALES = ("scale", "weight_scale_inv", "weight_scale")
# a linear's storage forms and how many tensors each is
FORMS = {"fp8": 2, "bf16": 1, "exl3": 4}


@dataclass(frozen=True)
class Need:
    """One thing vLLM creates and loads from the checkpoint.

    ``names``: the checkpoint name (any one of them, where vLLM's releases name it differently); for a
    ``linear``, its module prefix. ``quantized``: a linear built with the pack's quantization (else vLLM builds
    it unquantized and a source pack stores it in BF16). ``slices``: the output groups a ``wo_a`` may be stored
    as. ``layer``: the main layer or draft stage it belongs to (None at the top and in the vision tower)."""

    names: tuple[str, ...]
    group: str
    layer: int | None = None
    linear: bool = False
    quantized: bool = True
    slices: int = 0

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def suffix(self) -> str:
        """The name below the layer (``attn.wq_b``): what the same kind of layer carries."""
        return self.name.split(".", 2)[2] if self.layer is not None else self.name


@dataclass(frozen=True)
class Layout:
    """What the config (and the serving vLLM) says a pack's model is made of."""

    family: Family
    layers: int
    ratios: tuple[int, ...]  # each main layer's compress ratio
    hash_layers: int = 0  # V4
    kv_sources: frozenset[int] = frozenset()  # V4.1
    index_sources: frozenset[int] = frozenset()  # V4.1
    engram_layers: frozenset[int] = frozenset()  # V4.1
    noaux: bool = True  # topk_method is noaux_tc: the gate has a bias
    vision_gates: bool = False  # vLLM builds the vision-class gates (bias_vl; a bias on the hash layers too)
    shared_experts: bool = True
    o_groups: int = 8
    vision_layers: int = 0
    draft_stages: int = 0


def _linear(name: str, group: str, layer: int | None, *, quantized: bool = True, slices: int = 0) -> Need:
    return Need((name,), group, layer, linear=True, quantized=quantized, slices=slices)


def block_needs(layout: Layout, block: str, layer: int) -> Iterator[Need]:
    """What one decoder layer needs: ``block`` ``layers`` (a main layer) or ``mtp`` (a draft stage)."""
    p = f"{block}.{layer}"
    main = block == "layers"
    at = layer
    yield Need((f"{p}.attn_norm.weight",), ATTENTION, at)
    for name in ("attn.attn_sink", "attn.q_norm.weight", "attn.kv_norm.weight"):
        yield Need((f"{p}.{name}",), ATTENTION, at)
    for name in ("attn.wq_a", "attn.wkv", "attn.wq_b"):
        yield _linear(f"{p}.{name}", ATTENTION, at)
    yield _linear(f"{p}.attn.wo_a", ATTENTION, at, slices=layout.o_groups)
    yield _linear(f"{p}.attn.wo_b", ATTENTION, at)
    if main:
        yield from _compressor_and_indexer(layout, p, layer)
    for name in HC_PARAMS:
        yield Need((f"{p}.{name}",), HC, at)
    yield Need((f"{p}.ffn_norm.weight",), FFN_NORM, at)
    yield Need((f"{p}.ffn.gate.weight",), GATES, at)
    hash_layer = main and layout.family == V4 and layer < layout.hash_layers
    if hash_layer:
        yield Need((f"{p}.ffn.gate.tid2eid",), GATES, at)
    if layout.noaux and (not hash_layer or layout.vision_gates):
        yield Need((f"{p}.ffn.gate.bias",), GATES, at)
    if layout.vision_gates:  # the draft's MoE too: its config is the pack's (V4.1-Flash's base has the 3 stages')
        yield Need((f"{p}.ffn.gate.bias_vl",), GATES, at)
    if layout.shared_experts:
        for w in ("w1", "w2", "w3"):
            yield _linear(f"{p}.ffn.shared_experts.{w}", SHARED, at)
    if main and layer in layout.engram_layers:
        yield _linear(f"{p}.engram.wkv", ENGRAM, at)
        yield Need((f"{p}.engram.q_weight",), ENGRAM, at)
        yield Need((f"{p}.engram.k_weight",), ENGRAM, at)


def _compressor_and_indexer(layout: Layout, p: str, layer: int) -> Iterator[Need]:
    ratio = layout.ratios[layer]
    if layout.family == V41:
        if layer in layout.kv_sources:
            yield _linear(f"{p}.attn.compressor.wkv", ATTENTION, layer, quantized=False)
            if ratio > 1:
                yield _linear(f"{p}.attn.compressor.wgate", ATTENTION, layer, quantized=False)
            yield Need((f"{p}.attn.compressor.norm.weight",), ATTENTION, layer)
        if layer in layout.index_sources:
            yield _linear(f"{p}.attn.indexer.wq_b", ATTENTION, layer)
            yield _linear(f"{p}.attn.indexer.weights_proj", ATTENTION, layer, quantized=False)
            if layer in layout.kv_sources:
                yield _linear(f"{p}.attn.indexer.wk", ATTENTION, layer, quantized=False)
                yield Need((f"{p}.attn.indexer.k_norm.weight",), ATTENTION, layer)
        return
    compressors = []
    if ratio > 1:
        compressors.append(f"{p}.attn.compressor")
    if ratio == 4:
        yield _linear(f"{p}.attn.indexer.wq_b", ATTENTION, layer)
        yield _linear(f"{p}.attn.indexer.weights_proj", ATTENTION, layer, quantized=False)
        compressors.append(f"{p}.attn.indexer.compressor")
    for c in compressors:
        yield Need((f"{c}.ape",), ATTENTION, layer)
        yield _linear(f"{c}.wkv", ATTENTION, layer, quantized=False)
        yield _linear(f"{c}.wgate", ATTENTION, layer, quantized=False)
        yield Need((f"{c}.norm.weight",), ATTENTION, layer)


def top_needs(layout: Layout) -> Iterator[Need]:
    yield Need(("embed.weight",), TOP)
    yield Need(("norm.weight",), TOP)
    yield _linear("head", TOP, None, quantized=False)
    if layout.family == V4:
        for name in HC_HEAD:
            yield Need((name,), TOP)


def vision_needs(layout: Layout) -> Iterator[Need]:
    yield Need(("vision.patch_embed.proj.weight",), VISION)
    yield Need(("vision.patch_embed.proj.bias",), VISION)
    for b in range(layout.vision_layers):
        p = f"vision.blocks.{b}"
        for name in ("norm1.weight", "attn.wqkv.weight", "attn.wqkv.bias", "attn.wo.weight", "attn.wo.bias"):
            yield Need((f"{p}.{name}",), VISION)
        for name in ("norm2.weight", "mlp.w1.weight", "mlp.w2.weight"):
            yield Need((f"{p}.{name}",), VISION)
    yield Need(("vision.norm.weight",), VISION)
    for name in ("aligner.w1.weight", "aligner.w1.bias", "aligner.w2.weight", "aligner.w2.bias"):
        yield Need((name,), VISION)
    tokens = ("image_start", "image_end", "image_newline") + (("image_pad",) if layout.family == V4 else ())
    for name in tokens:
        yield Need((name,), VISION)


def draft_needs(layout: Layout, stages: int, mtp_style: bool) -> Iterator[Need]:
    """The draft's stages (``mtp.0`` .. ``mtp.{stages-1}``): decoder layers and their heads. ``mtp_style``:
    V4's MTP draft (``e_proj``/``h_proj`` per stage) rather than DSpark's."""
    for stage in range(stages):
        for need in block_needs(layout, "mtp", stage):
            yield Need(need.names, DRAFT, stage, need.linear, need.quantized, need.slices)
        p = f"mtp.{stage}"
        if mtp_style:
            yield Need((f"{p}.enorm.weight",), DRAFT, stage)
            yield Need((f"{p}.hnorm.weight",), DRAFT, stage)
            yield _linear(f"{p}.e_proj", DRAFT, stage)
            yield _linear(f"{p}.h_proj", DRAFT, stage)
            for name in HC_HEAD:
                yield Need((f"{p}.{name}",), DRAFT, stage)
            yield Need((f"{p}.norm.weight",), DRAFT, stage)
    if mtp_style or not stages:
        return
    yield _linear("mtp.0.main_proj", DRAFT, 0)
    yield Need(("mtp.0.main_norm.weight",), DRAFT, 0)
    last = stages - 1
    p = f"mtp.{last}"
    yield Need((f"{p}.norm.weight",), DRAFT, last)
    yield Need((f"{p}.markov_head.embed.weight", f"{p}.markov_head.markov_w1.weight"), DRAFT, last)
    yield Need((f"{p}.markov_head.head.weight", f"{p}.markov_head.markov_w2.weight"), DRAFT, last)
    yield Need((f"{p}.confidence_head.proj.weight",), DRAFT, last)
    if layout.family == V4:
        for name in HC_HEAD:
            yield Need((f"{p}.{name}",), DRAFT, last)


def storage(need: Need, form: str, marker: str) -> list[str]:
    """The checkpoint names of a linear stored in ``form`` (``fp8``, ``bf16``, ``exl3``; ``slices`` for a
    ``wo_a`` stored per group), ``marker`` the pack's codebook marker."""
    p = need.name
    if form == "slices":
        return [f"{p}.slice.{g}.{part}" for g in range(need.slices) for part in (*EXL3_PARTS, marker)]
    if form == "exl3":
        return [f"{p}.{part}" for part in (*EXL3_PARTS, marker)]
    return [f"{p}.weight", f"{p}.scale"] if form == "fp8" else [f"{p}.weight"]


def linear_state(need: Need, names: dict[str, str], marker: str) -> tuple[str | None, list[str]]:
    """(the form the pack stores ``need`` in, None when no part of it is there; the names it lacks)."""
    p = need.name
    weight = names.get(f"{p}.weight")
    if f"{p}.trellis" in names or f"{p}.suh" in names or f"{p}.svh" in names:
        missing = [f"{p}.{part}" for part in EXL3_PARTS if f"{p}.{part}" not in names]
        if not any(f"{p}.{m}" in names for m in MARKERS):
            missing.append(f"{p}.{marker}")
        return "exl3", missing
    if weight is not None:
        if weight in FP8_DTYPES:
            has_scale = any(f"{p}.{s}" in names for s in SCALES)
            return "fp8", [] if has_scale else [f"{p}.scale"]
        return "bf16", []
    if need.slices and any(f"{p}.slice.{g}.trellis" in names for g in range(need.slices)):
        missing = []
        for g in range(need.slices):
            q = f"{p}.slice.{g}"
            missing += [f"{q}.{part}" for part in EXL3_PARTS if f"{q}.{part}" not in names]
            if not any(f"{q}.{m}" in names for m in MARKERS):
                missing.append(f"{q}.{marker}")
        return "slices", missing
    if any(f"{p}.{s}" in names for s in SCALES):
        return "fp8", [f"{p}.weight"]
    return None, []


def possible_names(need: Need) -> list[str]:
    """Every checkpoint name that may stand for ``need`` (what the layers' comparison leaves to it)."""
    if not need.linear:
        return list(need.names)
    p = need.name
    found = [f"{p}.weight", *(f"{p}.{s}" for s in SCALES), *(f"{p}.{x}" for x in (*EXL3_PARTS, *MARKERS))]
    for g in range(need.slices):
        found += [f"{p}.slice.{g}.{x}" for x in (*EXL3_PARTS, *MARKERS)]
    return found
