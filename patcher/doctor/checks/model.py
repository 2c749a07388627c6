"""Pack checks on the model keys of config.json against the serving vLLM and flags.

config.topk-method, config.hash-layers, config.vision, config.spec-k.
"""

from __future__ import annotations

import re

from patch_dsv4.doctor.checks.config import fix_config_note
from patch_dsv4.doctor.readers.base import FAIL, PASS, WARN, DoctorContext, Row, check
from patch_dsv4.doctor.readers.family import V4
from patch_dsv4.doctor.readers.pack import (
    MTP_DRAFT_METHODS,
    config_int,
    echo,
    pack_scan,
    plural,
    routing_bias_layers,
    speculative_config,
)

# --------------------------------------------------------------------------- checks: model keys


@check("config.topk-method", needs=("pack",), family=V4)  # V4.1: read through the flattened config by v41.config
def check_topk_method(ctx: DoctorContext) -> Row:
    """FAIL if ``layers.N.ffn.gate.bias`` exists for N >= num_hash_layers and ``topk_method`` is not
    ``noaux_tc``: vLLM creates ``e_score_correction_bias`` only under noaux_tc, so the load raises
    KeyError or a skip-if-missing loader drops the routing biases *(inferred)* (V0.28.0
    nvidia/model.py:596-600,1411; V0.30.0 :861-868; R LOADER_NOTES.md:69-77)."""
    cfg = ctx.config()
    biased = routing_bias_layers(cfg, pack_scan(ctx))
    method = cfg.get("topk_method")
    if not biased:
        return Row("config.topk-method", PASS, "no routing bias (ffn.gate.bias) on a non-hash layer.")
    if method == "noaux_tc":
        return Row(
            "config.topk-method",
            PASS,
            f'{plural(len(biased), "layer")} ship ffn.gate.bias and topk_method is "noaux_tc".',
        )
    found = "absent" if method is None else echo(method)
    return Row(
        "config.topk-method",
        FAIL,
        f"the checkpoint ships routing biases on {len(biased)} layers (layers.{biased[0]}.ffn.gate.bias) but "
        f"topk_method is {found}; vLLM will not create e_score_correction_bias.",
        'Add "topk_method": "noaux_tc" at the top level of config.json (not inside a text_config)'
        + fix_config_note(ctx)
        + ".",
    )


@check("config.hash-layers", needs=("pack",), family=V4)  # V4.1 has no hash layers
def check_hash_layers(ctx: DoctorContext) -> Row:
    """FAIL if ``num_hash_layers`` is not the number of leading layers that carry ``ffn.gate.tid2eid``
    (R LOADER_NOTES.md:58-67)."""
    cfg = ctx.config()
    declared = cfg.get("num_hash_layers")
    layers = sorted(pack_scan(ctx).tid2eid_layers)
    if layers != list(range(len(layers))):
        return Row(
            "config.hash-layers",
            FAIL,
            f"ffn.gate.tid2eid is on layers {layers}, not on the first {len(layers)}.",
            "Re-download the shards holding the first layers' gate tensors.",
        )
    if (declared or 0) != len(layers) or isinstance(declared, bool):
        return Row(
            "config.hash-layers",
            FAIL,
            f"num_hash_layers is {echo(declared)} but the checkpoint has tid2eid on {plural(len(layers), 'layer')}.",
            f'Set "num_hash_layers": {len(layers)} in config.json (restore it from the source config).',
        )
    return Row("config.hash-layers", PASS, f"num_hash_layers {len(layers)} matches the layers carrying tid2eid.")


def _vllm_minor(version: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


@check("config.vision", needs=("pack",), family=V4)  # V4.1: v41.vision
def check_vision(ctx: DoctorContext) -> Row:
    """FAIL if vision tensors (``vision.*``, ``aligner.*``, ``image_*``, ``ffn.gate.bias_vl``) are present
    but ``vision_n_layers`` is 0 or absent: vLLM >= 0.30 picks the text class and rejects them. WARN when
    ``vision_n_layers`` > 0 without a vision tower, and for a vision pack on vLLM 0.28/0.29 (text only,
    loader-skips needed) (V0.30.0 transformers_utils/model_arch_config_convertor.py:601-606,
    nvidia/model.py:871-878; S FINDINGS.md)."""
    cfg = ctx.config()
    layers = config_int(cfg, "vision_n_layers") or 0
    scan = pack_scan(ctx)
    if scan.vision_tensors and layers <= 0:
        return Row(
            "config.vision",
            FAIL,
            f"the pack ships {scan.vision_tensors} vision tensors (e.g. {scan.first_vision_tensor}) but "
            f"vision_n_layers is {echo(cfg.get('vision_n_layers'))}.",
            "The pack ships a vision tower but vision_n_layers is 0: vLLM >= 0.30 will pick the text class and "
            "reject vision.* / leave gate.bias_vl unset. Restore vision_n_layers from the source config.",
        )
    if not scan.vision_tensors and layers > 0:
        return Row(
            "config.vision",
            WARN,
            f"vision_n_layers is {layers} but the pack has no vision tensors; vLLM >= 0.30 would build a "
            "vision tower and gate.bias_vl that nothing loads.",
            'Set "vision_n_layers": 0 for this text-only pack.',
        )
    if not layers:
        return Row("config.vision", PASS, "text-only pack: no vision tensors and no vision_n_layers.")
    runtime = ctx.runtime
    minor = _vllm_minor(runtime.vllm_version if runtime else None)
    if minor in ((0, 28), (0, 29)):
        return Row(
            "config.vision",
            WARN,
            f"vision pack ({scan.vision_tensors} vision tensors) on vLLM {runtime.vllm_version}, which has no "
            "DeepSeek-V4 vision class.",
            "This serves text only and needs patch-dsv4's loader-skips (patch-dsv4 apply); use vLLM >= 0.30 "
            "for images.",
        )
    return Row("config.vision", PASS, f"vision_n_layers {layers} and {scan.vision_tensors} vision tensors agree.")


@check("config.spec-k", needs=("pack",), family=V4)  # V4.1 drafts with DSpark only: v41.topology
def check_spec_k(ctx: DoctorContext) -> Row:
    """FAIL if ``num_speculative_tokens`` k > n MTP layers and k % n != 0: vLLM rejects it at startup
    (V0.28.0 config/speculative.py:1066-1081; R README.md:433-435, "4 is rejected outright")."""
    spec = speculative_config(ctx)
    if spec is None:
        return Row("config.spec-k", PASS, "no --speculative-config on the serve command line.")
    if isinstance(spec, str):
        return Row(
            "config.spec-k",
            FAIL,
            spec + ".",
            "--speculative-config takes a JSON object, e.g. "
            """'{"method":"dspark","num_speculative_tokens":3}'.""",
        )
    method = spec.get("method")
    if method not in MTP_DRAFT_METHODS:
        return Row(
            "config.spec-k", PASS, f"speculative method {echo(method)} does not draft from the pack's MTP layers."
        )
    n = len(pack_scan(ctx).mtp_blocks) or config_int(ctx.config(), "num_nextn_predict_layers") or 0
    k = spec.get("num_speculative_tokens")
    if n == 0:
        return Row(
            "config.spec-k",
            FAIL,
            f"--speculative-config asks for {method}, but the pack has no MTP layers.",
            "Drop --speculative-config, or serve a pack that ships its MTP layers.",
        )
    if not isinstance(k, int) or isinstance(k, bool):
        return Row("config.spec-k", PASS, f"{method} with num_speculative_tokens unset: vLLM uses the {n} MTP layers.")
    if k > n and k % n:
        return Row(
            "config.spec-k",
            FAIL,
            f"num_speculative_tokens is {k} and the pack has {n} MTP layers.",
            f"num_speculative_tokens={k} is not allowed with {n} MTP layers; use {n} (or a multiple of {n}).",
        )
    return Row("config.spec-k", PASS, f"num_speculative_tokens {k} fits the pack's {n} MTP layers.")
