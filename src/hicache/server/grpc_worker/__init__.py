"""hicache as an smg gRPC worker (``hicache serve --grpc-mode``): smg's ``SglangScheduler``
service (from the pinned ``smg-grpc-proto`` stubs) over the engine the HTTP server uses.

:mod:`.servicer` answers the RPCs; :mod:`.generate_request` and :mod:`.generate_reply`
turn a ``Generate`` call into engine requests (through ``/generate``'s validation) and its
outputs into messages; :mod:`.info` answers what smg reads about the worker;
:mod:`.tokenizer_bundle` zips the tokenizer for ``GetTokenizer``; :mod:`.keys` says which
key each RPC needs; :mod:`.server` runs the gRPC server. The commands: docs/router.md.
"""
