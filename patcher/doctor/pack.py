"""Pack checks: config.json against the safetensors headers (DOCTOR-FACTS.md A and D "Pack").

Every header is read once per run, by :func:`pack_scan`, which keeps only
what the checks need (which expert tensors exist, their layouts, the trellis
widths per layer, every marker's 4 bytes, the gate, vision and dense names) and
frees each header before reading the next shard. The checks below only compare
that summary with config.json, the intended serve flags and, where a row says
so, files of the installed vLLM (read as text, never imported).
"""

from __future__ import annotations

import ast
import errno
import json
import os
import re
import shlex
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .base import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    DoctorContext,
    PackUnreadable,
    Row,
    check,
    clip,
    json_cost,
    read_regular_file,
)
from .safetensors import Budget, Shard, ShardError

MARKER_VALUES = {"mcg": -877912083, "mul1": -2082680531}  # P exl3.py:94,96
VALID_K = (2, 3, 4, 5, 6)  # P exl3.py Exl3Config.__init__
PROJECTIONS = ("w1", "w2", "w3")
EXL3_PARTS = ("trellis", "suh", "svh", "marker")
SOURCE_PARTS = ("weight", "scale")
# Each expert's tensors as bits: EXL3 ones at projection * 4 + part, source-format ones from bit 12.
EXPERT_BITS = {
    **{
        (proj, part): p * 4 + (3 if part in ("mcg", "mul1") else EXL3_PARTS.index(part))
        for p, proj in enumerate(PROJECTIONS)
        for part in ("trellis", "suh", "svh", "mcg", "mul1")
    },
    **{
        (proj, part): 12 + p * 2 + SOURCE_PARTS.index(part)
        for p, proj in enumerate(PROJECTIONS)
        for part in SOURCE_PARTS
    },
}
LAYOUT_PART = {
    "trellis": "trellis",
    "suh": "suh",
    "svh": "svh",
    "mcg": "marker",
    "mul1": "marker",
    "weight": "weight",
    "scale": "scale",
}
# (projection, part) -> (its bit as a mask, its layout part, whether it is a marker): the scan's hot loop
EXPERT_PART_INFO = {key: (1 << bit, LAYOUT_PART[key[1]], key[1] in MARKER_VALUES) for key, bit in EXPERT_BITS.items()}
EXL3_COMPLETE = (1 << 12) - 1
SOURCE_COMPLETE = ((1 << 6) - 1) << 12
INDEX_NAME = "model.safetensors.index.json"
STOCK_POLICY = "bf16_as_stored"
FP8_DELEGATE = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}  # R fix_pack_config.py l.105-111
MTP_DRAFT_METHODS = ("dspark", "mtp", "deepseek_mtp")
# Dense linears of a DeepSeek-V4 block (R LOADER_NOTES.md:107-109; L README-dense-bake.md, Targets),
# each with the vLLM module prefix the checkpoint name is loaded into (L README-dense-serve.md).
DENSE_LINEARS = {
    "attn.wq_a": "attn.fused_wqa_wkv",
    "attn.wkv": "attn.fused_wqa_wkv",
    "attn.wq_b": "attn.wq_b",
    "attn.wo_a": "attn.wo_a",
    "attn.wo_b": "attn.wo_b",
    "attn.compressor.wkv": "attn.compressor.fused_wkv_wgate",
    "attn.compressor.wgate": "attn.compressor.fused_wkv_wgate",
    "attn.indexer.compressor.wkv": "attn.indexer.compressor.fused_wkv_wgate",
    "attn.indexer.compressor.wgate": "attn.indexer.compressor.fused_wkv_wgate",
    "attn.indexer.wq_b": "attn.indexer.wq_b",
    "attn.indexer.weights_proj": "attn.indexer.weights_proj",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_up_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.gate_up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
}
WO_A_SLICE = re.compile(r"attn\.wo_a\.slice\.([0-9]{1,4})$")
NUMBERED_SHARD = re.compile(r"model-([0-9]{1,9})-of-([0-9]{1,9})\.safetensors$")
MAX_LAYERS = 100_000  # num_hidden_layers doctor takes (the real pack: 43)
LEFTOVER_SUFFIXES = (".incomplete", ".part")
ROUTE_B_MARKER = "_bf16_to_fp8_stream"  # R scripts/patch_dsv4_loader.py
DSV4_NVIDIA = ("vllm", "models", "deepseek_v4", "nvidia")
# What the scan keeps (experts, layouts, dense modules and parts, widths, layers): the real pack needs ~13k.
MAX_SUMMARY = 50_000
INDEX_LIMIT = 64 << 20  # bytes of model.safetensors.index.json read (the real pack's would be ~8 MB)
INDEX_MEMORY = 128 << 20  # what json.loads may allocate for it (see json_cost)


def _index(text: str) -> int | None:
    """A layer or expert number in a tensor name (decimal digits, at most 9: int() takes them), else None."""
    return int(text) if text.isdecimal() and len(text) < 10 else None


# --------------------------------------------------------------------------- the scan


@dataclass
class PackScan:
    """What the headers hold, summarised in one pass over the shards."""

    files: list[Path] = field(default_factory=list)
    tensor_counts: dict[str, int] = field(default_factory=dict)  # file name -> tensors in its header
    listing_error: str | None = None
    problems: list[ShardError] = field(default_factory=list)
    safetensors_bytes: int = 0
    # (block, layer, expert) -> bit set of the tensors present; block is "layers" or "mtp".
    experts: dict[tuple[str, int, int], int] = field(default_factory=dict)
    # (block, projection, part, dtype, shape) -> [count, first name]
    expert_layouts: dict[tuple, list] = field(default_factory=dict)
    # (block, layer) -> trellis last dim -> first name with it
    widths: dict[tuple[str, int], dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    routed_marker_suffixes: Counter = field(default_factory=Counter)
    markers_checked: int = 0
    first_bad_marker: str | None = None
    bad_marker_count: int = 0
    mtp_blocks: set[int] = field(default_factory=set)
    gate_bias_layers: set[int] = field(default_factory=set)
    tid2eid_layers: set[int] = field(default_factory=set)
    vision_tensors: int = 0
    first_vision_tensor: str | None = None
    # "layers.N.attn.wq_a" -> part ("weight", "scale", "trellis", ...) -> (dtype, shape)
    dense: dict[str, dict[str, tuple[str, list]]] = field(default_factory=lambda: defaultdict(dict))

    def _marker(self, shard: Shard, name: str, entry: dict, suffix: str) -> None:
        self.markers_checked += 1
        start, end = entry["data_offsets"]
        expected = MARKER_VALUES[suffix]
        if end - start != 4:
            problem = f"{name} is {end - start} bytes, not one int32"
        else:
            try:
                value = shard.read_i32(name)
            except ShardError as exc:
                problem = str(exc)
            else:
                if value == expected:
                    return
                problem = f"{name} holds {value}, not the {suffix.upper()} marker {expected}"
        self.bad_marker_count += 1
        if self.first_bad_marker is None:
            self.first_bad_marker = problem

    def add_shard(self, shard: Shard) -> None:
        # One loop over ~2,900 names per shard (138k in the pack): the routed-expert names, nearly all
        # of them, take the first branch with as few lookups as possible.
        experts, layouts, widths, part_info = self.experts, self.expert_layouts, self.widths, EXPERT_PART_INFO
        for name, entry in shard.tensors.items():
            parts = name.split(".")
            if len(parts) == 7 and parts[3] == "experts" and parts[2] == "ffn":
                head, first, expert = parts[0], parts[1], parts[4]
                # isdecimal, not isdigit: int() refuses "²"; 9 digits at most: int() refuses 4,300
                if (
                    (head == "layers" or head == "mtp")
                    and first.isdecimal()
                    and expert.isdecimal()
                    and len(first) < 10
                    and len(expert) < 10
                ):
                    layer = int(first)
                    if head == "mtp":
                        self.mtp_blocks.add(layer)
                    part = parts[6]
                    info = part_info.get((parts[5], part))
                    if info is None:
                        continue
                    mask, layout_part, is_marker = info
                    key = (head, layer, int(expert))
                    experts[key] = experts.get(key, 0) | mask
                    shape = entry["shape"]
                    layout = (head, parts[5], layout_part, entry["dtype"], tuple(shape))
                    seen = layouts.get(layout)
                    if seen is None:
                        layouts[layout] = [1, name]
                    else:
                        seen[0] += 1
                    if is_marker:
                        if head == "layers":
                            self.routed_marker_suffixes[part] += 1
                        self._marker(shard, name, entry, part)
                    elif part == "trellis" and shape:
                        widths[(head, layer)].setdefault(shape[-1], name)
                    continue
            self._add_other(shard, name, entry, parts)

    def _add_other(self, shard: Shard, name: str, entry: dict, parts: list[str]) -> None:
        """Every name but a routed expert's: MTP blocks, gates, dense linears, the vision tower, stray markers."""
        head = parts[0]
        if head in ("layers", "mtp") and len(parts) > 2 and _index(parts[1]) is not None:
            layer = int(parts[1])
            if head == "mtp":
                self.mtp_blocks.add(layer)
            if len(parts) == 5 and parts[2] == "ffn" and parts[3] == "gate":
                if parts[4] == "bias_vl":
                    self._vision(name)
                elif head == "layers" and parts[4] == "bias":
                    self.gate_bias_layers.add(layer)
                elif head == "layers" and parts[4] == "tid2eid":
                    self.tid2eid_layers.add(layer)
            elif head == "layers" and len(parts) > 4:
                module = ".".join(parts[2:-1])
                if module in DENSE_LINEARS or WO_A_SLICE.match(module):
                    self.dense[f"layers.{layer}.{module}"][parts[-1]] = (entry["dtype"], entry["shape"])
        elif head in ("vision", "aligner") or head.startswith("image_"):
            self._vision(name)
        if parts[-1] in MARKER_VALUES:
            self._marker(shard, name, entry, parts[-1])

    def _vision(self, name: str) -> None:
        self.vision_tensors += 1
        # Name a tower tensor when there is one: it says "vision" more plainly than a gate's bias_vl.
        if self.first_vision_tensor is None or self.first_vision_tensor.endswith("bias_vl"):
            self.first_vision_tensor = name

    def size(self) -> int:
        """How many things the summary keeps (it is bounded by MAX_SUMMARY, give or take one shard)."""
        return (
            len(self.experts)
            + len(self.expert_layouts)
            + len(self.widths)
            + sum(map(len, self.widths.values()))
            + len(self.dense)
            + sum(map(len, self.dense.values()))
            + len(self.mtp_blocks)
            + len(self.gate_bias_layers)
            + len(self.tid2eid_layers)
        )

    # ---- derived facts

    def mtp_format(self) -> str:
        """``source`` (I8 .weight + .scale), ``exl3`` (.trellis ...), ``mixed`` or ``none``."""
        kinds = set()
        for (block, _, _), mask in self.experts.items():
            if block == "mtp":
                kinds.add("exl3" if mask & EXL3_COMPLETE else "source")
        if not kinds:
            return "none"
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def layer_k(self, block: str = "layers") -> dict[int, int | None]:
        """K per layer of ``block`` from its trellis widths; None where the layer mixes widths or one is not a K."""
        result = {}
        for (b, layer), widths in self.widths.items():
            if b != block:
                continue
            (width, *others) = widths
            result[layer] = None if others or width % 16 or width // 16 not in VALID_K else width // 16
        return result

    def dense_exl3_modules(self) -> list[str]:
        return sorted(m for m, parts in self.dense.items() if "trellis" in parts)


def scan_pack(pack: Path) -> PackScan:
    scan = PackScan()
    try:
        scan.files = sorted((p for p in pack.iterdir() if p.name.endswith(".safetensors")), key=lambda p: p.name)
    except OSError as exc:
        scan.listing_error = f"{pack} cannot be listed ({exc.strerror or exc})"
        return scan
    budget = Budget()
    for path in scan.files:
        try:
            scan.safetensors_bytes += path.stat().st_size
        except OSError:
            pass  # reported by pack.shards when the file is opened
        if scan.size() > MAX_SUMMARY:
            scan.problems.append(
                ShardError(
                    path,
                    f"not read: the shards before it name more experts, layers and modules than doctor "
                    f"summarises ({MAX_SUMMARY:,}); a DeepSeek-V4 pack has about 13,000",
                )
            )
            continue
        try:
            with Shard(path, budget) as shard:
                if shard.size_error:
                    scan.problems.append(shard.size_error)
                scan.tensor_counts[path.name] = len(shard.tensors)
                scan.add_shard(shard)
        except ShardError as exc:
            scan.problems.append(exc)
    return scan


def pack_scan(ctx: DoctorContext) -> PackScan:
    """The pack's header summary, read once per run."""
    assert ctx.pack is not None
    return ctx.cached("pack.scan", lambda: scan_pack(ctx.pack))


# --------------------------------------------------------------------------- config helpers


def plugin_int(value) -> int | None:
    """``int(value)`` as vllm-exl3 does it, or None where that raises."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return None


def _config_int(cfg: dict, key: str) -> int | None:
    value = cfg.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def quantization_config(cfg: dict) -> dict:
    quant = cfg.get("quantization_config")
    return quant if isinstance(quant, dict) else {}


def declared_bits(quant: dict) -> int:
    """The base K the plugin uses: ``bits``, or 4 when absent (``Exl3Config.from_config``)."""
    bits = plugin_int(quant.get("bits", 4))
    return 4 if bits is None else bits


def declared_layer_bits(quant: dict) -> tuple[dict[int, int], list[str]]:
    """``layer_bits`` as the plugin parses it, and the entries it would reject."""
    raw = quant.get("layer_bits") or {}
    if not isinstance(raw, dict):
        return {}, [f"layer_bits is a JSON {type(raw).__name__}, not an object"]
    parsed, rejected = {}, []
    for key, value in raw.items():
        layer, k = plugin_int(key), plugin_int(value)
        if layer is None or k is None or k not in VALID_K:
            rejected.append(f"layer_bits[{clip(repr(key))}] = {clip(repr(value))} (vllm-exl3 accepts 2-6)")
        else:
            parsed[layer] = k
    return parsed, rejected


def majority_k(scan: PackScan) -> int | None:
    counts = Counter(k for k in scan.layer_k().values() if k is not None)
    return counts.most_common(1)[0][0] if counts else None


def layer_bits_for(scan: PackScan, base: int) -> dict[str, int]:
    """The ``layer_bits`` map the shards need: the layers whose K differs from ``base``."""
    return {str(layer): k for layer, k in sorted(scan.layer_k().items()) if k is not None and k != base}


def valid_bits(quant: dict) -> int | None:
    """``bits`` when it is declared and the plugin accepts it (2-6)."""
    raw = quant.get("bits")
    bits = plugin_int(raw)
    return bits if bits in VALID_K and not isinstance(raw, bool) else None


def wanted_codebook(quant: dict, scan: PackScan) -> str | None:
    """The codebook to declare when the declared one (default mcg) is invalid or disagrees with the
    routed experts' marker tensors; None when it is right."""
    codebook = quant.get("codebook", "mcg")
    found = sorted(scan.routed_marker_suffixes)
    if isinstance(codebook, str) and codebook in MARKER_VALUES and (not found or found == [codebook]):
        return None
    return found[0] if len(found) == 1 else "mcg"


def layer_bits_problems(quant: dict, scan: PackScan) -> list[str]:
    """Entries the plugin rejects, and layers whose declared K is not their trellis width / 16."""
    bits = declared_bits(quant)
    layer_bits, problems = declared_layer_bits(quant)
    for layer, k in sorted(scan.layer_k().items()):
        declared = layer_bits.get(layer, bits)
        if k is not None and declared != k:
            problems.append(f"layer {layer} declares K{declared}, trellis width {k * 16} means K{k}")
    return problems


def source_mtp_problems(cfg: dict, quant: dict) -> list[str]:
    """What a pack with source-format MTP experts lacks for the plugin to hand them to the delegate."""
    layers = _config_int(cfg, "num_hidden_layers")
    mode, start = quant.get("mtp_experts"), quant.get("mtp_experts_start_layer")
    delegate = quant.get("non_routed_quantization")
    problems = []
    if mode != "source":
        problems.append(f'mtp_experts is {_json(mode) if mode is not None else "absent"}, not "source"')
    if start != layers:
        problems.append(f"mtp_experts_start_layer is {_echo(start)}, not num_hidden_layers ({layers})")
    if not (isinstance(delegate, dict) and delegate.get("quant_method")):
        problems.append("non_routed_quantization declares no quant_method for the draft's experts")
    return problems


def routing_bias_layers(cfg: dict, scan: PackScan) -> list[int]:
    """Non-hash layers that ship ``ffn.gate.bias`` (they need ``topk_method: noaux_tc``)."""
    hash_layers = _config_int(cfg, "num_hash_layers") or 0
    return sorted(layer for layer in scan.gate_bias_layers if layer >= hash_layers)


@dataclass(frozen=True)
class Dims:
    layers: int
    experts: int
    hidden: int
    intermediate: int


def model_dims(cfg: dict) -> Dims | str:
    """The geometry the expert contract is derived from, or the reason it cannot be."""
    keys = ("num_hidden_layers", "n_routed_experts", "hidden_size", "moe_intermediate_size")
    values = [_config_int(cfg, key) for key in keys]
    missing = [key for key, value in zip(keys, values, strict=True) if value is None or value <= 0]
    if missing:
        return f"config.json has no positive integer {', '.join(missing)}"
    if values[0] > MAX_LAYERS:
        return f"config.json's num_hidden_layers {values[0]} is more than doctor checks ({MAX_LAYERS:,})"
    return Dims(*values)


def tensor_parallel(ctx: DoctorContext) -> int:
    value = ctx.serve_flag("--tensor-parallel-size") or ctx.serve_flag("-tp")
    tp = plugin_int(value) if value is not None else 1
    return tp if tp and tp > 0 else 1


def speculative_config(ctx: DoctorContext) -> dict | str | None:
    """The ``--speculative-config`` JSON; a string says why it cannot be used; None when absent."""
    text = ctx.serve_flag("--speculative-config")
    if text is None:
        return None
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return f"--speculative-config is not JSON ({clip(str(exc))})"
    return spec if isinstance(spec, dict) else "--speculative-config is not a JSON object"


def drafts_from_mtp(ctx: DoctorContext) -> bool:
    spec = speculative_config(ctx)
    return isinstance(spec, dict) and spec.get("method") in MTP_DRAFT_METHODS


def fixer_refusal(ctx: DoctorContext) -> str | None:
    """Why ``--fix-config`` would refuse this pack, or None when it fits the recipe's fixer.

    R fix_pack_config.py writes a block for routed-only EXL3 packs with BF16 dense
    weights and source-format MTP experts; it deletes ``non_routed_exl3`` and re-adds
    ``mtp_experts: "source"`` on anything else (A.2 "Traps").
    """
    return ctx.cached("pack.fixer_refusal", lambda: _fixer_refusal(ctx))


def _fixer_refusal(ctx: DoctorContext) -> str | None:
    try:
        cfg = ctx.config()
    except PackUnreadable as exc:
        return str(exc)
    scan = pack_scan(ctx)
    if _config_int(cfg, "num_hidden_layers") is None:
        return "config.json has no integer num_hidden_layers"
    if "non_routed_exl3" in quantization_config(cfg) or scan.dense_exl3_modules():
        return "this is a dense-EXL3 pack (non_routed_exl3, lna-lab Dense bake), not a routed-only EXL3 pack"
    if scan.mtp_format() in ("exl3", "mixed"):
        return 'its MTP experts are EXL3 (.trellis); mtp_experts "source" would hand them to the fp8 delegate'
    if scan.listing_error or scan.problems:
        return "some shard headers cannot be read (see pack.shards), so layer_bits cannot be derived"
    k = scan.layer_k()
    if not k:
        return "the shards hold no routed-expert trellis, so this is not an EXL3 MixedK pack"
    mixed = sorted(layer for layer, value in k.items() if value is None)
    if mixed:
        return f"layer {mixed[0]} has trellis widths no single K expresses (see experts.one-k)"
    return None


def _fix_config_note(ctx: DoctorContext) -> str:
    if fixer_refusal(ctx) is None:
        return f" (patch-dsv4 doctor --pack {shlex.quote(str(ctx.pack))} --fix-config writes it)"
    return ""


def _no_shards(check_id: str, scan: PackScan) -> Row | None:
    """A skip row for a header-only check when there are no headers to read (pack.shards says why)."""
    if scan.listing_error or not scan.files:
        return Row(check_id, SKIP, "no shard to read (see pack.shards).")
    return None


def _first(items: list[str]) -> str:
    return f"{items[0]} (and {len(items) - 1} more)" if len(items) > 1 else items[0]


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _block(block: str, layer: int) -> str:
    return f"layer {layer}" if block == "layers" else f"{block}.{layer}"


def _json(value) -> str:
    return json.dumps(value, separators=(", ", ": "))


def _echo(value) -> str:
    """A value read from the pack, as a row quotes it: JSON, cut to 200 characters."""
    return clip(_json(value))


# --------------------------------------------------------------------------- public facts


@dataclass(frozen=True)
class PackFacts:
    """Facts about the pack that checks outside this module need (cached per run)."""

    vision: bool
    safetensors_bytes: int
    index_topk: int | None
    num_attention_heads: int | None
    attention_exl3: bool
    shared_experts_exl3: bool
    mtp_experts: str  # "source" | "exl3" | "mixed" | "none"


def _exl3_covers(non_routed_exl3, fragment: str) -> bool:
    if not isinstance(non_routed_exl3, dict):
        return False
    names = list(non_routed_exl3.get("layers") or {}) if isinstance(non_routed_exl3.get("layers"), dict) else []
    modules = non_routed_exl3.get("modules")
    names += [m for m in modules if isinstance(m, str)] if isinstance(modules, list) else []
    return any(fragment in name for name in names)


def pack_facts(ctx: DoctorContext) -> PackFacts:
    """Raises PackUnreadable when config.json cannot be read."""

    def compute() -> PackFacts:
        cfg = ctx.config()
        scan = pack_scan(ctx)
        nre = quantization_config(cfg).get("non_routed_exl3")
        return PackFacts(
            vision=scan.vision_tensors > 0 or (_config_int(cfg, "vision_n_layers") or 0) > 0,
            safetensors_bytes=scan.safetensors_bytes,
            index_topk=_config_int(cfg, "index_topk"),
            num_attention_heads=_config_int(cfg, "num_attention_heads"),
            attention_exl3=_exl3_covers(nre, "attn."),
            shared_experts_exl3=_exl3_covers(nre, "shared_experts"),
            mtp_experts=scan.mtp_format(),
        )

    return ctx.cached("pack.facts", compute)


# --------------------------------------------------------------------------- runtime reads


def _vllm_file(ctx: DoctorContext, *parts: str) -> tuple[str | None, str]:
    """(text, where) of a file of the installed vLLM; text is None and ``where`` says why when unread."""
    runtime = ctx.runtime
    if runtime is None or runtime.vllm_root is None:
        return None, "no vLLM environment located"
    path = runtime.vllm_root.joinpath(*parts)
    try:
        return read_regular_file(path).decode("utf-8", "replace"), str(path)
    except OSError as exc:
        return None, f"{path} cannot be read ({exc.strerror or exc})"


def _registered_quant_methods(text: str) -> set[str] | None:
    """The names in ``QuantizationMethods = Literal[...]``, read from the source (never imported)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "QuantizationMethods" for t in targets):
            return {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return None


# --------------------------------------------------------------------------- checks: config.json


@check("pack.config", needs=("pack",))
def check_config(ctx: DoctorContext) -> Row:
    """FAIL if config.json is missing, unreadable or not a JSON object (R serve_one_spark_dsv4.sh:45-48)."""
    try:
        cfg = ctx.config()
    except PackUnreadable as exc:
        return Row(
            "pack.config", FAIL, str(exc), f"config.json is missing or invalid in {ctx.pack}; download the pack again."
        )
    return Row(
        "pack.config",
        PASS,
        f"config.json read: model_type {_echo(cfg.get('model_type'))}, "
        f"num_hidden_layers {_echo(cfg.get('num_hidden_layers'))}, {len(cfg)} top-level keys.",
    )


@check("pack.text-config", needs=("pack",))
def check_text_config(ctx: DoctorContext) -> Row:
    """FAIL if ``text_config`` is ``{}`` or lacks ``num_attention_heads``: vLLM adopts it as the whole
    text config and config parsing fails (R LOADER_NOTES.md:126-133; fix_pack_config.py:118-119)."""
    cfg = ctx.config()
    if "text_config" not in cfg:
        return Row("pack.text-config", PASS, "config.json is flat (no text_config), as DeepSeek-V4 expects.")
    text_config = cfg["text_config"]
    if text_config == {}:
        return Row(
            "pack.text-config",
            FAIL,
            'config.json has an empty "text_config", which vLLM adopts as the whole text config.',
            'Delete the "text_config" key (the DeepSeek-V4 config is flat)' + _fix_config_note(ctx) + ".",
        )
    if not isinstance(text_config, dict) or "num_attention_heads" not in text_config:
        return Row(
            "pack.text-config",
            FAIL,
            'config.json has a "text_config" without num_attention_heads; vLLM adopts it and fails to parse.',
            'Delete the "text_config" key by hand (the DeepSeek-V4 config is flat: its keys belong at the top level).',
        )
    return Row("pack.text-config", PASS, "text_config is present and names num_attention_heads.")


@check("quant.method", needs=("pack",))
def check_quant_method(ctx: DoctorContext) -> Row:
    """FAIL unless ``quantization_config.quant_method == "exl3"``: for fp8 / deepseek_v4_fp8, vLLM's
    DeepseekV4FP8Config override silently replaces --quantization exl3 and the load balloons to
    ~117 GiB (V0.28.0 models/deepseek_v4/quant_config.py:135-152, config/model.py:1245-1266;
    R LOADER_NOTES.md:19-31)."""
    cfg = ctx.config()
    method = quantization_config(cfg).get("quant_method")
    if method == "exl3":
        return Row("quant.method", PASS, 'quantization_config.quant_method is "exl3".')
    found = "absent" if method is None else _echo(method)
    refusal = fixer_refusal(ctx)
    if refusal is None:
        how = (
            f'Set "quant_method": "exl3"{_fix_config_note(ctx)}; for the archived fork route use '
            f'the recipe\'s "python scripts/fix_pack_config.py {shlex.quote(str(ctx.pack))} --route b".'
        )
    else:
        how = 'Set "quant_method": "exl3" in quantization_config by hand, keeping the rest of the block.'
    return Row(
        "quant.method",
        FAIL,
        f'quantization_config.quant_method is {found}, not "exl3": vLLM\'s deepseek_v4_fp8 override '
        "replaces --quantization exl3 and the load balloons past memory (~117 GiB) before failing.",
        how,
    )


@check("quant.bits", needs=("pack",))
def check_quant_bits(ctx: DoctorContext) -> Row:
    """FAIL if ``bits`` is not in 2-6 (ValueError at config parse); WARN when absent, since the plugin
    then sizes every layer missing from ``layer_bits`` for K4 (P exl3.py Exl3Config.__init__, from_config)."""
    quant = quantization_config(ctx.config())
    scan = pack_scan(ctx)
    k = majority_k(scan)
    suggestion = f" (the shards say {k})" if k else ""
    if "bits" not in quant:
        return Row(
            "quant.bits",
            WARN,
            "quantization_config has no bits; vllm-exl3 then assumes 4.",
            f'Set "bits" to the K of the layers not listed in layer_bits{suggestion}' + _fix_config_note(ctx) + ".",
        )
    bits = valid_bits(quant)
    if bits is None:
        return Row(
            "quant.bits",
            FAIL,
            f"quantization_config.bits is {_echo(quant['bits'])}; vllm-exl3 accepts 2-6 and refuses the config.",
            f'Set "bits" to the K of the layers not listed in layer_bits{suggestion}' + _fix_config_note(ctx) + ".",
        )
    return Row("quant.bits", PASS, f"quantization_config.bits is {bits}.")


@check("quant.codebook", needs=("pack",))
def check_quant_codebook(ctx: DoctorContext) -> Row:
    """FAIL unless ``codebook`` is ``mcg``/``mul1`` (default ``mcg``) and matches the routed experts'
    marker tensors (``.mcg`` or ``.mul1``) (P exl3.py Exl3Config.__init__, from_config)."""
    quant = quantization_config(ctx.config())
    scan = pack_scan(ctx)
    codebook = quant.get("codebook", "mcg")
    found = sorted(scan.routed_marker_suffixes)
    where = f"the routed experts carry .{'/.'.join(found)} markers" if found else "no routed marker tensors were found"
    wanted = wanted_codebook(quant, scan)
    if wanted:
        return Row(
            "quant.codebook",
            FAIL,
            f"codebook {_echo(codebook)} does not match the pack: {where}.",
            f'Set "codebook": "{wanted}" in quantization_config' + _fix_config_note(ctx) + ".",
        )
    stated = "" if "codebook" in quant else " (absent; vllm-exl3 assumes mcg)"
    return Row("quant.codebook", PASS, f'codebook is "{codebook}"{stated} and {where}.')


# --------------------------------------------------------------------------- checks: files


def _leftovers(pack: Path) -> list[str]:
    found = []
    for folder in (pack, pack / ".cache" / "huggingface" / "download"):
        try:
            found += [str(p.relative_to(pack)) for p in folder.iterdir() if p.name.endswith(LEFTOVER_SUFFIXES)]
        except OSError:
            continue
    return sorted(found)


def _numbering_gaps(files: list[Path]) -> tuple[list[str], int]:
    """(the first missing shards of each numbered set, and a mixture of sets, at most 3 named; how many)."""
    totals: dict[str, set[int]] = defaultdict(set)
    for path in files:
        match = NUMBERED_SHARD.match(path.name)
        if match:
            totals[match.group(2)].add(int(match.group(1)))
    gaps, count = [], 0
    for total, numbers in sorted(totals.items()):
        width, n = len(total), 1
        inside = {number for number in numbers if 1 <= number <= int(total)}
        count += int(total) - len(inside)  # counted, not listed: a name may claim 999999999 shards
        while len(gaps) < 3 and n <= int(total):
            if n not in inside:
                gaps.append(f"model-{n:0{width}d}-of-{total}.safetensors")
            n += 1
    if len(totals) > 1:
        names = sorted(totals)
        gaps.append(
            f"shards of {len(totals)} different sets (of-{', of-'.join(names[:3])}"
            + (", ...)" if len(names) > 3 else ")")
        )
        count += 1
    return gaps, count


@check("pack.shards", needs=("pack",))
def check_shards(ctx: DoctorContext) -> Row:
    """FAIL on a gap in ``model-NNNNN-of-MMMMM``, a leftover ``*.incomplete``/``*.part``, a header that
    cannot be read, a tensor whose byte span is not dtype x shape, or ``8 + header_len + max_end`` not
    equal to the file size; a truncated shard fails mid-load (R README.md:38; L mtp_overlay.py
    read_header/validate_header)."""
    scan = pack_scan(ctx)
    pack = shlex.quote(str(ctx.pack))
    redownload = f"hf download <repo-id> --local-dir {pack}"
    if scan.listing_error:
        return Row(
            "pack.shards", FAIL, scan.listing_error + ".", f"Check the --pack path and its permissions ({pack})."
        )
    if not scan.files:
        return Row(
            "pack.shards",
            FAIL,
            f"{ctx.pack} holds no *.safetensors file.",
            f"Point --pack at the directory that holds the shards, or download them: {redownload}.",
        )
    gaps, gap_count = _numbering_gaps(scan.files)
    leftovers = _leftovers(ctx.pack)
    if scan.problems:
        first = scan.problems[0]
        if first.expected_size is not None:
            fix = (
                f"shard {first.path.name} is incomplete (expected {first.expected_size} bytes, found "
                f"{first.found_size}); resume the download: {redownload}."
            )
        else:
            fix = f"Re-download {first.path.name} (for a Hub pack: {redownload} resumes and repairs it)."
        detail = _first([str(p) for p in scan.problems])
        return Row("pack.shards", FAIL, f"{len(scan.files)} shards: {detail}.", fix)
    if gaps:
        more = f" (and {gap_count - 1} more)" if gap_count > 1 else ""
        return Row(
            "pack.shards",
            FAIL,
            f"{len(scan.files)} shards, but {gaps[0]}{more} is missing.",
            f"Download the missing shards: {redownload}.",
        )
    if leftovers:
        return Row(
            "pack.shards",
            FAIL,
            f"an interrupted download left {_first(leftovers)} in the pack.",
            f"Finish the download ({redownload}), then delete the leftover files.",
        )
    return Row(
        "pack.shards",
        PASS,
        f"{len(scan.files)} shards, {scan.safetensors_bytes / 1e9:.2f} GB: every header is valid and every "
        "file is exactly as long as its header says.",
    )


@check("pack.index", needs=("pack",))
def check_index(ctx: DoctorContext) -> Row:
    """FAIL if ``model.safetensors.index.json`` leaves out a ``*.safetensors`` on disk that holds tensors
    (vLLM silently skips it) or names a file that is not there (FileNotFoundError) (V0.28.0
    model_loader/weight_utils.py:573-598; P README.md "Native ExLlamaV3 packs")."""
    pack = ctx.pack
    scan = pack_scan(ctx)
    if scan.listing_error:
        return Row("pack.index", SKIP, scan.listing_error + " (see pack.shards).")
    path = pack / INDEX_NAME
    regenerate = "Regenerate the index from the files on disk (or delete it: the vcruz305 pack ships none)."
    try:
        raw = read_regular_file(path, INDEX_LIMIT)
    except FileNotFoundError:
        return Row("pack.index", PASS, f"no {INDEX_NAME}: vLLM loads every *.safetensors in the pack.")
    except OSError as exc:
        return Row("pack.index", FAIL, f"{INDEX_NAME} cannot be read ({exc.strerror or exc}).", regenerate)
    if json_cost(raw) > INDEX_MEMORY:
        return Row(
            "pack.index",
            FAIL,
            f"{INDEX_NAME} holds more JSON values than doctor reads ({len(raw):,} bytes, mostly separators "
            "and brackets).",
            regenerate,
        )
    try:
        weight_map = json.loads(raw).get("weight_map")
    except (ValueError, AttributeError, RecursionError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        return Row("pack.index", FAIL, f"{INDEX_NAME} has no valid weight_map (name -> file).", regenerate)
    listed = set(weight_map.values())
    on_disk = {p.name for p in scan.files}
    # vLLM skipping a shard that holds no tensor loses nothing.
    unlisted = sorted(name for name in on_disk - listed if scan.tensor_counts.get(name, 1))
    absent = sorted(name for name in listed if not (pack / name).is_file())
    if unlisted:
        return Row(
            "pack.index",
            FAIL,
            f"{INDEX_NAME} does not list {_first(unlisted)}; vLLM will silently skip it.",
            f"{INDEX_NAME} does not list {', '.join(unlisted)}; vLLM will silently skip them. " + regenerate,
        )
    if absent:
        return Row(
            "pack.index",
            FAIL,
            f"{INDEX_NAME} names {_first(absent)}, which is not in the pack (FileNotFoundError at load).",
            f"Restore {', '.join(absent)} into the pack, or regenerate the index from the files on disk.",
        )
    return Row("pack.index", PASS, f"{INDEX_NAME} lists all {len(on_disk)} *.safetensors files, and each exists.")


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _is_hub_cache_blob(pack: Path, target: str) -> bool:
    # A Hub cache snapshot (<repo>/snapshots/<rev>/) is made of links into <repo>/blobs/: that is its layout.
    real_pack = Path(os.path.realpath(pack))
    return real_pack.parent.name == "snapshots" and _inside(target, str(real_pack.parent.parent / "blobs"))


@check("pack.symlinks", needs=("pack",))
def check_symlinks(ctx: DoctorContext) -> Row:
    """FAIL on a dangling or looping symlink; WARN on a symlink out of the pack, since a derived pack
    then breaks when its source is deleted (L docs/LNA-CANON.md, Lessons; mtp_overlay.py link_source_files)."""
    pack = ctx.pack
    try:
        entries = sorted(pack.iterdir(), key=lambda p: p.name)
    except OSError as exc:
        return Row("pack.symlinks", SKIP, f"{pack} cannot be listed ({exc.strerror or exc}; see pack.shards).")
    broken, outside = [], []
    real_pack = os.path.realpath(pack)
    for entry in entries:
        if not entry.is_symlink():
            continue
        try:
            os.stat(entry)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                broken.append((entry.name, "a symlink loop"))
            else:
                broken.append((entry.name, f"a symlink to a missing file ({os.readlink(entry)})"))
            continue
        target = os.path.realpath(entry)
        if not _inside(target, real_pack) and not _is_hub_cache_blob(pack, target):
            outside.append(f"{entry.name} -> {target}")
    if broken:
        name, reason = broken[0]
        return Row(
            "pack.symlinks",
            FAIL,
            _first([f"{n} is {r}" for n, r in broken]) + ".",
            f"{name} is {reason.split(' (')[0]}; copy the real file into the pack in its place "
            "(derived packs should not depend on the source pack).",
        )
    if outside:
        return Row(
            "pack.symlinks",
            WARN,
            f"{_first(outside)} points outside the pack.",
            "Copy the linked files into the pack: deleting or moving the source pack would break this one.",
        )
    return Row("pack.symlinks", PASS, "no symlink in the pack is broken or leaves it.")


# --------------------------------------------------------------------------- checks: routed experts


def _missing_part(bit: int) -> str:
    if bit >= 12:
        bit -= 12
        return f"{PROJECTIONS[bit // 2]}.{SOURCE_PARTS[bit % 2]}"
    part = EXL3_PARTS[bit % 4]
    return f"{PROJECTIONS[bit // 4]}.{'mcg' if part == 'marker' else part}"


def _experts_by_layer(scan: PackScan) -> dict[tuple[str, int], dict[int, int]]:
    """(block, layer) -> expert -> the bit set of its tensors present."""
    by_layer: dict[tuple[str, int], dict[int, int]] = defaultdict(dict)
    for (block, layer, expert), mask in scan.experts.items():
        by_layer[(block, layer)][expert] = mask
    return by_layer


def _expected_experts(dims: Dims, by_layer: dict[tuple[str, int], dict[int, int]]):
    """(block, layer, complete mask) for every routed-expert layer the pack must hold."""
    for layer in range(dims.layers):
        yield "layers", layer, EXL3_COMPLETE
    for (block, layer), present in sorted(by_layer.items()):
        if block == "mtp":
            exl3 = sum(1 for m in present.values() if m & EXL3_COMPLETE) >= len(present) / 2
            yield "mtp", layer, EXL3_COMPLETE if exl3 else SOURCE_COMPLETE


@check("experts.complete", needs=("pack",))
def check_experts_complete(ctx: DoctorContext) -> Row:
    """FAIL if any ``layers.L.ffn.experts.E.w{1,2,3}.{trellis,suh,svh}`` or its marker (for L <
    num_hidden_layers, E < n_routed_experts), or any tensor of an MTP block's experts in its format,
    is missing: vLLM does not track unloaded weights of quantized models, so they stay uninitialised
    (V0.28.0 model_loader/default_loader.py:435-470)."""
    cfg = ctx.config()
    dims = model_dims(cfg)
    if isinstance(dims, str):
        return Row("experts.complete", SKIP, dims + ".")
    by_layer = _experts_by_layer(pack_scan(ctx))
    missing, first = 0, None
    # Counted per layer from the experts present (a config may declare millions of experts: none is looped over).
    for block, layer, complete in _expected_experts(dims, by_layer):
        present = {e: m for e, m in by_layer.get((block, layer), {}).items() if e < dims.experts}
        here = (dims.experts - len(present)) * bin(complete).count("1")
        here += sum(bin(complete & ~m).count("1") for m in present.values())
        if here and first is None:
            expert = 0
            while expert in present and not complete & ~present[expert]:
                expert += 1
            absent = complete & ~present.get(expert, 0)
            bit = (absent & -absent).bit_length() - 1
            first = f"{block}.{layer}.ffn.experts.{expert}.{_missing_part(bit)}"
        missing += here
    if missing:
        return Row(
            "experts.complete",
            FAIL,
            f"{_plural(missing, 'routed-expert tensor')} missing (first: {first}); vLLM would leave them "
            "uninitialised and generate garbage.",
            f"Re-download the shards that hold them (hf download <repo-id> --local-dir {shlex.quote(str(ctx.pack))}).",
        )
    blocks = len(list(_expected_experts(dims, by_layer)))
    return Row(
        "experts.complete",
        PASS,
        f"all {dims.experts} experts x 3 projections of {blocks} expert layers are present "
        f"({dims.layers} main, {blocks - dims.layers} MTP).",
    )


def _expected_layout(dims: Dims, projection: str, part: str, dtype: str, shape: tuple) -> str | None:
    """The layout vllm-exl3 allocates for this tensor (or the source draft format), or None if it matches."""
    h, i = dims.hidden, dims.intermediate
    in_dim, out_dim = (i, h) if projection == "w2" else (h, i)
    if part == "trellis":
        want = ("I16", f"[{in_dim // 16}, {out_dim // 16}, 16K]")
        ok = dtype == "I16" and len(shape) == 3 and shape[:2] == (in_dim // 16, out_dim // 16)
    elif part in ("suh", "svh"):
        size = in_dim if part == "suh" else out_dim
        want, ok = ("F16", f"[{size}]"), dtype == "F16" and shape == (size,)
    elif part == "marker":
        want, ok = ("I32", "[1]"), dtype == "I32" and shape == (1,)
    elif part == "weight":
        want = ("I8", f"[{out_dim}, {in_dim // 2}]")
        ok = dtype == "I8" and shape == (out_dim, in_dim // 2)
    else:
        want, ok = ("F8_E8M0", "[...]"), dtype == "F8_E8M0"
    return None if ok else f"{want[0]} {want[1]}"


@check("experts.shapes", needs=("pack",))
def check_experts_shapes(ctx: DoctorContext) -> Row:
    """FAIL unless each routed EXL3 expert tensor has the layout vllm-exl3 allocates: trellis I16
    [H/16, I/16, 16K] (w1/w3) or [I/16, H/16, 16K] (w2), suh/svh F16 of the input/output size, marker
    I32 [1] (a donor scalar [] fails); source-format MTP experts are I8 .weight and F8_E8M0 .scale; with
    TP > 1, I/16 must divide by TP (P exl3.py Exl3MoEMethod.create_weights/_load_exl3, shard_exl3_col;
    R LOADER_NOTES.md:81-82; L README-layer-overlay.md; L mtp_overlay.py source_draft_shapes)."""
    cfg = ctx.config()
    dims = model_dims(cfg)
    if isinstance(dims, str):
        return Row("experts.shapes", SKIP, dims + ".")
    scan = pack_scan(ctx)
    wrong, count = [], 0
    for (_block, projection, part, dtype, shape), (n, name) in scan.expert_layouts.items():
        expected = _expected_layout(dims, projection, part, dtype, shape)
        if expected:
            count += n
            wrong.append(f"{name} is {dtype} {list(shape)}, expected {expected}")
    tp = tensor_parallel(ctx)
    if wrong:
        scalar = any(" [], expected I32 [1]" in w for w in wrong)
        note = " Scalar MCG markers must be stored as [1]." if scalar else ""
        return Row(
            "experts.shapes",
            FAIL,
            f"{_plural(count, 'expert tensor')} with the wrong layout; {_first(wrong)}.",
            f"{wrong[0]} (the vllm-exl3 destination).{note} Re-create those tensors with the right layout "
            "(or re-download the pack).",
        )
    if (dims.intermediate // 16) % tp:
        return Row(
            "experts.shapes",
            FAIL,
            f"moe_intermediate_size {dims.intermediate} is {dims.intermediate // 16} trellis tiles, which "
            f"--tensor-parallel-size {tp} does not divide.",
            f"Serve with a --tensor-parallel-size that divides {dims.intermediate // 16}.",
        )
    return Row(
        "experts.shapes",
        PASS,
        f"every routed-expert tensor has the vllm-exl3 layout for hidden {dims.hidden}, intermediate "
        f"{dims.intermediate}" + (f", split {tp} ways" if tp > 1 else "") + ".",
    )


@check("experts.one-k", needs=("pack",))
def check_experts_one_k(ctx: DoctorContext) -> Row:
    """FAIL if a layer's experts mix trellis widths (gate/up/down or across experts) or a width is not
    a multiple of 16: per-layer bits cannot express it and the fused MoE needs one K per layer
    (R fix_pack_config.py:60-63; P physical_k_compat.py)."""
    scan = pack_scan(ctx)
    if skip := _no_shards("experts.one-k", scan):
        return skip
    problems = []
    for (block, layer), widths in sorted(scan.widths.items()):
        if len(widths) > 1:
            problems.append(
                f"{_block(block, layer)} mixes trellis widths {sorted(widths)} "
                f"({', '.join(widths[w] for w in sorted(widths))})"
            )
        elif next(iter(widths)) % 16:
            problems.append(f"{_block(block, layer)} has trellis width {next(iter(widths))}, not a multiple of 16")
    if problems:
        return Row(
            "experts.one-k",
            FAIL,
            _first(problems) + ".",
            f"{problems[0].split(' (')[0]}; per-layer bits cannot express it and the fused MoE needs one K "
            "per layer: re-quantize (or re-download) that layer's experts at one K.",
        )
    ks = Counter(k for k in scan.layer_k().values() if k)
    if not ks:
        return Row("experts.one-k", PASS, "the shards hold no routed-expert trellis (see experts.complete).")
    return Row(
        "experts.one-k",
        PASS,
        "every expert layer has one trellis width (" + ", ".join(f"{n} at K{k}" for k, n in sorted(ks.items())) + ").",
    )


@check("quant.layer-bits", needs=("pack",))
def check_layer_bits(ctx: DoctorContext) -> Row:
    """FAIL if ``layer_bits.get(L, bits) * 16`` differs from layer L's trellis width, or an entry is
    not a K in 2-6: ``EXL3 load shape mismatch`` part-way through the load (R fix_pack_config.py:40,43-69;
    LOADER_NOTES.md:79-88; P exl3.py Exl3Config.__init__, bits_for_prefix)."""
    quant = quantization_config(ctx.config())
    scan = pack_scan(ctx)
    bits = declared_bits(quant)
    layer_bits, _ = declared_layer_bits(quant)
    base = valid_bits(quant) or majority_k(scan) or bits
    wanted = _json(layer_bits_for(scan, base))
    problems = layer_bits_problems(quant, scan)
    if problems:
        return Row(
            "quant.layer-bits",
            FAIL,
            f"layer_bits does not match the shards: {_first(problems)}.",
            f'Set "layer_bits": {wanted} (the layers whose K is not {base})' + _fix_config_note(ctx) + ".",
        )
    return Row(
        "quant.layer-bits",
        PASS,
        f"bits {bits} and layer_bits {_json({str(k): v for k, v in sorted(layer_bits.items())})} match the "
        f"trellis width of all {len(scan.layer_k())} expert layers.",
    )


@check("experts.markers", needs=("pack",))
def check_markers(ctx: DoctorContext) -> Row:
    """FAIL unless every ``.mcg`` holds -877912083 and every ``.mul1`` -2082680531 (all markers read,
    4 bytes each): vllm-exl3 raises ``packed ABI mismatch`` only after the full load
    (P exl3.py:94,96, Exl3MoEMethod.process_weights_after_loading; L mtp_overlay.py verify_output)."""
    scan = pack_scan(ctx)
    if skip := _no_shards("experts.markers", scan):
        return skip
    if scan.bad_marker_count:
        return Row(
            "experts.markers",
            FAIL,
            f"{scan.bad_marker_count} of {scan.markers_checked} markers are wrong; first: {scan.first_bad_marker}.",
            f"{scan.first_bad_marker}: the pack's packed ABI does not match vllm-exl3 (the load would fail "
            "after reading every shard); re-download or re-quantize the tensors with wrong markers.",
        )
    if not scan.markers_checked:
        return Row("experts.markers", PASS, "the pack has no EXL3 marker tensors to read.")
    return Row(
        "experts.markers",
        PASS,
        f"all {scan.markers_checked} EXL3 markers read (4 bytes each) hold their codebook's value.",
    )


# --------------------------------------------------------------------------- checks: dense weights and MTP


def plain_bf16_dense(scan: PackScan) -> list[str]:
    """Dense linears stored as a BF16 ``.weight`` with no scale tensor and no EXL3 trellis."""
    scale_parts = ("scale", "weight_scale_inv", "weight_scale")
    return [
        module
        for module, parts in sorted(scan.dense.items())
        if parts.get("weight", ("",))[0] == "BF16"
        and "trellis" not in parts
        and not any(p in parts for p in scale_parts)
    ]


@check("dense.policy", needs=("pack",))
def check_dense_policy(ctx: DoctorContext) -> Row:
    """FAIL if dense linears are BF16 without scales, not covered by ``non_routed_exl3``, the policy is
    not ``bf16_as_stored``, a ``non_routed_quantization`` delegate is declared (without one the plugin
    keeps them unquantized) and the installed vLLM lacks the route-B loader (``_bf16_to_fp8_stream`` in
    deepseek_v4/nvidia/model.py): the plugin hands them to the fp8 method and the model returns empty or
    uniform text with no error (R README.md:309-319; LOADER_NOTES.md:134-140,166-180; P exl3.py
    get_quant_method). Without a located vLLM the route-B half is reported as unchecked."""
    quant = quantization_config(ctx.config())
    policy = quant.get("non_routed_dtype_policy")
    plain = plain_bf16_dense(pack_scan(ctx))
    if not plain:
        return Row("dense.policy", PASS, "no dense linear is stored as plain BF16, so the policy does not apply.")
    example = f"{_plural(len(plain), 'dense linear')} stored as BF16 with no scales (e.g. {plain[0]}.weight)"
    if policy == STOCK_POLICY:
        return Row("dense.policy", PASS, f'{example}, and non_routed_dtype_policy is "{STOCK_POLICY}".')
    found = "absent" if policy is None else _echo(policy)
    delegate = quant.get("non_routed_quantization")
    if not (isinstance(delegate, dict) and delegate.get("quant_method")):
        return Row(
            "dense.policy",
            PASS,
            f"{example}; policy {found}, but with no non_routed_quantization delegate vllm-exl3 keeps them "
            "unquantized.",
        )
    fix = (
        f'Set "non_routed_dtype_policy": "{STOCK_POLICY}" in quantization_config{_fix_config_note(ctx)}, '
        "and keep non_routed_quantization for the DSpark draft. (Hub packs downloaded after 2026-09-01 ship "
        "the fork value.)"
    )
    text, where = _vllm_file(ctx, *DSV4_NVIDIA, "model.py")
    if text is None:
        return Row(
            "dense.policy",
            WARN,
            f"{example}, non_routed_dtype_policy is {found}, and whether vLLM quantizes them at load "
            f"(route B) could not be checked: {where}.",
            fix + " Keep the policy only on the archived fork runtime with patch_dsv4_loader.py applied.",
        )
    if ROUTE_B_MARKER in text:
        return Row(
            "dense.policy", PASS, f"{example}; policy {found} with the route-B loader ({ROUTE_B_MARKER} in {where})."
        )
    return Row(
        "dense.policy",
        FAIL,
        f"non_routed_dtype_policy is {found} with {example}: on stock/nightly vLLM the plugin hands them to "
        "the fp8 method and the model returns empty or uniform text with no error.",
        fix,
    )


@check("mtp.format", needs=("pack",))
def check_mtp_format(ctx: DoctorContext) -> Row:
    """The MTP experts' format must match ``mtp_experts*``: source format (``.weight`` I8 + ``.scale``
    F8_E8M0) needs ``mtp_experts: "source"``, ``mtp_experts_start_layer == num_hidden_layers`` and a
    ``non_routed_quantization`` method; EXL3 (``.trellis``) needs ``mtp_experts`` absent or ``"exl3"`` and
    ``layer_bits`` K for layers num_hidden_layers + L. FAIL with DSpark on the command line (the draft
    loads after the target: ``KeyError: 'w13_weight_scale'``), else WARN (R fix_pack_config.py:103-111;
    LOADER_NOTES.md:176-180; P CHANGELOG.md:67; L README-mtp-overlay.md, mtp_overlay.py edited_config)."""
    cfg = ctx.config()
    quant = quantization_config(cfg)
    scan = pack_scan(ctx)
    fmt = scan.mtp_format()
    drafting = drafts_from_mtp(ctx)
    layers = _config_int(cfg, "num_hidden_layers")
    mode = quant.get("mtp_experts")
    if fmt == "none":
        if drafting:
            return Row(
                "mtp.format",
                FAIL,
                "--speculative-config drafts from MTP layers, but the pack has no MTP experts.",
                "Drop --speculative-config, or serve a pack that ships its MTP (DSpark) layers.",
            )
        return Row("mtp.format", PASS, "the pack has no MTP experts (no speculative decoding from it).")
    problems, fix = [], ""
    if fmt == "source":
        problems = source_mtp_problems(cfg, quant)
        fix = (
            f'Set "mtp_experts": "source", "mtp_experts_start_layer": {layers} and "non_routed_quantization": '
            f"{_json(FP8_DELEGATE)} in quantization_config" + _fix_config_note(ctx) + "."
        )
    elif fmt == "exl3":
        bits = declared_bits(quant)
        layer_bits, _ = declared_layer_bits(quant)
        if mode not in (None, "exl3"):
            problems.append(f"mtp_experts is {_echo(mode)}, which sends EXL3 draft experts to the fp8 delegate")
        wanted = {}
        for block, k in sorted(scan.layer_k("mtp").items()):
            index = (layers or 0) + block
            declared = layer_bits.get(index, bits)
            if k is not None and declared != k:
                problems.append(f"layer {index} (mtp.{block}) declares K{declared}, its trellis is K{k}")
                wanted[str(index)] = k
        steps = (
            ['remove "mtp_experts" and "mtp_experts_start_layer" from quantization_config']
            if mode not in (None, "exl3")
            else []
        )
        steps += [f'add {_json(wanted)} to "layer_bits"'] if wanted else []
        fix = "For this EXL3 draft, " + " and ".join(steps) + "."
    else:
        problems.append("some MTP experts are in the source format and some in EXL3")
        fix = "Rebuild the MTP overlay so every draft expert has one format (lna-lab tools/mtp_overlay.py)."
    if not problems:
        return Row("mtp.format", PASS, f"MTP experts are {fmt}-format and quantization_config declares them so.")
    symptom = {"source": " (KeyError: 'w13_weight_scale')", "exl3": " (EXL3 load shape mismatch)"}.get(fmt, "")
    if drafting:
        status, when = FAIL, "--speculative-config drafts from them, so the draft load will fail"
    else:
        status, when = WARN, "with --speculative-config dspark the draft load would fail"
    return Row(
        "mtp.format",
        status,
        f"the pack's MTP experts are {fmt}-format but {_first(problems)}; {when} after the target has loaded{symptom}.",
        fix,
    )


@check("quant.delegate", needs=("pack", "runtime"))
def check_quant_delegate(ctx: DoctorContext) -> Row:
    """FAIL if ``non_routed_quantization.quant_method`` is not a method the installed vLLM registers
    (``QuantizationMethods`` in vllm/model_executor/layers/quantization/__init__.py, read by AST):
    ``_non_routed_delegate`` raises at model construction (P exl3.py _non_routed_delegate)."""
    nrq = quantization_config(ctx.config()).get("non_routed_quantization")
    if nrq is None:
        return Row("quant.delegate", PASS, "quantization_config declares no non_routed_quantization delegate.")
    method = nrq.get("quant_method") if isinstance(nrq, dict) else None
    if not isinstance(method, str):
        return Row(
            "quant.delegate",
            FAIL,
            "non_routed_quantization names no quant_method.",
            f'Set "non_routed_quantization": {_json(FP8_DELEGATE)} in quantization_config.',
        )
    text, where = _vllm_file(ctx, "vllm", "model_executor", "layers", "quantization", "__init__.py")
    methods = _registered_quant_methods(text) if text is not None else None
    if methods is None:
        return Row(
            "quant.delegate", SKIP, f"the quantization methods of the installed vLLM could not be read ({where})."
        )
    if method not in methods:
        return Row(
            "quant.delegate",
            FAIL,
            f"non_routed_quantization names {_echo(method)}, which {where} does not register.",
            f'Use "fp8" (the DeepSeek-V4 block-FP8 declaration): "non_routed_quantization": {_json(FP8_DELEGATE)}.',
        )
    return Row("quant.delegate", PASS, f'non_routed_quantization "{method}" is a method this vLLM registers.')


def _vllm_prefix(module: str) -> str:
    """The vLLM module a checkpoint dense linear loads into: ``layers.3.attn.wq_a`` ->
    ``model.layers.3.attn.fused_wqa_wkv`` (L README-dense-serve.md, "Merged configuration")."""
    _, layer, rest = module.split(".", 2)
    return f"model.layers.{layer}.{'attn.wo_a' if WO_A_SLICE.match(rest) else DENSE_LINEARS[rest]}"


def _declared_dense_bits(nre: dict, prefix: str, base: int) -> int | None | str:
    """K for ``prefix`` the way vllm-exl3 reads ``non_routed_exl3`` (layers first, then module
    suffixes); None when the prefix is not declared, the raw value when it is not an integer."""
    layers = nre.get("layers") if isinstance(nre.get("layers"), dict) else {}
    if prefix in layers:
        entry = layers[prefix]
        raw = entry["bits"] if isinstance(entry, dict) and "bits" in entry else nre.get("bits", base)
    else:
        modules = nre.get("modules") if isinstance(nre.get("modules"), list) else []
        suffix = next((m for m in modules if isinstance(m, str) and (prefix == m or prefix.endswith("." + m))), None)
        if suffix is None:
            return None
        suffix_bits = nre.get("layer_bits") if isinstance(nre.get("layer_bits"), dict) else {}
        raw = suffix_bits.get(suffix, nre.get("bits", base))
    k = plugin_int(raw)
    return k if k is not None else repr(raw)


@check("dense.exl3-map", needs=("pack",))
def check_dense_exl3_map(ctx: DoctorContext) -> Row:
    """FAIL if ``non_routed_exl3`` and the dense EXL3 tensors disagree: a declared prefix with no
    tensors, an EXL3 linear nobody declares, ``bits*16 !=`` trellis width, fused halves with different
    K, a linear with zero or two markers, or ``bf16_shards`` with TP > 1; all fail during or after the
    load (L README.md:34; README-dense-serve.md:16-49; P exl3.py Exl3Config, Exl3LinearMethod)."""
    quant = quantization_config(ctx.config())
    nre = quant.get("non_routed_exl3")
    scan = pack_scan(ctx)
    modules = scan.dense_exl3_modules()
    if not nre and not modules:
        return Row("dense.exl3-map", PASS, "routed-only EXL3: no dense EXL3 tensors and no non_routed_exl3.")
    restore = (
        "Restore quantization_config.non_routed_exl3 from the bake's merged config "
        "(lna-lab tools/dense_bake.py --merge)."
    )
    if nre and not isinstance(nre, dict):
        return Row(
            "dense.exl3-map",
            FAIL,
            f"quantization_config.non_routed_exl3 is a JSON {type(nre).__name__}; vllm-exl3 needs an object.",
            restore if modules else "Remove non_routed_exl3: this pack has no dense EXL3 tensors.",
        )
    if not nre:
        return Row(
            "dense.exl3-map",
            FAIL,
            f"{len(modules)} dense linears are EXL3 (e.g. {modules[0]}.trellis) but quantization_config "
            "declares no non_routed_exl3, so vLLM would look for their .weight.",
            restore,
        )
    base = declared_bits(quant)
    problems: list[tuple[str, str]] = []
    codebook = nre.get("codebook", "mcg")
    if not isinstance(codebook, str) or codebook not in MARKER_VALUES:
        problems.append((f"non_routed_exl3.codebook is {_echo(codebook)}", 'Set non_routed_exl3 "codebook": "mcg".'))
    mismatched: Counter = Counter()
    groups: dict[str, set[int]] = defaultdict(set)
    for module in modules:
        parts = scan.dense[module]
        prefix = _vllm_prefix(module)
        markers = [p for p in parts if p in MARKER_VALUES]
        if len(markers) != 1 or "suh" not in parts or "svh" not in parts:
            problems.append(
                (
                    f"{module} has {len(markers)} markers and {'suh' in parts}/{'svh' in parts} suh/svh",
                    f"{module} needs .trellis, .suh, .svh and exactly one .mcg or .mul1; re-run the bake for it.",
                )
            )
        shape = parts["trellis"][1]
        width = shape[-1] if shape else 0
        groups[prefix].add(width)
        declared = _declared_dense_bits(nre, prefix, base)
        if declared is None:
            problems.append(
                (
                    f"{module} is EXL3 but non_routed_exl3 does not declare {prefix}",
                    f'Add "{prefix}": {{"bits": {width // 16}}} to non_routed_exl3.layers.',
                )
            )
        elif isinstance(declared, str) or declared not in VALID_K:
            problems.append(
                (
                    f"non_routed_exl3 declares {prefix} bits={declared} (vllm-exl3 accepts 2-6)",
                    f'Set "bits": {width // 16} for {prefix} in non_routed_exl3.layers.',
                )
            )
        elif declared * 16 != width:
            mismatched[(declared, width // 16)] += 1
            problems.append(
                (
                    f"non_routed_exl3 declares {prefix} bits={declared} but {module}.trellis has width "
                    f"{width} (K{width // 16})",
                    f'Set "bits": {width // 16} for {prefix} in non_routed_exl3.layers.',
                )
            )
    for prefix, widths in sorted(groups.items()):
        if len(widths) > 1:
            problems.append(
                (
                    f"the halves of {prefix} have trellis widths {sorted(widths)}",
                    f"Re-bake {prefix}'s source linears at one K (both halves of a fused module share it).",
                )
            )
    declared_layers = nre.get("layers") if isinstance(nre.get("layers"), dict) else {}
    tp = tensor_parallel(ctx)
    for prefix, entry in declared_layers.items():
        if prefix not in groups:
            problems.append(
                (
                    f"non_routed_exl3 declares {prefix} but the shards hold no EXL3 tensors for it",
                    f"Remove {prefix} from non_routed_exl3.layers, or add its baked tensors to the pack.",
                )
            )
        if isinstance(entry, dict) and entry.get("bf16_shards") and tp > 1:
            problems.append(
                (
                    f"{prefix} keeps bf16_shards, which vllm-exl3 refuses at --tensor-parallel-size {tp}",
                    "Serve at --tensor-parallel-size 1, or bake every shard of it to EXL3.",
                )
            )
    if not problems:
        return Row(
            "dense.exl3-map",
            PASS,
            f"non_routed_exl3 declares all {len(groups)} dense EXL3 modules ({len(modules)} linears) with "
            "the K of their trellis, one marker each.",
        )
    if len(mismatched) == 1 and sum(mismatched.values()) == len(problems):
        ((declared, k),) = mismatched
        fix = f'non_routed_exl3 declares bits={declared} where the trellis is K{k}: set every such "bits" to {k}.'
    else:
        fix = problems[0][1]
    return Row("dense.exl3-map", FAIL, _first([p for p, _ in problems]) + ".", fix)


@check("dense.wo-a-slices", needs=("pack",))
def check_wo_a_slices(ctx: DoctorContext) -> Row:
    """FAIL unless a pack storing ``attn.wo_a.slice.N`` is served at --tensor-parallel-size = the number
    of slices (8) with lna-lab's dense patch applied to the installed vLLM (its ``attn.wo_a.slice``
    mapping in deepseek_v4/nvidia/model.py and the ``_exl3_linears`` branch in flashinfer_sparse.py)
    (L tools/README-dense-serve.md, "TP=8 serving"; recipe-lna/patch_dsv4_dense_exl3.py)."""
    scan = pack_scan(ctx)
    if skip := _no_shards("dense.wo-a-slices", scan):
        return skip
    slices: dict[int, set[int]] = defaultdict(set)
    for module in scan.dense:
        _, layer, rest = module.split(".", 2)
        match = WO_A_SLICE.match(rest)
        if match:
            slices[int(layer)].add(int(match.group(1)))
    if not slices:
        return Row("dense.wo-a-slices", PASS, "wo_a is stored whole (no attn.wo_a.slice.N tensors).")
    n = max(max(ids) for ids in slices.values()) + 1
    fix = (
        f"This pack stores wo_a as {n} slices (lna-lab Dense bake); it serves only at --tensor-parallel-size {n} "
        "with recipe-lna/patch_dsv4_dense_exl3.py applied."
    )
    partial = sorted(layer for layer, ids in slices.items() if ids != set(range(n)))
    if partial:
        return Row(
            "dense.wo-a-slices",
            FAIL,
            f"layer {partial[0]} has wo_a slices {sorted(slices[partial[0]])}, not 0-{n - 1}.",
            "Re-run the dense merge: every layer needs all of its wo_a slices.",
        )
    tp = tensor_parallel(ctx)
    if tp != n:
        return Row(
            "dense.wo-a-slices",
            FAIL,
            f"wo_a is stored as {n} slices per layer but --tensor-parallel-size is {tp}.",
            fix,
        )
    model, model_where = _vllm_file(ctx, *DSV4_NVIDIA, "model.py")
    sparse, _ = _vllm_file(ctx, *DSV4_NVIDIA, "flashinfer_sparse.py")
    if model is None:
        return Row(
            "dense.wo-a-slices",
            WARN,
            f"wo_a is stored as {n} slices at TP {tp}; whether vLLM has lna-lab's dense patch could not be "
            f"checked: {model_where}.",
            fix,
        )
    if "attn.wo_a.slice." not in model or sparse is None or "_exl3_linears" not in sparse:
        return Row(
            "dense.wo-a-slices",
            FAIL,
            f"wo_a is stored as {n} slices but {model_where} (and its flashinfer_sparse.py) lack lna-lab's "
            "dense patch.",
            fix,
        )
    return Row(
        "dense.wo-a-slices",
        PASS,
        f"wo_a is stored as {n} slices, served at TP {tp} on a vLLM with lna-lab's dense patch.",
    )


# --------------------------------------------------------------------------- checks: model keys


@check("config.topk-method", needs=("pack",))
def check_topk_method(ctx: DoctorContext) -> Row:
    """FAIL if ``layers.N.ffn.gate.bias`` exists for N >= num_hash_layers and ``topk_method`` is not
    ``noaux_tc``: vLLM creates ``e_score_correction_bias`` only under noaux_tc, so the load raises
    KeyError or a skip-if-missing loader drops the routing biases *(inferred)* (V0.28.0
    nvidia/model.py:596-600,1411; V0.30.0 :861-868; R LOADER_NOTES.md:69-77)."""
    cfg = ctx.config()
    biased = routing_bias_layers(cfg, pack_scan(ctx))
    method = cfg.get("topk_method")
    if not biased:
        return Row("config.topk-method", PASS, "no routing bias (ffn.gate.bias) on a non-hash layer.")
    if method == "noaux_tc":
        return Row(
            "config.topk-method",
            PASS,
            f'{_plural(len(biased), "layer")} ship ffn.gate.bias and topk_method is "noaux_tc".',
        )
    found = "absent" if method is None else _echo(method)
    return Row(
        "config.topk-method",
        FAIL,
        f"the checkpoint ships routing biases on {len(biased)} layers (layers.{biased[0]}.ffn.gate.bias) but "
        f"topk_method is {found}; vLLM will not create e_score_correction_bias.",
        'Add "topk_method": "noaux_tc" at the top level of config.json (not inside a text_config)'
        + _fix_config_note(ctx)
        + ".",
    )


@check("config.hash-layers", needs=("pack",))
def check_hash_layers(ctx: DoctorContext) -> Row:
    """FAIL if ``num_hash_layers`` is not the number of leading layers that carry ``ffn.gate.tid2eid``
    (R LOADER_NOTES.md:58-67)."""
    cfg = ctx.config()
    declared = cfg.get("num_hash_layers")
    layers = sorted(pack_scan(ctx).tid2eid_layers)
    if layers != list(range(len(layers))):
        return Row(
            "config.hash-layers",
            FAIL,
            f"ffn.gate.tid2eid is on layers {layers}, not on the first {len(layers)}.",
            "Re-download the shards holding the first layers' gate tensors.",
        )
    if (declared or 0) != len(layers) or isinstance(declared, bool):
        return Row(
            "config.hash-layers",
            FAIL,
            f"num_hash_layers is {_echo(declared)} but the checkpoint has tid2eid on {_plural(len(layers), 'layer')}.",
            f'Set "num_hash_layers": {len(layers)} in config.json (restore it from the source config).',
        )
    return Row("config.hash-layers", PASS, f"num_hash_layers {len(layers)} matches the layers carrying tid2eid.")


def _vllm_minor(version: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


@check("config.vision", needs=("pack",))
def check_vision(ctx: DoctorContext) -> Row:
    """FAIL if vision tensors (``vision.*``, ``aligner.*``, ``image_*``, ``ffn.gate.bias_vl``) are present
    but ``vision_n_layers`` is 0 or absent: vLLM >= 0.30 picks the text class and rejects them. WARN when
    ``vision_n_layers`` > 0 without a vision tower, and for a vision pack on vLLM 0.28/0.29 (text only,
    loader-skips needed) (V0.30.0 transformers_utils/model_arch_config_convertor.py:601-606,
    nvidia/model.py:871-878; S FINDINGS.md)."""
    cfg = ctx.config()
    layers = _config_int(cfg, "vision_n_layers") or 0
    scan = pack_scan(ctx)
    if scan.vision_tensors and layers <= 0:
        return Row(
            "config.vision",
            FAIL,
            f"the pack ships {scan.vision_tensors} vision tensors (e.g. {scan.first_vision_tensor}) but "
            f"vision_n_layers is {_echo(cfg.get('vision_n_layers'))}.",
            "The pack ships a vision tower but vision_n_layers is 0: vLLM >= 0.30 will pick the text class and "
            "reject vision.* / leave gate.bias_vl unset. Restore vision_n_layers from the source config.",
        )
    if not scan.vision_tensors and layers > 0:
        return Row(
            "config.vision",
            WARN,
            f"vision_n_layers is {layers} but the pack has no vision tensors; vLLM >= 0.30 would build a "
            "vision tower and gate.bias_vl that nothing loads.",
            'Set "vision_n_layers": 0 for this text-only pack.',
        )
    if not layers:
        return Row("config.vision", PASS, "text-only pack: no vision tensors and no vision_n_layers.")
    runtime = ctx.runtime
    minor = _vllm_minor(runtime.vllm_version if runtime else None)
    if minor in ((0, 28), (0, 29)):
        return Row(
            "config.vision",
            WARN,
            f"vision pack ({scan.vision_tensors} vision tensors) on vLLM {runtime.vllm_version}, which has no "
            "DeepSeek-V4 vision class.",
            "This serves text only and needs patch-dsv4's loader-skips (patch-dsv4 apply); use vLLM >= 0.30 "
            "for images.",
        )
    return Row("config.vision", PASS, f"vision_n_layers {layers} and {scan.vision_tensors} vision tensors agree.")


@check("config.spec-k", needs=("pack",))
def check_spec_k(ctx: DoctorContext) -> Row:
    """FAIL if ``num_speculative_tokens`` k > n MTP layers and k % n != 0: vLLM rejects it at startup
    (V0.28.0 config/speculative.py:1066-1081; R README.md:433-435, "4 is rejected outright")."""
    spec = speculative_config(ctx)
    if spec is None:
        return Row("config.spec-k", PASS, "no --speculative-config on the serve command line.")
    if isinstance(spec, str):
        return Row(
            "config.spec-k",
            FAIL,
            spec + ".",
            "--speculative-config takes a JSON object, e.g. "
            """'{"method":"dspark","num_speculative_tokens":3}'.""",
        )
    method = spec.get("method")
    if method not in MTP_DRAFT_METHODS:
        return Row(
            "config.spec-k", PASS, f"speculative method {_echo(method)} does not draft from the pack's MTP layers."
        )
    n = len(pack_scan(ctx).mtp_blocks) or _config_int(ctx.config(), "num_nextn_predict_layers") or 0
    k = spec.get("num_speculative_tokens")
    if n == 0:
        return Row(
            "config.spec-k",
            FAIL,
            f"--speculative-config asks for {method}, but the pack has no MTP layers.",
            "Drop --speculative-config, or serve a pack that ships its MTP layers.",
        )
    if not isinstance(k, int) or isinstance(k, bool):
        return Row("config.spec-k", PASS, f"{method} with num_speculative_tokens unset: vLLM uses the {n} MTP layers.")
    if k > n and k % n:
        return Row(
            "config.spec-k",
            FAIL,
            f"num_speculative_tokens is {k} and the pack has {n} MTP layers.",
            f"num_speculative_tokens={k} is not allowed with {n} MTP layers; use {n} (or a multiple of {n}).",
        )
    return Row("config.spec-k", PASS, f"num_speculative_tokens {k} fits the pack's {n} MTP layers.")
