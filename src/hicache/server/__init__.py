"""The HTTP side of the serving engine: OpenAI's and SGLang's APIs over an
:class:`~hicache.engine.front.engine.Engine`.

``app`` assembles the FastAPI app (:func:`~hicache.server.app.create_app`); its routes
live by endpoint family in ``openai_routes``, ``native_routes`` and ``admin_routes``. Request
bodies: ``protocol`` (OpenAI) and ``native`` (SGLang's ``/generate``); response bodies:
``responses``; streaming fan-out of one HTTP request to engine requests: ``fanout``;
Prometheus: ``metrics``; the ``serve`` flags: ``args``.

Dependencies point one way: this package imports :mod:`hicache.engine`, never the
reverse, and reaches the cache only through the engine's methods.

Importing this package imports nothing else (``fastapi`` comes with ``app``).
"""
