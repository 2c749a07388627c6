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

V4, V41 = "v4", "v41"
V41_MODEL_TYPE = "deepseek_v41"
V41_ARCHITECTURE = "DeepseekV41ForCausalLM"
# vision_config key -> the attribute vLLM's V4.1 config sets (V4's names, which the V4 vision tower reads)
VISION_KEYS = {
    "num_hidden_layers": "vision_n_layers",
    "hidden_size": "vision_dim",
    "num_attention_heads": "vision_n_heads",
    "intermediate_size": "vision_inter_dim",
    "patch_size": "vision_patch_size",
    "downsample_ratio": "vision_downsample_ratio",
    "max_image_tokens": "vision_max_n_token",
}


def architectures(cfg: dict) -> list[str]:
    value = cfg.get("architectures")
    return [a for a in value if isinstance(a, str)] if isinstance(value, list) else []


def family_of(cfg: dict) -> str:
    """``v41`` when either discriminator says V4.1 (a disagreement is v41.config's FAIL), else ``v4``."""
    if cfg.get("model_type") == V41_MODEL_TYPE or V41_ARCHITECTURE in architectures(cfg):
        return V41
    return V4


def flatten_v41(cfg: dict) -> dict:
    """The V4.1 config as vLLM's ``DeepseekV41Config`` presents it: the top level, then every
    ``text_config`` key but ``model_type`` over it, then ``vision_config`` as ``vision_*``, then
    ``quantization_config.expert_dtype``. A ``text_config``/``vision_config`` that is not an object
    adds nothing (v41.config says why)."""
    flat = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    text = cfg.get("text_config")
    if isinstance(text, dict):
        flat.update((k, v) for k, v in text.items() if k != "model_type")
    vision = cfg.get("vision_config")
    if isinstance(vision, dict):
        flat.update((VISION_KEYS[k], v) for k, v in vision.items() if k in VISION_KEYS)
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and "expert_dtype" in quant:
        flat["expert_dtype"] = quant["expert_dtype"]
    return flat
