"""DeepSeek-V4.1 packs: config.json itself (v41-packs.md §1) and the delegate of a routed-only pack (§1.3).

v41.config, v41.delegate. Every number comes from the pack's own config, read as vLLM reads it
(family.flatten_v41): nothing stands in for V4.1-Flash-1017's config, which nobody here has seen.
:func:`v41_config_edits` is what ``--fix-config`` writes (or, for a pack it cannot write, prints).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from patch_dsv4.doctor.readers.base import FAIL, PASS, SKIP, DoctorContext, Row, check
from patch_dsv4.doctor.readers.family import V41, V41_ARCHITECTURE, V41_MODEL_TYPE, architectures
from patch_dsv4.doctor.readers.pack import echo, pack_scan, plural, quantization_config, wanted_codebook

MAX_LAYERS = 100_000
MAX_WIDTH = 1 << 24  # a hidden size, intermediate size, head count, ... doctor takes (V4.1-Flash: 5120)
# The text_config numbers every V4.1 row may read (V34 models/deepseek_v41/*, v41-packs.md §1.2).
REQUIRED = (
    "num_hidden_layers",
    "hidden_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
)
OPTIONAL = (
    "index_topk",
    "index_n_heads",
    "index_head_dim",
    "sliding_window",
    "num_nextn_predict_layers",
    "dspark_n_routed_experts",
    "dspark_block_size",
    "engram_head_dim",
    "engram_n_heads",
    "engram_max_ngram_size",
    "engram_vocab_size",
    "max_position_embeddings",
)
ENGRAM_KEYS = ("engram_head_dim", "engram_n_heads", "engram_max_ngram_size", "engram_vocab_size")
# The delegate a routed-only V4.1 pack's dense source weights need: MXFP8 in [32, 32] blocks (§1.3).
V41_DELEGATE = {
    "quant_method": "deepseek_v4_fp8",
    "weight_block_size": [32, 32],
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "activation_scheme": "dynamic",
    "expert_dtype": "fp4",
}


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _kind(value) -> str:
    return "absent" if value is None else f"a JSON {type(value).__name__} ({echo(value)})"


@dataclass(frozen=True)
class V41Numbers:
    """The V4.1 config's numbers, each checked (a positive integer within doctor's limits)."""

    values: dict  # key -> int, for the keys of REQUIRED and those of OPTIONAL present and valid
    engram_layers: tuple[int, ...]
    engram_rows: tuple[int, ...]
    compress_ratios: tuple[int, ...]
    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    dspark_targets: tuple[int, ...]

    def __getitem__(self, key: str) -> int:
        return self.values[key]

    def get(self, key: str) -> int | None:
        return self.values.get(key)

    @property
    def layers(self) -> int:
        return self.values["num_hidden_layers"]

    @property
    def draft_stages(self) -> int:
        return self.values.get("num_nextn_predict_layers", 0)

    @property
    def draft_experts(self) -> int:
        return self.values.get("dspark_n_routed_experts", self.values["n_routed_experts"])


def _int_list(cfg: dict, key: str, problems: list[str], below: int | None, what: str) -> tuple[int, ...]:
    value = cfg.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_int(v) is not None and v >= 0 for v in value):
        problems.append(f"{key} is {_kind(value)}, not a list of non-negative integers")
        return ()
    if len(value) > MAX_LAYERS:
        problems.append(f"{key} has {len(value):,} entries, more than doctor reads ({MAX_LAYERS:,})")
        return ()
    if below is not None and any(v >= below for v in value):
        problems.append(f"{key} {echo(value)} names a layer past num_hidden_layers ({below}): {what}")
    if len(set(value)) != len(value) and key != "compress_ratios":
        problems.append(f"{key} {echo(value)} names a layer twice")
    return tuple(value)


def read_numbers(cfg: dict) -> tuple[V41Numbers | None, list[str]]:
    """The flattened config's numbers, and every problem found (the numbers are None when a required
    one is unusable). Each problem is one clause, quoting what the config holds."""
    problems: list[str] = []
    values = {}
    for key in REQUIRED + OPTIONAL:
        raw = cfg.get(key)
        value = _int(raw)
        if key in ("num_hidden_layers", "num_nextn_predict_layers"):
            limit = MAX_LAYERS
        else:
            limit = 1 << 40 if "vocab" in key or "max_" in key else MAX_WIDTH
        if value is None or value <= 0 or value > limit:
            if raw is None and key in OPTIONAL:
                continue
            if key == "num_nextn_predict_layers" and value == 0:
                values[key] = 0
                continue
            bound = f" (doctor takes up to {limit:,})" if value is not None and value > limit else ""
            problems.append(f"{key} is {_kind(raw)}, not a positive integer{bound}")
            continue
        values[key] = value
    layers = values.get("num_hidden_layers")
    engram_layers = _int_list(cfg, "engram_layer_ids", problems, layers, "vLLM builds no such layer")
    rows = _int_list(cfg, "engram_num_embeddings", problems, None, "")
    if engram_layers and len(rows) != len(engram_layers):
        problems.append(
            f"engram_num_embeddings has {plural(len(rows), 'entry').replace('entrys', 'entries')} for "
            f"{plural(len(engram_layers), 'Engram layer')} (vLLM asserts one per layer)"
        )
    if engram_layers:
        problems += [f"{key} is {_kind(cfg.get(key))}, which Engram needs" for key in ENGRAM_KEYS if key not in values]
    if engram_layers and values.get("engram_max_ngram_size", 2) < 2:
        problems.append(
            f"engram_max_ngram_size is {values['engram_max_ngram_size']}: Engram hashes n-grams of 2 and more tokens"
        )
    if values.get("engram_head_dim", 32) % 32:
        problems.append(f"engram_head_dim {values['engram_head_dim']} is not a multiple of 32 (E8M0 scale blocks)")
    ratios = _int_list(cfg, "compress_ratios", problems, None, "")
    if layers and ratios and len(ratios) < layers:
        problems.append(f"compress_ratios has {len(ratios)} entries for {layers} layers")
    kv_sources = _int_list(cfg, "kv_source_layer_ids", problems, layers, "no compressor would be built")
    index_sources = _int_list(cfg, "index_source_layer_ids", problems, layers, "no indexer would be built")
    targets = _int_list(cfg, "dspark_target_layer_ids", problems, layers, "the draft would read no such layer")
    heads, groups = values.get("num_attention_heads"), values.get("o_groups")
    if heads and groups and heads % groups:
        problems.append(f"num_attention_heads {heads} does not divide into o_groups {groups}")
    if values.get("num_experts_per_tok", 0) > values.get("n_routed_experts", 1 << 62):
        problems.append(
            f"num_experts_per_tok {values['num_experts_per_tok']} is more than n_routed_experts "
            f"{values['n_routed_experts']}"
        )
    if problems:  # the rows that read the numbers skip; v41.config names the problem
        return None, problems
    return V41Numbers(values, engram_layers, rows, ratios, kv_sources, index_sources, targets), problems


def v41_numbers(ctx: DoctorContext) -> V41Numbers | None:
    """The pack's V4.1 numbers (cached), None when config.json lacks a usable one (v41.config says which)."""
    return ctx.cached("v41.numbers", lambda: read_numbers(ctx.config())[0])


def shape_problems(ctx: DoctorContext) -> list[str]:
    """What is wrong with the layout of config.json itself (the discriminators, the nesting)."""
    raw = ctx.raw_config()
    problems = []
    model_type, archs = raw.get("model_type"), architectures(raw)
    if model_type != V41_MODEL_TYPE or V41_ARCHITECTURE not in archs:
        problems.append(
            f"model_type is {echo(model_type)} and architectures {echo(raw.get('architectures'))}: vLLM takes "
            "the config class from model_type and the model from architectures, so both must say V4.1 "
            f'("{V41_MODEL_TYPE}", ["{V41_ARCHITECTURE}"])'
        )
    text = raw.get("text_config")
    if text is None:
        problems.append(
            "config.json is flat (no text_config): a V4.1 config nests its text keys in text_config, and vLLM's "
            "DeepseekV41Config reads them only from there"
        )
    elif not isinstance(text, dict):
        problems.append(f"text_config is {_kind(text)}, not an object")
    vision = raw.get("vision_config")
    if vision is not None and not isinstance(vision, dict):
        problems.append(f"vision_config is {_kind(vision)}, not an object")
    return problems


def topk_problem(ctx: DoctorContext) -> str | None:
    scan = pack_scan(ctx)
    method = ctx.config().get("topk_method")
    if scan.gate_bias_layers and method != "noaux_tc":
        return (
            f"the shards carry routing biases (ffn.gate.bias on {plural(len(scan.gate_bias_layers), 'layer')}) but "
            f'text_config.topk_method is {echo(method) if method is not None else "absent"}, not "noaux_tc": vLLM '
            "creates no e_score_correction_bias for them"
        )
    return None


@check("v41.config", needs=("pack",), family=V41)
def check_v41_config(ctx: DoctorContext) -> Row:
    """FAIL when config.json is not a V4.1 config vLLM reads as one: model_type and architectures
    disagree (§1.1), the text keys are not nested in ``text_config`` (V4-shaped), ``text_config`` or
    ``vision_config`` is not an object, a number the rows need is missing, not a positive integer or
    beyond reason, the per-layer lists contradict ``num_hidden_layers``, or the routing biases lack
    ``topk_method: noaux_tc`` (V34 transformers_utils/configs/deepseek_v41.py:26-62,
    models/deepseek_v41/attention.py:362-418, common/engram.py:204-211)."""
    problems = shape_problems(ctx)
    numbers, number_problems = read_numbers(ctx.config())
    problems += number_problems
    if not problems and (topk := topk_problem(ctx)):
        problems.append(topk)
    if problems:
        more = f" (and {plural(len(problems) - 1, 'more problem')})" if len(problems) > 1 else ""
        fix = (
            "Restore config.json from the base checkpoint's revision (deepseek-ai's V4.1 config.json, with the "
            "pack's quantization_config), keeping text_config and vision_config nested."
        )
        if problems[0].startswith("the shards carry routing biases"):
            fix = 'Set text_config.topk_method to "noaux_tc" (patch-dsv4 doctor --fix-config writes it).'
        return Row("v41.config", FAIL, f"DeepSeek-V4.1 pack, but {problems[0]}{more}.", fix)
    assert numbers is not None
    cfg = ctx.config()
    engram = (
        f"Engram on layers {list(numbers.engram_layers)}"
        if numbers.engram_layers
        else "no Engram (engram_layer_ids empty)"
    )
    draft = (
        f"DSpark {numbers.draft_stages} stages x {numbers.draft_experts} experts"
        if numbers.draft_stages
        else "no DSpark draft"
    )
    vision = _int(cfg.get("vision_n_layers"))
    nested = " and vision_config" if "vision_config" in ctx.raw_config() else ""
    return Row(
        "v41.config",
        PASS,
        f"DeepSeek-V4.1 config, nested text_config{nested} "
        f"read flattened as vLLM does: {numbers.layers} layers, hidden {numbers['hidden_size']}, "
        f"{numbers['n_routed_experts']} experts top-{numbers['num_experts_per_tok']}, {engram}, {draft}, "
        + (f"vision {vision} layers." if vision else "no vision tower."),
    )


def delegate_problems(cfg: dict) -> list[str]:
    """What a routed-only V4.1 pack's quantization_config lacks for vllm-exl3 to hand its source FP8
    dense weights and FP4 draft experts to the [32, 32] delegate (§1.3)."""
    quant = quantization_config(cfg)
    delegate = quant.get("non_routed_quantization")
    problems = []
    if not isinstance(delegate, dict) or not delegate.get("quant_method"):
        problems.append("non_routed_quantization declares no quant_method")
    elif delegate.get("weight_block_size") != [32, 32]:
        problems.append(
            f"non_routed_quantization.weight_block_size is {echo(delegate.get('weight_block_size'))}, not [32, 32] "
            "(V4.1's source scales are MXFP8 [32, 32]; a V4-style [128, 128] block maps them to the wrong parameter)"
        )
    return problems


def draft_problems(cfg: dict, layers: int) -> list[str]:
    quant = quantization_config(cfg)
    problems = []
    if quant.get("mtp_experts") != "source":
        problems.append(f'mtp_experts is {echo(quant.get("mtp_experts"))}, not "source"')
    start = quant.get("mtp_experts_start_layer")
    if start is not None and start != layers:
        problems.append(f"mtp_experts_start_layer is {echo(start)}, not num_hidden_layers ({layers})")
    return problems


def pack_is_routed_only(ctx: DoctorContext) -> bool:
    scan = pack_scan(ctx)
    return not scan.v41.exl3_places and scan.mtp_format() != "exl3"


@check("v41.delegate", needs=("pack",), family=V41)
def check_v41_delegate(ctx: DoctorContext) -> Row:
    """FAIL when a routed-only V4.1 pack (source FP8 dense weights, §2.3) has no ``non_routed_quantization``
    delegate with ``weight_block_size`` [32, 32], or its source-format draft experts are not declared
    ``mtp_experts: "source"`` (``mtp_experts_start_layer`` = num_hidden_layers where given): the dense
    scales or the draft experts have no parameter to load into (V34 models/deepseek_v41/quant_config.py:221-243,
    nvidia/model.py:1538-1549; VC scripts/validate_pack.py). A dense-EXL3 pack needs no delegate."""
    numbers = v41_numbers(ctx)
    if numbers is None:
        return Row("v41.delegate", SKIP, "config.json lacks the numbers this check reads (see v41.config).")
    if not pack_is_routed_only(ctx):
        return Row("v41.delegate", PASS, "a dense-EXL3 pack: its dense linears and draft are EXL3, no delegate.")
    cfg = ctx.config()
    problems = delegate_problems(cfg)
    if pack_scan(ctx).mtp_format() == "source":
        problems += draft_problems(cfg, numbers.layers)
    if problems:
        return Row(
            "v41.delegate",
            FAIL,
            f"routed-only pack (dense weights in source FP8), but quantization_config's {problems[0]}"
            + (f" (and {plural(len(problems) - 1, 'more')})" if len(problems) > 1 else "")
            + ".",
            f"Set quantization_config.non_routed_quantization to {json.dumps(V41_DELEGATE)} and "
            f'"mtp_experts": "source", "mtp_experts_start_layer": {numbers.layers} '
            "(patch-dsv4 doctor --fix-config writes them).",
        )
    return Row(
        "v41.delegate",
        PASS,
        "routed-only pack: non_routed_quantization hands the source FP8 dense weights ([32, 32]) and the draft's "
        "experts to the delegate.",
    )


# --------------------------------------------------------------------------- the edits --fix-config makes


@dataclass(frozen=True)
class ConfigEdit:
    """One config.json edit: ``path`` of keys from the top, the value found (None: absent) and the one wanted."""

    path: tuple[str, ...]
    old: object
    new: object

    def line(self) -> str:
        where = ".".join(self.path)
        return f"{where}: {json.dumps(self.old) if self.old is not None else 'absent'} -> {json.dumps(self.new)}"


def v41_config_edits(ctx: DoctorContext) -> list[ConfigEdit]:
    """The edits of config.json (as written: text keys inside ``text_config``) that the failing V4.1 rows
    ask for: quant_method, codebook, the routed-only delegate and draft fields, topk_method. Empty when
    none is needed or config.json's layout itself is wrong (v41.config: restored by hand, never guessed)."""
    raw = ctx.raw_config()
    if ctx.pack_family() != V41 or shape_problems(ctx):
        return []
    numbers = v41_numbers(ctx)
    scan = pack_scan(ctx)
    edits: list[ConfigEdit] = []
    quant = raw.get("quantization_config") if isinstance(raw.get("quantization_config"), dict) else {}
    has_exl3 = bool(scan.layer_k()) or bool(scan.v41.exl3_places)
    if has_exl3 and quant.get("quant_method") != "exl3":
        edits.append(ConfigEdit(("quantization_config", "quant_method"), quant.get("quant_method"), "exl3"))
    codebook = wanted_codebook(quant, scan)
    if has_exl3 and codebook:
        edits.append(ConfigEdit(("quantization_config", "codebook"), quant.get("codebook"), codebook))
    if numbers is not None and has_exl3 and pack_is_routed_only(ctx):
        if delegate_problems(raw):
            edits.append(
                ConfigEdit(
                    ("quantization_config", "non_routed_quantization"),
                    quant.get("non_routed_quantization"),
                    dict(V41_DELEGATE),
                )
            )
        if scan.mtp_format() == "source" and draft_problems(raw, numbers.layers):
            if quant.get("mtp_experts") != "source":
                edits.append(ConfigEdit(("quantization_config", "mtp_experts"), quant.get("mtp_experts"), "source"))
            if quant.get("mtp_experts_start_layer") != numbers.layers:
                edits.append(
                    ConfigEdit(
                        ("quantization_config", "mtp_experts_start_layer"),
                        quant.get("mtp_experts_start_layer"),
                        numbers.layers,
                    )
                )
    if topk_problem(ctx):
        edits.append(ConfigEdit(("text_config", "topk_method"), raw["text_config"].get("topk_method"), "noaux_tc"))
    return edits


def apply_edits(raw: dict, edits: list[ConfigEdit]) -> dict:
    """``raw`` with ``edits`` made (the input is not modified)."""
    new = copy.deepcopy(raw)
    for edit in edits:
        target = new
        for key in edit.path[:-1]:
            if not isinstance(target.get(key), dict):
                target[key] = {}
            target = target[key]
        target[edit.path[-1]] = copy.deepcopy(edit.new)
    return new


def v41_fixer_refusal(ctx: DoctorContext) -> str | None:
    """Why ``--fix-config`` writes nothing for this V4.1 pack, or None."""
    problems = shape_problems(ctx)
    if problems:
        return f"config.json is not laid out as a V4.1 config ({problems[0]}); restore it by hand"
    scan = pack_scan(ctx)
    if scan.listing_error or scan.problems:
        return "some shard headers cannot be read (see pack.shards)"
    return None
