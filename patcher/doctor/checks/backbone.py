"""Pack check on everything vLLM creates outside the routed experts, tensor by tensor: backbone.complete.

A DeepSeek-V4 or V4.1 pack published without part of its backbone loads, answers ``/v1/models`` and writes
fluent garbage: vLLM does not track the weights a quantized model never loaded (V0.28.0
model_loader/default_loader.py:435-470; V34 default_loader.py:549-551), so the parameters keep what
``torch.empty`` gave them. vcruz305's DSV4.1-Flash-EXL3-4.75bpw at e971fd55 lacked 1,243 of the 1,621
non-routed tensors of its base (Blackwellboy/DeepSeek-V4.1-Flash-EXL3-DGX-Spark-recipe
docs/QUALITY_MISSING_ATTN_WEIGHTS.md @186513f). What vLLM creates comes from readers/inventory.py; the
pack's names from the one header scan (PackScan.others), local or on the Hub alike.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from patch_dsv4.doctor.checks.v41_config import v41_numbers
from patch_dsv4.doctor.checks.v41_tensors import images_off
from patch_dsv4.doctor.readers.base import FAIL, PASS, SKIP, WARN, DoctorContext, Row, check
from patch_dsv4.doctor.readers.family import V4, V41
from patch_dsv4.doctor.readers.inventory import (
    DRAFT,
    GROUPS,
    VISION,
    Layout,
    Need,
    block_needs,
    draft_needs,
    linear_state,
    possible_names,
    storage,
    top_needs,
    vision_needs,
)
from patch_dsv4.doctor.readers.pack import PackScan, config_int, drafts_from_mtp, first_of, no_shards, pack_scan
from patch_dsv4.doctor.readers.serving_env import older_than

VISION_CLASS = (0, 30)  # the first vLLM with DeepSeek's vision classes (and their gates' bias_vl)
# Where a pack's config.json may name the checkpoint it was made from (transformers writes _name_or_path).
BASE_KEYS = ("base_model", "base_model_name_or_path", "source_model", "_name_or_path")
SHOWN_LAYERS = 6  # layer numbers a group names before "and N more"
# Blocks (layers, draft stages, vision blocks) doctor lists one by one: a real pack has 43 layers at most. A
# config past it is judged by the rows that count without listing (experts.complete, v41.config).
MAX_BLOCKS = 1024
MAX_GROUPS = 64  # wo_a's output groups (o_groups) read: 8 in every DeepSeek-V4


def base_of(cfg: dict) -> str | None:
    """The checkpoint the pack's config.json says it was made from, if it names one (top level or in its
    quantization_config): a Hub id or a path, as written."""
    quant = cfg.get("quantization_config")
    for where in (cfg, quant if isinstance(quant, dict) else {}):
        for key in BASE_KEYS:
            value = where.get(key)
            if isinstance(value, str) and value.strip() and len(value) < 300 and value.isprintable():
                return value.strip()
    return None


def layout_of(ctx: DoctorContext, scan: PackScan) -> Layout | str:
    """The pack's model as vLLM builds it, or why the config does not say."""
    cfg = ctx.config()
    family = ctx.pack_family() or V4
    vision_layers = config_int(cfg, "vision_n_layers") or 0
    shared = cfg.get("n_shared_experts")
    # absent from config.json: whatever the pack carries (a shared expert half there is reported below)
    shared_experts = (
        bool(shared) if "n_shared_experts" in cfg else any(".ffn.shared_experts." in n for n in scan.others)
    )
    o_groups = config_int(cfg, "o_groups") or 8
    common = {
        "noaux": cfg.get("topk_method") == "noaux_tc",
        "shared_experts": shared_experts,
        "o_groups": o_groups if 0 < o_groups <= MAX_GROUPS else 8,
        "vision_layers": max(vision_layers, 0),
    }
    if family == V41:
        numbers = v41_numbers(ctx)
        if numbers is None:
            return "config.json lacks the numbers this check reads (see v41.config)"
        ratios = tuple(numbers.compress_ratios[: numbers.layers])
        return Layout(
            V41,
            numbers.layers,
            ratios + (0,) * (numbers.layers - len(ratios)),
            kv_sources=frozenset(numbers.kv_sources),
            index_sources=frozenset(numbers.index_sources),
            engram_layers=frozenset(numbers.engram_layers),
            vision_gates=vision_layers > 0,  # V4.1 exists from 0.30.0 on, its vision class with it
            draft_stages=numbers.draft_stages,
            **common,
        )
    layers = config_int(cfg, "num_hidden_layers")
    if layers is None or layers <= 0:
        return "config.json has no usable num_hidden_layers"
    ratios = cfg.get("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) < layers:
        return "config.json has no compress_ratios entry for each layer (vLLM builds each layer's attention from it)"
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ratios[:layers]):
        return "config.json's compress_ratios are not all non-negative integers"
    runtime = ctx.runtime
    old = older_than(runtime.vllm_version, VISION_CLASS) if runtime is not None else None
    return Layout(
        V4,
        layers,
        tuple(ratios[:layers]),
        hash_layers=max(config_int(cfg, "num_hash_layers") or 0, 0),
        vision_gates=vision_layers > 0 and old is not True,
        draft_stages=max(config_int(cfg, "num_nextn_predict_layers") or 0, 0),
        **common,
    )


def needs_of(ctx: DoctorContext, layout: Layout, scan: PackScan) -> tuple[list[Need], list[str]]:
    """Everything the pack must hold for vLLM, and what was left unjudged (said in the row). The caller has
    checked that the layers are at most MAX_BLOCKS."""
    needs: list[Need] = []
    for layer in range(layout.layers):
        needs += block_needs(layout, "layers", layer)
    needs += top_needs(layout)
    notes = []
    has_tower = any(n.startswith(("vision.", "aligner.", "image_")) for n in scan.others)
    if has_tower and layout.vision_layers and layout.vision_gates:
        if images_off(ctx):
            notes.append("the vision tower was not judged: the serve line turns images off")
        elif layout.vision_layers > MAX_BLOCKS:
            notes.append(f"the vision tower was not judged: {layout.vision_layers:,} blocks, more than doctor lists")
        else:
            needs += vision_needs(layout)
    if scan.mtp_blocks:
        stages = max(max(scan.mtp_blocks) + 1, layout.draft_stages)
        if stages > MAX_BLOCKS:
            notes.append(f"the draft was not judged: {stages:,} stages, more than doctor lists")
        else:
            mtp_style = any(n.startswith("mtp.") and ".e_proj." in n for n in scan.others)
            needs += draft_needs(layout, stages, mtp_style)
    return needs, notes


def _guess_forms(needs: list[Need], names: dict[str, str], marker: str) -> tuple[dict, dict[str, str | None]]:
    """Each linear's state, and for each kind of linear (its name below the layer) the form the pack stores
    the others of that kind in; "" keys the pack's most common form of a quantized linear."""
    states, by_kind = {}, defaultdict(Counter)
    for need in needs:
        if need.linear:
            form, missing = linear_state(need, names, marker)
            states[need] = (form, missing)
            if form is not None:
                by_kind[need.suffix][form] += 1
                if need.quantized:
                    by_kind[""][form] += 1
    forms = {kind: counts.most_common(1)[0][0] for kind, counts in by_kind.items()}
    return states, forms


def missing_names(needs: list[Need], names: dict[str, str], marker: str) -> list[tuple[Need, list[str]]]:
    """Each need the pack does not meet, with the names it lacks (a linear absent altogether is counted in
    the form the pack stores that kind of linear in: a source pack's FP8 weight and scale, an EXL3 one's four
    tensors)."""
    states, forms = _guess_forms(needs, names, marker)
    found = []
    for need in needs:
        if need.linear:
            form, missing = states[need]
            if form is None:
                guess = forms.get(need.suffix) or (forms.get("") if need.quantized else None) or "bf16"
                if guess == "slices" and not need.slices:
                    guess = "exl3"
                missing = storage(need, guess, marker)
        elif any(name in names for name in need.names):
            continue
        else:
            missing = [need.name]
        if missing:
            found.append((need, missing))
    return found


def odd_ones(needs: list[Need], names: dict[str, str]) -> list[str]:
    """Names that most main layers of a kind (the same inventory) carry and a layer of that kind lacks, beyond
    what the inventory asks: a tensor of vLLM's this inventory would not know, or a pack cut unevenly."""
    by_layer: dict[int, list[Need]] = defaultdict(list)
    for need in needs:
        if need.layer is not None and need.name.startswith("layers."):
            by_layer[need.layer].append(need)
    carried: dict[int, set[str]] = defaultdict(set)
    for name in names:
        if name.startswith("layers."):
            parts = name.split(".", 2)
            if len(parts) == 3 and parts[1].isdecimal() and not parts[2].startswith(("ffn.experts.", "engram.embed.")):
                carried[int(parts[1])].add(parts[2])
    kinds: dict[tuple, list[int]] = defaultdict(list)
    judged: dict[int, set[str]] = {}
    for layer, layer_needs in by_layer.items():
        kinds[tuple(need.suffix for need in layer_needs)].append(layer)
        judged[layer] = {n.split(".", 2)[2] for need in layer_needs for n in possible_names(need)}
    odd = []
    for layers in kinds.values():
        if len(layers) < 2:
            continue
        counts = Counter(suffix for layer in layers for suffix in carried[layer])
        usual = {suffix for suffix, n in counts.items() if 2 * n > len(layers)}
        for layer in sorted(layers):
            odd += [f"layers.{layer}.{suffix}" for suffix in sorted(usual - carried[layer] - judged[layer])]
    return odd


def tensors(count: int) -> str:
    return f"{count:,} tensor{'' if count == 1 else 's'}"


def layer_span(layers: list[int]) -> str:
    """``0-39``, ``3, 5-9, 12`` (and ``... and N more`` past a few runs)."""
    runs: list[list[int]] = []
    for layer in sorted(set(layers)):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    text = [f"{a}-{b}" if b > a else str(a) for a, b in runs]
    more = f" and {len(text) - SHOWN_LAYERS} more runs" if len(text) > SHOWN_LAYERS else ""
    return ", ".join(text[:SHOWN_LAYERS]) + more


def summary(found: list[tuple[Need, list[str]]]) -> tuple[int, list[str], list[str]]:
    """(tensors missing, a clause per group in GROUPS order, the groups)."""
    counts, layers, first = Counter(), defaultdict(list), {}
    for need, missing in found:
        counts[need.group] += len(missing)
        if need.layer is not None:
            layers[need.group].append(need.layer)
        first.setdefault(need.group, missing[0])
    groups = [g for g in GROUPS if counts[g]]
    clauses = []
    for group in groups:
        where, what = set(layers[group]), "stage" if group == DRAFT else "layer"
        on = f" on {what}s {layer_span(list(where))}" if len(where) > 1 else f" on {what} {min(where)}" if where else ""
        clauses.append(f"{group} {counts[group]:,}{on} (first: {first[group]})")
    return sum(counts.values()), clauses, groups


# The groups vcruz305's scripts/fix_missing_backbone.py restores (the main layers' names but experts and engram.)
REPAIRED_BY_VCRUZ = frozenset({"attention", "shared experts", "hc_*", "gates", "ffn_norm"})


def _fix(ctx: DoctorContext, groups: list[str]) -> str:
    base = base_of(ctx.config())
    where = (
        f"from {base}, the checkpoint config.json names as the pack's base, at the revision the pack was made from"
        if base
        else "from the checkpoint the pack was made from, at that revision (config.json names none)"
    )
    text = f"Restore the missing tensors ({', '.join(groups)}) {where}"
    if ctx.pack_family() == V41 and set(groups) <= REPAIRED_BY_VCRUZ:
        text += "; vcruz305's scripts/fix_missing_backbone.py does this for its 4.75bpw V4.1 pack"
    return text + "; or re-download the pack once its publisher has restored them."


@check("backbone.complete", needs=("pack",))
def check_backbone(ctx: DoctorContext) -> Row:
    """FAIL [silent] when a tensor vLLM creates outside the routed experts is missing from the shards
    (inventory.py: per layer attention, compressor, indexer, hc_*, gates, norms, shared experts, Engram
    projection, as the config's compress ratios, hash, kv/index source and Engram layers say; the top level;
    the vision tower where the pack carries one and the serve line asks for images), counted per group with
    the first layers and tensors; WARN when only the draft's stages lack some (speculative decoding then
    proposes from uninitialised weights: a slower, not a wrong answer *(inferred)*), or when a layer lacks a
    name the other layers of its kind carry. A linear is met by any complete storage form (FP8 weight and scale,
    BF16 weight, EXL3, wo_a slices): a pack's format is its own."""
    scan = pack_scan(ctx)
    if skip := no_shards("backbone.complete", scan):
        return skip
    layout = layout_of(ctx, scan)
    if isinstance(layout, str):
        return Row("backbone.complete", SKIP, layout + ".")
    if layout.layers > MAX_BLOCKS:
        return Row(
            "backbone.complete",
            SKIP,
            f"config.json declares {layout.layers:,} layers, more than doctor lists tensor by tensor "
            f"({MAX_BLOCKS:,}; a DeepSeek-V4 has 43): see the rows that count the experts.",
        )
    needs, notes = needs_of(ctx, layout, scan)
    names = scan.others
    markers = Counter(scan.routed_marker_suffixes)
    marker = markers.most_common(1)[0][0] if markers else "mcg"
    found = missing_names(needs, names, marker)
    odd = odd_ones(needs, names)
    note = f" ({'; '.join(notes)})" if notes else ""
    serving = [(need, missing) for need, missing in found if need.group != DRAFT]
    if serving:
        total, clauses, groups = summary(found)
        extra = f"; and {first_of(odd)}, which other layers of its kind carry" if odd else ""
        return Row(
            "backbone.complete",
            FAIL,
            f"[silent] {tensors(total)} vLLM creates {'are' if total != 1 else 'is'} missing: {'; '.join(clauses)}"
            f"{extra}. vLLM would serve with them uninitialised and report nothing: fluent garbage{note}.",
            _fix(ctx, groups),
        )
    if found or odd:
        parts = []
        if found:
            total, clauses, groups = summary(found)
            parts.append(
                f"the draft lacks {tensors(total)}: {'; '.join(clauses)}; with speculative decoding its "
                "stages would propose from uninitialised weights (answers stay right, fewer drafts are accepted)"
            )
        else:
            groups = []
        if odd:
            parts.append(
                f"{first_of(odd)} is missing where the other layers of its kind carry it (vLLM's inventory as "
                "doctor reads it has no parameter for it: a pack cut unevenly, or a tensor doctor does not know)"
            )
        fix = (
            _fix(ctx, groups)
            + (
                " Or serve without --speculative-config."
                if drafts_from_mtp(ctx)
                else " It matters only with --speculative-config, which the serve line does not give."
            )
            if found
            else (
                "Compare the layer with the others of its kind and restore what it lacks from the checkpoint the pack "
                "was made from (or re-download the pack)."
            )
        )
        return Row("backbone.complete", WARN, "; ".join(parts) + f"{note}.", fix)
    kinds = ["attention", "hc_*", "gates", "norms"] + (["shared experts"] if layout.shared_experts else [])
    where = []
    if layout.family == V41:
        where.append(f"compressors on {sorted(layout.kv_sources)}, indexers on {sorted(layout.index_sources)}")
        if layout.engram_layers:
            where.append(f"Engram projections on {sorted(layout.engram_layers)}")
    else:
        compressed = sum(1 for r in layout.ratios if r > 1)
        indexed = sum(1 for r in layout.ratios if r == 4)
        where.append(f"compressors on {compressed} layers, indexers on {indexed}")
    held = sum(len(storage(n, linear_state(n, names, marker)[0] or "bf16", marker)) if n.linear else 1 for n in needs)
    tables = " and the Engram tables" if layout.engram_layers else ""
    tower = any(need.group == VISION for need in needs)
    draft = sorted({need.layer for need in needs if need.group == DRAFT and need.layer is not None})
    also = (
        ["the top level"] + (["the vision tower"] if tower else []) + ([f"{len(draft)} draft stages"] if draft else [])
    )
    return Row(
        "backbone.complete",
        PASS,
        f"all {held:,} tensors vLLM creates outside the routed experts{tables} are present: "
        f"{layout.layers} layers' {', '.join(kinds)} ({'; '.join(where)}), {', '.join(also)}{note}.",
    )
