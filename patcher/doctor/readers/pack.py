"""The pack, read once: the shards' headers summarised, and what config.json declares.

Every header is read once per run, by :func:`pack_scan`, which keeps only
what the checks need (which expert tensors exist, their layouts, the trellis
widths per layer, every marker's 4 bytes, the gate, vision and dense names) and
frees each header before reading the next shard. The checks (config, shards,
experts, bits, dense, model; registered in report order by run.py) only compare
that summary with config.json, the intended serve flags and, where a row says
so, files of the installed vLLM (read as text, never imported).
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import operator
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from patch_dsv4.doctor.readers.base import (
    SKIP,
    DoctorContext,
    Row,
    clip,
    json_cost_over,
)
from patch_dsv4.doctor.readers.safetensors import Budget, Shard, ShardError
from patch_dsv4.doctor.readers.v41_scan import V41Summary

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
MAX_LAYERS = 100_000  # num_hidden_layers doctor takes (the real pack: 43)
# What the scan keeps (experts, layouts, dense modules and parts, widths, layers): the real pack needs ~13k.
MAX_SUMMARY = 50_000
INDEX_LIMIT = 64 << 20  # bytes of model.safetensors.index.json read (the real pack's would be ~8 MB)
INDEX_MEMORY = 128 << 20  # what json.loads may allocate for it (see json_cost)


def _index(text: str) -> int | None:
    """A layer or expert number in a tensor name (decimal digits, at most 9: int() takes them), else None."""
    return int(text) if text.isdecimal() and len(text) < 10 else None


# --------------------------------------------------------------------------- the scan


def _expert_owner(prefix: str) -> list | None:
    """For ``layers.L.ffn.experts.E`` (or ``mtp.``): [0 bits, (block, L, E), (block, L), block]; else None."""
    parts = prefix.split(".")
    if len(parts) != 5 or parts[3] != "experts" or parts[2] != "ffn" or parts[0] not in ("layers", "mtp"):
        return None
    layer, expert = _index(parts[1]), _index(parts[4])
    if layer is None or expert is None:
        return None
    return [0, (parts[0], layer, expert), (parts[0], layer), parts[0]]


_DTYPE, _SHAPE, _OFFSETS = map(operator.itemgetter, ("dtype", "shape", "data_offsets"))
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _first_places(keys: list, places: list[int]) -> dict:
    """Each distinct key -> the first of ``places`` (the same length, ascending) where it is."""
    return dict(zip(reversed(keys), reversed(places), strict=True))


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
    markers_unread: int = 0  # markers of a pack whose data is not read (on the Hub: headers only)
    first_bad_marker: str | None = None
    bad_marker_count: int = 0
    mtp_blocks: set[int] = field(default_factory=set)
    gate_bias_layers: set[int] = field(default_factory=set)
    tid2eid_layers: set[int] = field(default_factory=set)
    vision_tensors: int = 0
    first_vision_tensor: str | None = None
    # "layers.N.attn.wq_a" -> part ("weight", "scale", "trellis", ...) -> (dtype, shape)
    dense: dict[str, dict[str, tuple[str, list]]] = field(default_factory=lambda: defaultdict(dict))
    # every tensor but a routed expert's (main layers' and the draft's) -> its dtype: what backbone.complete
    # compares with what vLLM creates (inventory.py); a few thousand names in a real pack
    others: dict[str, str] = field(default_factory=dict)
    v41: V41Summary = field(default_factory=V41Summary)  # what the DeepSeek-V4.1 rows read
    _pending: list = field(default_factory=list, repr=False)  # markers of the shard being read, to check

    def _marker(self, shard: Shard, place: int, name: str, entry: dict, suffix: str) -> None:
        """Queue one marker of ``shard``, the tensor at ``place`` in its header (read in one batch by
        ``_read_markers``, at the end of the shard)."""
        if not shard.reads_data:
            self.markers_unread += 1
            return
        self.markers_checked += 1
        start, end = entry["data_offsets"]
        self._pending.append((place, name, start, suffix, None if end - start == 4 else end - start))

    def _read_markers(self, shard: Shard) -> None:
        """Check the queued markers in header order, their bytes read a window at a time (thousands per shard,
        packed together)."""
        pending, self._pending = self._pending, []
        pending.sort(key=_FIRST)  # the routed experts' and the others' (queued apart) in header order
        values = shard.read_i32s([start for _, _, start, _, size in pending if size is None])
        found = iter(values)
        for _, name, start, suffix, size in pending:
            expected = MARKER_VALUES[suffix]
            if size is not None:
                problem = f"{name} is {size} bytes, not one int32"
            else:
                value = next(found)
                if value == expected:
                    continue
                if value is None:
                    problem = str(
                        ShardError(shard.path, f"tensor {name!r} cannot be read at byte {8 + shard.header_len + start}")
                    )
                else:
                    problem = f"{name} holds {value}, not the {suffix.upper()} marker {expected}"
            self.bad_marker_count += 1
            if self.first_bad_marker is None:
                self.first_bad_marker = problem

    def add_shard(self, shard: Shard) -> None:
        # One loop over ~3,900 names per shard (188k in the pack) does only what needs a name at a time. A
        # routed expert's name, nearly all of them, is cut at its last two dots (``layers.L.ffn.experts.E`` .
        # ``w1`` . ``trellis``); what the first piece says is worked out once per expert (``owners``), where its
        # tensors' bits gather, and the name's place in the header goes into the bucket of its kind (block,
        # layer, projection, part). The buckets are read after the loop (``_add_buckets``).
        tensors = shard.tensors
        self.v41.add_payload(shard)
        owners: dict[str, list | None] = {}  # this shard's "layers.L.ffn.experts.E" -> _expert_owner's answer
        found = []  # the owners with bits, in order
        kinds: dict[tuple[str, int], dict] = {}  # (block, layer) -> (projection, part) -> [bit mask, places]
        for place, name in enumerate(tensors):
            pieces = name.rsplit(".", 2)
            owner = owners.get(pieces[0], False)
            if owner is False:
                owner = owners[pieces[0]] = self._owner(pieces[0], kinds)
            if owner is None:
                self._add_other(shard, place, name, tensors[name], name.split("."))
                continue
            bucket = owner[4].get((pieces[1], pieces[2]))
            if bucket is None:
                if owner[3] == "mtp":
                    start, end = tensors[name]["data_offsets"]
                    self.v41.mtp_bytes += end - start
                continue
            if not owner[0]:
                found.append(owner)
            owner[0] |= bucket[0]
            bucket[1].append(place)
        experts = self.experts
        for owner in found:
            experts[owner[1]] = experts.get(owner[1], 0) | owner[0]
        if found:
            self._add_buckets(shard, kinds)
        if self._pending:
            self._read_markers(shard)

    def _owner(self, prefix: str, kinds: dict) -> list | None:
        """_expert_owner's answer for ``prefix``, with the buckets of its layer (new ones for a new layer)."""
        owner = _expert_owner(prefix)
        if owner is not None:
            buckets = kinds.get(owner[2])
            if buckets is None:
                buckets = kinds[owner[2]] = {key: [1 << bit, []] for key, bit in EXPERT_BITS.items()}
            owner.append(buckets)
            if owner[3] == "mtp":
                self.mtp_blocks.add(owner[2][1])
        return owner

    def _add_buckets(self, shard: Shard, kinds: dict) -> None:
        """The layouts, trellis widths and markers of a shard's routed-expert tensors, read a bucket at a time.

        Each fact keeps the first name in the header that shows it, and facts are added in header order, as a
        loop over the names would. A bucket's tensors nearly always share one layout, which two counts (in C)
        prove; one that holds several is counted tensor by tensor."""
        names, entries = list(shard.tensors), list(shard.tensors.values())
        # (first place, key, count, name), (first place, (block, layer), width, name), (first place, suffix, count)
        layouts, widths, markers = [], [], []
        for (block, layer), buckets in kinds.items():
            for (projection, part), (_, places) in buckets.items():
                if not places:
                    continue
                bucket = list(map(entries.__getitem__, places))
                shapes, dtypes = list(map(_SHAPE, bucket)), list(map(_DTYPE, bucket))
                head = (block, projection, LAYOUT_PART[part])
                if shapes.count(shapes[0]) == len(shapes) and dtypes.count(dtypes[0]) == len(dtypes):
                    layouts.append((places[0], (*head, dtypes[0], tuple(shapes[0])), len(places), names[places[0]]))
                    if part == "trellis" and shapes[0]:
                        widths.append((places[0], (block, layer), shapes[0][-1], names[places[0]]))
                else:
                    keys = list(zip(dtypes, map(tuple, shapes), strict=True))
                    first = _first_places(keys, places)
                    layouts += [(first[key], head + key, n, names[first[key]]) for key, n in Counter(keys).items()]
                    if part == "trellis":
                        kept = [(shape[-1], at) for shape, at in zip(shapes, places, strict=True) if shape]
                        first = _first_places([width for width, _ in kept], [at for _, at in kept])
                        widths += [(at, (block, layer), width, names[at]) for width, at in first.items()]
                if block == "mtp" or part in MARKER_VALUES:
                    offsets = list(map(_OFFSETS, bucket))
                    starts, ends = list(map(_FIRST, offsets)), list(map(_SECOND, offsets))
                    if block == "mtp":
                        self.v41.mtp_bytes += sum(ends) - sum(starts)
                    if part in MARKER_VALUES:
                        self._add_markers(shard, part, places, names, starts, ends)
                        if block == "layers":
                            markers.append((places[0], part, len(places)))
        layouts.sort(key=_FIRST)
        kept_layouts = self.expert_layouts
        for _, key, n, name in layouts:
            seen = kept_layouts.get(key)
            if seen is None:
                kept_layouts[key] = [n, name]
            else:
                seen[0] += n
        widths.sort(key=_FIRST)
        for _, layer, width, name in widths:
            self.widths[layer].setdefault(width, name)
        markers.sort(key=_FIRST)
        for _, suffix, n in markers:
            self.routed_marker_suffixes[suffix] += n

    def _add_markers(self, shard: Shard, suffix: str, places, names, starts, ends) -> None:
        """Count a bucket of routed-expert markers, and queue them to be read."""
        if not shard.reads_data:
            self.markers_unread += len(places)
            return
        self.markers_checked += len(places)
        sizes = list(map(operator.sub, ends, starts))
        sizes = [None] * len(sizes) if sizes.count(4) == len(sizes) else [None if n == 4 else n for n in sizes]
        names = map(names.__getitem__, places)
        self._pending += zip(places, names, starts, itertools.repeat(suffix), sizes, strict=False)

    def _add_other(self, shard: Shard, place: int, name: str, entry: dict, parts: list[str]) -> None:
        """Every name but a routed expert's: MTP blocks, gates, dense linears, the vision tower, stray markers."""
        head = parts[0]
        numbered = head in ("layers", "mtp") and len(parts) > 2 and _index(parts[1]) is not None
        self.others[name] = entry["dtype"]
        self.v41.note(name, parts, entry, shard.path.name, int(parts[1]) if numbered else None)
        if numbered:
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
            self._marker(shard, place, name, entry, parts[-1])

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
            + len(self.others)
            + len(self.mtp_blocks)
            + len(self.gate_bias_layers)
            + len(self.tid2eid_layers)
            + self.v41.size()
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


def _collector_paused(read):
    """``read`` with Python's cycle collector paused: json.loads of a pack's headers makes ~600k dicts and lists,
    none in a cycle and each freed with its shard, and the collector's passes over them (and over everything
    imported) cost ~10% of doctor's run while freeing nothing."""

    @functools.wraps(read)
    def paused(*args):
        if not gc.isenabled():
            return read(*args)
        gc.disable()
        try:
            return read(*args)
        finally:
            gc.enable()

    return paused


@_collector_paused
def scan_source(source) -> PackScan:
    """Every shard header of ``source`` (a source.PackSource), read once and summarised."""
    scan = PackScan()
    try:
        scan.files = source.shard_files()
    except OSError as exc:
        scan.listing_error = f"{source.label} cannot be listed ({exc.strerror or exc})"
        return scan
    budget = Budget()
    for path in scan.files:
        scan.safetensors_bytes += source.file_size(path) or 0
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
            with source.open_shard(path, budget) as shard:
                if shard.size_error:
                    scan.problems.append(shard.size_error)
                scan.tensor_counts[path.name] = len(shard.tensors)
                scan.add_shard(shard)
        except ShardError as exc:
            scan.problems.append(exc)
    return scan


def scan_pack(pack: Path) -> PackScan:
    """The header summary of the pack in directory ``pack``."""
    from patch_dsv4.doctor.readers.source import LocalSource

    return scan_source(LocalSource(pack))


def pack_scan(ctx: DoctorContext) -> PackScan:
    """The pack's header summary, read once per run."""
    source = ctx.source
    assert source is not None
    if source.local is not None:
        return ctx.cached("pack.scan", lambda: scan_pack(source.local))
    return ctx.cached("pack.scan", lambda: scan_source(source))


@dataclass(frozen=True)
class PackIndex:
    """``model.safetensors.index.json`` as read: ``weight_map`` (tensor name -> file) when it is valid;
    ``absent`` when the pack has none; ``error`` says why it cannot be used (one sentence, no period)."""

    weight_map: dict | None = None
    absent: bool = False
    error: str | None = None


def pack_index(ctx: DoctorContext) -> PackIndex:
    """The pack's index, read once per run (through the pack's source: a directory or the Hub)."""

    @_collector_paused
    def read() -> PackIndex:
        assert ctx.source is not None
        try:
            raw = ctx.source.read_file(INDEX_NAME, INDEX_LIMIT)
        except FileNotFoundError:
            return PackIndex(absent=True)
        except OSError as exc:
            return PackIndex(error=f"{INDEX_NAME} cannot be read ({exc.strerror or exc})")
        if json_cost_over(raw, INDEX_MEMORY):
            return PackIndex(
                error=f"{INDEX_NAME} holds more JSON values than doctor reads ({len(raw):,} bytes, mostly "
                "separators and brackets)"
            )
        try:
            weight_map = json.loads(raw).get("weight_map")
        except (ValueError, AttributeError, RecursionError):
            weight_map = None
        if not isinstance(weight_map, dict) or not set(map(type, weight_map.values())) <= {str}:
            return PackIndex(error=f"{INDEX_NAME} has no valid weight_map (name -> file)")
        return PackIndex(weight_map=weight_map)

    return ctx.cached("pack.index", read)


# --------------------------------------------------------------------------- config helpers


def plugin_int(value) -> int | None:
    """``int(value)`` as vllm-exl3 does it, or None where that raises."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return None


def config_int(cfg: dict, key: str) -> int | None:
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
    layers = config_int(cfg, "num_hidden_layers")
    mode, start = quant.get("mtp_experts"), quant.get("mtp_experts_start_layer")
    delegate = quant.get("non_routed_quantization")
    problems = []
    if mode != "source":
        problems.append(f'mtp_experts is {json_text(mode) if mode is not None else "absent"}, not "source"')
    if start != layers:
        problems.append(f"mtp_experts_start_layer is {echo(start)}, not num_hidden_layers ({layers})")
    if not (isinstance(delegate, dict) and delegate.get("quant_method")):
        problems.append("non_routed_quantization declares no quant_method for the draft's experts")
    return problems


def routing_bias_layers(cfg: dict, scan: PackScan) -> list[int]:
    """Non-hash layers that ship ``ffn.gate.bias`` (they need ``topk_method: noaux_tc``)."""
    hash_layers = config_int(cfg, "num_hash_layers") or 0
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
    values = [config_int(cfg, key) for key in keys]
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


def no_shards(check_id: str, scan: PackScan) -> Row | None:
    """A skip row for a header-only check when there are no headers to read (pack.shards says why)."""
    if scan.listing_error or not scan.files:
        return Row(check_id, SKIP, "no shard to read (see pack.shards).")
    return None


def first_of(items: list[str]) -> str:
    return f"{items[0]} (and {len(items) - 1} more)" if len(items) > 1 else items[0]


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def block_label(block: str, layer: int) -> str:
    return f"layer {layer}" if block == "layers" else f"{block}.{layer}"


def json_text(value) -> str:
    return json.dumps(value, separators=(", ", ": "))


def echo(value) -> str:
    """A value read from the pack, as a row quotes it: JSON, cut to 200 characters."""
    return clip(json_text(value))


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
            vision=scan.vision_tensors > 0 or (config_int(cfg, "vision_n_layers") or 0) > 0,
            safetensors_bytes=scan.safetensors_bytes,
            index_topk=config_int(cfg, "index_topk"),
            num_attention_heads=config_int(cfg, "num_attention_heads"),
            attention_exl3=_exl3_covers(nre, "attn."),
            shared_experts_exl3=_exl3_covers(nre, "shared_experts"),
            mtp_experts=scan.mtp_format(),
        )

    return ctx.cached("pack.facts", compute)
