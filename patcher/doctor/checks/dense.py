"""Pack checks on the weights outside the routed experts: dense linears, the MTP draft, the delegate.

dense.policy, mtp.format, quant.delegate, dense.exl3-map, dense.wo-a-slices; where a row
says so, against files of the installed vLLM (read as text, never imported).
"""

from __future__ import annotations

import ast
from collections import Counter, defaultdict

from patch_dsv4.doctor.checks.config import fix_config_note
from patch_dsv4.doctor.readers.base import FAIL, PASS, SKIP, WARN, DoctorContext, Row, check
from patch_dsv4.doctor.readers.family import V4
from patch_dsv4.doctor.readers.files import read_regular_file
from patch_dsv4.doctor.readers.pack import (
    DENSE_LINEARS,
    FP8_DELEGATE,
    MARKER_VALUES,
    STOCK_POLICY,
    VALID_K,
    WO_A_SLICE,
    config_int,
    declared_bits,
    declared_layer_bits,
    drafts_from_mtp,
    echo,
    first_of,
    json_text,
    no_shards,
    pack_scan,
    plain_bf16_dense,
    plugin_int,
    plural,
    quantization_config,
    source_mtp_problems,
    tensor_parallel,
)

ROUTE_B_MARKER = "_bf16_to_fp8_stream"  # R scripts/patch_dsv4_loader.py
DSV4_NVIDIA = ("vllm", "models", "deepseek_v4", "nvidia")


# --------------------------------------------------------------------------- runtime reads


def _vllm_file(ctx: DoctorContext, *parts: str) -> tuple[str | None, str]:
    """(text, where) of a file of the installed vLLM; text is None and ``where`` says why when unread."""
    runtime = ctx.runtime
    if runtime is None or runtime.vllm_root is None:
        return None, "no vLLM environment located"
    path = runtime.vllm_root.joinpath(*parts)
    try:
        return read_regular_file(path).decode("utf-8", "replace"), str(path)
    except OSError as exc:
        return None, f"{path} cannot be read ({exc.strerror or exc})"


def _registered_quant_methods(text: str) -> set[str] | None:
    """The names in ``QuantizationMethods = Literal[...]``, read from the source (never imported)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "QuantizationMethods" for t in targets):
            return {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return None


# --------------------------------------------------------------------------- checks: dense weights and MTP


@check("dense.policy", needs=("pack",), family=V4)  # V4.1's delegate is deepseek_v4_fp8 [32, 32]: v41.delegate
def check_dense_policy(ctx: DoctorContext) -> Row:
    """FAIL if dense linears are BF16 without scales, not covered by ``non_routed_exl3``, the policy is
    not ``bf16_as_stored``, a ``non_routed_quantization`` delegate is declared (without one the plugin
    keeps them unquantized) and the installed vLLM lacks the route-B loader (``_bf16_to_fp8_stream`` in
    deepseek_v4/nvidia/model.py): the plugin hands them to the fp8 method and the model returns empty or
    uniform text with no error (R README.md:309-319; LOADER_NOTES.md:134-140,166-180; P exl3.py
    get_quant_method). Without a located vLLM the route-B half is reported as unchecked."""
    quant = quantization_config(ctx.config())
    policy = quant.get("non_routed_dtype_policy")
    plain = plain_bf16_dense(pack_scan(ctx))
    if not plain:
        return Row("dense.policy", PASS, "no dense linear is stored as plain BF16, so the policy does not apply.")
    example = f"{plural(len(plain), 'dense linear')} stored as BF16 with no scales (e.g. {plain[0]}.weight)"
    if policy == STOCK_POLICY:
        return Row("dense.policy", PASS, f'{example}, and non_routed_dtype_policy is "{STOCK_POLICY}".')
    found = "absent" if policy is None else echo(policy)
    delegate = quant.get("non_routed_quantization")
    if not (isinstance(delegate, dict) and delegate.get("quant_method")):
        return Row(
            "dense.policy",
            PASS,
            f"{example}; policy {found}, but with no non_routed_quantization delegate vllm-exl3 keeps them "
            "unquantized.",
        )
    fix = (
        f'Set "non_routed_dtype_policy": "{STOCK_POLICY}" in quantization_config{fix_config_note(ctx)}, '
        "and keep non_routed_quantization for the DSpark draft. (Hub packs downloaded after 2026-09-01 ship "
        "the fork value.)"
    )
    text, where = _vllm_file(ctx, *DSV4_NVIDIA, "model.py")
    if text is None:
        return Row(
            "dense.policy",
            WARN,
            f"{example}, non_routed_dtype_policy is {found}, and whether vLLM quantizes them at load "
            f"(route B) could not be checked: {where}.",
            fix + " Keep the policy only on the archived fork runtime with patch_dsv4_loader.py applied.",
        )
    if ROUTE_B_MARKER in text:
        return Row(
            "dense.policy", PASS, f"{example}; policy {found} with the route-B loader ({ROUTE_B_MARKER} in {where})."
        )
    return Row(
        "dense.policy",
        FAIL,
        f"non_routed_dtype_policy is {found} with {example}: on stock/nightly vLLM the plugin hands them to "
        "the fp8 method and the model returns empty or uniform text with no error.",
        fix,
    )


@check("mtp.format", needs=("pack",), family=V4)  # V4.1: v41.delegate
def check_mtp_format(ctx: DoctorContext) -> Row:
    """The MTP experts' format must match ``mtp_experts*``: source format (``.weight`` I8 + ``.scale``
    F8_E8M0) needs ``mtp_experts: "source"``, ``mtp_experts_start_layer == num_hidden_layers`` and a
    ``non_routed_quantization`` method; EXL3 (``.trellis``) needs ``mtp_experts`` absent or ``"exl3"`` and
    ``layer_bits`` K for layers num_hidden_layers + L. FAIL with DSpark on the command line (the draft
    loads after the target: ``KeyError: 'w13_weight_scale'``), else WARN (R fix_pack_config.py:103-111;
    LOADER_NOTES.md:176-180; P CHANGELOG.md:67; L README-mtp-overlay.md, mtp_overlay.py edited_config)."""
    cfg = ctx.config()
    quant = quantization_config(cfg)
    scan = pack_scan(ctx)
    fmt = scan.mtp_format()
    drafting = drafts_from_mtp(ctx)
    layers = config_int(cfg, "num_hidden_layers")
    mode = quant.get("mtp_experts")
    if fmt == "none":
        if drafting:
            return Row(
                "mtp.format",
                FAIL,
                "--speculative-config drafts from MTP layers, but the pack has no MTP experts.",
                "Drop --speculative-config, or serve a pack that ships its MTP (DSpark) layers.",
            )
        return Row("mtp.format", PASS, "the pack has no MTP experts (no speculative decoding from it).")
    problems, fix = [], ""
    if fmt == "source":
        problems = source_mtp_problems(cfg, quant)
        fix = (
            f'Set "mtp_experts": "source", "mtp_experts_start_layer": {layers} and "non_routed_quantization": '
            f"{json_text(FP8_DELEGATE)} in quantization_config" + fix_config_note(ctx) + "."
        )
    elif fmt == "exl3":
        bits = declared_bits(quant)
        layer_bits, _ = declared_layer_bits(quant)
        if mode not in (None, "exl3"):
            problems.append(f"mtp_experts is {echo(mode)}, which sends EXL3 draft experts to the fp8 delegate")
        wanted = {}
        for block, k in sorted(scan.layer_k("mtp").items()):
            index = (layers or 0) + block
            declared = layer_bits.get(index, bits)
            if k is not None and declared != k:
                problems.append(f"layer {index} (mtp.{block}) declares K{declared}, its trellis is K{k}")
                wanted[str(index)] = k
        steps = (
            ['remove "mtp_experts" and "mtp_experts_start_layer" from quantization_config']
            if mode not in (None, "exl3")
            else []
        )
        steps += [f'add {json_text(wanted)} to "layer_bits"'] if wanted else []
        fix = "For this EXL3 draft, " + " and ".join(steps) + "."
    else:
        problems.append("some MTP experts are in the source format and some in EXL3")
        fix = "Rebuild the MTP overlay so every draft expert has one format (lna-lab tools/mtp_overlay.py)."
    if not problems:
        return Row("mtp.format", PASS, f"MTP experts are {fmt}-format and quantization_config declares them so.")
    symptom = {"source": " (KeyError: 'w13_weight_scale')", "exl3": " (EXL3 load shape mismatch)"}.get(fmt, "")
    if drafting:
        status, when = FAIL, "--speculative-config drafts from them, so the draft load will fail"
    else:
        status, when = WARN, "with --speculative-config dspark the draft load would fail"
    return Row(
        "mtp.format",
        status,
        f"the pack's MTP experts are {fmt}-format but {first_of(problems)}; "
        f"{when} after the target has loaded{symptom}.",
        fix,
    )


@check("quant.delegate", needs=("pack", "runtime"), family=V4)  # V4.1: v41.delegate
def check_quant_delegate(ctx: DoctorContext) -> Row:
    """FAIL if ``non_routed_quantization.quant_method`` is not a method the installed vLLM registers
    (``QuantizationMethods`` in vllm/model_executor/layers/quantization/__init__.py, read by AST):
    ``_non_routed_delegate`` raises at model construction (P exl3.py _non_routed_delegate)."""
    nrq = quantization_config(ctx.config()).get("non_routed_quantization")
    if nrq is None:
        return Row("quant.delegate", PASS, "quantization_config declares no non_routed_quantization delegate.")
    method = nrq.get("quant_method") if isinstance(nrq, dict) else None
    if not isinstance(method, str):
        return Row(
            "quant.delegate",
            FAIL,
            "non_routed_quantization names no quant_method.",
            f'Set "non_routed_quantization": {json_text(FP8_DELEGATE)} in quantization_config.',
        )
    text, where = _vllm_file(ctx, "vllm", "model_executor", "layers", "quantization", "__init__.py")
    methods = _registered_quant_methods(text) if text is not None else None
    if methods is None:
        return Row(
            "quant.delegate", SKIP, f"the quantization methods of the installed vLLM could not be read ({where})."
        )
    if method not in methods:
        return Row(
            "quant.delegate",
            FAIL,
            f"non_routed_quantization names {echo(method)}, which {where} does not register.",
            f'Use "fp8" (the DeepSeek-V4 block-FP8 declaration): "non_routed_quantization": {json_text(FP8_DELEGATE)}.',
        )
    return Row("quant.delegate", PASS, f'non_routed_quantization "{method}" is a method this vLLM registers.')


def _vllm_prefix(module: str) -> str:
    """The vLLM module a checkpoint dense linear loads into: ``layers.3.attn.wq_a`` ->
    ``model.layers.3.attn.fused_wqa_wkv`` (L README-dense-serve.md, "Merged configuration")."""
    _, layer, rest = module.split(".", 2)
    return f"model.layers.{layer}.{'attn.wo_a' if WO_A_SLICE.match(rest) else DENSE_LINEARS[rest]}"


def _declared_dense_bits(nre: dict, prefix: str, base: int) -> int | None | str:
    """K for ``prefix`` the way vllm-exl3 reads ``non_routed_exl3`` (layers first, then module
    suffixes); None when the prefix is not declared, the raw value when it is not an integer."""
    layers = nre.get("layers") if isinstance(nre.get("layers"), dict) else {}
    if prefix in layers:
        entry = layers[prefix]
        raw = entry["bits"] if isinstance(entry, dict) and "bits" in entry else nre.get("bits", base)
    else:
        modules = nre.get("modules") if isinstance(nre.get("modules"), list) else []
        suffix = next((m for m in modules if isinstance(m, str) and (prefix == m or prefix.endswith("." + m))), None)
        if suffix is None:
            return None
        suffix_bits = nre.get("layer_bits") if isinstance(nre.get("layer_bits"), dict) else {}
        raw = suffix_bits.get(suffix, nre.get("bits", base))
    k = plugin_int(raw)
    return k if k is not None else repr(raw)


# non_routed_exl3 is V4's; V4.1 packs say it in their headers: v41.pack-kind
@check("dense.exl3-map", needs=("pack",), family=V4)
def check_dense_exl3_map(ctx: DoctorContext) -> Row:
    """FAIL if ``non_routed_exl3`` and the dense EXL3 tensors disagree: a declared prefix with no
    tensors, an EXL3 linear nobody declares, ``bits*16 !=`` trellis width, fused halves with different
    K, a linear with zero or two markers, or ``bf16_shards`` with TP > 1; all fail during or after the
    load (L README.md:34; README-dense-serve.md:16-49; P exl3.py Exl3Config, Exl3LinearMethod)."""
    quant = quantization_config(ctx.config())
    nre = quant.get("non_routed_exl3")
    scan = pack_scan(ctx)
    modules = scan.dense_exl3_modules()
    if not nre and not modules:
        return Row("dense.exl3-map", PASS, "routed-only EXL3: no dense EXL3 tensors and no non_routed_exl3.")
    restore = (
        "Restore quantization_config.non_routed_exl3 from the bake's merged config "
        "(lna-lab tools/dense_bake.py --merge)."
    )
    if nre and not isinstance(nre, dict):
        return Row(
            "dense.exl3-map",
            FAIL,
            f"quantization_config.non_routed_exl3 is a JSON {type(nre).__name__}; vllm-exl3 needs an object.",
            restore if modules else "Remove non_routed_exl3: this pack has no dense EXL3 tensors.",
        )
    if not nre:
        return Row(
            "dense.exl3-map",
            FAIL,
            f"{len(modules)} dense linears are EXL3 (e.g. {modules[0]}.trellis) but quantization_config "
            "declares no non_routed_exl3, so vLLM would look for their .weight.",
            restore,
        )
    base = declared_bits(quant)
    problems: list[tuple[str, str]] = []
    codebook = nre.get("codebook", "mcg")
    if not isinstance(codebook, str) or codebook not in MARKER_VALUES:
        problems.append((f"non_routed_exl3.codebook is {echo(codebook)}", 'Set non_routed_exl3 "codebook": "mcg".'))
    mismatched: Counter = Counter()
    groups: dict[str, set[int]] = defaultdict(set)
    for module in modules:
        parts = scan.dense[module]
        prefix = _vllm_prefix(module)
        markers = [p for p in parts if p in MARKER_VALUES]
        if len(markers) != 1 or "suh" not in parts or "svh" not in parts:
            problems.append(
                (
                    f"{module} has {len(markers)} markers and {'suh' in parts}/{'svh' in parts} suh/svh",
                    f"{module} needs .trellis, .suh, .svh and exactly one .mcg or .mul1; re-run the bake for it.",
                )
            )
        shape = parts["trellis"][1]
        width = shape[-1] if shape else 0
        groups[prefix].add(width)
        declared = _declared_dense_bits(nre, prefix, base)
        if declared is None:
            problems.append(
                (
                    f"{module} is EXL3 but non_routed_exl3 does not declare {prefix}",
                    f'Add "{prefix}": {{"bits": {width // 16}}} to non_routed_exl3.layers.',
                )
            )
        elif isinstance(declared, str) or declared not in VALID_K:
            problems.append(
                (
                    f"non_routed_exl3 declares {prefix} bits={declared} (vllm-exl3 accepts 2-6)",
                    f'Set "bits": {width // 16} for {prefix} in non_routed_exl3.layers.',
                )
            )
        elif declared * 16 != width:
            mismatched[(declared, width // 16)] += 1
            problems.append(
                (
                    f"non_routed_exl3 declares {prefix} bits={declared} but {module}.trellis has width "
                    f"{width} (K{width // 16})",
                    f'Set "bits": {width // 16} for {prefix} in non_routed_exl3.layers.',
                )
            )
    for prefix, widths in sorted(groups.items()):
        if len(widths) > 1:
            problems.append(
                (
                    f"the halves of {prefix} have trellis widths {sorted(widths)}",
                    f"Re-bake {prefix}'s source linears at one K (both halves of a fused module share it).",
                )
            )
    declared_layers = nre.get("layers") if isinstance(nre.get("layers"), dict) else {}
    tp = tensor_parallel(ctx)
    for prefix, entry in declared_layers.items():
        if prefix not in groups:
            problems.append(
                (
                    f"non_routed_exl3 declares {prefix} but the shards hold no EXL3 tensors for it",
                    f"Remove {prefix} from non_routed_exl3.layers, or add its baked tensors to the pack.",
                )
            )
        if isinstance(entry, dict) and entry.get("bf16_shards") and tp > 1:
            problems.append(
                (
                    f"{prefix} keeps bf16_shards, which vllm-exl3 refuses at --tensor-parallel-size {tp}",
                    "Serve at --tensor-parallel-size 1, or bake every shard of it to EXL3.",
                )
            )
    if not problems:
        return Row(
            "dense.exl3-map",
            PASS,
            f"non_routed_exl3 declares all {len(groups)} dense EXL3 modules ({len(modules)} linears) with "
            "the K of their trellis, one marker each.",
        )
    if len(mismatched) == 1 and sum(mismatched.values()) == len(problems):
        ((declared, k),) = mismatched
        fix = f'non_routed_exl3 declares bits={declared} where the trellis is K{k}: set every such "bits" to {k}.'
    else:
        fix = problems[0][1]
    return Row("dense.exl3-map", FAIL, first_of([p for p, _ in problems]) + ".", fix)


@check("dense.wo-a-slices", needs=("pack",), family=V4)  # V4.1: v41.pack-kind
def check_wo_a_slices(ctx: DoctorContext) -> Row:
    """FAIL unless a pack storing ``attn.wo_a.slice.N`` is served at --tensor-parallel-size = the number
    of slices (8) with lna-lab's dense patch applied to the installed vLLM (its ``attn.wo_a.slice``
    mapping in deepseek_v4/nvidia/model.py and the ``_exl3_linears`` branch in flashinfer_sparse.py)
    (L tools/README-dense-serve.md, "TP=8 serving"; recipe-lna/patch_dsv4_dense_exl3.py)."""
    scan = pack_scan(ctx)
    if skip := no_shards("dense.wo-a-slices", scan):
        return skip
    slices: dict[int, set[int]] = defaultdict(set)
    for module in scan.dense:
        _, layer, rest = module.split(".", 2)
        match = WO_A_SLICE.match(rest)
        if match:
            slices[int(layer)].add(int(match.group(1)))
    if not slices:
        return Row("dense.wo-a-slices", PASS, "wo_a is stored whole (no attn.wo_a.slice.N tensors).")
    n = max(max(ids) for ids in slices.values()) + 1
    fix = (
        f"This pack stores wo_a as {n} slices (lna-lab Dense bake); it serves only at --tensor-parallel-size {n} "
        "with recipe-lna/patch_dsv4_dense_exl3.py applied."
    )
    partial = sorted(layer for layer, ids in slices.items() if ids != set(range(n)))
    if partial:
        return Row(
            "dense.wo-a-slices",
            FAIL,
            f"layer {partial[0]} has wo_a slices {sorted(slices[partial[0]])}, not 0-{n - 1}.",
            "Re-run the dense merge: every layer needs all of its wo_a slices.",
        )
    tp = tensor_parallel(ctx)
    if tp != n:
        return Row(
            "dense.wo-a-slices",
            FAIL,
            f"wo_a is stored as {n} slices per layer but --tensor-parallel-size is {tp}.",
            fix,
        )
    model, model_where = _vllm_file(ctx, *DSV4_NVIDIA, "model.py")
    sparse, _ = _vllm_file(ctx, *DSV4_NVIDIA, "flashinfer_sparse.py")
    if model is None:
        return Row(
            "dense.wo-a-slices",
            WARN,
            f"wo_a is stored as {n} slices at TP {tp}; whether vLLM has lna-lab's dense patch could not be "
            f"checked: {model_where}.",
            fix,
        )
    if "attn.wo_a.slice." not in model or sparse is None or "_exl3_linears" not in sparse:
        return Row(
            "dense.wo-a-slices",
            FAIL,
            f"wo_a is stored as {n} slices but {model_where} (and its flashinfer_sparse.py) lack lna-lab's "
            "dense patch.",
            fix,
        )
    return Row(
        "dense.wo-a-slices",
        PASS,
        f"wo_a is stored as {n} slices, served at TP {tp} on a vLLM with lna-lab's dense patch.",
    )
