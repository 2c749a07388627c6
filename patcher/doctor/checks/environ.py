"""Environment and flag checks: ``os.environ`` and the intended vLLM command line.

The variables are judged against the installed vLLM's own ``vllm/envs.py``
(read by AST), never a list kept here. Rows follow DOCTOR-FACTS.md table D
"Environment and flags".
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

from patch_dsv4.doctor.checks.runtime import module_assignment, parse_python, target_option, vllm_file
from patch_dsv4.doctor.readers.base import (
    FAIL,
    INFO,
    PASS,
    SKIP,
    WARN,
    DoctorContext,
    Row,
    check,
    clip,
)
from patch_dsv4.doctor.readers.family import V4
from patch_dsv4.doctor.readers.files import read_regular_file
from patch_dsv4.doctor.readers.pack import INDEX_NAME, pack_index, pack_scan
from patch_dsv4.doctor.readers.serving_env import (
    dense_exl3_modules,
    exl3_attention,
    exl3_shared_experts,
    find_package,
    locate_extension,
    max_model_len,
)

SHARED_STREAM = "VLLM_DISABLE_SHARED_EXPERTS_STREAM"
#: Each switch of the aux-streams patch and the value that turns the streams off (patches/aux_streams.py).
AUX_STREAM_SWITCHES = (
    ("PATCH_DSV4_AUX_STREAMS", "0"),
    ("LNA_DSV4_AUX_STREAMS", "0"),
    ("DSV41_EXL3_SERIAL_STREAMS", "1"),
)
LONG_CONTEXT = 200_000  # R README.md:423-427: expandable segments are "required past about 200k tokens"


@dataclass(frozen=True)
class VllmEnvs:
    """The variables ``vllm/envs.py`` declares, and those it parses with ``int()``."""

    known: frozenset
    int_parsed: frozenset


def _read_envs(path: Path) -> VllmEnvs | None:
    tree, _ = parse_python(path)
    table = module_assignment(tree, "environment_variables") if tree else None
    if not isinstance(table, ast.Dict):
        return None
    # Helpers such as maybe_convert_int() parse with int() for the entries that call them.
    int_helpers = {"int"} | {
        f.name
        for f in tree.body
        if isinstance(f, ast.FunctionDef)
        and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "int" for c in ast.walk(f))
    }
    known, int_parsed = set(), set()
    for key, value in zip(table.keys, table.values, strict=True):
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            continue
        known.add(key.value)
        if any(
            isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in int_helpers
            for c in ast.walk(value)
        ):
            int_parsed.add(key.value)
    return VllmEnvs(frozenset(known), frozenset(int_parsed))


def vllm_envs(ctx: DoctorContext) -> VllmEnvs | None:
    def read():
        path = vllm_file(ctx.runtime, "vllm/envs.py")
        return _read_envs(path) if path else None

    return ctx.cached("vllm:envs", read)


@check("env.unknown-vllm", needs=("runtime",))
def unknown_vllm_variables(ctx: DoctorContext) -> Row:
    """``VLLM_*`` variables the installed vLLM does not declare in ``environment_variables``.

    WARN for each (vLLM logs "Unknown vLLM environment variable detected");
    INFO when only the plugin's own VLLM_EXL3_* are unknown; FAIL for any with
    --fail-on-environ-validation (ValueError at startup). The 0.28.0 case:
    VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION exists only from 0.29.0.
    Evidence: V0.28.0 envs.py:2207-2213; V0.33.0 platforms/interface.py:1458-1471;
    S notes/lna-lab-exl3.md §4.
    """
    envs = vllm_envs(ctx)
    version = ctx.runtime.vllm_version or "this vLLM"
    if envs is None:
        return Row("env.unknown-vllm", SKIP, "vllm/envs.py has no readable environment_variables table")
    unknown = sorted(v for v in ctx.environ if v.startswith("VLLM_") and v not in envs.known)
    if not unknown:
        return Row("env.unknown-vllm", PASS, f"every VLLM_* variable set is declared in vLLM {version}'s envs.py.")
    plugin_own = [v for v in unknown if v.startswith("VLLM_EXL3_")]
    others = [v for v in unknown if v not in plugin_own]
    if ctx.serve_switch("--fail-on-environ-validation"):
        steps = ([f"unset {' '.join(others)}"] if others else []) + (
            ["drop --fail-on-environ-validation (vllm-exl3's VLLM_EXL3_* are unknown to vLLM by design)"]
            if plugin_own
            else []
        )
        return Row(
            "env.unknown-vllm",
            FAIL,
            f"{_are(unknown)} unknown to vLLM {version}: with "
            "--fail-on-environ-validation it raises ValueError at startup.",
            "; ".join(steps),
        )
    if others:
        return Row(
            "env.unknown-vllm",
            WARN,
            f'{_are(others)} unknown to vLLM {version} (logged as "Unknown vLLM '
            'environment variable"; it has no effect there).',
            f"unset {' '.join(others)}",
        )
    return Row(
        "env.unknown-vllm",
        INFO,
        f"{_are(plugin_own)} read by vllm-exl3; vLLM {version} logs "
        f"{'it' if len(plugin_own) == 1 else 'them'} as unknown, which is harmless.",
    )


def _are(names: list[str]) -> str:
    return f"{', '.join(names)} {'is' if len(names) == 1 else 'are'}"


_WORDS = {"true": "1", "yes": "1", "on": "1", "false": "0", "no": "0", "off": "0"}


def _is_int(value: str) -> bool:
    try:
        int(value)
    except ValueError:
        return False
    return True


@check("env.int-parse", needs=("runtime",))
def integer_variables(ctx: DoctorContext) -> Row:
    """Variables the installed vLLM parses with ``int()`` (directly or through a helper), set to non-integers.

    FAIL for each, e.g. VLLM_DISABLE_SHARED_EXPERTS_STREAM=true: ValueError at
    startup. Evidence: V0.28.0 envs.py:1998 (``bool(int(os.getenv(...)))``);
    S notes/lna-lab-exl3.md §4.
    """
    envs = vllm_envs(ctx)
    if envs is None:
        return Row("env.int-parse", SKIP, "vllm/envs.py has no readable environment_variables table")
    bad = sorted((name, value) for name, value in ctx.environ.items() if name in envs.int_parsed and not _is_int(value))
    if bad:
        said = ", ".join(f"{name}={clip(repr(value))}" for name, value in bad)
        fix = " ".join(f"{name}={_WORDS.get(value.strip().lower(), '<integer>')}" for name, value in bad)
        return Row(
            "env.int-parse",
            FAIL,
            f"{said} must be an integer: vLLM parses it with int() and stops at startup.",
            f"export {fix}",
        )
    checked = sorted(n for n in ctx.environ if n in envs.int_parsed)
    return Row("env.int-parse", PASS, f"integer variables set: {', '.join(checked) or 'none'}; all parse.")


def _switch_on(value: str | None) -> bool:
    try:
        return value is not None and int(value) != 0
    except ValueError:
        return False


@check("env.shared-stream", needs=("pack",), family=V4)  # V4.1: v41.shared-stream, from the headers
def shared_expert_stream(ctx: DoctorContext) -> Row:
    """EXL3 shared experts need vLLM's second shared-expert stream switched off.

    FAIL when ``non_routed_exl3`` covers ``shared_experts`` and
    VLLM_DISABLE_SHARED_EXPERTS_STREAM is not a non-zero integer [late]: the
    second stream deadlocks exllamav3's per-device lock at decode, GPUs at 100 %.
    Evidence: L README.md:36, serve-dsv4-tp8.sh:11; V0.28.0 fused_moe/runner/shared_experts.py:64.
    """
    if not exl3_shared_experts(ctx):
        return Row("env.shared-stream", PASS, "the shared experts are not EXL3 (non_routed_exl3 does not cover them).")
    value = ctx.environ.get(SHARED_STREAM)
    if _switch_on(value):
        return Row("env.shared-stream", PASS, f"the shared experts are EXL3 and {SHARED_STREAM}={value}.")
    state = "unset" if value is None else clip(repr(value))
    return Row(
        "env.shared-stream",
        FAIL,
        f"the shared experts are EXL3 and {SHARED_STREAM} is {state}: vLLM's second "
        "shared-expert stream deadlocks exllamav3's per-device lock at decode.",
        f"export {SHARED_STREAM}=1",
    )


@check("env.aux-streams", needs=("runtime", "pack"), family=V4)  # V4.1: v41.aux-streams (the compressor only)
def attention_aux_streams(ctx: DoctorContext) -> Row:
    """EXL3 attention linears must stay off vLLM's DeepSeek-V4 auxiliary streams.

    WARN when attention linears are EXL3 unless the aux-streams patch is applied
    and PATCH_DSV4_AUX_STREAMS=0 (or lna-lab's LNA_DSV4_AUX_STREAMS=0, or MiaAI-Lab's
    DSV41_EXL3_SERIAL_STREAMS=1) is set:
    vLLM has no setting of its own for it. Evidence: L README.md:62;
    S notes/lna-lab-exl3.md §1 (G), §4.
    """
    if not exl3_attention(ctx):
        return Row("env.aux-streams", PASS, "no attention linear is EXL3 (non_routed_exl3 covers no attn module).")
    verdict = (ctx.runtime.patch_verdicts or {}).get("aux-streams")
    switched = [f"{name}={off}" for name, off in AUX_STREAM_SWITCHES if ctx.environ.get(name, "").strip() == off]
    if verdict == "applied" and switched:
        return Row(
            "env.aux-streams",
            PASS,
            f"attention linears are EXL3; the aux-streams patch is applied and {switched[0]}.",
        )
    missing = ([] if verdict == "applied" else [f"the aux-streams patch is {verdict or 'not known'}"]) + (
        [] if switched else [f"{AUX_STREAM_SWITCHES[0][0]}=0 is not set"]
    )
    return Row(
        "env.aux-streams",
        WARN,
        f"attention linears are EXL3 but {' and '.join(missing)}, so they can run on vLLM's auxiliary streams.",
        f"patch-dsv4 apply --with aux-streams{target_option(ctx.runtime)} && export {AUX_STREAM_SWITCHES[0][0]}=0",
    )


WO_A_SLICE = "attn.wo_a.slice."
# What lna-lab's fork of vllm-exl3 names in its per-rank wo_a loader (recipe-lna/vllm_exl3_exl3.py.lna @ a131603)
SLICE_AWARE_LOADER = ("_wo_a_slice_rank", "_WO_A_SLICE_RE")
_NEEDED_OK = ("applied", "upstream")


def exl3_compressor_or_attention(ctx: DoctorContext) -> list[str]:
    """The attention and compressor modules ``non_routed_exl3`` declares EXL3."""
    return [m for m in dense_exl3_modules(ctx) if ".attn." in f".{m}." or "compressor" in m]


def wo_a_slices(ctx: DoctorContext) -> str | None:
    """Where the pack names ``attn.wo_a.slice.G`` tensors (a shard's header, else the index), or None."""

    def find() -> str | None:
        scan = pack_scan(ctx)
        found = sorted(m for m in scan.dense if WO_A_SLICE in f"{m}.")
        if found:
            return f"the shards hold {found[0]}.*"
        weight_map = pack_index(ctx).weight_map
        names = (
            sorted(n for n in weight_map if isinstance(n, str) and WO_A_SLICE in n)
            if isinstance(weight_map, dict)
            else []
        )
        return f"{INDEX_NAME} names {clip(names[0])}" if names else None

    return ctx.cached("pack.wo_a_slices", find)


def plugin_loads_wo_a_slices(ctx: DoctorContext) -> bool | None:
    """Whether the installed vllm_exl3/exl3.py has a wo_a loader that takes slice ids as ranks (None: no plugin)."""
    package = find_package(ctx.runtime.site_dirs, "vllm_exl3")
    source = package / "exl3.py" if package is not None and package.is_dir() else None
    if source is None or not source.is_file():
        return None
    try:
        text = read_regular_file(source).decode("utf-8", "replace")
    except OSError:
        return None
    return any(name in text for name in SLICE_AWARE_LOADER)


@check("env.dense-exl3", needs=("runtime", "pack"), family=V4)  # V4.1: v41.pack-kind
def dense_exl3_patches(ctx: DoctorContext) -> Row:
    """A pack with EXL3 attention or compressor linears needs the dense-exl3 patches (and aux-streams).

    FAIL when ``non_routed_exl3`` covers attention or compressor modules, or the
    pack stores ``attn.wo_a.slice.G`` tensors, and the opt-in patches
    dense-exl3 (and exl3-wo-a-slices for slices) are not applied [late]: a
    KeyError mid-load (compressor, wo_a slices) or an AttributeError on
    ``.weight`` at the first forward. FAIL too when the pack has slices and the
    installed vllm-exl3 has no per-rank wo_a loader (only lna-lab's fork has
    one): the load stops with ``shard_idx ... out of range``. Evidence:
    S notes/dense-exl3.md §1, patches/dense_exl3.py, patches/exl3_wo_a_slices.py.
    """
    modules = exl3_compressor_or_attention(ctx)
    slices = wo_a_slices(ctx)
    if not modules and not slices:
        return Row("env.dense-exl3", PASS, "no attention or compressor linear is EXL3: dense-exl3 is not needed.")
    declared = f"non_routed_exl3 declares {len(modules)} attention/compressor modules EXL3" if modules else None
    what = " and ".join(
        [*([f"{declared} ({clip(modules[0])}, ...)"] if modules else []), *([slices] if slices else [])]
    )
    verdicts = ctx.runtime.patch_verdicts or {}
    needed = ["dense-exl3"] + (["exl3-wo-a-slices"] if slices else [])
    missing = [pid for pid in needed if verdicts.get(pid) not in _NEEDED_OK]
    target = target_option(ctx.runtime)
    if missing:
        wanted = [*needed, *(["aux-streams"] if verdicts.get("aux-streams") not in _NEEDED_OK else [])]
        said = ", ".join(f"{pid} is {verdicts.get(pid) or 'not known'}" for pid in missing)
        command = "patch-dsv4 apply" + "".join(f" --with {pid}" for pid in wanted) + target
        return Row(
            "env.dense-exl3",
            FAIL,
            f"{what}, but {said}: stock vLLM leaves the compressor unquantized, reads .weight of EXL3 linears at "
            "the first forward" + (" and has no mapping for wo_a slices" if slices else "") + ".",
            f"{command} (over lna-lab's scripts: patch-dsv4 takeover"
            + "".join(f" --with {p}" for p in wanted)
            + f"{target})",
        )
    if slices and plugin_loads_wo_a_slices(ctx) is False:
        return Row(
            "env.dense-exl3",
            FAIL,
            f"{slices}, but the installed vllm-exl3 cannot load wo_a slices (its exl3.py has no per-rank wo_a "
            "loader): the load stops with 'shard_idx ... out of range'.",
            "install a vllm-exl3 whose wo_a loader takes the slice index as the owning rank (lna-lab's fork of "
            "vllm-exl3 has one: _wo_a_slice_rank), and serve at --tensor-parallel-size equal to o_groups",
        )
    return Row(
        "env.dense-exl3",
        PASS,
        f"{what}; {' and '.join(f'{pid} is {verdicts[pid]}' for pid in needed)}"
        + ("; the installed vllm-exl3 loads wo_a slices." if slices else "."),
    )


def cuda_graphs_off(ctx: DoctorContext) -> str | None:
    """What on the command line turns CUDA-graph capture off, if anything."""
    if ctx.serve_switch("--enforce-eager"):
        return "--enforce-eager"
    raw = ctx.serve_flag("--compilation-config")
    try:
        config = json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        config = None
    if isinstance(config, dict) and str(config.get("cudagraph_mode", "")).upper() == "NONE":
        return 'cudagraph_mode "NONE"'
    return None


def _tune_cache_populated(path: str | None) -> bool:
    if not path:
        return False
    target = Path(path)
    try:
        if target.is_file():
            return target.stat().st_size > 0
        return target.is_dir() and any(p.is_file() and p.stat().st_size > 0 for p in target.rglob("*"))
    except OSError:
        return False


def _capture_guarded_sources(ctx: DoctorContext) -> Path | None:
    """The installed exllamav3_ext source that checks for stream capture (lna-lab's exl3_gemm.cu fix), if any."""
    package = find_package(ctx.runtime.site_dirs, "exllamav3")
    if package is None or not package.is_dir():
        return None
    for path in sorted((package / "exllamav3_ext").rglob("*.cu")):
        try:
            if b"cudaStreamIsCapturing" in path.read_bytes():
                return path
        except OSError:
            continue
    return None


@check("env.graphs-autotune", needs=("runtime", "pack"))
def graph_capture_autotune(ctx: DoctorContext) -> Row:
    """CUDA-graph capture with exllamav3's GEMM on the path runs its autotuner inside the capture.

    WARN when graphs are on (no --enforce-eager) and EXL3 goes through
    exllamav3's GEMM (dense EXL3, or no vllm_exl3_c), unless EXLLAMAV3_TUNE_CACHE
    points at a populated cache or the extension sources check
    ``cudaStreamIsCapturing`` [late]: "operation not permitted when stream is
    capturing" at capture. Evidence: L README.md:35, serve-dsv4-tp8.sh:12;
    S notes/lna-lab-exl3.md §2.
    """
    off = cuda_graphs_off(ctx)
    if off:
        return Row("env.graphs-autotune", PASS, f"{off}: no CUDA-graph capture, so no autotuning inside one.")
    # a V4.1 pack declares no non_routed_exl3: its dense EXL3 linears are in the headers (v41_scan)
    dense = bool(dense_exl3_modules(ctx)) or (ctx.pack_family() == "v41" and bool(pack_scan(ctx).v41.exl3_places))
    native = locate_extension(ctx.runtime, "vllm_exl3_c").path is not None
    if not dense and native:
        return Row(
            "env.graphs-autotune",
            PASS,
            "routed experts take vllm_exl3_c and no dense linear is EXL3: exllamav3's GEMM is not captured.",
        )
    cache = ctx.environ.get("EXLLAMAV3_TUNE_CACHE")
    if _tune_cache_populated(cache):
        return Row("env.graphs-autotune", PASS, f"EXLLAMAV3_TUNE_CACHE={cache} holds a tuned cache: capture reuses it.")
    guarded = _capture_guarded_sources(ctx)
    if guarded:
        return Row("env.graphs-autotune", PASS, f"{guarded.name} skips tuning while a stream is capturing.")
    path = "dense EXL3 linears" if dense else "routed experts without vllm_exl3_c"
    return Row(
        "env.graphs-autotune",
        WARN,
        f"CUDA graphs are on and {path} run exllamav3's GEMM, whose autotuner would run inside the capture "
        '("operation not permitted when stream is capturing").',
        "add --enforce-eager, or export EXLLAMAV3_TUNE_CACHE=<a cache tuned on this GPU>, "
        "or use an exllamav3_ext built with a capture guard",
    )


@check("env.alloc-conf")
def allocator_for_long_context(ctx: DoctorContext) -> Row:
    """Long contexts need PyTorch's expandable segments.

    WARN when --max-model-len (absent or auto: the pack's max_position_embeddings)
    is over ~200k and PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) lacks
    expandable_segments:True. Evidence: R README.md:423-427, serve_one_spark_dsv4.sh:63.
    """
    length, source = max_model_len(ctx)
    if length is None:
        return Row("env.alloc-conf", SKIP, _no_length(ctx))
    conf = ",".join(ctx.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    expandable = "expandable_segments:True" in conf.replace(" ", "")
    if length > LONG_CONTEXT and not expandable:
        return Row(
            "env.alloc-conf",
            WARN,
            f"{source} is {length:,} tokens without expandable segments: past ~200k "
            "the prefill buffers fragment the allocator.",
            "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        )
    said = "expandable segments on" if expandable else "expandable segments off"
    return Row("env.alloc-conf", PASS, f"{source} is {length:,} tokens, {said}.")


def _no_length(ctx: DoctorContext) -> str:
    """Why the context length is not known, as it is: a flag that is no number, no flag and no pack, or no flag
    and a pack whose config.json gives no max_position_embeddings."""
    flag = ctx.serve_flag("--max-model-len")
    if flag is not None and flag.strip().lower() not in ("auto", "-1"):
        return f"--max-model-len {clip(repr(flag))} is not a number of tokens"
    said = "--max-model-len is auto" if flag is not None else "no --max-model-len in --serve-args"
    if ctx.pack is None:
        return f"{said} and no --pack whose max_position_embeddings would give the context length"
    value = ctx.config().get("max_position_embeddings")
    found = "has no max_position_embeddings" if value is None else f"gives max_position_embeddings {clip(repr(value))}"
    return f"{said}, and the pack's config.json {found}: the context length is not known here"


def moe_kernel_choices(ctx: DoctorContext) -> frozenset | None:
    """The VLLM_EXL3_MOE_KERNEL values the installed plugin's get_moe_kernel_backend() accepts (None: it has none)."""
    package = find_package(ctx.runtime.site_dirs, "vllm_exl3")
    tree, _ = parse_python(package / "exl3.py") if package is not None and package.is_dir() else (None, None)
    if tree is None:
        return None
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef) and function.name == "get_moe_kernel_backend":
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Compare)
                    and isinstance(node.ops[0], (ast.In, ast.NotIn))
                    and isinstance(node.comparators[0], (ast.Set, ast.List, ast.Tuple))
                ):
                    values = [e.value for e in node.comparators[0].elts if isinstance(e, ast.Constant)]
                    return frozenset(v for v in values if isinstance(v, str))
    return None


@check("env.exl3-vars", needs=("runtime",))
def plugin_variables(ctx: DoctorContext) -> Row:
    """vllm-exl3's own switches: VLLM_EXL3_MOE_KERNEL and EXL3_FUSED_MOE.

    WARN on a kernel name the installed plugin's get_moe_kernel_backend() does
    not accept (it falls back to auto), or that a plugin without it ignores;
    WARN on EXL3_FUSED_MOE=0 (the per-expert Python loop). Evidence: P exl3.py
    get_moe_kernel_backend, fused_moe_enabled.
    """
    kernel, fused = ctx.environ.get("VLLM_EXL3_MOE_KERNEL"), ctx.environ.get("EXL3_FUSED_MOE")
    problems, fixes = [], []
    if fused == "0":
        problems.append("EXL3_FUSED_MOE=0 forces the per-expert Python loop (very slow)")
        fixes.append("unset EXL3_FUSED_MOE")
    if kernel is not None:
        choices = moe_kernel_choices(ctx)
        if choices is None:
            problems.append(f"VLLM_EXL3_MOE_KERNEL={kernel!r} is ignored: the installed vllm-exl3 has no kernel choice")
            fixes.append("unset VLLM_EXL3_MOE_KERNEL")
        elif kernel.strip().lower() not in choices:
            problems.append(
                f"VLLM_EXL3_MOE_KERNEL={clip(repr(kernel))} is not one of {', '.join(sorted(choices))}; "
                "the plugin falls back to auto"
            )
            fixes.append(f"export VLLM_EXL3_MOE_KERNEL=auto (or one of {', '.join(sorted(choices))})")
    if problems:
        return Row("env.exl3-vars", WARN, "; ".join(problems) + ".", "; ".join(fixes))
    said = ", ".join(
        f"{n}={v}" for n, v in (("VLLM_EXL3_MOE_KERNEL", kernel), ("EXL3_FUSED_MOE", fused)) if v is not None
    )
    if not said:
        return Row(
            "env.exl3-vars",
            PASS,
            "neither VLLM_EXL3_MOE_KERNEL nor EXL3_FUSED_MOE is set: the plugin's defaults apply.",
        )
    return Row("env.exl3-vars", PASS, f"{said}: accepted by the installed vllm-exl3.")


@check("flags.recipe")
def recipe_flags(ctx: DoctorContext) -> Row:
    """The flags both recipes serve with: --kv-cache-dtype fp8 and --quantization exl3.

    WARN when either is set to something else; INFO when absent (the pack's
    config decides); SKIP without --serve-args. Evidence: R serve_one_spark_dsv4.sh:96-109;
    L serve-dsv4-tp8.sh:15-17.
    """
    if not ctx.serve_args:
        return Row("flags.recipe", SKIP, "no --serve-args given")
    kv = ctx.serve_flag("--kv-cache-dtype")
    quantization = ctx.serve_flag("--quantization") or ctx.serve_flag("-q")
    differences = ([f"--kv-cache-dtype is {clip(kv)}"] if kv is not None and not kv.startswith("fp8") else []) + (
        [f"--quantization is {clip(quantization)}"] if quantization is not None and quantization != "exl3" else []
    )
    if differences:
        return Row(
            "flags.recipe",
            WARN,
            f"the recipes serve with --kv-cache-dtype fp8 --quantization exl3; {' and '.join(differences)}.",
            "serve with --kv-cache-dtype fp8 --quantization exl3",
        )
    absent = [name for name, value in (("--kv-cache-dtype", kv), ("--quantization", quantization)) if value is None]
    if absent:
        return Row("flags.recipe", INFO, f"{' and '.join(absent)} not given: vLLM takes it from the pack's config.")
    return Row("flags.recipe", PASS, f"--kv-cache-dtype {clip(kv)} --quantization exl3, as the recipes serve.")
