"""What a DeepSeek-V4.1 row needs from the shards' headers, gathered by the one header scan.

:class:`pack.PackScan` hands every tensor that is not a routed expert to :meth:`V41Summary.note`
(and counts the draft's expert bytes itself), whichever way the headers were read; the V4.1 rows
(v41_tensors, v41_engram, v41_serving) read only this summary and PackScan's own. Nothing here
opens a file. Families are those of v41-packs.md §2.1; the EXL3 names (``.trellis`` or
``_trellis``) of §2.2; the routed-only/dense rule of §2.3.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

# How a tensor's name below ``layers.L.`` says its family (v41-packs.md §2.1): where an EXL3 trellis sits.
ATTENTION = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "q_norm", "kv_norm", "attn_sink")
# where an EXL3 trellis outside the main layers' routed experts sits, as §2.3 names the dense-EXL3 places
EXL3_PLACES = ("attention", "compressor", "indexer", "shared expert", "Engram projection", "head", "draft", "other")
TABLE_PARTS = ("weight", "scale")


def family(rest: list[str]) -> str | None:
    """The §2.1 family of ``layers.L.<rest>``, or None (routed experts, the Engram table, unknown names)."""
    first = rest[0]
    if first.startswith("hc_"):
        return "mHC"
    if first in ("attn_norm", "ffn_norm"):
        return "norms"
    if first == "attn" and len(rest) > 1:
        second = rest[1]
        if second == "compressor":
            return "compressor"
        if second == "indexer":
            return "indexer"
        return "attention" if second in ATTENTION else None
    if first == "ffn" and len(rest) > 1:
        if rest[1] == "gate":
            return "router"
        if rest[1] == "shared_experts":
            return "shared expert"
        return None
    if first == "engram" and len(rest) > 1 and rest[1] != "embed":
        return "Engram projection"
    return None


def is_trellis(part: str) -> bool:
    return part == "trellis" or part.endswith("_trellis")


@dataclass
class V41Summary:
    """Per-family layer sets, the Engram tables' headers, EXL3 places and byte counts."""

    payload_bytes: int = 0  # every tensor's bytes (each shard's last data offset)
    mtp_bytes: int = 0  # the DSpark draft's (mtp.*) bytes
    vision_bytes: int = 0  # vision.*, aligner.*, image_*
    # layer -> "weight"/"scale" -> (dtype, shape, shard file name) of layers.L.engram.embed.*
    tables: dict[int, dict[str, tuple[str, list, str]]] = field(default_factory=lambda: defaultdict(dict))
    table_bytes: int = 0
    exl3_places: Counter = field(default_factory=Counter)  # EXL3_PLACES -> trellis count
    first_exl3: dict[str, str] = field(default_factory=dict)  # EXL3_PLACES -> first name

    def add_payload(self, shard) -> None:
        """One shard's payload size: the file past its header where the file is as long as the header says
        (the tensors then cover it from 0 with no gap), else the last tensor's end."""
        file_size, header_len = getattr(shard, "file_size", 0), getattr(shard, "header_len", 0)
        if getattr(shard, "size_error", None) is None and file_size > 8 + header_len:
            self.payload_bytes += file_size - 8 - header_len
            return
        self.payload_bytes += max((entry["data_offsets"][1] for entry in shard.tensors.values()), default=0)

    def size(self) -> int:
        return len(self.tables) + len(self.first_exl3)

    def note(self, name: str, parts: list[str], entry: dict, shard_name: str, layer: int | None) -> None:
        """A tensor that is not a routed expert of a main layer; ``layer`` is L of ``layers.L.`` / ``mtp.L.``."""
        head = parts[0]
        start, end = entry["data_offsets"]
        if head == "mtp":
            self.mtp_bytes += end - start
            if is_trellis(parts[-1]):
                self._exl3("draft", name)
            return
        if head in ("vision", "aligner") or head.startswith("image_"):
            self.vision_bytes += end - start
            return
        if head == "layers" and layer is not None and len(parts) > 2:
            rest = parts[2:]
            if rest[0] == "engram" and len(rest) == 3 and rest[1] == "embed" and rest[2] in TABLE_PARTS:
                self.tables[layer][rest[2]] = (entry["dtype"], list(entry["shape"]), shard_name)
                self.table_bytes += end - start
                return
            if is_trellis(parts[-1]):
                kind = family(rest)
                self._exl3(kind if kind in EXL3_PLACES else "other", name)
            return
        if head == "head" and is_trellis(parts[-1]):
            self._exl3("head", name)
        elif is_trellis(parts[-1]):
            self._exl3("other", name)

    def _exl3(self, place: str, name: str) -> None:
        self.exl3_places[place] += 1
        self.first_exl3.setdefault(place, name)
