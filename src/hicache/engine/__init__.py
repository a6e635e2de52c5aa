"""The engine loop room: the loop and its lifecycle (:mod:`.engine`), continuous batching
(:mod:`.scheduler`), per-request state (:mod:`.request`), sampling and logit processing,
and output processing (detokenization, stop strings).

It drives the model runner (:mod:`hicache.runner`) over the cache's request verbs
(:mod:`hicache.cache`); the HTTP side (:mod:`hicache.server`) reaches both only through
:class:`~hicache.engine.engine.Engine`.
"""

from hicache.engine.sampling import SamplingParams, make_generator, sample

__all__ = ["SamplingParams", "make_generator", "sample"]
