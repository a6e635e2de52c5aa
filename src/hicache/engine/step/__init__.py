"""The one step body every rank runs (:class:`~hicache.engine.step.core.EngineCore`),
what builds it, and the scheduler and request ends it runs."""
