"""Pack checks on the trellis widths and the codebook markers.

quant.layer-bits (the declared K per layer against the trellis widths), experts.markers
(every marker's 4 bytes are the codebook's value).
"""

from __future__ import annotations

from .base import FAIL, PASS, SKIP, DoctorContext, Row, check
from .pack import (
    declared_bits,
    declared_layer_bits,
    first_of,
    fix_config_note,
    json_text,
    layer_bits_for,
    layer_bits_problems,
    majority_k,
    no_shards,
    pack_scan,
    quantization_config,
    valid_bits,
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
