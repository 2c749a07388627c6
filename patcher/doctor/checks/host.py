"""Host checks: the GPUs (``nvidia-smi`` when it is on PATH), ``/proc/meminfo`` and the pack's size.

A CPU-only machine, a build container without a driver, or a tool that hangs
or prints something unexpected gives ``skip`` rows, never a failure. Rows
follow DOCTOR-FACTS.md table D "Host".
"""

from __future__ import annotations

import math
import re

from patch_dsv4.doctor.checks.runtime import build_exllamav3_fix, target_option
from patch_dsv4.doctor.readers.base import FAIL, INFO, PASS, SKIP, WARN, DoctorContext, Row, check
from patch_dsv4.doctor.readers.family import V4
from patch_dsv4.doctor.readers.serving_env import (
    gib,
    gpu_memory_utilization,
    gpus,
    human_readable_int,
    locate_extension,
    max_model_len,
    meminfo,
    pack_bytes,
    release,
    run_tool,
    tensor_parallel_size,
    vision_pack,
)

# Listing the cubins of a several-hundred-MB extension takes longer than a query of the driver.
CUOBJDUMP_TIMEOUT_S = 30.0
MLA_KV_BYTES_PER_TOKEN_LAYER = 512 + 64  # kv_lora_rank + qk_rope_head_dim (P exl3.py compute_mla_kv_cache_bytes)
LONG_CONTEXT_TOKENS = 262_144
RECIPE_BATCHED_TOKENS = 2048


@check("host.gpu")
def gpu_path(ctx: DoctorContext) -> Row:
    """The GPUs and the attention path they take.

    INFO: SM12x (GB10 12.1, RTX PRO 12.0) take FlashInfer's SM120 sparse-MLA
    kernels (the wide-swa patch matters for vision prefill on FlashInfer 0.6.x);
    other architectures take FlashMLA (dtype-policy must cover flashmla.py on
    0.28/0.29). SKIP without nvidia-smi or a driver. Evidence: R preflight.py:109-124;
    L Dockerfile:3; S FINDINGS.md.
    """
    found, problem = gpus(ctx)
    if not found:
        return Row("host.gpu", SKIP, f"no GPU to read: {problem}")
    kinds = {}
    for gpu in found:
        kinds[(gpu.name, gpu.sm)] = kinds.get((gpu.name, gpu.sm), 0) + 1
    listed = ", ".join(f"{count} x {name} sm_{sm}" for (name, sm), count in kinds.items())
    if all(gpu.sm // 10 == 12 for gpu in found):
        path = "FlashInfer SM120 sparse-MLA attention (wide-swa matters for vision prefill on FlashInfer 0.6.x)"
    else:
        path = "FlashMLA attention (on vLLM 0.28/0.29 dtype-policy must cover flashmla.py)"
    return Row("host.gpu", INFO, f"{listed}: {path}.")


def _runs_on(sm: int, cubins: set[tuple[int, str]]) -> bool:
    """CUDA's binary compatibility: a cubin runs on its own SM, and a plain (not arch-specific "a") one on later
    minors."""
    return any(
        number == sm or (number // 10 == sm // 10 and number < sm and suffix != "a") for number, suffix in cubins
    )


@check("host.ext-arch", needs=("runtime",))
def extension_cubins(ctx: DoctorContext) -> Row:
    """Was exllamav3_ext compiled for these GPUs?

    ``cuobjdump --list-elf`` of the extension the serving interpreter loads.
    WARN if no cubin runs on a GPU's sm_XX. SKIP without the extension, a GPU
    or cuobjdump. Evidence: R install_local_runtime.sh:66 (12.1a); L Dockerfile:3 (12.0).
    """
    found, problem = gpus(ctx)
    if not found:
        return Row("host.ext-arch", SKIP, f"no GPU to compare with: {problem}")
    extension = locate_extension(ctx.runtime, "exllamav3_ext").path
    if extension is None:
        return Row("host.ext-arch", SKIP, "no compiled exllamav3_ext (rt.exllamav3-ext reports it)")
    listing = run_tool(ctx, "cuobjdump", ["--list-elf", str(extension)], timeout=CUOBJDUMP_TIMEOUT_S)
    if listing.output is None:
        return Row("host.ext-arch", SKIP, f"cannot list the extension's cubins: {listing.problem}")
    cubins = {(int(number), suffix) for number, suffix in re.findall(r"sm_(\d+)([af]?)\b", listing.output)}
    if not cubins:
        return Row("host.ext-arch", SKIP, f"cuobjdump lists no sm_ cubin in {extension.name}")
    built = ", ".join(f"sm_{n}{s}" for n, s in sorted(cubins))
    missing = sorted({gpu.sm for gpu in found if not _runs_on(gpu.sm, cubins)})
    if missing:
        return Row(
            "host.ext-arch",
            WARN,
            f"{extension.name} holds cubins for {built}, none of which runs on "
            f"{', '.join(f'sm_{sm}' for sm in missing)}.",
            build_exllamav3_fix(ctx),
        )
    return Row("host.ext-arch", PASS, f"{extension.name} holds cubins for {built}, which run on every GPU here.")


@check("host.page-cache")
def page_cache(ctx: DoctorContext) -> Row:
    """On unified memory (GB10), the page cache counts as used GPU memory.

    WARN when the GPU shares host memory and MemFree is below
    --gpu-memory-utilization x MemTotal: vLLM's startup check fails ("Free
    memory on device ... less than desired GPU memory utilization"). PASS on
    discrete GPUs. Evidence: R docs/LOADER_NOTES.md:33-44, serve_one_spark_dsv4.sh:65-87,
    README.md:405-409.
    """
    found, problem = gpus(ctx)
    if not found:
        return Row("host.page-cache", SKIP, f"cannot tell whether the GPU shares host memory: {problem}")
    if not any(gpu.unified_memory for gpu in found):
        return Row(
            "host.page-cache", PASS, "the GPUs have their own memory: the page cache does not count against vLLM."
        )
    memory, problem = meminfo(ctx)
    util = gpu_memory_utilization(ctx)
    if not memory or util is None:
        return Row("host.page-cache", SKIP, problem or "--gpu-memory-utilization is not a fraction")
    total, free, cached = memory["MemTotal"], memory.get("MemFree", 0), memory.get("Cached", 0)
    wanted = util * total
    if free >= wanted:
        return Row(
            "host.page-cache",
            PASS,
            f"MemFree {gib(free)} covers --gpu-memory-utilization {util} of MemTotal {gib(total)}.",
        )
    fitting = math.floor(free / total * 100) / 100
    return Row(
        "host.page-cache",
        WARN,
        f"on unified memory MemFree is {gib(free)}, below {util} x MemTotal ({gib(wanted)}), with {gib(cached)} "
        "in the page cache: vLLM's startup memory check will fail.",
        "drop the page cache first (sync; echo 1 | sudo tee /proc/sys/vm/drop_caches, or the recipe's "
        f"DROP_PAGE_CACHE=1), or lower --gpu-memory-utilization to {fitting:.2f}",
    )


_STREAMING = ("applied", "upstream", "not-applicable")


@check("host.sorted-load", needs=("runtime", "pack"), family=V4)  # V4's vision class
def sorted_vision_load(ctx: DoctorContext) -> Row:
    """Will vLLM's vision loader hold the whole pack in host memory?

    vLLM 0.30-0.32's DeepSeek-V4 vision class sorts the weight iterator, which
    materializes every shard. FAIL when a vision pack meets that loader (the
    stream-load verdict, or the version where there is none) and MemTotal is
    below 1.2 x the pack's bytes; on unified memory the weights themselves take
    the same memory, so 2.2 x [late]: the machine wedges mid-load.
    Evidence: R README.md:345; S FINDINGS.md (stream load).
    """
    runtime = ctx.runtime
    if not vision_pack(ctx):
        return Row("host.sorted-load", PASS, "a text-only pack: the vision class's sorted load does not run.")
    verdict = (runtime.patch_verdicts or {}).get("stream-load")
    version = runtime.vllm_version or "this vLLM"
    if verdict is None:
        found = release(runtime.vllm_version)
        verdict = "pending" if found and (0, 30) <= found[:2] < (0, 33) else "not-applicable"
    if verdict in _STREAMING:
        return Row(
            "host.sorted-load",
            PASS,
            f"stream-load is {verdict} on vLLM {version}: the weights stream, not the whole pack at once.",
        )
    memory, problem = meminfo(ctx)
    if not memory:
        return Row("host.sorted-load", SKIP, f"the vision loader sorts the pack but host memory is unknown: {problem}")
    size, total = pack_bytes(ctx), memory["MemTotal"]
    found_gpus, _ = gpus(ctx)
    unified = any(gpu.unified_memory for gpu in found_gpus)
    factor = 2.2 if unified else 1.2
    if total < size * factor:
        shared = " (on unified memory the loaded weights take the same memory)" if unified else ""
        return Row(
            "host.sorted-load",
            FAIL,
            f"vLLM {version}'s vision loader holds the whole pack ({size / 1e9:.0f} GB) in host memory; MemTotal "
            f"{gib(total)} is below {factor} x that{shared}, so the load will exhaust RAM.",
            f"patch-dsv4 apply{target_option(runtime)}",
        )
    return Row(
        "host.sorted-load",
        PASS,
        f"the sorted load holds about {size / 1e9:.0f} GB; MemTotal {gib(total)} has room for {factor} x that.",
    )


@check("host.other-model")
def other_gpu_processes(ctx: DoctorContext) -> Row:
    """Another process on the GPU.

    WARN when nvidia-smi lists a compute process (on unified boxes two model
    processes take each other down). SKIP without nvidia-smi or on output it
    cannot read. Evidence: R docs/TEST_VISION.md §1, README.md:410-412.
    """
    listing = run_tool(
        ctx, "nvidia-smi", ["--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"]
    )
    if listing.output is None:
        return Row("host.other-model", SKIP, f"cannot list GPU processes: {listing.problem}")
    processes, unreadable = [], []
    for line in listing.output.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if not line.strip():
            continue
        if fields[0].isdigit() and len(fields) >= 2:
            processes.append((fields[0], fields[1]))
        else:
            unreadable.append(line.strip())
    if processes:
        said = ", ".join(f"{pid} ({name})" for pid, name in processes)
        return Row(
            "host.other-model",
            WARN,
            f"another process is using the GPU: {said}.",
            f"stop it before serving (kill {' '.join(pid for pid, _ in processes)}); on a unified-memory box "
            "two model processes take each other down",
        )
    if unreadable:
        return Row(
            "host.other-model", SKIP, f"nvidia-smi printed process lines doctor cannot read ({unreadable[0][:60]!r})"
        )
    return Row("host.other-model", PASS, "no compute process holds a GPU.")


# V4's 43 x (512 + 64) bytes a token; V4.1's memory: v41.engram-capacity
@check("host.kv-budget", needs=("pack",), family=V4)
def kv_budget(ctx: DoctorContext) -> Row:
    """Do the weights and one --max-model-len request's KV fit in --gpu-memory-utilization of a GPU?

    KV per token is taken as vllm-exl3's ``compute_mla_kv_cache_bytes``:
    num_hidden_layers x (512 + 64) bytes at fp8, an upper bound (DeepSeek-V4
    compresses most layers' KV), replicated on every TP rank; weights are the
    pack's bytes / TP. WARN when the weights alone exceed the budget, or with
    --max-num-batched-tokens > 2048 at 256k; INFO when only the upper bound
    exceeds it. Evidence: P exl3.py compute_mla_kv_cache_bytes,
    validate_context_scaling, CHANGELOG.md:35-36; R README.md:416-422,428-432.
    """
    config = ctx.config()
    found, problem = gpus(ctx)
    if not found:
        return Row("host.kv-budget", SKIP, f"no GPU memory to budget: {problem}")
    tp, util = tensor_parallel_size(ctx), gpu_memory_utilization(ctx)
    length, _ = max_model_len(ctx)
    if tp is None or util is None or length is None:
        return Row(
            "host.kv-budget",
            SKIP,
            "--tensor-parallel-size, --gpu-memory-utilization or --max-model-len is not readable",
        )
    if any(gpu.unified_memory for gpu in found):
        memory, problem = meminfo(ctx)
        if not memory:
            return Row("host.kv-budget", SKIP, f"unified memory but host memory is unknown: {problem}")
        per_gpu = memory["MemTotal"]
    else:
        per_gpu = min(gpu.memory_mib for gpu in found) * 2**20
    budget = util * per_gpu
    weights = pack_bytes(ctx) / tp
    layers = config.get("num_hidden_layers")
    kv_dtype = ctx.serve_flag("--kv-cache-dtype") or "auto"
    kv = (
        length
        * (layers if isinstance(layers, int) and 0 < layers < 100_000 else 43)
        * MLA_KV_BYTES_PER_TOKEN_LAYER
        * (1 if kv_dtype.startswith("fp8") else 2)
    )
    batched = human_readable_int(ctx.serve_flag("--max-num-batched-tokens"))
    figures = (
        f"weights {gib(weights)} per GPU, KV for {length:,} tokens at most {gib(kv)}, "
        f"budget {util} x {gib(per_gpu)} = {gib(budget)}"
    )
    if weights > budget:
        return Row(
            "host.kv-budget",
            WARN,
            f"the weights alone exceed the memory vLLM may use ({figures}).",
            "raise --gpu-memory-utilization or spread the pack over more GPUs (--tensor-parallel-size)",
        )
    if batched and batched > RECIPE_BATCHED_TOKENS and length >= LONG_CONTEXT_TOKENS:
        return Row(
            "host.kv-budget",
            WARN,
            f"--max-num-batched-tokens {batched} at --max-model-len {length:,}: the "
            f"recipe keeps {RECIPE_BATCHED_TOKENS} past 256k (prefill buffers grow with it).",
            f"serve with --max-num-batched-tokens {RECIPE_BATCHED_TOKENS}",
        )
    if weights + kv > budget:
        return Row(
            "host.kv-budget", INFO, f"one full-length request may not fit: {figures} (the KV figure is an upper bound)."
        )
    return Row("host.kv-budget", PASS, f"one full-length request fits: {figures}.")
