"""A paused prefill instance never writes into pages its decode instance has given away
(issue 33, item 1), over both transports: a prefill process (tiny-random-llama, CPU)
paused with SIGSTOP, a decode engine in this process.

* The registration in the paused instance's socket: the decode half of a room fails after
  the registration's bound, its pages fenced (not reused); two requests served by the
  decode alone; once the prefill instance resumes it never answers 200 for the room, the
  held pages are freed, and the two requests, sent again (served from the decode's
  cache), equal a plain engine's.
* A pause during a transfer already under way (the sender stopped between two halves of
  its first write): the same, through the decode's health bound.

On the old code the room's KV landed in the pages the two requests had taken, and the
second answer differed from a plain engine's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any

import httpx
import pytest

from hicache.disagg.config import NO_TRANSFER_HOST, Bootstrap
from hicache.engine.front.engine import Engine
from hicache.engine.sampling import SamplingParams
from tests.disagg.peers import prefill_server
from tests.disagg.test_pd_engine import FAST, assert_idle, free_port, make_engine
from tests.helpers.services import missing

pytestmark = pytest.mark.timeout(240)

BACKENDS = ["mooncake", pytest.param("nixl", marks=pytest.mark.matrix)]
PARAMS = SamplingParams(temperature=0, max_tokens=8)
ROOM_PROMPT = list(range(1000, 1060))  # 15 pages of 4: the room's
ALONE = [list(range(2000, 2100)), list(range(3000, 3100))]  # 25 pages each
"""Two prompts the decode serves alone: with the room's pages freed, the second takes some
of them (the free list is FIFO; 64 pages in all)."""


@contextmanager
def prefill_process(backend: str, port: int, slow: Any = None) -> Iterator[tuple[int, str]]:
    """A prefill instance in a child process: ``(pid, url)``; always resumed and reaped."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=prefill_server, args=(there, backend, port, slow), daemon=True)
    proc.start()
    there.close()
    try:
        if not here.poll(120):
            raise AssertionError("the prefill instance did not start within 120 s")
        url = here.recv()
        if isinstance(url, tuple):
            missing(f"the {backend} transport", url[1])
        yield proc.pid, url  # type: ignore[misc]
    finally:
        with suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        with suppress(OSError):
            here.send("stop")
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        here.close()


def fenced_pages(decode: Engine) -> int:
    return int(decode.call(lambda: decode.core.scheduler.ends.fenced_pages).result(timeout=30))


def wait_settled(decode: Engine, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while fenced_pages(decode) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fenced_pages(decode) == 0, "the fenced pages were not freed once the prefill resumed"


def alone(decode: Engine) -> list[Any]:
    """The two prompts, served by the decode alone (the router's no-transfer host)."""
    b = Bootstrap(NO_TRANSFER_HOST, 1, 0)
    return [decode.generate(p, PARAMS, 60, bootstrap=b) for p in ALONE]


def given_up(decode: Engine, d: Any) -> list[Any]:
    """The decode half ``d`` failed while the prefill is paused: its pages are fenced (out
    of use, not freed), and the decode serves the two prompts alone meanwhile."""
    assert d.error is not None and "did not answer" in d.error, d.error
    assert fenced_pages(decode) == len(ROOM_PROMPT) // 4
    return alone(decode)


def after_resume(
    decode: Engine, first: list[Any], p_half: Future[httpx.Response], want: list[list[int]]
) -> None:
    """Once the prefill resumed: it never answers 200 for the room whose decode half
    failed, the held pages are freed, and the two prompts sent again (from the decode's
    cache) equal a plain engine's, as they did the first time."""
    p = p_half.result(timeout=180)
    wait_settled(decode)
    again = alone(decode)
    assert [o.output_ids for o in first] == want
    assert [o.output_ids for o in again] == want, "a page given away was written"
    assert again[1].cached.device >= 96  # served from the decode's cache
    assert p.status_code != 200, p.text
    assert_idle(decode)


def prefill_half(url: str, port: int, room: int) -> httpx.Response:
    body = {
        "input_ids": ROOM_PROMPT,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": room,
    }
    return httpx.post(f"{url}/generate", json=body, timeout=180)


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    with make_engine("tiny-random-llama") as plain:
        return [plain.generate(p, PARAMS, timeout=60).output_ids for p in ALONE]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_registration_read_after_the_decode_gave_up_is_never_written(
    backend: str, want: list[list[int]]
) -> None:
    port = free_port()
    with (
        prefill_process(backend, port) as (pid, p_url),
        make_engine(
            "tiny-random-llama", "decode", port=port, transfer_backend=backend, **FAST
        ) as decode,
        ThreadPoolExecutor(1) as ex,
    ):
        os.kill(pid, signal.SIGSTOP)
        try:
            p_half = ex.submit(prefill_half, p_url, port, 5)  # in the paused socket
            d = decode.generate(ROOM_PROMPT, PARAMS, 60, bootstrap=Bootstrap("127.0.0.1", port, 5))
            first = given_up(decode, d)
        finally:
            os.kill(pid, signal.SIGCONT)
        after_resume(decode, first, p_half, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pause_during_a_transfer_under_way_never_writes_a_page_given_away(
    backend: str, want: list[list[int]]
) -> None:
    port = free_port()
    writing = mp.get_context("spawn").Event()
    with (
        prefill_process(backend, port, writing) as (pid, p_url),
        make_engine(
            "tiny-random-llama", "decode", port=port, transfer_backend=backend, **FAST
        ) as decode,
        ThreadPoolExecutor(2) as ex,
    ):
        b = Bootstrap("127.0.0.1", port, 6)
        d_half = ex.submit(decode.generate, ROOM_PROMPT, PARAMS, 60, bootstrap=b)
        time.sleep(0.5)  # registered
        p_half = ex.submit(prefill_half, p_url, port, 6)
        assert writing.wait(60), "the prefill instance did not start writing"
        os.kill(pid, signal.SIGSTOP)  # half of its first write has landed
        try:
            d = d_half.result(timeout=60)
            first = given_up(decode, d)
        finally:
            os.kill(pid, signal.SIGCONT)
        after_resume(decode, first, p_half, want)
