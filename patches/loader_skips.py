"""Let the 0.28/0.29 loaders pass over the vision pack's tensors that have no home there.

DeepSeek-V4-Flash-Vision packs ship tensors the vLLM 0.28.0 and 0.29.0 NVIDIA
loaders have no parameter or module for, and each one stops the load:
- `layers.N.ffn.gate.bias` on hash layers: mapped to `gate.e_score_correction_bias`,
  which hash layers do not create (`DeepseekV4Model.load_weights`, KeyError);
- `gate.bias_vl` on every MoE layer, target (`DeepseekV4Model.load_weights`) and
  DSpark draft (`DSparkDeepseekV4ForCausalLM.load_weights`): KeyError;
- the vision tower (`vision.*`, `aligner.*`, `image_*`), which the text class's
  `AutoWeightsLoader` rejects ("There is no module or parameter named 'vision'").
Each skip is guarded by "the model has no such parameter or module", never by the
name alone: a tensor with a home is always loaded. From 0.30.0 `bias_vl` is a real
weight used in the forward, and an unconditional skip would leave it uninitialised
without any error for a quantized model.

DeepSeek-V4.1's text class (`DeepseekV41LLMForCausalLM`, `deepseek_v41/nvidia/model.py`;
`deepseek_v4_1/` in the nightlies) ships with vLLM 0.30.0 on and passes over the vision
tower itself: its weight mapper drops `vision.`, `aligner.` and `image_`, and
`DeepseekV4Model.load_weights` skips them. Its edit is there to say so, with that evidence.

Fixed upstream in vLLM 0.30.0: `DeepseekV4MoE.__init__` (`nvidia/model.py`) creates
`gate.bias_vl` and the hash-layer `gate.e_score_correction_bias` for vision
checkpoints, and `DeepseekV4ForConditionalGeneration` (`common/vl_model.py`) owns
the vision tower.

What the probes check, through the evaluator (patcher/patching/evaluate): `creates(
DeepseekV4MoE, "gate.bias_vl", on=...)` for a hash and a non-hash MoE layer of a
vision checkpoint (and the hash layer's `gate.e_score_correction_bias`), however the
parameter is made; the vision class builds `vision` and `aligner` for a vision
checkpoint served with images; V4.1's text class maps the vision prefixes to None
(its mapper as built) or its loader goes on past a weight of each prefix.
"""

from __future__ import annotations

import ast

from patch_dsv4.output.verdicts import Outcome, Verdict
from patch_dsv4.patches._v41 import in_layouts
from patch_dsv4.patching.edits import ForeignEdit, NotProven, ReplaceStatements, Variant
from patch_dsv4.patching.evaluate import Evaluator, attribute_value, cases, creates, is_module, passes_over
from patch_dsv4.patching.evaluate.values import Const, Inst, Reach, Seq, V, describe, is_none, options
from patch_dsv4.patching.follow import Follower
from patch_dsv4.patching.patch import Context, Example, Patch, Scope

MODEL = "vllm/models/deepseek_v4/nvidia/model.py"
DSPARK = "vllm/models/deepseek_v4/nvidia/dspark.py"
VL_MODEL = "vllm/models/deepseek_v4/common/vl_model.py"
NIGHTLY_VL_MODEL = "vllm/models/deepseek_v4/nvidia/vl_model.py"  # the vision class on 0.29-0.30 nightlies
TEXT_CLASS = "DeepseekV4ForCausalLM"
V41_TEXT_CLASS = "DeepseekV41LLMForCausalLM"
VISION_PREFIXES = ("vision.", "aligner.", "image_")
VISION_CLASS = "DeepseekV4ForConditionalGeneration"


# The helpers below are written into vLLM as they stand here (edits.helper_source): not formatted.
# fmt: off
def _patch_dsv4_vision_tower_prefixes():
    """Checkpoint prefixes of the vision tower of DeepSeek-V4-Flash-Vision packs.

    Written by patch-dsv4 (loader-skips). Passed to AutoWeightsLoader as
    ignore_unexpected_prefixes, which skips a tensor only where the model has
    no module or parameter of that name: the text class has no vision tower.
    """
    return ["vision.", "aligner.", "image_"]


def _patch_dsv4_gate_bias_without_home(name, params_dict):
    """Whether ``name`` is a MoE gate bias this model has no parameter for.

    Written by patch-dsv4 (loader-skips). Vision checkpoints ship gate.bias on
    hash layers (loaded as e_score_correction_bias, which hash layers lack here)
    and gate.bias_vl on every MoE layer (no such parameter here). A name that
    has a parameter is always loaded.
    """
    return name not in params_dict and name.endswith(
        (".ffn.gate.e_score_correction_bias", ".ffn.gate.bias_vl")
    )
# fmt: on


# -- the text class's AutoWeightsLoader: ignore the vision tower where it has no module
VISION_TOWER = (
    Variant(
        anchor="loader = AutoWeightsLoader(self)",
        replacement="""
loader = AutoWeightsLoader(
    self,
    # patch-dsv4 (loader-skips): the pack's vision tower has no module here.
    ignore_unexpected_prefixes=_patch_dsv4_vision_tower_prefixes(),
)
""",
        releases="0.29.0 (AutoWeightsLoader lost skip_prefixes/skip_substrs; the mapper drops mtp.)",
    ),
    Variant(
        anchor='loader = AutoWeightsLoader(self, skip_substrs=["mtp."])',
        replacement="""
loader = AutoWeightsLoader(
    self,
    skip_substrs=["mtp."],
    # patch-dsv4 (loader-skips): the pack's vision tower has no module here.
    ignore_unexpected_prefixes=_patch_dsv4_vision_tower_prefixes(),
)
""",
        releases="0.28.0",
    ),
)

# -- MoE gate biases without a parameter (target and DSpark draft loaders)
_SKIP = """
# patch-dsv4 (loader-skips): a vision-pack gate bias with no parameter here.
if _patch_dsv4_gate_bias_without_home(name, params_dict):
    continue
"""
_PP_CHECK = """
if is_pp_missing_parameter(name, self):
    continue
"""
_LORA_LOOKUP = """
if name not in params_dict:
    head, _, leaf = name.rpartition(".")
    suffixed = f"{head}.base_layer.{leaf}"
    if suffixed in params_dict:
        name = suffixed
"""
_LOOKUP = "param = params_dict[name]\n"
_BIAS_RENAME = """
if name.endswith(".ffn.gate.bias"):
    name = name.replace(".ffn.gate.bias", ".ffn.gate.e_score_correction_bias")
"""


def _then(*pieces: str) -> str:
    """Statements one after the other."""
    return "".join(piece.strip("\n") + "\n" for piece in pieces)


TARGET_GATE_BIAS = (
    Variant(
        _then(_PP_CHECK, _LORA_LOOKUP, _LOOKUP),
        _then(_PP_CHECK, _LORA_LOOKUP, _SKIP, _LOOKUP),
        releases="0.29.0 (a LoRA base_layer lookup between the PP check and the lookup)",
    ),
    Variant(_then(_PP_CHECK, _LOOKUP), _then(_PP_CHECK, _SKIP, _LOOKUP), releases="0.28.0"),
)
DRAFT_GATE_BIAS = (
    Variant(_then(_BIAS_RENAME, _LOOKUP), _then(_BIAS_RENAME, _SKIP, _LOOKUP), releases="0.28.0, 0.29.0"),
)


# -- upstream probes: what the code builds and skips, evaluated (patcher/patching/evaluate) --------------------
MOE_CLASS = "DeepseekV4MoE"


def _moe_homes(ctx: Context) -> Outcome | NotProven:
    """Upstream where the release's MoE gives both gate biases of vision packs a parameter: ``gate.bias_vl`` on
    every MoE layer of a vision checkpoint (hash and non-hash), and ``gate.e_score_correction_bias`` on its hash
    layers too, whatever spelling creates them (``x.a = ``, ``setattr``, ``register_parameter``, a helper, a
    base class)."""
    ev = Evaluator.of(ctx)
    moe = ev.follower.class_def(MODEL, MOE_CLASS)
    if moe is None:
        return NotProven(f"{MOE_CLASS} not found in {MODEL}")
    wanted = (
        ("gate.bias_vl", (cases.VISION_HASH_LAYER, cases.VISION_LAYER)),
        ("gate.e_score_correction_bias", (cases.VISION_HASH_LAYER, cases.VISION_LAYER)),
    )
    for attr, on in wanted:
        for case in on:
            made = creates(ev, moe, attr, case)
            if made.reach is not Reach.YES:
                how = "may leave" if made.reach is Reach.MAYBE else "leaves"
                return NotProven(f"{MOE_CLASS}.__init__ {how} {attr} {describe(made.value)} on {case}")
    return Outcome.upstream(
        f"{MODEL}: {MOE_CLASS}.__init__ creates gate.bias_vl and, for vision checkpoints, the hash-layer "
        "gate.e_score_correction_bias (on every MoE layer of a vision checkpoint, hash and non-hash)"
    )


def _upstream_target_gate_bias(ctx: Context, tree: ast.Module | None) -> Outcome | NotProven | None:
    return _moe_homes(ctx)


def _upstream_draft_gate_bias(ctx: Context, tree: ast.Module | None) -> Outcome | NotProven | None:
    if tree is None:
        return None
    homes = _moe_homes(ctx)
    # the draft's decoder layer is the target's own class, however the file imports it
    layer = Follower(ctx).resolve(Follower.module_of(DSPARK), "DeepseekV4DecoderLayer")
    reuses_target_layers = bool(layer) and all(d.file == MODEL and d.kind == "class" for d in layer)
    if not reuses_target_layers:
        return NotProven(f"{DSPARK} builds its layers from its own DeepseekV4DecoderLayer, not {MODEL}'s")
    if isinstance(homes, NotProven):
        return homes
    return Outcome.upstream(f"{DSPARK} builds its layers from DeepseekV4DecoderLayer, whose MoE has both biases")


def _upstream_vision_tower(ctx: Context, tree: ast.Module | None) -> Outcome | NotProven | None:
    """Upstream where the vision class owns the vision tower: built for a vision checkpoint served with images."""
    ev = Evaluator.of(ctx)
    # the vision class is in common/vl_model.py, or (nightlies between 0.29.0 and 0.30.0) nvidia/vl_model.py
    where, vision = VL_MODEL, ev.follower.class_def(VL_MODEL, VISION_CLASS)
    if vision is None:
        where, vision = NIGHTLY_VL_MODEL, ev.follower.class_def(NIGHTLY_VL_MODEL, VISION_CLASS)
    if vision is None:
        return None
    for attr in ("vision", "aligner"):
        made = creates(ev, vision, attr, cases.VISION_CHECKPOINT, what=is_module)
        if made.reach is not Reach.YES:
            return NotProven(f"{VISION_CLASS}.__init__ leaves {attr} {describe(made.value)} on {made.case}")
    return Outcome.upstream(
        f"{where}: {VISION_CLASS} owns the vision tower: its __init__ builds vision and aligner for a vision "
        "checkpoint served with images"
    )


def _drops(mapper: V) -> set[str]:
    """The names a weight mapper (a ``WeightsMapper`` built with its rules) maps to None, in any of its rules."""
    dropped = set()
    for option in options(mapper):
        if isinstance(option, Inst):
            for _field, rules in option.attrs:
                for pair in rules.items if isinstance(rules, Seq) and rules.kind == "dict" else ():
                    key, target = pair.items  # type: ignore[attr-defined]
                    if isinstance(key, Const) and is_none(target):
                        dropped.add(key.value)
    return dropped


def _v41_passes_over_the_vision_tower(file: str):
    """Upstream where V4.1's text class drops the vision tower itself: its weight mapper (as built, a factory's
    result evaluated) maps each prefix to None, or ``DeepseekV4Model.load_weights`` goes on to the next weight,
    for a weight of each prefix, before loading it."""

    def probe(ctx: Context, tree: ast.Module | None) -> Outcome | NotProven | None:
        if tree is None:
            return None
        ev = Evaluator.of(ctx)
        found = []
        text_class = ev.follower.class_def(file, V41_TEXT_CLASS)
        if text_class is not None and set(VISION_PREFIXES) <= _drops(
            attribute_value(ev, text_class, "hf_to_vllm_mapper")
        ):
            found.append("its weight mapper")
        loader = ev.follower.function(file, "DeepseekV4Model", "load_weights")
        params = [a.arg for a in loader.node.args.args][1:2] if loader is not None else []  # type: ignore
        if params and all(passes_over(ev, loader, params[0], case) for case in cases.VISION_WEIGHTS):
            found.append("DeepseekV4Model.load_weights")
        if found:
            return Outcome.upstream(
                f"{file}: {V41_TEXT_CLASS} drops vision., aligner. and image_ itself ({' and '.join(found)})"
            )
        return NotProven(f"{V41_TEXT_CLASS} neither maps vision., aligner. and image_ to None nor skips them")

    return probe


def _skips_on(scope: ast.AST | None, suffix: str, guarded: bool) -> bool:
    """Whether ``scope`` holds ``if name.endswith(<suffix>) [and name not in params_dict]: continue``.

    Ours skips through a helper call, never in this shape; a sibling's edit in the scope changes nothing here.
    """
    if scope is None:
        return False
    for node in ast.walk(scope):
        if not (isinstance(node, ast.If) and len(node.body) == 1 and isinstance(node.body[0], ast.Continue)):
            continue
        test = ast.unparse(node.test)
        if f"name.endswith({suffix!r})" in test.replace('"', "'") and (not guarded or "not in params_dict" in test):
            return True
    return False


def _recipe_target_skip(tree: ast.Module, scope: ast.AST | None) -> str | None:
    if _skips_on(scope, ".ffn.gate.e_score_correction_bias", guarded=True):
        return "load_weights skips .ffn.gate.e_score_correction_bias names that have no parameter"
    return None


def _recipe_draft_skip(tree: ast.Module, scope: ast.AST | None) -> str | None:
    if _skips_on(scope, ".ffn.gate.bias_vl", guarded=False):
        return "load_weights skips every .ffn.gate.bias_vl, with or without a parameter"
    return None


RECIPE_TARGET_SKIP = ForeignEdit(
    script="patch_dsv4_stock028.py",
    recipe="DGX-Spark recipe",
    meaning="it skips what this patch skips, but patch-dsv4 can neither verify nor revert it: take it over",
    found=_recipe_target_skip,
)
RECIPE_DRAFT_SKIP = ForeignEdit(
    script="patch_dsv4_stock028.py",
    recipe="DGX-Spark recipe",
    meaning=(
        "its skip is unconditional: a gate.bias_vl that has a parameter (vLLM 0.30 on) is left uninitialised, "
        "and nothing reports it for quantized models; it must be replaced"
    ),
    found=_recipe_draft_skip,
)


class LoaderSkips(Patch):
    id = "loader-skips"
    title = "0.28/0.29 loaders skip the vision pack's tensors that have no parameter or module there"
    serve_impact = "the 0.28/0.29 loader meets the vision pack's extra tensors: KeyError part-way through the load"
    edits = (
        ReplaceStatements(
            label="text class ignores the vision tower it has no module for",
            file=MODEL,
            scope=Scope(TEXT_CLASS, "load_weights"),
            variants=VISION_TOWER,
            helpers=(_patch_dsv4_vision_tower_prefixes,),
            probe=_upstream_vision_tower,
        ),
        ReplaceStatements(
            label="target loader skips gate biases without a parameter",
            file=MODEL,
            scope=Scope("DeepseekV4Model", "load_weights"),
            variants=TARGET_GATE_BIAS,
            helpers=(_patch_dsv4_gate_bias_without_home,),
            probe=_upstream_target_gate_bias,
            foreign=(RECIPE_TARGET_SKIP,),
        ),
        ReplaceStatements(
            label="DSpark draft loader skips gate biases without a parameter",
            file=DSPARK,
            scope=Scope("DSparkDeepseekV4ForCausalLM", "load_weights"),
            variants=DRAFT_GATE_BIAS,
            helpers=(_patch_dsv4_gate_bias_without_home,),
            probe=_upstream_draft_gate_bias,
            foreign=(RECIPE_DRAFT_SKIP,),
        ),
        *(
            ReplaceStatements(
                label=f"text class ignores the vision tower it has no module for ({tag})",
                file=file,
                scope=Scope(V41_TEXT_CLASS, "load_weights"),
                variants=VISION_TOWER,
                helpers=(_patch_dsv4_vision_tower_prefixes,),
                probe=_v41_passes_over_the_vision_tower(file),
            )
            for file, tag in in_layouts("nvidia/model.py")
        ),
    )


EXAMPLES = (
    Example(
        "dspark-gate-bias",
        DSPARK,
        before="""\
class DSparkDeepseekV4ForCausalLM(nn.Module):
    def load_weights(self, weights):
        params_dict = dict(self.named_parameters())
        for name, loaded_weight in weights:
            if name.endswith(".ffn.gate.bias"):
                name = name.replace(".ffn.gate.bias", ".ffn.gate.e_score_correction_bias")
            param = params_dict[name]
            loaded_params.add(name)
""",
        after='''\
def _patch_dsv4_gate_bias_without_home(name, params_dict):
    """Whether ``name`` is a MoE gate bias this model has no parameter for.

    Written by patch-dsv4 (loader-skips). Vision checkpoints ship gate.bias on
    hash layers (loaded as e_score_correction_bias, which hash layers lack here)
    and gate.bias_vl on every MoE layer (no such parameter here). A name that
    has a parameter is always loaded.
    """
    return name not in params_dict and name.endswith(
        (".ffn.gate.e_score_correction_bias", ".ffn.gate.bias_vl")
    )


class DSparkDeepseekV4ForCausalLM(nn.Module):
    def load_weights(self, weights):
        params_dict = dict(self.named_parameters())
        for name, loaded_weight in weights:
            if name.endswith(".ffn.gate.bias"):
                name = name.replace(".ffn.gate.bias", ".ffn.gate.e_score_correction_bias")
            # patch-dsv4 (loader-skips): a vision-pack gate bias with no parameter here.
            if _patch_dsv4_gate_bias_without_home(name, params_dict):
                continue
            param = params_dict[name]
            loaded_params.add(name)
''',
    ),
    Example(
        "dspark-changed-lookup-drifts",
        DSPARK,
        before="""\
class DSparkDeepseekV4ForCausalLM(nn.Module):
    def load_weights(self, weights):
        for name, loaded_weight in weights:
            if name.endswith(".ffn.gate.bias"):
                name = name.replace(".ffn.gate.bias", ".ffn.gate.e_score_correction_bias")
            param = params_dict.get(name)
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
    Example(
        "model-0.28",
        MODEL,
        before="""\
class DeepseekV4Model(nn.Module):
    def load_weights(self, weights):
        for name, loaded_weight in weights:
            if "attn_sink" in name:
                if is_pp_missing_parameter(name, self):
                    continue
                params_dict[name][:1].copy_(loaded_weight)
                continue
            else:
                if is_pp_missing_parameter(name, self):
                    continue
                param = params_dict[name]
                param.weight_loader(param, loaded_weight)


class DeepseekV4ForCausalLM(nn.Module):
    def load_weights(self, weights):
        loader = AutoWeightsLoader(self, skip_substrs=["mtp."])
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
""",
        after='''\
def _patch_dsv4_gate_bias_without_home(name, params_dict):
    """Whether ``name`` is a MoE gate bias this model has no parameter for.

    Written by patch-dsv4 (loader-skips). Vision checkpoints ship gate.bias on
    hash layers (loaded as e_score_correction_bias, which hash layers lack here)
    and gate.bias_vl on every MoE layer (no such parameter here). A name that
    has a parameter is always loaded.
    """
    return name not in params_dict and name.endswith(
        (".ffn.gate.e_score_correction_bias", ".ffn.gate.bias_vl")
    )


class DeepseekV4Model(nn.Module):
    def load_weights(self, weights):
        for name, loaded_weight in weights:
            if "attn_sink" in name:
                if is_pp_missing_parameter(name, self):
                    continue
                params_dict[name][:1].copy_(loaded_weight)
                continue
            else:
                if is_pp_missing_parameter(name, self):
                    continue
                # patch-dsv4 (loader-skips): a vision-pack gate bias with no parameter here.
                if _patch_dsv4_gate_bias_without_home(name, params_dict):
                    continue
                param = params_dict[name]
                param.weight_loader(param, loaded_weight)


def _patch_dsv4_vision_tower_prefixes():
    """Checkpoint prefixes of the vision tower of DeepSeek-V4-Flash-Vision packs.

    Written by patch-dsv4 (loader-skips). Passed to AutoWeightsLoader as
    ignore_unexpected_prefixes, which skips a tensor only where the model has
    no module or parameter of that name: the text class has no vision tower.
    """
    return ["vision.", "aligner.", "image_"]


class DeepseekV4ForCausalLM(nn.Module):
    def load_weights(self, weights):
        loader = AutoWeightsLoader(
            self,
            skip_substrs=["mtp."],
            # patch-dsv4 (loader-skips): the pack's vision tower has no module here.
            ignore_unexpected_prefixes=_patch_dsv4_vision_tower_prefixes(),
        )
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
''',
    ),
    Example(
        "model-0.29",
        MODEL,
        before="""\
class DeepseekV4Model(nn.Module):
    def load_weights(self, weights):
        for name, loaded_weight in weights:
            if is_pp_missing_parameter(name, self):
                continue
            # Non-LoRA params on a LoRA-wrapped module live at
            # ``<head>.base_layer.<leaf>``; the checkpoint is plain.
            if name not in params_dict:
                head, _, leaf = name.rpartition(".")
                suffixed = f"{head}.base_layer.{leaf}"
                if suffixed in params_dict:
                    name = suffixed
            param = params_dict[name]


class DeepseekV4ForCausalLM(nn.Module):
    def load_weights(self, weights):
        loader = AutoWeightsLoader(self)
""",
        after='''\
def _patch_dsv4_gate_bias_without_home(name, params_dict):
    """Whether ``name`` is a MoE gate bias this model has no parameter for.

    Written by patch-dsv4 (loader-skips). Vision checkpoints ship gate.bias on
    hash layers (loaded as e_score_correction_bias, which hash layers lack here)
    and gate.bias_vl on every MoE layer (no such parameter here). A name that
    has a parameter is always loaded.
    """
    return name not in params_dict and name.endswith(
        (".ffn.gate.e_score_correction_bias", ".ffn.gate.bias_vl")
    )


class DeepseekV4Model(nn.Module):
    def load_weights(self, weights):
        for name, loaded_weight in weights:
            if is_pp_missing_parameter(name, self):
                continue
            # Non-LoRA params on a LoRA-wrapped module live at
            # ``<head>.base_layer.<leaf>``; the checkpoint is plain.
            if name not in params_dict:
                head, _, leaf = name.rpartition(".")
                suffixed = f"{head}.base_layer.{leaf}"
                if suffixed in params_dict:
                    name = suffixed
            # patch-dsv4 (loader-skips): a vision-pack gate bias with no parameter here.
            if _patch_dsv4_gate_bias_without_home(name, params_dict):
                continue
            param = params_dict[name]


def _patch_dsv4_vision_tower_prefixes():
    """Checkpoint prefixes of the vision tower of DeepSeek-V4-Flash-Vision packs.

    Written by patch-dsv4 (loader-skips). Passed to AutoWeightsLoader as
    ignore_unexpected_prefixes, which skips a tensor only where the model has
    no module or parameter of that name: the text class has no vision tower.
    """
    return ["vision.", "aligner.", "image_"]


class DeepseekV4ForCausalLM(nn.Module):
    def load_weights(self, weights):
        loader = AutoWeightsLoader(
            self,
            # patch-dsv4 (loader-skips): the pack's vision tower has no module here.
            ignore_unexpected_prefixes=_patch_dsv4_vision_tower_prefixes(),
        )
''',
    ),
)
