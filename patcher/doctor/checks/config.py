"""Pack checks on config.json and its quantization block (DOCTOR-FACTS.md A "Pack").

pack.config, pack.text-config, quant.method, quant.bits, quant.codebook: what the
pack declares, compared with its shards' summary (:func:`pack.pack_scan`).
"""

from __future__ import annotations

import shlex

from patch_dsv4.doctor.readers.base import FAIL, PASS, WARN, DoctorContext, PackUnreadable, Row, check
from patch_dsv4.doctor.readers.family import V4
from patch_dsv4.doctor.readers.pack import (
    config_int,
    echo,
    majority_k,
    pack_scan,
    quantization_config,
    valid_bits,
    wanted_codebook,
)

# --------------------------------------------------------------------------- checks: config.json


@check("pack.config", needs=("pack",), family=V4)  # V4.1: v41.config
def check_config(ctx: DoctorContext) -> Row:
    """FAIL if config.json is missing, unreadable or not a JSON object (R serve_one_spark_dsv4.sh:45-48)."""
    try:
        cfg = ctx.config()
    except PackUnreadable as exc:
        return Row(
            "pack.config", FAIL, str(exc), f"config.json is missing or invalid in {ctx.pack}; download the pack again."
        )
    return Row(
        "pack.config",
        PASS,
        f"config.json read: model_type {echo(cfg.get('model_type'))}, "
        f"num_hidden_layers {echo(cfg.get('num_hidden_layers'))}, {len(cfg)} top-level keys.",
    )


@check("pack.text-config", needs=("pack",), family=V4)  # V4.1's text_config is its layout, not a fault
def check_text_config(ctx: DoctorContext) -> Row:
    """FAIL if ``text_config`` is ``{}`` or lacks ``num_attention_heads``: vLLM adopts it as the whole
    text config and config parsing fails (R LOADER_NOTES.md:126-133; fix_pack_config.py:118-119)."""
    cfg = ctx.config()
    if "text_config" not in cfg:
        return Row("pack.text-config", PASS, "config.json is flat (no text_config), as DeepSeek-V4 expects.")
    text_config = cfg["text_config"]
    if text_config == {}:
        return Row(
            "pack.text-config",
            FAIL,
            'config.json has an empty "text_config", which vLLM adopts as the whole text config.',
            'Delete the "text_config" key (the DeepSeek-V4 config is flat)' + fix_config_note(ctx) + ".",
        )
    if not isinstance(text_config, dict) or "num_attention_heads" not in text_config:
        return Row(
            "pack.text-config",
            FAIL,
            'config.json has a "text_config" without num_attention_heads; vLLM adopts it and fails to parse.',
            'Delete the "text_config" key by hand (the DeepSeek-V4 config is flat: its keys belong at the top level).',
        )
    return Row("pack.text-config", PASS, "text_config is present and names num_attention_heads.")


@check("quant.method", needs=("pack",))
def check_quant_method(ctx: DoctorContext) -> Row:
    """FAIL unless ``quantization_config.quant_method == "exl3"``: for fp8 / deepseek_v4_fp8, vLLM's
    DeepseekV4FP8Config override silently replaces --quantization exl3 and the load balloons to
    ~117 GiB (V0.28.0 models/deepseek_v4/quant_config.py:135-152, config/model.py:1245-1266;
    R LOADER_NOTES.md:19-31)."""
    cfg = ctx.config()
    method = quantization_config(cfg).get("quant_method")
    if method == "exl3":
        return Row("quant.method", PASS, 'quantization_config.quant_method is "exl3".')
    found = "absent" if method is None else echo(method)
    refusal = fixer_refusal(ctx)
    if refusal is None and ctx.pack_family() == "v41":  # the recipe's V4 fixer would flatten a V4.1 config
        how = f'Set "quant_method": "exl3" in quantization_config{fix_config_note(ctx)}.'
    elif refusal is None:
        how = (
            f'Set "quant_method": "exl3"{fix_config_note(ctx)}; for the archived fork route use '
            f'the recipe\'s "python scripts/fix_pack_config.py {shlex.quote(str(ctx.pack))} --route b".'
        )
    else:
        how = 'Set "quant_method": "exl3" in quantization_config by hand, keeping the rest of the block.'
    return Row(
        "quant.method",
        FAIL,
        f'quantization_config.quant_method is {found}, not "exl3": vLLM\'s deepseek_v4_fp8 override '
        "replaces --quantization exl3 and the load balloons past memory (~117 GiB) before failing.",
        how,
    )


@check("quant.bits", needs=("pack",), family=V4)  # V4.1 packs mix K per tensor (SAGE: K1-K6 in a layer): v41.experts
def check_quant_bits(ctx: DoctorContext) -> Row:
    """FAIL if ``bits`` is not in 2-6 (ValueError at config parse); WARN when absent, since the plugin
    then sizes every layer missing from ``layer_bits`` for K4 (P exl3.py Exl3Config.__init__, from_config)."""
    quant = quantization_config(ctx.config())
    scan = pack_scan(ctx)
    k = majority_k(scan)
    suggestion = f" (the shards say {k})" if k else ""
    if "bits" not in quant:
        return Row(
            "quant.bits",
            WARN,
            "quantization_config has no bits; vllm-exl3 then assumes 4.",
            f'Set "bits" to the K of the layers not listed in layer_bits{suggestion}' + fix_config_note(ctx) + ".",
        )
    bits = valid_bits(quant)
    if bits is None:
        return Row(
            "quant.bits",
            FAIL,
            f"quantization_config.bits is {echo(quant['bits'])}; vllm-exl3 accepts 2-6 and refuses the config.",
            f'Set "bits" to the K of the layers not listed in layer_bits{suggestion}' + fix_config_note(ctx) + ".",
        )
    return Row("quant.bits", PASS, f"quantization_config.bits is {bits}.")


@check("quant.codebook", needs=("pack",))
def check_quant_codebook(ctx: DoctorContext) -> Row:
    """FAIL unless ``codebook`` is ``mcg``/``mul1`` (default ``mcg``) and matches the routed experts'
    marker tensors (``.mcg`` or ``.mul1``) (P exl3.py Exl3Config.__init__, from_config)."""
    quant = quantization_config(ctx.config())
    scan = pack_scan(ctx)
    codebook = quant.get("codebook", "mcg")
    found = sorted(scan.routed_marker_suffixes)
    where = f"the routed experts carry .{'/.'.join(found)} markers" if found else "no routed marker tensors were found"
    wanted = wanted_codebook(quant, scan)
    if wanted:
        return Row(
            "quant.codebook",
            FAIL,
            f"codebook {echo(codebook)} does not match the pack: {where}.",
            f'Set "codebook": "{wanted}" in quantization_config' + fix_config_note(ctx) + ".",
        )
    stated = "" if "codebook" in quant else " (absent; vllm-exl3 assumes mcg)"
    return Row("quant.codebook", PASS, f'codebook is "{codebook}"{stated} and {where}.')


# --------------------------------------------------------------------------- what --fix-config would write


def fixer_refusal(ctx: DoctorContext) -> str | None:
    """Why ``--fix-config`` would refuse this pack, or None when it fits the recipe's fixer.

    R fix_pack_config.py writes a block for routed-only EXL3 packs with BF16 dense
    weights and source-format MTP experts; it deletes ``non_routed_exl3`` and re-adds
    ``mtp_experts: "source"`` on anything else (A.2 "Traps").
    """
    return ctx.cached("pack.fixer_refusal", lambda: _fixer_refusal(ctx))


def _fixer_refusal(ctx: DoctorContext) -> str | None:
    try:
        cfg = ctx.config()
    except PackUnreadable as exc:
        return str(exc)
    if ctx.pack_family() == "v41":  # V4.1 has its own edits (v41_config.v41_config_edits)
        from patch_dsv4.doctor.checks.v41_config import v41_fixer_refusal

        return v41_fixer_refusal(ctx)
    scan = pack_scan(ctx)
    if config_int(cfg, "num_hidden_layers") is None:
        return "config.json has no integer num_hidden_layers"
    if "non_routed_exl3" in quantization_config(cfg) or scan.dense_exl3_modules():
        return "this is a dense-EXL3 pack (non_routed_exl3, lna-lab Dense bake), not a routed-only EXL3 pack"
    if scan.mtp_format() in ("exl3", "mixed"):
        return 'its MTP experts are EXL3 (.trellis); mtp_experts "source" would hand them to the fp8 delegate'
    if scan.listing_error or scan.problems:
        return "some shard headers cannot be read (see pack.shards), so layer_bits cannot be derived"
    k = scan.layer_k()
    if not k:
        return "the shards hold no routed-expert trellis, so this is not an EXL3 MixedK pack"
    mixed = sorted(layer for layer, value in k.items() if value is None)
    if mixed:
        return f"layer {mixed[0]} has trellis widths no single K expresses (see experts.one-k)"
    return None


def fix_config_note(ctx: DoctorContext) -> str:
    if fixer_refusal(ctx) is None:
        return f" (patch-dsv4 doctor --pack {shlex.quote(str(ctx.pack))} --fix-config writes it)"
    return ""
