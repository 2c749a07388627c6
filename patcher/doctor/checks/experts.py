"""Pack checks on the routed experts: every one present, shaped as the config says, one K per layer; the
trellis widths and the codebook markers.

experts.complete, experts.shapes, experts.one-k, quant.layer-bits (the declared K per layer against the trellis
widths), experts.markers (every marker's 4 bytes are the codebook's value).
"""

from __future__ import annotations

import shlex
from collections import Counter, defaultdict

from patch_dsv4.doctor.checks.config import fix_config_note
from patch_dsv4.doctor.readers.base import FAIL, PASS, SKIP, DoctorContext, Row, check
from patch_dsv4.doctor.readers.family import V4
from patch_dsv4.doctor.readers.pack import (
    EXL3_COMPLETE,
    EXL3_PARTS,
    PROJECTIONS,
    SOURCE_COMPLETE,
    SOURCE_PARTS,
    Dims,
    PackScan,
    block_label,
    declared_bits,
    declared_layer_bits,
    first_of,
    json_text,
    layer_bits_for,
    layer_bits_problems,
    majority_k,
    model_dims,
    no_shards,
    pack_scan,
    plural,
    quantization_config,
    tensor_parallel,
    valid_bits,
)

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


@check("experts.complete", needs=("pack",), family=V4)  # V4.1's draft has dspark_n_routed_experts: v41.experts
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
            f"{plural(missing, 'routed-expert tensor')} missing (first: {first}); vLLM would leave them "
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


@check("experts.shapes", needs=("pack",), family=V4)  # V4.1: v41.experts
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
            f"{plural(count, 'expert tensor')} with the wrong layout; {first_of(wrong)}.",
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


@check("experts.one-k", needs=("pack",), family=V4)  # V4.1: v41.experts
def check_experts_one_k(ctx: DoctorContext) -> Row:
    """FAIL if a layer's experts mix trellis widths (gate/up/down or across experts) or a width is not
    a multiple of 16: per-layer bits cannot express it and the fused MoE needs one K per layer
    (R fix_pack_config.py:60-63; P physical_k_compat.py)."""
    scan = pack_scan(ctx)
    if skip := no_shards("experts.one-k", scan):
        return skip
    problems = []
    for (block, layer), widths in sorted(scan.widths.items()):
        if len(widths) > 1:
            problems.append(
                f"{block_label(block, layer)} mixes trellis widths {sorted(widths)} "
                f"({', '.join(widths[w] for w in sorted(widths))})"
            )
        elif next(iter(widths)) % 16:
            problems.append(f"{block_label(block, layer)} has trellis width {next(iter(widths))}, not a multiple of 16")
    if problems:
        return Row(
            "experts.one-k",
            FAIL,
            first_of(problems) + ".",
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


# --------------------------------------------------------------------------- checks: trellis widths and markers


@check("quant.layer-bits", needs=("pack",), family=V4)  # V4.1: v41.experts (K per tensor)
def check_layer_bits(ctx: DoctorContext) -> Row:
    """FAIL if ``layer_bits.get(L, bits) * 16`` differs from layer L's trellis width, or an entry is
    not a K in 2-6: ``EXL3 load shape mismatch`` part-way through the load (R fix_pack_config.py:40,43-69;
    LOADER_NOTES.md:79-88; P exl3.py Exl3Config.__init__, bits_for_prefix)."""
    quant = quantization_config(ctx.config())
    scan = pack_scan(ctx)
    bits = declared_bits(quant)
    layer_bits, _ = declared_layer_bits(quant)
    base = valid_bits(quant) or majority_k(scan) or bits
    wanted = json_text(layer_bits_for(scan, base))
    problems = layer_bits_problems(quant, scan)
    if problems:
        return Row(
            "quant.layer-bits",
            FAIL,
            f"layer_bits does not match the shards: {first_of(problems)}.",
            f'Set "layer_bits": {wanted} (the layers whose K is not {base})' + fix_config_note(ctx) + ".",
        )
    return Row(
        "quant.layer-bits",
        PASS,
        f"bits {bits} and layer_bits {json_text({str(k): v for k, v in sorted(layer_bits.items())})} match the "
        f"trellis width of all {len(scan.layer_k())} expert layers.",
    )


@check("experts.markers", needs=("pack",))
def check_markers(ctx: DoctorContext) -> Row:
    """FAIL unless every ``.mcg`` holds -877912083 and every ``.mul1`` -2082680531 (all markers read,
    4 bytes each): vllm-exl3 raises ``packed ABI mismatch`` only after the full load
    (P exl3.py:94,96, Exl3MoEMethod.process_weights_after_loading; L mtp_overlay.py verify_output)."""
    scan = pack_scan(ctx)
    if skip := no_shards("experts.markers", scan):
        return skip
    if scan.bad_marker_count:
        return Row(
            "experts.markers",
            FAIL,
            f"{scan.bad_marker_count} of {scan.markers_checked} markers are wrong; first: {scan.first_bad_marker}.",
            f"{scan.first_bad_marker}: the pack's packed ABI does not match vllm-exl3 (the load would fail "
            "after reading every shard); re-download or re-quantize the tensors with wrong markers.",
        )
    if scan.markers_unread:
        return Row(
            "experts.markers",
            SKIP,
            f"{scan.markers_unread} EXL3 markers are in the shards' data, which doctor does not read from the "
            f"Hub (headers only); run doctor on the downloaded pack to check them.",
        )
    if not scan.markers_checked:
        return Row("experts.markers", PASS, "the pack has no EXL3 marker tensors to read.")
    return Row(
        "experts.markers",
        PASS,
        f"all {scan.markers_checked} EXL3 markers read (4 bytes each) hold their codebook's value.",
    )
