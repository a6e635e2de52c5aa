"""The model runner room: models over the paged KV pools, checkpoints and loading,
attention kernels, CUDA graphs for decode, and the runner's per-request recurrent state.

The engine loop (:mod:`hicache.engine`) drives it; nothing here imports the loop, the
HTTP side or the cache facade. Importing this package does not import transformers;
loading a model does.
"""

from hicache.runner.checkpoints import DEFAULT_MODEL, TINY_MODELS, Checkpoint, resolve_checkpoint
from hicache.runner.loader import LoadedModel, default_dtype, load_model, weights_fingerprint
from hicache.runner.model_runner import ForwardBatch, ModelRunner, kv_spec_from_hf_config

__all__ = [
    "DEFAULT_MODEL",
    "TINY_MODELS",
    "Checkpoint",
    "ForwardBatch",
    "LoadedModel",
    "ModelRunner",
    "default_dtype",
    "kv_spec_from_hf_config",
    "load_model",
    "resolve_checkpoint",
    "weights_fingerprint",
]
