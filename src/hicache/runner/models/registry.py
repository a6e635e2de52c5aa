"""Which Hugging Face architectures the engine implements, and building the hybrid ones.

:data:`SUPPORTED_MODEL_TYPES` lists every ``model_type`` accepted: the Llama-style
:data:`~hicache.runner.models.config.FAMILIES` (served by :class:`DecoderLM`) and the
:data:`HYBRID_FAMILIES` (a :class:`~hicache.runner.models.hybrid.HybridLM` each; DeepSeek-V2/V3,
:data:`~hicache.runner.models.deepseek.DEEPSEEK_FAMILIES`, are among them: their MLA
decoder is built on the hybrid frame, with the MLA pool; DeepSeek-V3.2,
:data:`~hicache.runner.models.deepseek_v32.DSA_FAMILY`, adds the DSA indexer).
:func:`check_supported` refuses anything else with one error naming the list;
:func:`check_tensor_parallel` refuses a tensor-parallel size a family cannot be split over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hicache.runner.models.config import (
    FAMILIES,
    DecoderConfig,
    UnsupportedModelError,
    check_split,
)
from hicache.runner.models.deepseek import DEEPSEEK_FAMILIES, DeepseekConfig, DeepseekLM
from hicache.runner.models.deepseek_v32 import DSA_FAMILY, DeepseekV32Config, DeepseekV32LM
from hicache.runner.models.gemma3 import Gemma3Config, Gemma3LM
from hicache.runner.models.gpt_oss import GptOssConfig, GptOssLM
from hicache.runner.models.hybrid import HybridConfig, HybridLM
from hicache.runner.models.nemotron_h import NemotronHConfig, NemotronHLM
from hicache.runner.models.qwen3_next import Qwen3NextConfig, Qwen3NextLM
from hicache.runner.parallel import TPGroup

__all__ = [
    "HYBRID_FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "build_hybrid_model",
    "check_supported",
    "check_tensor_parallel",
    "hybrid_config_from_hf",
]


@dataclass(frozen=True)
class _Hybrid:
    """A hybrid family: its config from a Hugging Face config, and its model class."""

    config: Callable[[Any], HybridConfig]
    model: type[HybridLM]


_HYBRIDS: dict[str, _Hybrid] = {
    "gemma3_text": _Hybrid(Gemma3Config.from_hf, Gemma3LM),
    "gpt_oss": _Hybrid(GptOssConfig.from_hf, GptOssLM),
    "qwen3_next": _Hybrid(Qwen3NextConfig.from_hf, Qwen3NextLM),
    "nemotron_h": _Hybrid(NemotronHConfig.from_hf, NemotronHLM),
    **{family: _Hybrid(DeepseekConfig.from_hf, DeepseekLM) for family in DEEPSEEK_FAMILIES},
    DSA_FAMILY: _Hybrid(DeepseekV32Config.from_hf, DeepseekV32LM),
}
"""Every hybrid family by ``model_type`` (a config's ``family``)."""

HYBRID_FAMILIES: tuple[str, ...] = tuple(_HYBRIDS)
"""``model_type`` values of the hybrid families."""

SUPPORTED_MODEL_TYPES: tuple[str, ...] = FAMILIES + HYBRID_FAMILIES


def check_supported(hf_config: Any) -> str:
    """The config's ``model_type`` if supported; else UnsupportedModelError with the list."""
    model_type = str(getattr(hf_config, "model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        arch = ", ".join(getattr(hf_config, "architectures", None) or ()) or "unknown"
        raise UnsupportedModelError(
            f"model_type={model_type!r} (architectures: {arch}) is not supported; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def check_tensor_parallel(hf_config: Any, size: int) -> None:
    """Refuse, before any weight is read, to split the config's model over ``size`` ranks
    when it cannot be: ValueError naming the numbers when ``size`` cannot split a
    Llama-style model's heads (it must divide the query heads, and divide the K/V heads or
    be a multiple of them: then they are replicated) or does not divide its intermediate
    size (:meth:`~hicache.runner.models.config.DecoderConfig.check_tensor_parallel`), or
    what a hybrid family splits
    (:meth:`~hicache.runner.models.hybrid.HybridConfig.check_tensor_parallel`:
    UnsupportedModelError for a family with no sharded model). ``size ==
    1`` always passes; an unsupported ``model_type`` raises as :func:`check_supported`."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor-parallel size={size!r} is invalid; must be an int >= 1")
    model_type = check_supported(hf_config)
    if size == 1:
        return
    if model_type in DEEPSEEK_FAMILIES:
        _check_deepseek_split(DeepseekConfig.from_hf(hf_config), size)
        return
    if model_type == DSA_FAMILY:  # the indexer is replicated: the MLA and MoE split
        _check_deepseek_split(DeepseekV32Config.from_hf(hf_config), size)
        return
    if model_type in HYBRID_FAMILIES:  # the family's own rule (HybridConfig.check_tensor_parallel)
        hybrid_config_from_hf(hf_config).check_tensor_parallel(size)
        return
    if model_type in FAMILIES:
        DecoderConfig.from_hf(hf_config).check_tensor_parallel(size)
    # any other family checks its own split where its model is built


def _check_deepseek_split(cfg: DeepseekConfig, size: int) -> None:
    """ValueError naming the numbers unless ``size`` divides a DeepSeek model's query heads
    (each rank decompresses the latent into its own heads), its dense MLP's and its
    experts' intermediate sizes. The latent itself is whole on every rank."""
    sizes = [("num_attention_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size)]
    if cfg.moe is not None:
        sizes.append(("moe_intermediate_size", cfg.moe.intermediate_size))
    check_split(size, sizes, cfg.family)


def hybrid_config_from_hf(hf_config: Any) -> HybridConfig:
    """The engine config of a hybrid-family Hugging Face config."""
    model_type = check_supported(hf_config)
    family = _HYBRIDS.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"model_type={model_type!r} is not a hybrid family; hybrid ones: {HYBRID_FAMILIES}"
        )
    return family.config(hf_config)


def build_hybrid_model(
    cfg: HybridConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPGroup | None = None,
) -> HybridLM:
    """An eval-mode hybrid model with *uninitialized* weights on ``device`` (load next):
    the model class of ``cfg.family`` (:meth:`HybridLM.build`). ``tp``: this rank's
    tensor-parallel group (the families that split: DeepSeek, Qwen3-Next, Nemotron-H,
    their :meth:`~HybridLM.build`; the others refuse a group of more than one rank)."""
    family = _HYBRIDS.get(cfg.family)
    if family is None:
        raise UnsupportedModelError(f"no hybrid model for {type(cfg).__name__}")
    with torch.device("meta"):
        model = family.model.build(cfg, tp)
    model = model.to_empty(device=torch.device(device)).to(dtype)
    model.after_cast()
    model.requires_grad_(False)
    return model.eval()
