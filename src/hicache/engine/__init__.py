"""The engine loop, in four rooms over shared pieces (:mod:`tests.test_rooms` pins the
direction ``front -> drivers -> step -> shared``, ``front -> roles -> shared``):

- :mod:`.front`: the client API, lifecycle and health (:class:`~.front.engine.Engine`);
- :mod:`.drivers`: who runs the step (rank 0's :mod:`.drivers.leader`, a follower's
  :mod:`.drivers.follower`);
- :mod:`.step`: the one step body every rank runs (:mod:`.step.core`) over continuous
  batching (:mod:`.step.scheduler`) and the end of a request (:mod:`.step.ends`);
- :mod:`.roles`: the prefill/decode roles and their set-up;
- shared, this package's own modules: the request, sampling, step inputs, the rank
  channel (:mod:`.ranks`), the configuration, the role hooks (:mod:`.role`).

It drives the model runner (:mod:`hicache.runner`) over the cache's request verbs
(:mod:`hicache.cache`); the HTTP side (:mod:`hicache.server`) reaches both only through
the :class:`~hicache.engine.front.engine.Engine`.
"""

from hicache.engine.sampling import SamplingParams, make_generator, sample

__all__ = ["SamplingParams", "make_generator", "sample"]
