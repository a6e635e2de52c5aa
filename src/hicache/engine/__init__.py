"""The engine loop room, in three parts: the front (:mod:`.engine`: the client API and the
lifecycle), the one step body every rank runs (:mod:`.core` over continuous batching in
:mod:`.scheduler`, batch sampling in :mod:`.batch_sampling`, the end of a request in
:mod:`.ends`, per-request state in :mod:`.request`, output processing in :mod:`.output`),
and the rank drivers that run it (:mod:`.leader` on rank 0, :mod:`.follower` on the
others).

It drives the model runner (:mod:`hicache.runner`) over the cache's request verbs
(:mod:`hicache.cache`); the HTTP side (:mod:`hicache.server`) reaches both only through
:class:`~hicache.engine.engine.Engine`.
"""

from hicache.engine.sampling import SamplingParams, make_generator, sample

__all__ = ["SamplingParams", "make_generator", "sample"]
