"""HTTP client side of the serving benchmarks: timed requests to a ``hicache serve``.

* :func:`stream_completion`: one streamed, greedy ``/v1/completions`` request, timed
  (:class:`RequestRecord`, with the prompt tokens each tier served, :data:`TIERS`);
* :func:`stream_generate`: the same through SGLang's native ``/generate`` with
  ``input_ids``, which SGLang's router (``smg``) also serves and forwards (its
  ``/v1/completions`` takes text prompts only); it also gives the output ids and the
  inter-token latency; :func:`stream_request` sends either, by :data:`APIS` name;
* :func:`flush_cache`: ``POST /flush_cache``, retried while requests are in flight;
* :func:`server_ttft`: the server's own TTFT histogram totals from ``/metrics``;
  :func:`server_agreement`: its tensor-parallel agreement counters;
  :func:`server_counters`: every counter (:func:`parse_metrics` reads the text).

Failures raise :class:`hicache.bench.serverproc.ServerError`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from hicache.bench.serverproc import ADMIN_KEY, ServerError

__all__ = [
    "APIS",
    "TIERS",
    "RequestRecord",
    "flush_cache",
    "parse_metrics",
    "server_agreement",
    "server_counters",
    "server_ttft",
    "stream_completion",
    "stream_generate",
    "stream_request",
]

TIERS: tuple[str, ...] = ("device", "host", "storage")
"""The tiers of ``usage.cached_tokens_details``."""

APIS: tuple[str, ...] = ("completions", "generate")
"""The request routes a benchmark can send by: ``/v1/completions``, ``/generate``."""


async def flush_cache(client: httpx.AsyncClient, url: str, *, tries: int = 50) -> float:
    """``POST /flush_cache`` (retried while the server says requests are in flight, 409).

    Returns the seconds it took; ServerError if it never succeeds.
    """
    t = time.perf_counter()
    for _ in range(tries):
        r = await client.post(
            f"{url}/flush_cache", headers={"authorization": f"Bearer {ADMIN_KEY}"}
        )
        if r.status_code == 200:
            return time.perf_counter() - t
        if r.status_code != 409:
            raise ServerError(f"POST /flush_cache answered {r.status_code}: {r.text}")
        await asyncio.sleep(0.1)
    raise ServerError(f"POST /flush_cache kept answering 409 after {tries} tries")


async def server_ttft(client: httpx.AsyncClient, url: str) -> tuple[float, int]:
    """The server's TTFT histogram totals from ``/metrics``: (sum in seconds, count)."""
    text = (await client.get(f"{url}/metrics")).text
    total, count = 0.0, 0
    for line in text.splitlines():
        if line.startswith("hicache_ttft_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("hicache_ttft_seconds_count"):
            count = int(float(line.split()[-1]))
    return total, count


async def server_agreement(client: httpx.AsyncClient, url: str) -> tuple[float, int]:
    """The server's tensor-parallel agreement counters from ``/metrics``: (seconds rank 0
    spent in the step's agreement collectives, steps); (0.0, 0) with one rank or from a
    server that does not export them."""
    text = (await client.get(f"{url}/metrics")).text
    seconds, steps = 0.0, 0
    for line in text.splitlines():
        if line.startswith("hicache_tp_agreement_seconds_total"):
            seconds = float(line.split()[-1])
        elif line.startswith("hicache_tp_steps_total"):
            steps = int(float(line.split()[-1]))
    return seconds, steps


def published_after(counters: Mapping[str, float], since: float, now: float) -> bool:
    """Whether a server's cache figures in ``counters`` (:func:`parse_metrics` of its
    ``/metrics``) were published after ``since`` (``perf_counter`` s; ``now`` is the
    clock as they were read): the engine publishes them every ``stats_interval_s``, not
    per request, and ``hicache_stats_age_seconds`` says how old they are. True without
    that gauge (nothing to wait for)."""
    age = counters.get("hicache_stats_age_seconds")
    return age is None or now - age > since


def parse_metrics(text: str, *, labels: bool = False) -> dict[str, float]:
    """The samples of a Prometheus text exposition (``/metrics``): by sample name summed
    over labels (``hicache_l3_read_bytes_total``, ...), or with ``labels`` each labelled
    sample by itself (``hicache_device_tokens{holder="requests"}``). Comments and
    unparsable values are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if not labels:
            name = name.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


async def server_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Every sample of the server's ``/metrics``, summed over labels by sample name
    (:func:`parse_metrics`); counters are what a difference makes sense of."""
    return parse_metrics((await client.get(f"{url}/metrics")).text)


@dataclass(frozen=True)
class RequestRecord:
    """One finished request. Times in seconds (``perf_counter``), token counts in tokens."""

    group: int
    """Round (multiturn) or phase (long context) index, from 0."""
    client: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float
    start_s: float
    end_s: float
    cached: dict[str, int]
    """Prompt tokens served from each tier: ``{"device", "host", "storage"}``."""
    output_ids: tuple[int, ...] = ()
    """The generated token ids (``/generate`` only; empty from ``/v1/completions``)."""
    itl_s: float | None = None
    """Mean inter-token latency (s): from the first streamed event to the last token's,
    over ``output_tokens - 1``; None with fewer than two output tokens or from
    ``/v1/completions``."""


async def sse_chunks(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """POST ``body`` to ``url`` and yield each server-sent event's JSON with the
    ``time.perf_counter()`` it arrived at, up to ``[DONE]``. ServerError on a non-200
    answer or an error event."""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise ServerError(f"{url} answered {resp.status_code}: {text}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerError(f"stream error: {chunk['error']}")
            yield now, chunk


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    prompt: list[int],
    max_tokens: int,
    *,
    group: int,
    client_id: int,
) -> RequestRecord:
    """Send one streamed, greedy ``/v1/completions`` request and time it.

    TTFT = from sending to the first SSE ``data:`` event (the server sends one as soon as
    a token adds text, or when the request ends). ServerError on a non-200 answer or a
    stream without a final ``usage``.
    """
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] | None = None
    async for now, chunk in sse_chunks(client, f"{url}/v1/completions", body):
        first = now if first is None else first
        if chunk.get("usage"):
            usage = chunk["usage"]
    end = time.perf_counter()
    if usage is None or first is None:
        raise ServerError("the stream ended without a final chunk carrying usage")
    details = usage.get("cached_tokens_details") or {}
    return RequestRecord(
        group=group,
        client=client_id,
        prompt_tokens=int(usage["prompt_tokens"]),
        output_tokens=int(usage["completion_tokens"]),
        ttft_s=first - start,
        latency_s=end - start,
        start_s=start,
        end_s=end,
        cached={t: int(details.get(t, 0)) for t in TIERS},
    )


async def stream_generate(
    client: httpx.AsyncClient,
    url: str,
    prompt: list[int],
    max_tokens: int,
    *,
    group: int,
    client_id: int,
    ignore_eos: bool = False,
    fields: Mapping[str, Any] | None = None,
) -> RequestRecord:
    """Send one streamed, greedy ``POST /generate`` with ``input_ids`` and time it.

    TTFT = from sending to the first SSE ``data:`` event (the server sends one as soon as
    a token adds text, or when the request ends); the inter-token latency is the time
    from that event to the last one carrying tokens, over ``completion_tokens - 1``.
    Chunks are cumulative (SGLang's): the last one has every output id and
    ``meta_info`` (``prompt_tokens``, ``completion_tokens``, ``cached_tokens_details``).
    ``ignore_eos``: generate exactly ``max_tokens`` tokens; ``fields``: more top-level
    body fields (``session_id``, ...). ServerError on a non-200
    answer, an error event, or a stream that ends without a finished chunk.
    """
    params: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": 0.0}
    if ignore_eos:
        params["ignore_eos"] = True
    body = {"input_ids": prompt, "sampling_params": params, "stream": True, **(fields or {})}
    start = time.perf_counter()
    first: float | None = None
    last_t = start
    final: dict[str, Any] | None = None
    async for now, chunk in sse_chunks(client, f"{url}/generate", body):
        first = now if first is None else first
        if final is None or len(chunk.get("output_ids", ())) > len(final.get("output_ids", ())):
            last_t = now  # a chunk with new tokens
        final = chunk
    end = time.perf_counter()
    meta = {} if final is None else (final.get("meta_info") or {})
    if final is None or first is None or meta.get("finish_reason") is None:
        raise ServerError(f"the /generate stream from {url} ended without a finished chunk")
    details = meta.get("cached_tokens_details") or {}
    out = int(meta["completion_tokens"])
    return RequestRecord(
        group=group,
        client=client_id,
        prompt_tokens=int(meta["prompt_tokens"]),
        output_tokens=out,
        ttft_s=first - start,
        latency_s=end - start,
        start_s=start,
        end_s=end,
        cached={t: int(details.get(t, 0)) for t in TIERS},
        output_ids=tuple(int(i) for i in final.get("output_ids", ())),
        itl_s=(last_t - first) / (out - 1) if out > 1 else None,
    )


async def stream_request(
    api: str,
    client: httpx.AsyncClient,
    url: str,
    prompt: list[int],
    max_tokens: int,
    *,
    group: int,
    client_id: int,
) -> RequestRecord:
    """:func:`stream_completion` (``api="completions"``) or :func:`stream_generate`
    (``"generate"``); ValueError naming any other ``api``."""
    if api == "completions":
        return await stream_completion(
            client, url, prompt, max_tokens, group=group, client_id=client_id
        )
    if api == "generate":
        return await stream_generate(
            client, url, prompt, max_tokens, group=group, client_id=client_id
        )
    raise ValueError(f"api={api!r} is unknown; choose from {', '.join(APIS)}")
