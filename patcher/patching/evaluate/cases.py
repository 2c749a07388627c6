"""The cases a patch names: what the objects its code reads are, in each checkpoint and setting that matters.

A :class:`Case` gives values to *roles* (``wo_a``, ``vllm_config``, ``prefix``...). A question binds roles to the
code it starts from: a parameter takes the role of its own name, and a question may bind more
(``{"self.wo_a": "wo_a"}``). A case may also say what a vLLM function returns in it (``extract_layer_index`` of
the layer's prefix), what a user's setting is, and what a loop over the weights takes (its ``item``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from patch_dsv4.patching.evaluate.values import MISSING, NONE, Const, Ext, Seq, Setting, Thing, V


@dataclass(frozen=True)
class Case:
    name: str
    roles: tuple[tuple[str, V], ...] = ()
    calls: tuple[tuple[str, V], ...] = ()  # dotted vLLM function -> what it returns in this case
    settings: tuple[tuple[str, V], ...] | None = None  # None: settings are left as they are read (unknown)
    item: V | None = None  # what a loop over the weights takes first
    notes: tuple[str, ...] = field(default=(), compare=False)

    def role(self, name: str) -> V | None:
        return dict(self.roles).get(name)

    def call(self, dotted: str) -> V | None:
        return dict(self.calls).get(dotted)

    def setting(self, setting: Setting) -> V:
        """The value a setting has in this case: the case's, else (the case sets settings) unset."""
        if self.settings is None:
            return setting
        found = dict(self.settings).get(setting.name)
        if found is not None:
            return found
        return setting.default if setting.default is not None else NONE

    def __str__(self) -> str:
        return self.name


#: No facts: every test whose value depends on the checkpoint is unknown (both arms are followed).
ANY = Case("any checkpoint")


# -- wo_a: the attention's output projection, by how a checkpoint stores it ----------------------------------
def _wo_a(dtype: str) -> Thing:
    weight = Thing("wo_a.weight", (("dtype", Ext(dtype)),), foreign=True)
    return Thing("wo_a", (("weight", weight), ("_exl3_linears", MISSING)), truth=True)


WO_A_BF16 = Case("wo_a BF16", roles=(("wo_a", _wo_a("torch.bfloat16")),))
WO_A_FP8 = Case("wo_a FP8", roles=(("wo_a", _wo_a("torch.float8_e4m3fn")),))
#: vllm-exl3 builds LinearEXL3 objects and deletes the linear's ``.weight``.
EXL3_LINEARS = Seq("list", (Thing("LinearEXL3", truth=True, foreign=True),))
WO_A_EXL3 = Case(
    "wo_a EXL3 (no .weight)",
    roles=(("wo_a", Thing("wo_a", (("weight", MISSING), ("_exl3_linears", EXL3_LINEARS)), truth=True)),),
)
WO_A_CASES = (WO_A_BF16, WO_A_FP8, WO_A_EXL3)


# -- an EXL3 linear (the compressor's fused_wkv_wgate), and the quant config of an EXL3 pack -----------------
EXL3_QUANT_CONFIG = Thing(
    "the pack's EXL3 quant config",
    (("get_name", Thing("get_name", returns=Const("exl3"))),),
    truth=True,
)
#: A linear vllm-exl3 took over: no ``.weight``, its shards, and its quant method (which runs them).
EXL3_LINEAR = (("weight", MISSING), ("_exl3_linears", EXL3_LINEARS), ("quant_method", Thing("quant_method")))


def _exl3_pack() -> Case:
    base = _checkpoint(vision=False)
    vllm_config = Thing("vllm_config", (*base.attrs, ("quant_config", EXL3_QUANT_CONFIG)), truth=True)
    return Case("an EXL3 pack that quantizes the compressor", roles=(("vllm_config", vllm_config),))


# -- MoE layers: hash and non-hash, of a vision and of a text checkpoint --------------------------------------
EXTRACT_LAYER_INDEX = "vllm.model_executor.models.utils.extract_layer_index"
NUM_HASH_LAYERS = 3


def _checkpoint(vision: bool) -> Thing:
    """``vllm_config`` of a DeepSeek-V4 checkpoint (vision: with its vision tower, served with images on)."""
    hf_config = Thing(
        "hf_config",
        (
            ("vision_n_layers", Const(27 if vision else 0)),
            ("topk_method", Const("noaux_tc")),
            ("num_hash_layers", Const(NUM_HASH_LAYERS)),
        ),
        truth=True,
    )
    images = Thing("get_limit_per_prompt", returns=Const(1))
    multimodal = Thing("multimodal_config", (("get_limit_per_prompt", images),), truth=True) if vision else NONE
    model_config = Thing(
        "model_config",
        (("hf_config", hf_config), ("hf_text_config", hf_config), ("multimodal_config", multimodal)),
        truth=True,
    )
    return Thing("vllm_config", (("model_config", model_config),), truth=True)


def _moe_layer(vision: bool, hash_layer: bool) -> Case:
    index = 0 if hash_layer else NUM_HASH_LAYERS + 7
    kind = "vision" if vision else "text"
    return Case(
        f"{'a hash' if hash_layer else 'a non-hash'} MoE layer of a {kind} checkpoint",
        roles=(
            ("vllm_config", _checkpoint(vision)),
            ("config", _checkpoint(vision).attr("model_config").attr("hf_config")),  # type: ignore[union-attr]
            ("prefix", Const(f"model.layers.{index}.ffn")),
            ("num_hash_layers", Const(NUM_HASH_LAYERS)),
        ),
        calls=((EXTRACT_LAYER_INDEX, Const(index)),),
    )


VISION_HASH_LAYER = _moe_layer(vision=True, hash_layer=True)
VISION_LAYER = _moe_layer(vision=True, hash_layer=False)
TEXT_HASH_LAYER = _moe_layer(vision=False, hash_layer=True)
TEXT_LAYER = _moe_layer(vision=False, hash_layer=False)
MOE_LAYER_CASES = (VISION_HASH_LAYER, VISION_LAYER, TEXT_HASH_LAYER, TEXT_LAYER)
EXL3_PACK = _exl3_pack()
VISION_CHECKPOINT = Case(
    "a vision checkpoint served with images on",
    roles=(
        ("vllm_config", _checkpoint(vision=True)),
        ("config", _checkpoint(vision=True).attr("model_config").attr("hf_config")),  # type: ignore[union-attr]
    ),
)


def v41_checkpoint(hf_config: V) -> Case:
    """A DeepSeek-V4.1 vision checkpoint served with images, its config ``hf_config`` (an instance of V4.1's
    config class, which the question finds in the tree)."""
    images = Thing("get_limit_per_prompt", returns=Const(1))
    model_config = Thing(
        "model_config",
        (("hf_config", hf_config), ("hf_text_config", hf_config),
         ("multimodal_config", Thing("multimodal_config", (("get_limit_per_prompt", images),), truth=True))),
        truth=True,
    )  # fmt: skip
    vllm_config = Thing("vllm_config", (("model_config", model_config),), truth=True)
    return Case("a DeepSeek-V4.1 checkpoint", roles=(("vllm_config", vllm_config),))


# -- the weights a loader takes -------------------------------------------------------------------------------
def weight_named(name: str) -> Case:
    """A loop over the weights whose first item is the tensor ``name``."""
    return Case(f"a weight named {name}", item=Seq("tuple", (Const(name), Thing("tensor", foreign=True))))


LANGUAGE_MODEL_WEIGHT = weight_named("language_model.model.layers.0.attn.wq_a.weight")
VISION_WEIGHTS = tuple(
    weight_named(name) for name in ("vision.blocks.0.attn.qkv.weight", "aligner.proj.weight", "image_newline")
)


# -- a user's settings ---------------------------------------------------------------------------------------
#: What each setting read may be: unset, or set to "0" or "1" (``vllm.envs`` gives typed values: False, True).
SETTING_VALUES = (None, Const("0"), Const("1"))
ENVS_VALUES = (Const(False), Const(True))


def settings_cases(read: dict[str, bool], limit: int = 64) -> tuple[Case, ...]:
    """Every combination of the settings ``read`` (name -> whether it is a ``vllm.envs`` attribute), at most
    ``limit``: the cases "a setting on and off"."""
    names = sorted(read)
    domains = [ENVS_VALUES if read[n] else SETTING_VALUES for n in names]
    cases = []
    for values in itertools.islice(itertools.product(*domains), limit):
        pairs = tuple((n, v) for n, v in zip(names, values, strict=True) if v is not None)
        label = ", ".join(f"{n}={v.value!r}" for n, v in pairs) or "no setting set"
        cases.append(Case(label, settings=pairs))
    return tuple(cases)
