"""The engine's front: its lifecycle, its health and the API other threads call
(:class:`~hicache.engine.front.engine.Engine`)."""
