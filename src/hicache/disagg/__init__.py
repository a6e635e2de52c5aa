"""Prefill/decode disaggregation: a prefill instance computes a prompt's KV and sends it,
page by page and store by store, into the L1 pages a decode instance gave the request;
the decode instance decodes and streams. SGLang's router (``smg``) sends each request to
both at once with a bootstrap room that pairs them.

Modules, one concept each:

- :mod:`~hicache.disagg.config`: the role, the transfer backend and the bounds
  (:class:`DisaggConfig`, frozen);
- :mod:`~hicache.disagg.transport`: moving bytes between two instances' registered L1
  pools (:class:`Transport`; Mooncake's transfer engine and NIXL implement it, in
  :mod:`~hicache.disagg.mooncake_transport` and :mod:`~hicache.disagg.nixl_transport`;
  :mod:`~hicache.disagg.backends` picks one by :class:`TransferBackend`);
- :mod:`~hicache.disagg.pages`: a pool's geometry as told to a peer, and the spans that
  copy pages of one pool into pages of another (pure);
"""

from hicache.disagg.config import DisaggConfig, DisaggMode, TransferBackend

__all__ = ["DisaggConfig", "DisaggMode", "TransferBackend"]
