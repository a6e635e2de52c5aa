"""The ``file`` backend with writers in other processes: paused (SIGSTOP) in the middle of a
record, killed there, or racing on the same keys. Records are created in place, so a
reader can meet one half written: it must read a miss that marks nothing while the writer
lives, heal it once the writer is taken for dead, and never use a byte of it.

A writer is this module run as a script (:func:`writer_main`): a real ``FileStorage`` in
its own process. Asked to stop at its ``k``-th record, it lets the kernel take the first
half of that record (a partial ``writev``, which the backend must and does continue), then
stops itself; the test resumes or kills it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from hicache.config import MemLayout
from hicache.keys import Namespace, PageKey, page_keys
from hicache.memory import HostPool
from hicache.spec import KVSpec
from hicache.storage import create_storage
from hicache.storage.backends import file as file_mod
from hicache.storage.backends.file import FileStorage
from hicache.storage.record import HEADER_SIZE
from hicache.storage.stats import SetOutcome

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
PAGE = 4
PAGES = 8
NS = Namespace.for_spec(
    SPEC, model="m", weights_fingerprint="w", layout="page_first", page_size=PAGE
)
REPO = Path(__file__).resolve().parents[2]
WRITTEN, SKIPPED = SetOutcome.WRITTEN, SetOutcome.SKIPPED


def pool(seed: int) -> HostPool:
    p = HostPool(SPEC, PAGES, PAGE, MemLayout.PAGE_FIRST, pin_memory=False)
    p.buffer.copy_(
        torch.randn(p.buffer.shape, generator=torch.Generator().manual_seed(seed)).to(p.dtype)
    )
    return p


def keys(n: int = PAGES) -> list[PageKey]:
    return page_keys(NS, list(range(n * PAGE)))


def storage(root: Path) -> FileStorage:
    st = create_storage("file", namespace=NS, extra_config={"file_path": str(root)})
    assert isinstance(st, FileStorage)
    st.start()
    return st


def writer_main() -> None:
    """``writer ROOT SEED STOP_AT RECORDS``: print ``ready``, wait for a line on stdin,
    write ``RECORDS`` records under :func:`keys`, record ``i`` holding ``pool(SEED)``'s
    page ``i % PAGES`` (stopping itself halfway through record ``STOP_AT`` unless it is
    -1), print the outcomes as one JSON line."""
    root, seed, stop_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    n = int(sys.argv[4])
    real_writev = os.writev
    calls = {"n": 0}

    def half_then_stop(fd: int, bufs: Any) -> int:
        calls["n"] += 1
        if calls["n"] - 1 != stop_at:
            return real_writev(fd, bufs)
        head, first = bufs[0], memoryview(bufs[1])
        n = real_writev(fd, [head, first[: first.nbytes // 2]])
        os.kill(os.getpid(), signal.SIGSTOP)
        return n  # a partial write: the backend writes the rest

    os.writev = half_then_stop
    src = pool(seed)
    with storage(root) as st:
        print("ready", flush=True)
        sys.stdin.readline()
        result = st.batch_set(keys(n), src, [i % PAGES for i in range(n)])
    print(json.dumps([o.value for o in result.outcomes]), flush=True)


@contextmanager
def writer(
    root: Path, seed: int, stop_at: int = -1, records: int = PAGES
) -> Iterator[subprocess.Popen[str]]:
    """A writer process (see :func:`writer_main`), resumed and reaped on the way out."""
    code = "from tests.storage.test_storage_file_writers import writer_main; writer_main()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(root), str(seed), str(stop_at), str(records)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=30)


def ready(proc: subprocess.Popen[str]) -> None:
    """Wait until ``proc`` has its backend open and waits for :func:`go`."""
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"


def go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def wait_stopped(proc: subprocess.Popen[str]) -> None:
    """Block until ``proc`` has stopped itself (fails if it exited instead)."""
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"writer ended instead of stopping (status {status})"


def outcomes(proc: subprocess.Popen[str]) -> list[SetOutcome]:
    """Resume ``proc`` and return its batch's outcomes."""
    proc.send_signal(signal.SIGCONT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return [SetOutcome(v) for v in json.loads(out.splitlines()[-1])]


def page_bytes(p: HostPool, page: int) -> bytes:
    return p.read_pages([page]).view(torch.uint8).numpy().tobytes()


def read_all(st: FileStorage) -> tuple[list[bool], HostPool]:
    dst = pool(99)
    return st.batch_get(keys(), dst, list(range(PAGES))), dst


def test_a_paused_writers_record_is_a_miss_until_it_resumes(tmp_path: Path) -> None:
    """Writer A stops halfway through record 3. A reader meets a short young file: a miss
    ``absent`` that marks nothing, and its own write of those pages skips record 3 (A is
    writing it) and the keys A wrote. Resumed, A completes record 3: every record reads
    back as A's bytes."""
    a_src, mine = pool(1), pool(2)
    with writer(tmp_path, seed=1, stop_at=3) as a, storage(tmp_path) as st:
        ready(a)
        go(a)
        wait_stopped(a)
        path = st.path_of(keys()[3].key)
        assert HEADER_SIZE < path.stat().st_size < HEADER_SIZE + a_src.page_bytes
        got, _ = read_all(st)
        assert got == [True] * 3 + [False] * 5
        assert st.stats().miss("absent") == 5 and st.stats().miss("corrupt") == 0
        mine_out = st.batch_set(keys(), mine, list(range(PAGES))).outcomes
        assert mine_out == (SKIPPED,) * 4 + (WRITTEN,) * 4
        assert outcomes(a) == [WRITTEN] * 4 + [SKIPPED] * 4
        got, dst = read_all(st)
        assert got == [True] * PAGES
        for i in range(PAGES):
            assert page_bytes(dst, i) == page_bytes(a_src if i < 4 else mine, i)
        assert st.stats().repaired == 0


def test_a_writer_paused_past_the_grace_is_healed_over_harmlessly(tmp_path: Path) -> None:
    """Writer A stops halfway through record 3 for longer than ``PARTIAL_GRACE_S`` (its
    last write made that old). A reader reads it ``corrupt`` and its next write replaces
    it (a rename over it). Resumed, A finishes its record in the file it holds, now out of
    the folder: the reader's record stays, whole; A's other records are untouched."""
    a_src, mine = pool(1), pool(2)
    with writer(tmp_path, seed=1, stop_at=3) as a, storage(tmp_path) as st:
        ready(a)
        go(a)
        wait_stopped(a)
        path = st.path_of(keys()[3].key)
        past = time.time() - file_mod.PARTIAL_GRACE_S - 1
        os.utime(path, (past, past))
        got, _ = read_all(st)
        assert got[:4] == [True, True, True, False]
        assert st.stats().miss("corrupt") == 1
        assert st.batch_set(keys(4), mine, list(range(4))).outcomes == (SKIPPED,) * 3 + (WRITTEN,)
        assert st.stats().repaired == 1
        assert outcomes(a) == [WRITTEN] * PAGES  # A never saw the heal
        got, dst = read_all(st)
        assert got == [True] * PAGES
        for i in range(PAGES):
            assert page_bytes(dst, i) == page_bytes(mine if i == 3 else a_src, i)
        assert not list(tmp_path.rglob("*.tmp"))


def test_a_killed_writers_half_record_is_a_miss_then_healed(tmp_path: Path) -> None:
    """Writer A is killed halfway through record 2: its half record stays at the key's
    path. Young, it is a miss that marks nothing; once past the grace, ``corrupt``, and the
    next write of the key heals it; every byte read back is a whole record's."""
    a_src, mine = pool(1), pool(2)
    with writer(tmp_path, seed=1, stop_at=2) as a:
        ready(a)
        go(a)
        wait_stopped(a)
        a.kill()
        a.wait(timeout=30)
    with storage(tmp_path) as st:
        path = st.path_of(keys()[2].key)
        assert HEADER_SIZE < path.stat().st_size < HEADER_SIZE + a_src.page_bytes
        got, _ = read_all(st)
        assert got == [True, True] + [False] * 6
        assert st.stats().miss("corrupt") == 0
        past = time.time() - file_mod.PARTIAL_GRACE_S - 1
        os.utime(path, (past, past))
        got, _ = read_all(st)
        assert got[:3] == [True, True, False] and st.stats().miss("corrupt") == 1
        assert (
            st.batch_set(keys(), mine, list(range(PAGES))).outcomes
            == (SKIPPED,) * 2 + (WRITTEN,) * 6
        )
        assert st.stats().repaired == 1
        got, dst = read_all(st)
        assert got == [True] * PAGES
        for i in range(PAGES):
            assert page_bytes(dst, i) == page_bytes(a_src if i < 2 else mine, i)


def test_two_writers_of_the_same_keys_write_each_record_once(tmp_path: Path) -> None:
    """Two processes released together write the same 512 keys (different bytes, to tell
    them apart): every key is written by exactly one of them, the other skips it, and
    each record reads back whole, as the bytes of the one that wrote it. (Which writer
    gets which keys is the scheduler's: often one process takes them all.)"""
    n = 512
    srcs = {1: pool(1), 2: pool(2)}
    with writer(tmp_path, seed=1, records=n) as a, writer(tmp_path, seed=2, records=n) as b:
        ready(a)
        ready(b)
        go(a)
        go(b)
        outs = {1: outcomes(a), 2: outcomes(b)}
    for i in range(n):
        assert sorted(o.value for o in (outs[1][i], outs[2][i])) == ["skipped", "written"]
    with storage(tmp_path) as st:
        ks = keys(n)
        for lo in range(0, n, PAGES):
            dst = pool(99)
            assert st.batch_get(ks[lo : lo + PAGES], dst, list(range(PAGES))) == [True] * PAGES
            for j in range(PAGES):
                who = 1 if outs[1][lo + j] is WRITTEN else 2
                assert page_bytes(dst, j) == page_bytes(srcs[who], j)
        assert not list(tmp_path.rglob("*.tmp"))
