"""A server's ``/metrics`` samples in tests, read through the benches' one parser
(:func:`hicache.bench.httpclient.parse_metrics`)."""

from __future__ import annotations

import httpx

from hicache.bench.httpclient import parse_metrics


def metric(url: str, name: str, labels: str = "", default: float | None = None) -> float:
    """Sample ``name`` with ``labels`` (as exposed, e.g. ``'{holder="requests"}'``) of the
    server at ``url``; with no ``labels``, summed over the sample's label sets. When it is
    absent: ``default``, or AssertionError when that is None."""
    got = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text, labels=bool(labels))
    key = name + labels
    if key in got:
        return got[key]
    if default is None:
        raise AssertionError(f"{key} not in {url}/metrics")
    return default
