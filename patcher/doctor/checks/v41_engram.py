"""DeepSeek-V4.1's Engram tables against the host that would hold them (v41-packs.md §3).

v41.engram-capacity. vLLM 0.30-0.34 keeps the tables resident: per TP rank, ``cdiv(heads, TP)`` of a
layer's hash-head ranges, in pinned host memory (``cpu_offload``, the default), rounded up to a power
of two unless ``--engram-config '{"use_thp": true}'`` or a ``pinned_max_round_threshold_mb`` below the
allocation; on a GB10 (DGX Spark) host memory is the GPU's memory, so the tables and the weights
share it. The table sizes come from the pack's headers (or its config where the pack lacks them),
never from constants.
"""

from __future__ import annotations

import ast
import re

from patch_dsv4.doctor.checks.runtime import parse_python, vllm_file
from patch_dsv4.doctor.checks.v41_config import v41_numbers
from patch_dsv4.doctor.checks.v41_serving import data_parallel_size, dspark_on, json_flag
from patch_dsv4.doctor.checks.v41_tensors import disk_engram_kit, images_off, table_expectations
from patch_dsv4.doctor.readers.base import FAIL, INFO, PASS, SKIP, WARN, DoctorContext, Row, check, clip
from patch_dsv4.doctor.readers.family import V41
from patch_dsv4.doctor.readers.pack import pack_scan
from patch_dsv4.doctor.readers.serving_env import gib, gpu_memory_utilization, gpus, meminfo, tensor_parallel_size

GB10_VISIBLE = 121.69 * 2**30  # what a DGX Spark shows as MemTotal (DOCTOR-FACTS.md B.2)


def power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


def round_threshold(ctx: DoctorContext) -> int | None:
    """``pinned_max_round_threshold_mb`` from PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF, in bytes."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        match = re.search(r"pinned_max_round_threshold_mb\s*:\s*(\d{1,12})", ctx.environ.get(name, ""))
        if match:
            return int(match.group(1)) << 20
    return None


def engram_config_fields(ctx: DoctorContext) -> frozenset | None:
    """The fields of the installed vLLM's ``EngramConfig`` (vllm/config/engram.py, read by AST)."""

    def read():
        if ctx.runtime is None:
            return None
        path = vllm_file(ctx.runtime, "vllm/config/engram.py")
        tree, _ = parse_python(path) if path else (None, None)
        if tree is None:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == "EngramConfig":
                return frozenset(
                    n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                )
        return None

    return ctx.cached("vllm:engram-config", read)


def rank_tables(ctx: DoctorContext, tp: int) -> tuple[int, int, int]:
    """(largest rank's exact bytes, the same pinned by default, all tables' bytes) at ``tp`` ranks: each
    rank holds cdiv(heads, tp)/heads of every layer's weight and scale (V34 common/engram.py:962-1020)."""
    numbers = v41_numbers(ctx)
    heads = numbers["engram_n_heads"] * (numbers["engram_max_ngram_size"] - 1)
    share = -(-heads // tp)
    found = pack_scan(ctx).v41.tables
    exact = pinned = total = 0
    for layer, parts in table_expectations(numbers).items():
        for part, (_dtype, shape) in parts.items():
            got = found.get(layer, {}).get(part)
            rows, width = (got[1] if got and len(got[1]) == 2 else shape)[:2]
            size = rows * width  # F8: one byte an element
            total += size
            mine = -(-rows * share // heads) * width
            exact += mine
            pinned += mine if mine > (round_threshold(ctx) or 1 << 62) else power_of_two(mine)
    return exact, pinned, total


@check("v41.engram-capacity", needs=("pack",), family=V41)
def check_engram_capacity(ctx: DoctorContext) -> Row:
    """FAIL when the resident Engram tables cannot be held: on unified memory (GB10) when one rank's
    tables plus its share of the weights exceed MemTotal (WARN past --gpu-memory-utilization of it); on
    a discrete GPU host when the node's tables exceed MemAvailable (WARN within 10 %). FAIL on an
    ``--engram-config`` that stock vLLM refuses (``disk_offload`` is Qwen4Exp-only; a key its
    EngramConfig lacks, such as a kit's ``disk_backed``). PASS when a kit's disk-backed Engram is
    installed and switched on. Without a readable GPU it says what it computed and what it could not
    decide, never PASS (V34 config/engram.py:37-62,90-104, common/engram.py:1064-1093; v41-packs.md §3)."""
    numbers = v41_numbers(ctx)
    if numbers is None:
        return Row("v41.engram-capacity", SKIP, "config.json lacks the numbers this check reads (see v41.config).")
    if not numbers.engram_layers:
        return Row("v41.engram-capacity", PASS, "no Engram layers: no tables to hold.")
    engram = json_flag(ctx, "--engram-config")
    if isinstance(engram, str):
        return Row("v41.engram-capacity", FAIL, engram + ".", "--engram-config takes a JSON object.")
    engram = engram or {}
    fields = engram_config_fields(ctx)
    kit = disk_engram_kit(ctx)
    unknown = sorted(k for k in engram if fields is not None and k not in fields)
    if unknown and not kit:
        return Row(
            "v41.engram-capacity",
            FAIL,
            f"--engram-config sets {', '.join(map(clip, unknown))}, which vLLM {ctx.runtime.vllm_version}'s "
            "EngramConfig "
            "does not have: it refuses the config at startup (extra fields are forbidden).",
            "Drop " + ", ".join(unknown) + " from --engram-config (a kit key: it works only in that kit's image).",
        )
    if engram.get("disk_offload") is True:
        return Row(
            "v41.engram-capacity",
            FAIL,
            '--engram-config "disk_offload": true is for Qwen4Exp only: vLLM raises ValueError for DeepSeek-V4.1.',
            'Drop "disk_offload" from --engram-config.',
        )
    if kit:
        return Row(
            "v41.engram-capacity", PASS, f"{kit} is installed: the tables are read from the pack's files, not held."
        )
    tp, dp = tensor_parallel_size(ctx), data_parallel_size(ctx)
    util = gpu_memory_utilization(ctx)
    if tp is None or dp is None or util is None:
        return Row(
            "v41.engram-capacity",
            SKIP,
            "--tensor-parallel-size, --data-parallel-size or --gpu-memory-utilization is not readable.",
        )
    exact, pinned, total = rank_tables(ctx, tp)
    thp = engram.get("use_thp") is True
    on_gpu = engram.get("cpu_offload") is False
    tables = exact if thp or on_gpu else pinned
    scan = pack_scan(ctx).v41
    weights = scan.payload_bytes - scan.table_bytes
    weights -= 0 if dspark_on(ctx) else scan.mtp_bytes
    weights -= scan.vision_bytes if images_off(ctx) else 0
    weights_rank = max(weights, 0) // tp
    how = (
        "exact with use_thp"
        if thp
        else ("in GPU memory (cpu_offload false)" if on_gpu else "pinned, rounded up to powers of two")
    )
    figures = (
        f"at TP={tp} each rank holds {gib(tables)} of Engram tables ({how}; {gib(exact)} exact, "
        f"{gib(total)} in all) plus at least {gib(weights_rank)} of weights"
    )
    fix_more = "use a kit with disk-backed Engram (vcruz305, LakyFx, MiaAI-Lab), or more TP ranks / host memory" + (
        "" if thp else """; --engram-config '{"use_thp": true}' pins the exact size"""
    )
    found, problem = gpus(ctx)
    memory, mem_problem = meminfo(ctx)
    if not found:
        need = tables + weights_rank
        decided = "more than" if need > GB10_VISIBLE else "within"
        text = (
            f"could not tell the GPU ({problem}): {figures}, {gib(need)} per rank, {decided} a GB10's "
            f"{gib(GB10_VISIBLE)}; a discrete-GPU host needs {gib(tables * tp)} of free RAM per TP group. Run "
            "doctor on the serving host (with its --serve-args) to decide."
        )
        if need > GB10_VISIBLE:
            return Row(
                "v41.engram-capacity", WARN, text, f"If this is a DGX Spark, it cannot serve this pack so: {fix_more}."
            )
        return Row("v41.engram-capacity", INFO, text)
    if not memory:
        return Row("v41.engram-capacity", SKIP, f"host memory is unknown ({mem_problem}); {figures}.")
    unified = any(gpu.unified_memory for gpu in found)
    if unified:
        have = memory["MemTotal"]
        need = tables + weights_rank
        if need > have:
            return Row(
                "v41.engram-capacity",
                FAIL,
                f"DeepSeek-V4.1 keeps its Engram tables resident in pinned host memory, which on {found[0].name} is "
                f"GPU memory: {figures}, {gib(need)}, more than its {gib(have)}.",
                f"Stock vLLM {ctx.runtime.vllm_version if ctx.runtime else ''} cannot serve this pack on this "
                f"topology: {fix_more}.",
            )
        if need > util * have:
            return Row(
                "v41.engram-capacity",
                WARN,
                f"on unified memory {figures}, {gib(need)}, past --gpu-memory-utilization {util} of {gib(have)}: "
                "little or no room is left for the KV cache.",
                f"Lower the footprint: {fix_more}.",
            )
        return Row("v41.engram-capacity", PASS, f"unified memory: {figures}, {gib(need)} of {gib(have)}.")
    # Discrete GPUs: the node's ranks each pin their share; co-located DP replicas share one copy by default.
    node = tables * tp  # DP replicas on one node share one copy by default (dp_shared_memory)
    if on_gpu:
        per_gpu = min(gpu.memory_mib or 0 for gpu in found) * 2**20
        if tables > per_gpu:
            return Row(
                "v41.engram-capacity",
                FAIL,
                f"cpu_offload false puts each rank's tables ({gib(tables)}) in GPU memory, more than {gib(per_gpu)}.",
                "Drop cpu_offload: false from --engram-config (the tables then live in pinned host RAM).",
            )
        return Row(
            "v41.engram-capacity", PASS, f"cpu_offload false: {gib(tables)} of tables per GPU of {gib(per_gpu)}."
        )
    available = memory.get("MemAvailable", memory["MemTotal"])
    text = f"{figures}; the node pins {gib(node)} of host RAM for {tp} ranks, MemAvailable {gib(available)}"
    if node > available:
        return Row(
            "v41.engram-capacity",
            FAIL,
            f"{text}: it does not fit (pinned memory cannot be swapped).",
            f"{fix_more[0].upper()}{fix_more[1:]}.",
        )
    if node > 0.9 * available:
        return Row("v41.engram-capacity", WARN, f"{text}: within 10 % of it.", f"Free host memory, or {fix_more}.")
    return Row("v41.engram-capacity", PASS, text + ".")
