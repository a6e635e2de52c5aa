"""The serving engine: models over the paged KV pool, the model runner, loading, sampling.

Importing this package does not import transformers; loading a model does.
"""

from hicache.engine.checkpoints import DEFAULT_MODEL, TINY_MODELS, Checkpoint, resolve_checkpoint
from hicache.engine.loader import LoadedModel, default_dtype, load_model, weights_fingerprint
from hicache.engine.runner import ForwardBatch, ModelRunner, kv_spec_from_hf_config
from hicache.engine.sampling import SamplingParams, make_generator, sample

__all__ = [
    "DEFAULT_MODEL",
    "TINY_MODELS",
    "Checkpoint",
    "ForwardBatch",
    "LoadedModel",
    "ModelRunner",
    "SamplingParams",
    "default_dtype",
    "kv_spec_from_hf_config",
    "load_model",
    "make_generator",
    "resolve_checkpoint",
    "sample",
    "weights_fingerprint",
]
