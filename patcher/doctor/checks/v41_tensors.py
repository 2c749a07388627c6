"""DeepSeek-V4.1 packs: what the shards hold (v41-packs.md §2), read from the one header scan.

v41.pack-kind, v41.engram-tables, v41.experts, v41.vision (the backbone is backbone.complete's, for both
families). The silent failures come first: a pack without its Engram tables loads and answers with fluent garbage,
because vLLM does not track unloaded weights of quantized models (V34 default_loader.py:549-551).
"""

from __future__ import annotations

from math import prod

from patch_dsv4.doctor.checks.experts import _expected_layout
from patch_dsv4.doctor.checks.v41_config import V41Numbers, pack_is_routed_only, v41_numbers
from patch_dsv4.doctor.checks.v41_serving import json_flag
from patch_dsv4.doctor.readers.base import FAIL, INFO, PASS, SKIP, WARN, DoctorContext, Row, check
from patch_dsv4.doctor.readers.family import V41
from patch_dsv4.doctor.readers.pack import EXL3_COMPLETE, SOURCE_COMPLETE, Dims, first_of, no_shards, pack_scan, plural
from patch_dsv4.doctor.readers.safetensors import DTYPE_SIZES
from patch_dsv4.doctor.readers.serving_env import find_package, read_utf8

# what the installed vllm-exl3 needs to expose the [32, 32] delegate block to V4.1's loader (VX deepseek_v41.py)
PLUGIN_V41_MARKERS = ("install_deepseek_v41_compat", "deepseek_v41")
# Mia's in-tree EXL3 method (MIA overlay/exl3.py), the one way dense-EXL3 V4.1 packs serve today (K §1 item 3)
IN_TREE_EXL3 = "vllm/model_executor/layers/quantization/exl3.py"
MAX_K = 8  # exllamav3's MoE kernel takes K 1-8 (VC lock exllamav3_moe_kernel_k); per-tensor K in V4.1 packs

# What a kit's disk-backed Engram leaves in the vLLM tree, and the switch that turns it on (v41-packs.md §3.3).
DISK_ENGRAM_KITS = (
    ("vcruz305's disk-backed Engram", "engram_disk", "VLLM_ENGRAM_DISK_BACKED"),
    ("LakyFx/tonyd2wild's DiskEngramTable", "DiskEngramTable", "DSV41_ENGRAM_DISK"),
)
ENGRAM_SOURCES = ("vllm/models/deepseek_v41", "vllm/models/deepseek_v4_1", "vllm/model_executor/models/deepseek_v41")


def _skip_without_numbers(check_id: str, ctx: DoctorContext) -> tuple[V41Numbers | None, Row | None]:
    numbers = v41_numbers(ctx)
    if numbers is None:
        return None, Row(check_id, SKIP, "config.json lacks the numbers this check reads (see v41.config).")
    return numbers, no_shards(check_id, pack_scan(ctx))


def _plugin_has_v41(ctx: DoctorContext) -> bool | None:
    """Whether the installed vllm_exl3 has its DeepSeek-V4.1 shim (None: no plugin, or no runtime)."""
    if ctx.runtime is None:
        return None
    package = find_package(ctx.runtime.site_dirs, "vllm_exl3")
    if package is None or not package.is_dir():
        return None
    for path in sorted(package.glob("*.py")):
        text, _ = read_utf8(path)
        if text and any(marker in text for marker in PLUGIN_V41_MARKERS):
            return True
    return False


@check("v41.pack-kind", needs=("pack",), family=V41)
def check_pack_kind(ctx: DoctorContext) -> Row:
    """Which V4.1 EXL3 pack this is, from the headers alone (§2.3): routed-only when every ``.trellis``
    is a main layer's routed expert (vcruz305, SAGE, DERISKED: serves with vllm-exl3 and its V4.1
    shim), dense EXL3 otherwise (Mia-AiLab: EXL3 attention, shared experts, head, draft). FAIL for dense
    EXL3 where the serving vLLM has no in-tree EXL3 method: stock vLLM with vllm-exl3 loads only routed
    EXL3 experts for V4.1 (K §1 items 2-3). WARN for routed-only when the installed vllm-exl3 lacks its
    V4.1 shim (``install_deepseek_v41_compat``): the FP8 scales would map to ``weight_scale_inv``."""
    scan = pack_scan(ctx)
    if skip := no_shards("v41.pack-kind", scan):
        return skip
    places = scan.v41.exl3_places
    if not scan.layer_k() and not places:
        return Row("v41.pack-kind", INFO, "no EXL3 tensor in the shards: not an EXL3 pack (source checkpoint?).")
    if pack_is_routed_only(ctx):
        plugin = _plugin_has_v41(ctx)
        detail = (
            f"routed-only EXL3: the {len(scan.layer_k())} layers' routed experts are EXL3, the dense linears and "
            f"the draft's experts ({scan.mtp_format()}) stay in source format."
        )
        if plugin is False:
            return Row(
                "v41.pack-kind",
                WARN,
                detail + " The installed vllm-exl3 has no DeepSeek-V4.1 shim (install_deepseek_v41_compat): the "
                "[32, 32] FP8 scales would map to weight_scale_inv, which no parameter has.",
                "Install a vllm-exl3 with DeepSeek-V4.1 support (it needs no model-code edit and no patch).",
            )
        if plugin:
            needs = "vllm-exl3 with its V4.1 shim, which is installed"
        elif ctx.runtime is None:
            needs = "vllm-exl3 with its V4.1 shim (no vLLM environment was read to tell whether it is installed)"
        else:
            needs = "vllm-exl3 with its V4.1 shim (vllm-exl3 is not installed: see rt.plugin)"
        return Row("v41.pack-kind", PASS, f"{detail} It needs {needs}; no patch-dsv4 opt-in.")
    where = [f"{place} ({scan.v41.first_exl3[place]})" for place in places]
    if scan.mtp_format() == "exl3" and "draft" not in places:
        where.append("draft experts")
    detail = f"dense EXL3: EXL3 tensors outside the routed experts, in {first_of(where)}"
    switches = []
    if "shared expert" in places:
        switches.append("VLLM_DISABLE_SHARED_EXPERTS_STREAM=1")
    if "compressor" in places:
        switches.append("the aux-streams opt-in with PATCH_DSV4_AUX_STREAMS=0")
    opt_ins = (
        f" Served so, this kind also needs {' and '.join(switches)} (v41.shared-stream, v41.aux-streams)."
        if switches
        else ""
    )
    if ctx.runtime is None:
        return Row(
            "v41.pack-kind",
            INFO,
            detail + "; it serves only with an in-tree EXL3 method (MiaAI-Lab's image); no vLLM environment was "
            "read to tell." + opt_ins,
        )
    in_tree = ctx.runtime.vllm_root is not None and (ctx.runtime.vllm_root / IN_TREE_EXL3).is_file()
    if in_tree:
        return Row(
            "v41.pack-kind",
            PASS,
            detail + f"; the serving vLLM has an in-tree EXL3 method ({IN_TREE_EXL3}, MiaAI-Lab's), which loads "
            "them." + opt_ins,
        )
    return Row(
        "v41.pack-kind",
        FAIL,
        detail + f"; vLLM {ctx.runtime.vllm_version or ''} has no in-tree EXL3 method and vllm-exl3 loads only routed "
        "EXL3 experts for V4.1, so these tensors have no parameter to load into." + opt_ins,
        "Serve this pack with MiaAI-Lab's image (its in-tree exl3.py and model edits), or use a routed-only "
        "EXL3 pack; patch-dsv4 has no V4.1 dense-EXL3 port yet.",
    )


def table_expectations(numbers: V41Numbers) -> dict[int, dict[str, tuple[str, list[int]]]]:
    """layer -> part -> (dtype, shape) of the Engram tables the config describes (§2.1, §3.1)."""
    dim = numbers["engram_head_dim"]
    return {
        layer: {"weight": ("F8_E4M3", [rows, dim]), "scale": ("F8_E8M0", [rows, dim // 32])}
        for layer, rows in zip(numbers.engram_layers, numbers.engram_rows, strict=True)
    }


MAX_PRIMES = 1024  # primes doctor computes to check engram_num_embeddings (V4.1-Flash: 48)
MAX_PRIME_START = 1 << 40  # and the largest engram_vocab_size it starts from (V4.1-Flash: 16,000,000)


def _is_prime(n: int) -> bool:
    """Miller-Rabin with the first 12 prime bases: exact below 3.3e24."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in bases:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_prime_rows(numbers: V41Numbers) -> list[int] | None:
    """Each Engram layer's rows by vLLM's rule: every (n-gram order, head) of every layer in turn takes the
    next prime above the last, starting at engram_vocab_size; a table's rows are the sum of its primes
    (V34 common/engram.py:218; reproduces V4.1-Flash's [384006168, 384016682]). None when the config asks
    for more primes, or larger ones, than doctor computes."""
    heads = numbers["engram_n_heads"] * (numbers["engram_max_ngram_size"] - 1)
    start = numbers["engram_vocab_size"]
    if heads <= 0 or heads * len(numbers.engram_layers) > MAX_PRIMES or start > MAX_PRIME_START:
        return None
    rows, n = [], start
    for _ in numbers.engram_layers:
        total = 0
        for _ in range(heads):
            n += 1
            while not _is_prime(n):
                n += 1
            total += n
        rows.append(total)
    return rows


def engram_tables_fix(layers: list[int]) -> str:
    """The one fix for a V4.1 pack without its Engram tables: v41.engram-tables gives it, and pack.shards for
    the numbered shards such a pack lacks (Mia's card: "you still need shards 47 and 48")."""
    return (
        "Hardlink (or copy) the base checkpoint's shards holding "
        + ", ".join(f"layers.{layer}.engram.embed.*" for layer in layers)
        + " (model-00047/00048-of-00048 in deepseek-ai's V4.1-Flash) from the revision the pack was made from "
        "into the pack, and add their entries to model.safetensors.index.json."
    )


def absent_engram_layers(ctx: DoctorContext) -> list[int]:
    """The Engram layers of a V4.1 pack whose tables no shard holds and no disk-backed kit reads ([] otherwise)."""
    if ctx.pack_family() != V41:
        return []
    numbers = v41_numbers(ctx)
    if numbers is None or not numbers.engram_layers:
        return []
    found = pack_scan(ctx).v41.tables
    expected = table_expectations(numbers)
    absent = [layer for layer, parts in expected.items() if any(part not in found.get(layer, {}) for part in parts)]
    return [] if not absent or disk_engram_kit(ctx) else absent


@check("v41.engram-tables", needs=("pack",), family=V41)
def check_engram_tables(ctx: DoctorContext) -> Row:
    """FAIL [silent] when a layer of ``engram_layer_ids`` has no ``layers.L.engram.embed.{weight,scale}`` in
    the shards: vLLM allocates the table (torch.empty) and nothing fills it (Mia's card: "you still need
    shards 47 and 48"). FAIL when a table is not [rows_i, head_dim] F8_E4M3 / [rows_i, head_dim/32]
    F8_E8M0 with rows_i from ``engram_num_embeddings``, or when the primes from ``engram_vocab_size`` do
    not sum to ``engram_num_embeddings`` (vLLM only asserts <=). WARN on ``engram_table_dir``: stock vLLM
    has no reader for it (V34 common/engram.py:204-234,915,1022-1093; v41-packs.md §4.1)."""
    numbers, skip = _skip_without_numbers("v41.engram-tables", ctx)
    if skip:
        return skip
    if not numbers.engram_layers:
        return Row("v41.engram-tables", PASS, "engram_layer_ids is empty: this model has no Engram tables.")
    scan = pack_scan(ctx)
    found = scan.v41.tables
    expected = table_expectations(numbers)
    missing = [
        f"layers.{layer}.engram.embed.{part}"
        for layer, parts in expected.items()
        for part in parts
        if part not in found.get(layer, {})
    ]
    if missing:
        kit = disk_engram_kit(ctx)
        if kit:
            return Row(
                "v41.engram-tables",
                PASS,
                f"the pack holds no Engram table ({plural(len(missing), 'tensor')} absent); {kit} reads them from "
                "its own files.",
            )
        layers = sorted({int(name.split(".")[1]) for name in missing})
        names = ", ".join(f"layers.{layer}.engram.embed.{{weight,scale}}" for layer in layers)
        total = sum(prod(shape) * DTYPE_SIZES[dtype] for parts in expected.values() for dtype, shape in parts.values())
        return Row(
            "v41.engram-tables",
            FAIL,
            f"[silent] the pack has no Engram table for {plural(len(layers), 'layer')} ({names}, "
            f"{total / 2**30:.1f} GiB in the source checkpoint): vLLM would allocate the tables and serve with "
            "them uninitialised, and nothing would report it.",
            engram_tables_fix(layers),
        )
    wrong = []
    for layer, parts in expected.items():
        for part, (dtype, shape) in parts.items():
            got_dtype, got_shape, shard = found[layer][part]
            if (got_dtype, got_shape) != (dtype, shape):
                wrong.append(
                    f"layers.{layer}.engram.embed.{part} in {shard} is {got_dtype} {got_shape}, the config "
                    f"(engram_num_embeddings, engram_head_dim) says {dtype} {shape}"
                )
    if wrong:
        return Row(
            "v41.engram-tables",
            FAIL,
            f"{first_of(wrong)}: these tables do not belong to this config.",
            "Take the Engram shards and config.json from the same base revision (re-download the shards that "
            "hold the tables).",
        )
    primes = engram_prime_rows(numbers)
    if primes is not None and primes != list(numbers.engram_rows):
        return Row(
            "v41.engram-tables",
            FAIL,
            f"engram_num_embeddings {list(numbers.engram_rows)} is not what engram_vocab_size "
            f"{numbers['engram_vocab_size']} gives by vLLM's prime layout ({primes}): vLLM would hash "
            "n-grams into rows these tables do not lay out that way.",
            "Restore engram_vocab_size, engram_n_heads, engram_max_ngram_size and engram_num_embeddings from "
            "the base checkpoint's config.json.",
        )
    total = scan.v41.table_bytes
    checked = "the prime layout agrees" if primes is not None else "the prime layout was not recomputed (too large)"
    table_dir = ctx.config().get("engram_table_dir")
    detail = (
        f"Engram tables of layers {list(numbers.engram_layers)} present, shaped as the config says "
        f"({total / 2**30:.1f} GiB); {checked}."
    )
    if table_dir:
        return Row(
            "v41.engram-tables",
            WARN,
            detail + f" text_config.engram_table_dir is {table_dir!r}, which stock vLLM does not read (a kit key).",
            'Serve with the kit that reads engram_table_dir, or set "engram_table_dir": null.',
        )
    return Row("v41.engram-tables", PASS, detail)


@check("v41.experts", needs=("pack",), family=V41)
def check_experts(ctx: DoctorContext) -> Row:
    """FAIL when a main layer's routed expert (E < n_routed_experts, L < num_hidden_layers) lacks an EXL3
    tensor, a draft stage's expert (E < dspark_n_routed_experts, the stages of num_nextn_predict_layers)
    lacks one in its format, a tensor does not have vllm-exl3's layout for hidden_size /
    moe_intermediate_size, or a trellis width is not 16 K with K 1-8. K may differ per tensor (V4.1 packs
    mix K inside a layer: SAGE 1.59, v41-packs.md §2.2)."""
    numbers, skip = _skip_without_numbers("v41.experts", ctx)
    if skip:
        return skip
    scan = pack_scan(ctx)
    experts, draft_experts = numbers["n_routed_experts"], numbers.draft_experts
    by_block: dict[tuple[str, int], dict[int, int]] = {}
    for (block, layer, expert), mask in scan.experts.items():
        by_block.setdefault((block, layer), {})[expert] = mask
    missing, first = 0, None

    def count(block: str, layer: int, total: int, complete: int) -> None:
        """Counted from the experts present: a config may declare millions, none is looped over."""
        nonlocal missing, first
        present = {e: m for e, m in by_block.get((block, layer), {}).items() if e < total}
        here = (total - len(present)) * bin(complete).count("1")
        here += sum(bin(complete & ~m).count("1") for m in present.values())
        if here and first is None:
            expert = 0
            while expert in present and not complete & ~present[expert]:
                expert += 1
            first = f"{block}.{layer}.ffn.experts.{expert}"
        missing += here

    for layer in range(numbers.layers):
        count("layers", layer, experts, EXL3_COMPLETE)
    draft_format = scan.mtp_format()
    if numbers.draft_stages:
        complete = EXL3_COMPLETE if draft_format == "exl3" else SOURCE_COMPLETE
        for stage in range(numbers.draft_stages):
            count("mtp", stage, draft_experts, complete)
    dims = Dims(numbers.layers, experts, numbers["hidden_size"], numbers["moe_intermediate_size"])
    wrong = []
    for (_block, projection, part, dtype, shape), (_n, name) in scan.expert_layouts.items():
        expected = _expected_layout(dims, projection, part, dtype, shape)
        if expected:
            wrong.append(f"{name} is {dtype} {list(shape)}, expected {expected}")
    bad_k = [
        name
        for widths in scan.widths.values()
        for width, name in widths.items()
        if width % 16 or not 1 <= width // 16 <= MAX_K
    ]
    if missing:
        return Row(
            "v41.experts",
            FAIL,
            f"[silent] {plural(missing, 'expert tensor')} missing (first: {first}); vLLM would leave them "
            "uninitialised.",
            "Re-download the shards that hold them (hf download <repo-id> --local-dir <pack>).",
        )
    if wrong or bad_k:
        problems = wrong + [f"{name} has a trellis width that is not 16 x K (K 1-{MAX_K})" for name in bad_k]
        return Row(
            "v41.experts",
            FAIL,
            f"{first_of(problems)}.",
            "Re-create those tensors with vllm-exl3's layout for this config (or re-download the pack).",
        )
    ks = sorted({w // 16 for widths in scan.widths.values() for w in widths})
    return Row(
        "v41.experts",
        PASS,
        f"{experts} experts x {numbers.layers} layers (EXL3, K {', '.join(map(str, ks))}) and "
        + (
            f"{draft_experts} x {numbers.draft_stages} draft stages ({draft_format})"
            if numbers.draft_stages
            else "no draft"
        )
        + f" complete, laid out for hidden {dims.hidden}, intermediate {dims.intermediate}.",
    )


def images_off(ctx: DoctorContext) -> bool:
    """Whether the serve command line turns images off (--language-model-only, or an image limit of 0)."""
    if ctx.serve_switch("--language-model-only"):
        return True
    limit = ctx.serve_flag("--limit-mm-per-prompt") or ""
    return '"image": 0' in limit.replace(" ", "").replace(":", ": ") or "image=0" in limit.replace(" ", "")


@check("v41.vision", needs=("pack",), family=V41)
def check_vision(ctx: DoctorContext) -> Row:
    """FAIL when the shards carry vision tensors (``vision.*``, ``aligner.*``, ``image_*``,
    ``ffn.gate.bias_vl``) but ``vision_config.num_hidden_layers`` is 0 or absent: no parameter for them,
    KeyError mid-load. WARN when the pack has no vision tower but the serve line does not turn images
    off: the V4.1 class always builds the tower *(inferred)* (V34 nvidia/vl_model.py:166-181;
    models/deepseek_v4/nvidia/model.py:313-320)."""
    scan = pack_scan(ctx)
    if skip := no_shards("v41.vision", scan):
        return skip
    layers = ctx.config().get("vision_n_layers")
    layers = layers if isinstance(layers, int) and not isinstance(layers, bool) else 0
    if scan.vision_tensors and layers <= 0:
        return Row(
            "v41.vision",
            FAIL,
            f"the shards carry {scan.vision_tensors} vision tensors (e.g. {scan.first_vision_tensor}) but "
            "vision_config.num_hidden_layers is 0 or absent: vLLM has no parameter for them (KeyError mid-load).",
            "Restore vision_config from the base checkpoint's config.json.",
        )
    if not scan.vision_tensors:
        if images_off(ctx):
            return Row("v41.vision", PASS, "no vision tower in the pack, and the serve line turns images off.")
        return Row(
            "v41.vision",
            WARN,
            "this V4.1 pack has no vision tower, but vLLM's V4.1 class builds one and would answer image "
            "requests with uninitialised weights.",
            "Serve it with --language-model-only.",
        )
    return Row(
        "v41.vision", PASS, f"vision tower of {layers} layers ({scan.vision_tensors} tensors with the gates' bias_vl)."
    )


def _table_dir_switch(ctx: DoctorContext) -> str | None:
    """MiaAI-Lab's switch: ``engram_table_dir`` in the config or in a dict ``--hf-overrides``."""
    if ctx.config().get("engram_table_dir"):
        return "text_config.engram_table_dir"
    overrides = json_flag(ctx, "--hf-overrides")
    if isinstance(overrides, dict) and overrides.get("engram_table_dir"):
        return "--hf-overrides engram_table_dir"
    return None


def disk_engram_kit(ctx: DoctorContext) -> str | None:
    """The disk-backed Engram kit installed in the vLLM tree with its switch on, if any (v41-packs.md §3.3):
    its marker in the V4.1 model sources, and its variable (or MiaAI-Lab's engram_table_dir) set."""
    if ctx.runtime is None or ctx.runtime.vllm_root is None:
        return None
    kits = [
        (label, marker, switch)
        for label, marker, switch in DISK_ENGRAM_KITS
        if ctx.environ.get(switch, "").strip() in ("1", "true", "True")
    ]
    table_dir = _table_dir_switch(ctx)
    if table_dir:
        kits.append(("MiaAI-Lab's file-backed Engram", "engram_table_dir", table_dir))
    for label, marker, switch in kits:
        for folder in ENGRAM_SOURCES:
            try:
                paths = sorted((ctx.runtime.vllm_root / folder).rglob("*.py"))
            except OSError:
                continue
            for path in paths:
                try:
                    if marker.encode() in path.read_bytes() or marker in path.name:
                        said = switch if switch.startswith(("text_config", "--")) else f"{switch}=1"
                        return f"{label} ({path.name}, {said})"
                except OSError:
                    continue
    return None
