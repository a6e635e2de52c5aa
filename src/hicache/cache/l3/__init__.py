"""The owner side of L3: a cache's slot for one tier and the tier's two parties.

:mod:`.slot` (:class:`~hicache.cache.l3.slot.L3Slot`: attach, detach, retired backends),
:mod:`.tier` (the attached tier and the detached one), :mod:`.keys` (this rank's keys and
namespaces), :mod:`.prefetches` (lookup -> read -> take and the policy, one party of the
sync; :mod:`.prefetch` its per-request record, :mod:`.reads` the read an agreed lookup
plans) and :mod:`.writes` (L2 -> L3 behind backups, the other party). The worker threads
are :mod:`hicache.controller.storage_controller`'s; the flows: ``docs/architecture.md``.
"""
