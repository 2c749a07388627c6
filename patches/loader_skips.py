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

Fixed upstream in vLLM 0.30.0: `DeepseekV4MoE.__init__` (`nvidia/model.py`) creates
`gate.bias_vl` and the hash-layer `gate.e_score_correction_bias` for vision
checkpoints, and `DeepseekV4ForConditionalGeneration` (`common/vl_model.py`) owns
the vision tower.
"""

from __future__ import annotations

import ast
import textwrap

from patch_dsv4.edits import ReplaceStatements, Scope
from patch_dsv4.fingerprint import find_scope, normalize_node, statements
from patch_dsv4.patch import Context, Example, Patch
from patch_dsv4.verdicts import Outcome, Verdict

MODEL = "vllm/models/deepseek_v4/nvidia/model.py"
DSPARK = "vllm/models/deepseek_v4/nvidia/dspark.py"
VL_MODEL = "vllm/models/deepseek_v4/common/vl_model.py"
TEXT_CLASS = "DeepseekV4ForCausalLM"
VISION_CLASS = "DeepseekV4ForConditionalGeneration"

# -- the text class's AutoWeightsLoader: ignore the vision tower where it has no module
VISION_HELPER = '''
def _patch_dsv4_vision_tower_prefixes():
    """Checkpoint prefixes of the vision tower of DeepSeek-V4-Flash-Vision packs.

    Written by patch-dsv4 (loader-skips). Passed to AutoWeightsLoader as
    ignore_unexpected_prefixes, which skips a tensor only where the model has
    no module or parameter of that name: the text class has no vision tower.
    """
    return ["vision.", "aligner.", "image_"]
'''
VISION_VARIANTS = (
    (  # 0.29.0 (AutoWeightsLoader lost skip_prefixes/skip_substrs; the mapper drops mtp.)
        """
loader = AutoWeightsLoader(self)
""",
        """
loader = AutoWeightsLoader(
    self,
    # patch-dsv4 (loader-skips): the pack's vision tower has no module here.
    ignore_unexpected_prefixes=_patch_dsv4_vision_tower_prefixes(),
)
""",
    ),
    (  # 0.28.0
        """
loader = AutoWeightsLoader(self, skip_substrs=["mtp."])
""",
        """
loader = AutoWeightsLoader(
    self,
    skip_substrs=["mtp."],
    # patch-dsv4 (loader-skips): the pack's vision tower has no module here.
    ignore_unexpected_prefixes=_patch_dsv4_vision_tower_prefixes(),
)
""",
    ),
)

# -- MoE gate biases without a parameter (target and DSpark draft loaders)
GATE_BIAS_HELPER = '''
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
'''
GATE_BIAS_SKIP = """
# patch-dsv4 (loader-skips): a vision-pack gate bias with no parameter here.
if _patch_dsv4_gate_bias_without_home(name, params_dict):
    continue
"""
_PP_CHECK = """
if is_pp_missing_parameter(name, self):
    continue
"""
_LORA_LOOKUP = """
# Non-LoRA params on a LoRA-wrapped module live at
# ``<head>.base_layer.<leaf>``; the checkpoint is plain.
if name not in params_dict:
    head, _, leaf = name.rpartition(".")
    suffixed = f"{head}.base_layer.{leaf}"
    if suffixed in params_dict:
        name = suffixed
"""
_LOOKUP = """
param = params_dict[name]
"""
_BIAS_RENAME = """
if name.endswith(".ffn.gate.bias"):
    name = name.replace(
        ".ffn.gate.bias", ".ffn.gate.e_score_correction_bias"
    )
"""


def _join(*pieces: str) -> str:
    """Statements one after the other, without blank lines between them."""
    return "".join(piece.strip("\n") + "\n" for piece in pieces)


MODEL_VARIANTS = (
    # 0.29.0: the LoRA base_layer lookup sits between the PP check and the lookup.
    (_join(_PP_CHECK, _LORA_LOOKUP, _LOOKUP), _join(_PP_CHECK, _LORA_LOOKUP, GATE_BIAS_SKIP, _LOOKUP)),
    # 0.28.0
    (_join(_PP_CHECK, _LOOKUP), _join(_PP_CHECK, GATE_BIAS_SKIP, _LOOKUP)),
)
DSPARK_VARIANTS = (
    # 0.28.0 and 0.29.0
    (_join(_BIAS_RENAME, _LOOKUP), _join(_BIAS_RENAME, GATE_BIAS_SKIP, _LOOKUP)),
)


def _occurs(scope: ast.AST, code: str) -> bool:
    """Whether the statements of ``code`` stand consecutively in one block of ``scope``."""
    wanted = statements(code)
    n = len(wanted)
    for node in ast.walk(scope):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not (isinstance(block, list) and block and isinstance(block[0], ast.stmt)):
                continue
            dumps = [normalize_node(stmt) for stmt in block]
            if any(dumps[i : i + n] == wanted for i in range(len(dumps) - n + 1)):
                return True
    return False


def _variant(ctx: Context, file: str, scope: Scope, variants) -> tuple[str, str]:
    """The (anchor, replacement) of the release at hand: the variant whose edit or
    anchor is in the file; the newest one otherwise, so that drift is reported
    against the code we know best."""
    tree = ctx.ast(file)
    node = find_scope(tree, scope.cls, scope.func) if tree is not None else None
    if node is not None:
        for anchor, replacement in variants:
            if _occurs(node, replacement) or _occurs(node, anchor):
                return anchor, replacement
    return variants[0]


# -- upstream probes
def _assigned_parameters(func: ast.AST) -> dict[str, list[ast.Assign]]:
    """``self.x.y = nn.Parameter(...)`` assignments in ``func``, by target."""
    found: dict[str, list[ast.Assign]] = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            if ast.unparse(node.value.func).split(".")[-1] == "Parameter":
                for target in node.targets:
                    found.setdefault(ast.unparse(target), []).append(node)
    return found


def _under_vision_condition(func: ast.AST, assign: ast.Assign) -> bool:
    for node in ast.walk(func):
        if isinstance(node, ast.If) and "vision_n_layers" in ast.unparse(node.test):
            if any(sub is assign for stmt in node.body for sub in ast.walk(stmt)):
                return True
    return False


def _moe_homes(ctx: Context) -> str | None:
    """Evidence that the release's MoE gives both gate biases of vision packs a parameter."""
    tree = ctx.ast(MODEL)
    init = find_scope(tree, "DeepseekV4MoE", "__init__") if tree is not None else None
    if init is None:
        return None
    params = _assigned_parameters(init)
    has_bias_vl = "self.gate.bias_vl" in params
    hash_bias = any(_under_vision_condition(init, a) for a in params.get("self.gate.e_score_correction_bias", []))
    if has_bias_vl and hash_bias:
        return (
            f"{MODEL}: DeepseekV4MoE.__init__ creates gate.bias_vl and, for vision checkpoints, "
            "the hash-layer gate.e_score_correction_bias"
        )
    return None


def _probe_target_gate_bias(ctx: Context, text: str | None) -> Outcome | None:
    evidence = _moe_homes(ctx)
    return Outcome.upstream(evidence) if evidence else None


def _probe_draft_gate_bias(ctx: Context, text: str | None) -> Outcome | None:
    if text is None:
        return None
    evidence = _moe_homes(ctx)
    try:
        tree = ctx.parse(text)
    except SyntaxError:
        return None
    reuses_target_layers = any(
        isinstance(node, ast.ImportFrom)
        and (node.module, node.level) in (("vllm.models.deepseek_v4.nvidia.model", 0), ("model", 1))
        and any(alias.name == "DeepseekV4DecoderLayer" for alias in node.names)
        for node in tree.body
    )
    if evidence and reuses_target_layers:
        return Outcome.upstream(f"{evidence}; {DSPARK} builds its layers from that DeepseekV4DecoderLayer")
    return None


def _probe_vision_tower(ctx: Context, text: str | None) -> Outcome | None:
    tree = ctx.ast(VL_MODEL)
    init = find_scope(tree, VISION_CLASS, "__init__") if tree is not None else None
    if init is None:
        return None
    assigned = {
        ast.unparse(t) for node in ast.walk(init) if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
    }
    if {"self.vision", "self.aligner"} <= assigned:
        return Outcome.upstream(
            f"{VL_MODEL}: {VISION_CLASS} owns the vision tower (vision, aligner, image_*) "
            "and its weight mapper drops them when images are off"
        )
    return None


class LoaderSkips(Patch):
    __doc__ = __doc__
    id = "loader-skips"
    title = "0.28/0.29 loaders skip the vision pack's tensors that have no parameter or module there"

    def edits(self, ctx: Context) -> list[ReplaceStatements]:
        edits = []
        for label, file, scope, variants, helper, probe in (
            (
                "text class ignores the vision tower it has no module for",
                MODEL,
                Scope(TEXT_CLASS, "load_weights"),
                VISION_VARIANTS,
                VISION_HELPER,
                _probe_vision_tower,
            ),
            (
                "target loader skips gate biases without a parameter",
                MODEL,
                Scope("DeepseekV4Model", "load_weights"),
                MODEL_VARIANTS,
                GATE_BIAS_HELPER,
                _probe_target_gate_bias,
            ),
            (
                "DSpark draft loader skips gate biases without a parameter",
                DSPARK,
                Scope("DSparkDeepseekV4ForCausalLM", "load_weights"),
                DSPARK_VARIANTS,
                GATE_BIAS_HELPER,
                _probe_draft_gate_bias,
            ),
        ):
            anchor, replacement = _variant(ctx, file, scope, variants)
            edits.append(
                ReplaceStatements(
                    label=label,
                    file=file,
                    scope=scope,
                    anchor=anchor,
                    replacement=replacement,
                    helpers=(helper,),
                    probe=probe,
                )
            )
        return edits


def _indented(code: str, spaces: int) -> str:
    return textwrap.indent(code.strip("\n"), " " * spaces) + "\n"


_DSPARK_BEFORE = f'''
import torch


class DSparkDeepseekV4ForCausalLM(nn.Module):
    def load_weights(self, weights):
        params_dict = dict(self.named_parameters())
        loaded_params = set()
        for name, loaded_weight in weights:
            if "attn_sink" in name:
                continue
{_indented(_join(_BIAS_RENAME, _LOOKUP), 12)}            loaded_params.add(name)
        return loaded_params
'''
_DSPARK_AFTER = _DSPARK_BEFORE.replace(
    "import torch\n\n\n", "import torch\n\n\n" + GATE_BIAS_HELPER.strip() + "\n\n\n"
).replace(_indented(_LOOKUP, 12), _indented(_join(GATE_BIAS_SKIP, _LOOKUP), 12))


def _model_before(plain_branch: str, loader: str) -> str:
    return f'''
import torch


class DeepseekV4Model(nn.Module):
    def load_weights(self, weights):
        params_dict = dict(self.named_parameters())
        for name, loaded_weight in weights:
            if "attn_sink" in name:
{_indented(_PP_CHECK, 16)}                params_dict[name][:1].copy_(loaded_weight)
                continue
            else:
{_indented(plain_branch, 16)}                param.weight_loader(param, loaded_weight)


class DeepseekV4ForCausalLM(nn.Module):
    def load_weights(self, weights):
{_indented(loader, 8)}        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
'''


def _model_after(version_index: int) -> str:
    (vision_anchor, vision_edit), (gate_anchor, gate_edit) = VISION_VARIANTS[version_index], MODEL_VARIANTS[version_index]
    return (
        _model_before(gate_edit, vision_edit)
        .replace("import torch\n\n\n", "import torch\n\n\n" + GATE_BIAS_HELPER.strip() + "\n\n\n")
        .replace(
            "\n\n\nclass DeepseekV4ForCausalLM(", "\n\n\n" + VISION_HELPER.strip() + "\n\n\nclass DeepseekV4ForCausalLM("
        )
    )


EXAMPLES = (
    Example("dspark-gate-bias", DSPARK, _DSPARK_BEFORE, _DSPARK_AFTER),
    Example(
        "dspark-changed-lookup-drifts",
        DSPARK,
        _DSPARK_BEFORE.replace("param = params_dict[name]", "param = params_dict.get(name)"),
        None,
        Verdict.DRIFTED,
    ),
    Example("model-0.29", MODEL, _model_before(*(v[0] for v in (MODEL_VARIANTS[0], VISION_VARIANTS[0]))), _model_after(0)),
    Example("model-0.28", MODEL, _model_before(*(v[0] for v in (MODEL_VARIANTS[1], VISION_VARIANTS[1]))), _model_after(1)),
)
