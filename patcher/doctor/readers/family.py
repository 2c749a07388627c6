"""Which DeepSeek a pack is (V4 or V4.1), from config.json alone, and V4.1's config as vLLM reads it.

V4.1 when ``model_type`` is ``deepseek_v41`` or ``architectures`` names
``DeepseekV41ForCausalLM`` (v41-packs.md §1.1; V34 transformers_utils/config.py:177,
model_executor/models/registry.py:393-396). vLLM's ``DeepseekV41Config`` copies every
``text_config`` key but ``model_type`` onto the config and turns ``vision_config`` into
``vision_*`` attributes (V34 transformers_utils/configs/deepseek_v41.py:26-62), and
``get_hf_text_config`` returns the config itself: :func:`flatten_v41` builds that view, so
the rows read the numbers vLLM reads, from the pack's own config.
"""

from __future__ import annotations

from enum import Enum


class Family(str, Enum):
    """Which DeepSeek a pack is; a check registered for one runs on that family's packs only."""

    V4 = "v4"
    V41 = "v41"

    def __str__(self) -> str:
        return self.value


V4, V41 = Family
V41_MODEL_TYPE = "deepseek_v41"
V41_ARCHITECTURE = "DeepseekV41ForCausalLM"
# vision_config key -> the attribute vLLM's V4.1 config sets (V34 transformers_utils/configs/deepseek_v41.py:52-62)
VISION_KEYS = {
    "num_hidden_layers": "vision_n_layers",
    "hidden_size": "vision_dim",
    "num_attention_heads": "vision_n_heads",
    "intermediate_size": "vision_inter_dim",
    "patch_size": "vision_patch_size",
    "downsample_ratio": "vision_downsample_ratio",
    "max_image_tokens": "vision_max_n_token",
    "rope_theta": "vision_rope_theta",
    "min_pixels": "vision_min_pixels",
    "max_wh_ratio": "vision_max_wh_ratio",
}


def architectures(cfg: dict) -> list[str]:
    value = cfg.get("architectures")
    return [a for a in value if isinstance(a, str)] if isinstance(value, list) else []


def family_of(cfg: dict) -> Family:
    """V4.1 when either discriminator says so (a disagreement is v41.config's FAIL), else V4."""
    if cfg.get("model_type") == V41_MODEL_TYPE or V41_ARCHITECTURE in architectures(cfg):
        return V41
    return V4


def flatten_v41(cfg: dict) -> dict:
    """The V4.1 config as vLLM's ``DeepseekV41Config`` presents it: every ``text_config`` key but
    ``model_type`` (and ``rope_scaling``, which it moves to ``rope_parameters``), then the top level over
    them (``PreTrainedConfig.__init__`` sets its kwargs after), ``quantization_config.expert_dtype`` where
    the text keys did not set one, and ``vision_config`` as ``vision_*`` (``vision_n_layers`` 0 without one).
    A ``text_config``/``vision_config`` that is not an object adds nothing (v41.config says why)
    (V34 transformers_utils/configs/deepseek_v41.py:20-62)."""
    text = cfg.get("text_config")
    flat = {k: v for k, v in text.items() if k not in ("model_type", "rope_scaling")} if isinstance(text, dict) else {}
    flat.update((k, v) for k, v in cfg.items() if k not in ("text_config", "vision_config"))
    quant = cfg.get("quantization_config")
    if "expert_dtype" not in flat and isinstance(quant, dict) and "expert_dtype" in quant:
        flat["expert_dtype"] = quant["expert_dtype"]
    vision = cfg.get("vision_config")
    vision = vision if isinstance(vision, dict) else {}
    flat["vision_n_layers"] = vision.get("num_hidden_layers", 0)
    flat.update((VISION_KEYS[k], v) for k, v in vision.items() if k in VISION_KEYS and k != "num_hidden_layers")
    return flat
