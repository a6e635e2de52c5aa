"""Scoring requests through the server reuse the cache: ``echo`` + ``logprobs`` without a
start position (what lm-eval's ``local-completions`` sends) against the tiny model, one
server with the cache and its scoring entries, one with ``disable_radix_cache``.

The bound: the same fp32 model computes each position's logits in both servers, but in
forwards of different shapes (a choice's whole prompt, or only its tail after a cached
prefix), and CPU matmuls may sum in another order per shape, so a logit may differ in its
last bits; a logprob then differs by a few fp32 ulps of the log-softmax (|x| < 20 here:
ulp 2e-6), hence 1e-4 per token. The cached positions' records are the very fp32 values
the first choice's forward computed (byte-exact through the pools).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers.api_fixtures import make_engine, serve

CONTEXT = list(range(300, 337))  # 37 tokens: 9 whole pages of 4
CHOICES = [[1000 + i, 2000 + i, 3000 + i] for i in range(4)]
TOL = 1e-4


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    on = make_engine()
    off = make_engine(disable_radix_cache=True)
    try:
        with serve(on) as url_on, serve(off) as url_off:
            yield {"on": url_on, "off": url_off}
    finally:
        on.close()
        off.close()


def score(url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
        **extra,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def computed(out: dict[str, Any]) -> int:
    usage = out["usage"]
    return int(usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"])


def test_a_questions_choices_reuse_the_context_with_equal_logprobs(
    servers: dict[str, str],
) -> None:
    got: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for mode in ("on", "off"):
        for choice in CHOICES:
            got[mode].append(score(servers[mode], CONTEXT + choice))
    n = len(CONTEXT) + 3
    assert [computed(o) for o in got["off"]] == [n] * 4
    # the first choice computes all; the others reuse the context's 9 whole pages
    assert [computed(o) for o in got["on"]] == [n, n - 36, n - 36, n - 36]
    # the cached positions (1..36) carry the first choice's values, bit for bit
    first = got["on"][0]["choices"][0]["logprobs"]
    for later in got["on"][1:]:
        lp = later["choices"][0]["logprobs"]
        assert lp["token_logprobs"][: 36 + 1] == first["token_logprobs"][: 36 + 1]
        assert lp["top_logprobs"][: 36 + 1] == first["top_logprobs"][: 36 + 1]
    for on, off in zip(got["on"], got["off"], strict=True):
        lp_on = on["choices"][0]["logprobs"]
        lp_off = off["choices"][0]["logprobs"]
        assert lp_on["tokens"] == lp_off["tokens"]
        assert lp_on["token_logprobs"][0] is None and lp_off["token_logprobs"][0] is None
        for a, b in zip(lp_on["token_logprobs"][1:], lp_off["token_logprobs"][1:], strict=True):
            assert abs(a - b) <= TOL
        for a, b in zip(lp_on["top_logprobs"][1:], lp_off["top_logprobs"][1:], strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) <= TOL for k in a)


def test_a_request_asking_more_alternatives_than_kept_recomputes(
    servers: dict[str, str],
) -> None:
    prompt = [*range(400, 437), 7, 8]
    score(servers["on"], prompt)
    assert computed(score(servers["on"], prompt, logprobs=3)) == len(prompt)
    assert computed(score(servers["on"], prompt)) == len(prompt) - 36
