"""DeepSeek-V4.1 packs against the intended serve command, the environment and the installed vLLM
(v41-packs.md §4): the traps that fail late or silently.

v41.ep-filter-draft, v41.draft-overrides, v41.topology, v41.indexer-topk, v41.shared-stream,
v41.aux-streams, v41.flashinfer. Flags are read in both of vLLM's spellings (``--x '{json}'`` and
the dotted ``--x.key value``). The pack's facts come from the header scan (pack.pack_scan), never
from reading pack files here.
"""

from __future__ import annotations

import json

from patch_dsv4.doctor.checks.runtime import (
    flashinfer_install,
    flashinfer_served,
    pip_install,
    pip_remove,
    target_option,
)
from patch_dsv4.doctor.checks.v41_config import v41_numbers
from patch_dsv4.doctor.readers.base import FAIL, INFO, PASS, SKIP, WARN, DoctorContext, Row, check, clip
from patch_dsv4.doctor.readers.family import V41
from patch_dsv4.doctor.readers.pack import pack_scan, plural
from patch_dsv4.doctor.readers.serving_env import find_dist, gpus, max_model_len, tensor_parallel_size

SHARED_STREAM = "VLLM_DISABLE_SHARED_EXPERTS_STREAM"
GEMM_THRESHOLD = "VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD"
AUX_SWITCHES = (("PATCH_DSV4_AUX_STREAMS", "0"), ("DSV41_EXL3_SERIAL_STREAMS", "1"))
PERSISTENT_TOPK = (512, 1024, 2048)  # V34 model_executor/layers/indexer_topk.py:279-280
DRAFT_QUANT_KEYS = ("non_routed_quantization", "mtp_experts", "mtp_experts_start_layer")


def json_flag(ctx: DoctorContext, name: str) -> dict | str | None:
    """``--name '{...}'`` merged with the dotted ``--name.key value`` forms; a string says why it cannot
    be read; None when the flag is absent."""
    text = ctx.serve_flag(name)
    value: dict = {}
    if text is not None:
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError) as exc:
            return f"{name} is not JSON ({clip(str(exc))})"
        if not isinstance(parsed, dict):
            return f"{name} is a JSON {type(parsed).__name__}, not an object"
        value = parsed
    args = ctx.serve_args
    dotted = False
    for i, arg in enumerate(args):
        if arg.startswith(name + "."):
            key, _, inline = arg[len(name) + 1 :].partition("=")
            raw = inline if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            try:
                parsed_value = json.loads(raw)
            except (ValueError, RecursionError):
                parsed_value = raw
            target = value
            *parents, last = key.split(".")  # --x.a.b v nests as {"a": {"b": v}}, as vLLM reads it
            for parent in parents:
                if not isinstance(target.get(parent), dict):
                    target[parent] = {}
                target = target[parent]
            target[last] = parsed_value
            dotted = True
    return value if (text is not None or dotted) else None


def dspark_on(ctx: DoctorContext) -> bool:
    spec = json_flag(ctx, "--speculative-config")
    return isinstance(spec, dict) and spec.get("method") == "dspark"


def _positive(ctx: DoctorContext, *names: str) -> int | None:
    for name in names:
        value = ctx.serve_flag(name)
        if value is not None:
            return int(value) if value.isascii() and value.isdigit() and 0 < len(value) <= 6 and int(value) else None
    return 1


def data_parallel_size(ctx: DoctorContext) -> int | None:
    return _positive(ctx, "--data-parallel-size", "-dp")


def expert_parallel(ctx: DoctorContext) -> bool:
    return ctx.serve_switch("--enable-expert-parallel") or ctx.serve_switch("-ep")


@check("v41.ep-filter-draft", needs=("pack",), family=V41)
def check_ep_filter_draft(ctx: DoctorContext) -> Row:
    """WARN [silent-draft] with expert parallelism, ``--enable-ep-weight-filter``, DSpark, TP x DP > 1 and a
    draft with fewer experts than the target stored in source format: the filter's expert map is sized
    from the target's n_routed_experts, so EP ranks 1..n-1 skip their draft experts before reading them,
    and nothing reports it (V34 model_loader/default_loader.py:455, ep_weight_filter.py:117,
    v1/worker/gpu/spec_decode/dspark/utils.py:36-70; FC tools/engram/draft_ep_filter_fix.py)."""
    numbers = v41_numbers(ctx)
    on = [
        expert_parallel(ctx),
        ctx.serve_switch("--enable-ep-weight-filter"),
        dspark_on(ctx),
    ]
    if not all(on):
        names = ("--enable-expert-parallel", "--enable-ep-weight-filter", "DSpark --speculative-config")
        missing = [name for name, present in zip(names, on, strict=True) if not present]
        listed = ", no ".join(missing[:-1]) + (" and no " if len(missing) > 1 else "") + missing[-1]
        return Row(
            "v41.ep-filter-draft",
            PASS,
            f"the serve line has no {listed}: the EP weight filter skips no DSpark draft expert.",
        )
    tp, dp = tensor_parallel_size(ctx), data_parallel_size(ctx)
    if numbers is None or tp is None or dp is None:
        return Row("v41.ep-filter-draft", SKIP, "the config's expert counts or TP/DP are not readable.")
    ranks, target, draft = tp * dp, numbers["n_routed_experts"], numbers.draft_experts
    source = pack_scan(ctx).mtp_format() == "source"
    if ranks <= 1 or draft >= target or not source:
        why = (
            "one EP rank"
            if ranks <= 1
            else ("the draft has as many experts as the target" if draft >= target else "the draft's experts are EXL3")
        )
        return Row("v41.ep-filter-draft", PASS, f"--enable-ep-weight-filter with DSpark, but {why}: nothing skipped.")
    starved = "rank 1 never loads its" if ranks == 2 else f"ranks 1-{ranks - 1} never load their"
    return Row(
        "v41.ep-filter-draft",
        WARN,
        f"[silent-draft] --enable-ep-weight-filter sizes its expert filter from the target's {target} experts; the "
        f"DSpark draft has {draft}, so EP {starved} draft experts (acceptance "
        "collapses, nothing is reported).",
        "Drop --enable-ep-weight-filter (every rank then reads all expert tensors: a slower load, the same memory).",
    )


@check("v41.draft-overrides", needs=("pack",), family=V41)
def check_draft_overrides(ctx: DoctorContext) -> Row:
    """FAIL [late] with DSpark when a dict ``--hf-overrides`` supplies quantization_config keys that
    config.json lacks (non_routed_quantization, mtp_experts, mtp_experts_start_layer): dict overrides
    reach the target only, the draft re-reads config.json and fails after the whole target load
    (V34 config/speculative.py:1318-1343, "Dict overrides are target-specific", :1328)."""
    overrides = json_flag(ctx, "--hf-overrides")
    if overrides is None:
        return Row("v41.draft-overrides", PASS, "no --hf-overrides on the serve line.")
    if isinstance(overrides, str):
        return Row(
            "v41.draft-overrides", FAIL, overrides + ".", "--hf-overrides takes a JSON object; quote it for the shell."
        )
    quant = overrides.get("quantization_config")
    if not dspark_on(ctx) or not isinstance(quant, dict):
        return Row(
            "v41.draft-overrides",
            PASS,
            "--hf-overrides sets no quantization_config keys for a DSpark draft to miss.",
        )
    written = ctx.raw_config().get("quantization_config")
    written = written if isinstance(written, dict) else {}
    lacking = [key for key in DRAFT_QUANT_KEYS if key in quant and written.get(key) != quant[key]]
    if not lacking:
        return Row(
            "v41.draft-overrides",
            PASS,
            "--hf-overrides' quantization_config keys are in config.json too, where the DSpark draft reads them.",
        )
    keys = ", ".join(lacking)
    edit = json.dumps({key: quant[key] for key in lacking})
    return Row(
        "v41.draft-overrides",
        FAIL,
        f"[late] --hf-overrides is a dict: vLLM applies it to the target only, and the DSpark draft reads "
        f"config.json's quantization_config, which lacks {keys}; the draft load would fail after the full "
        "target load.",
        f"Put {clip(edit)} into config.json's quantization_config (a local copy of the pack's small files will "
        "do) and drop them from --hf-overrides.",
    )


@check("v41.topology", needs=("pack",), family=V41)
def check_topology(ctx: DoctorContext) -> Row:
    """FAIL (early) when num_attention_heads % TP != 0 or TP > o_groups (V34 models/deepseek_v41/attention.py:364,
    ``n_local_groups = o_groups // tp``; TP3 is a kit feature), with ``--enable-dbo``/``--ubatch-size`` on an
    Engram model (use_ubatching: DBO or a ubatch size above 1; config/vllm.py:1413-1420,
    config/parallel.py:720-721), or with speculative method ``mtp`` (V4.1 ships DSpark only,
    config/speculative.py:863-873)."""
    numbers = v41_numbers(ctx)
    tp = tensor_parallel_size(ctx)
    if numbers is None or tp is None:
        return Row("v41.topology", SKIP, "the config's head counts or --tensor-parallel-size are not readable.")
    heads, groups = numbers["num_attention_heads"], numbers["o_groups"]
    problems = []
    if heads % tp or tp > groups:
        fits = [n for n in (1, 2, 4, 8, 16, 32, 64) if heads % n == 0 and n <= groups]
        problems.append(
            f"--tensor-parallel-size {tp} does not split {heads} attention heads in {groups} output groups "
            f"(stock vLLM takes TP in {', '.join(map(str, fits))})"
        )
    ubatch = ctx.serve_flag("--ubatch-size")
    ubatching = ubatch is not None and not (ubatch.isascii() and ubatch.isdigit() and int(ubatch) <= 1)
    if numbers.engram_layers and (ctx.serve_switch("--enable-dbo") or ubatching):  # V34 config/parallel.py:720-721
        problems.append("--enable-dbo/--ubatch-size above 1 are refused for a model with Engram")
    spec = json_flag(ctx, "--speculative-config")
    if isinstance(spec, dict) and spec.get("method") in ("mtp", "deepseek_mtp"):
        problems.append(f'--speculative-config method "{spec["method"]}" is refused for V4.1, which drafts with DSpark')
    if problems:
        return Row(
            "v41.topology",
            FAIL,
            f"{problems[0]}" + (f" (and {plural(len(problems) - 1, 'more')})" if len(problems) > 1 else "") + ".",
            "Serve DeepSeek-V4.1 with a TP that divides the heads and the output groups, no "
            "--enable-dbo/--ubatch-size, "
            'and --speculative-config \'{"method": "dspark"}\'.',
        )
    return Row("v41.topology", PASS, f"TP {tp} splits {heads} heads and {groups} output groups.")


@check("v41.indexer-topk", needs=("pack",), family=V41)
def check_indexer_topk(ctx: DoctorContext) -> Row:
    """WARN on SM12x (GB10 12.1, RTX PRO 12.0) when ``--sparse-indexer-topk-backend`` is auto (or persistent)
    and index_topk is 512/1024/2048: auto skips ``cooperative`` there and takes ``persistent``, whose CTA
    count grows with max_model_len; GB10 then fails engine init (V34 model_executor/layers/indexer_topk.py:
    160-163, 279-280; FC tools/engram/persistent_topk_sm12x_fix.py). Without a readable GPU the row says
    what it could not decide (INFO), never PASS."""
    numbers = v41_numbers(ctx)
    topk = numbers.get("index_topk") if numbers else None
    backend = (ctx.serve_flag("--sparse-indexer-topk-backend") or "auto").strip().lower()
    if topk is None:
        return Row("v41.indexer-topk", SKIP, "config.json gives no usable index_topk (see v41.config).")
    if topk not in PERSISTENT_TOPK:
        return Row("v41.indexer-topk", PASS, f"index_topk is {topk}: vLLM does not pick persistent_topk for it.")
    if backend not in ("auto", "persistent"):
        return Row("v41.indexer-topk", PASS, f"--sparse-indexer-topk-backend {backend}: not persistent_topk.")
    length, source = max_model_len(ctx)
    at = f" at {source} {length:,}" if length else ""
    found, problem = gpus(ctx)
    if not found:
        return Row(
            "v41.indexer-topk",
            INFO,
            f"could not tell the GPU ({problem}): on SM12x (GB10, RTX PRO) --sparse-indexer-topk-backend {backend} "
            f"with index_topk {topk} picks persistent_topk, which fails engine init on GB10{at}; run doctor on the "
            "serving host to decide, or pass --sparse-indexer-topk-backend per_row there.",
        )
    sm12 = [gpu for gpu in found if gpu.sm // 10 == 12]
    if not sm12:
        return Row("v41.indexer-topk", PASS, f"GPU sm_{found[0].sm} is not SM12x: persistent_topk fits there.")
    return Row(
        "v41.indexer-topk",
        WARN,
        f"On {sm12[0].name} (sm_{sm12[0].sm}) with index_topk {topk}, --sparse-indexer-topk-backend {backend} "
        f'picks persistent_topk, which fails engine init{at} on GB10 ("persistent_topk would oversubscribe").',
        "Pass --sparse-indexer-topk-backend per_row.",
    )


def _int_on(value: str | None) -> bool:
    try:
        return value is not None and int(value) != 0
    except ValueError:
        return False


@check("v41.shared-stream", needs=("pack",), family=V41)
def check_shared_stream(ctx: DoctorContext) -> Row:
    """FAIL [late] when the shared experts are EXL3 (a ``.trellis`` under ``ffn.shared_experts.`` in the
    headers: V4.1 packs declare no non_routed_exl3) and VLLM_DISABLE_SHARED_EXPERTS_STREAM is not a
    non-zero integer: vLLM runs them on a second stream beside the EXL3 routed experts, which deadlocks
    exllamav3's per-device lock at decode (V34 envs.py:2222-2223, fused_moe/runner/shared_experts.py:74,134;
    MIA extensions/cooperative_moe/runtime.py)."""
    v41 = pack_scan(ctx).v41
    if not v41.exl3_places.get("shared expert"):
        return Row("v41.shared-stream", PASS, "the shared experts are not EXL3 (no trellis under ffn.shared_experts).")
    value = ctx.environ.get(SHARED_STREAM)
    if _int_on(value):
        return Row("v41.shared-stream", PASS, f"the shared experts are EXL3 and {SHARED_STREAM}={value}.")
    state = "unset" if value is None else clip(repr(value))
    return Row(
        "v41.shared-stream",
        FAIL,
        f"[late] the shared experts are EXL3 ({v41.first_exl3['shared expert']}) and {SHARED_STREAM} is {state}: "
        "vLLM's shared-expert stream runs them beside the EXL3 routed experts and deadlocks exllamav3 at decode.",
        f"export {SHARED_STREAM}=1",
    )


@check("v41.aux-streams", needs=("pack",), family=V41)
def check_aux_streams(ctx: DoctorContext) -> Row:
    """FAIL [late] when the attention compressor is EXL3 (the only V4.1 linear that runs on an aux stream,
    beside the EXL3 fused_wqa_wkv) unless the aux-streams patch is applied with its switch
    (PATCH_DSV4_AUX_STREAMS=0, or MiaAI-Lab's DSV41_EXL3_SERIAL_STREAMS=1) or
    VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD=0 (untested): decode hang (V34 models/deepseek_v41/nvidia/model.py:
    767-771, attention.py:1023-1070; patches/aux_streams.py). Other EXL3 attention linears never run on an
    aux stream in V4.1 (PASS)."""
    v41 = pack_scan(ctx).v41
    if not v41.exl3_places.get("compressor"):
        others = " (other attention linears are EXL3; V4.1 runs none of them on an aux stream)"
        return Row(
            "v41.aux-streams",
            PASS,
            "the attention compressor is not EXL3" + (others if v41.exl3_places.get("attention") else "") + ".",
        )
    verdict = (ctx.runtime.patch_verdicts or {}).get("aux-streams") if ctx.runtime else None
    switched = [f"{name}={off}" for name, off in AUX_SWITCHES if ctx.environ.get(name, "").strip() == off]
    if verdict == "applied" and switched:
        return Row("v41.aux-streams", PASS, f"the compressor is EXL3; aux-streams is applied and {switched[0]}.")
    if ctx.environ.get(GEMM_THRESHOLD, "").strip() == "0":
        return Row("v41.aux-streams", PASS, f"the compressor is EXL3 and {GEMM_THRESHOLD}=0 keeps it on one stream.")
    said = f"the aux-streams patch is {verdict or 'not known'}"
    target = target_option(ctx.runtime) if ctx.runtime else ""
    return Row(
        "v41.aux-streams",
        FAIL,
        f"[late] the pack's attention compressor is EXL3 ({v41.first_exl3['compressor']}) and {said}"
        + ("" if switched else f", {AUX_SWITCHES[0][0]}=0 not set")
        + ": vLLM runs it on an auxiliary stream beside the EXL3 fused_wqa_wkv, which deadlocks exllamav3.",
        f"patch-dsv4 apply --with aux-streams{target} && export {AUX_SWITCHES[0][0]}=0 "
        f"(or export {GEMM_THRESHOLD}=0, untested)",
    )


@check("v41.flashinfer", needs=("runtime", "pack"), family=V41)
def check_flashinfer(ctx: DoctorContext) -> Row:
    """WARN when the installed flashinfer-python is not the version the installed vLLM pins (0.34.0 pins
    0.7.3, which the index does not offer, so installs end on another with --no-deps; skew broke DSV4
    before), unless the pin is not served and the installed one is the nearest above it that pip's index
    serves (runtime.flashinfer_served, which asks the index once a run), and when flashinfer-jit-cache or
    flashinfer-cubin is of another version than flashinfer-python:
    a stale precompiled module shadows a newer or patched FlashInfer (V34 vllm-0.34.0.dist-info/METADATA:90;
    v41-packs.md §4.1 rt.flashinfer-pin)."""
    site_dirs = ctx.runtime.site_dirs
    vllm = find_dist(site_dirs, "vllm")
    pin = vllm.pinned("flashinfer-python") if vllm else None
    installed = find_dist(site_dirs, "flashinfer-python")
    version = installed.version if installed else None
    others = [
        (name, dist) for name in ("flashinfer-jit-cache", "flashinfer-cubin") if (dist := find_dist(site_dirs, name))
    ]
    problems, fixes = [], []
    pinned = " (the version vLLM pins)" if pin else " (vLLM pins none)"
    if version is None:
        problems.append(
            f"flashinfer-python is not installed (vLLM pins {pin})" if pin else "flashinfer-python is not installed"
        )
        fixes.append(flashinfer_install(ctx.runtime, pin) if pin else pip_install(ctx.runtime, "flashinfer-python"))
    elif pin and version != pin:
        if flashinfer_served(ctx.runtime, pin)[0] == version:  # the pin is not served: this is the nearest that is
            pinned = f" (vLLM pins {pin}, which pip's index does not serve; {version} is the nearest above it)"
        else:
            problems.append(f"vLLM {ctx.runtime.vllm_version} pins flashinfer-python=={pin}; {version} is installed")
            fixes.append(flashinfer_install(ctx.runtime, pin, no_deps=True))
    skewed = [(name, dist) for name, dist in others if version and dist.version != version]
    if skewed:
        shown = ", ".join(f"{name} {dist.version}" for name, dist in skewed)
        problems.append(f"{shown} beside flashinfer-python {version}: its precompiled modules shadow the package's")
        fixes.append(pip_remove(ctx.runtime, [dist for _, dist in skewed]) + f" (or install them at {version})")
    kernel, kernel_note = _sm120_kernel(ctx, version is not None)
    if kernel:
        return Row(
            "v41.flashinfer",
            FAIL,
            kernel + (f"; also {'; '.join(problems)}" if problems else "") + ".",
            "; ".join(fixes) if fixes else "install a FlashInfer whose SM120 DSV4 decode table has that pair",
        )
    if problems:
        return Row(
            "v41.flashinfer",
            WARN,
            "; ".join(problems) + " (version skew broke DeepSeek-V4 attention before).",
            "; ".join(fixes),
        )
    extra = f", {', '.join(f'{n} {d.version}' for n, d in others)}" if others else ""
    return Row("v41.flashinfer", PASS, f"flashinfer-python {version}{pinned}{extra}; {kernel_note}.")


DECODE_HEADS = (
    8,
    16,
    32,
    64,
    128,
)  # what the SM120 decode pads a rank's heads to (V34 deepseek_v41 flashinfer_sparse.py)


def _sm120_kernel(ctx: DoctorContext, installed: bool) -> tuple[str | None, str]:
    """(why vLLM stops at attention init, or None; what was checked): on SM12x the installed FlashInfer's
    ``_DECODE_DSV4_DISPATCH`` must hold (the rank's heads padded to 8/16/32/64/128, the window width):
    sliding_window, or ceil((sliding_window + k) / 64) x 64 with ``use_non_causal`` and a DSpark draft of k
    tokens (V34 models/deepseek_v41/nvidia/flashinfer_sparse.py:605-613, utils/flashinfer.py:502-514)."""
    from patch_dsv4.doctor.checks.runtime import decode_table
    from patch_dsv4.doctor.readers.serving_env import find_package

    numbers = v41_numbers(ctx)
    window = numbers.get("sliding_window") if numbers else None
    tp = tensor_parallel_size(ctx)
    if not installed or numbers is None or window is None or tp is None:
        return None, "the SM120 decode table was not checked (no FlashInfer, sliding_window or TP to read)"
    found, problem = gpus(ctx)
    if not found:
        return None, f"the SM120 decode table is checked on SM12x only, and the GPU could not be told ({problem})"
    if not any(gpu.sm // 10 == 12 for gpu in found):
        return None, f"GPU sm_{found[0].sm} does not decode through FlashInfer's SM120 kernels"
    local = -(-numbers["num_attention_heads"] // tp)
    heads = next((h for h in DECODE_HEADS if h >= local), local)
    attention = json_flag(ctx, "--attention-config")
    spec = json_flag(ctx, "--speculative-config")
    width = window
    if isinstance(attention, dict) and attention.get("use_non_causal") is True and dspark_on(ctx):
        k = spec.get("num_speculative_tokens") if isinstance(spec, dict) else None
        k = (
            k
            if isinstance(k, int) and not isinstance(k, bool) and 0 < k < 1 << 20
            else numbers.get("dspark_block_size")
        )
        width = -(-(window + (k or 0)) // 64) * 64
    package = find_package(ctx.runtime.site_dirs, "flashinfer")
    table = decode_table(package) if package is not None and package.is_dir() else None
    if table is None or table.pairs is None:
        return None, f"the SM120 decode table for (heads={heads}, width={width}) is a run-time predicate or absent"
    if (heads, width) in table.pairs:
        return None, f"(heads={heads}, width={width}) is in its SM120 decode table"
    return (
        f"FlashInfer has no SM120 DSV4 decode kernel for (heads={heads}, width={width}) in "
        f"{table.source.name}: vLLM stops at attention init",
        "",
    )
