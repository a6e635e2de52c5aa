"""The ``nixl`` backend's own guarantees: NIXL's POSIX plugin moving the ``file`` backend's
records, zero-copy for ``page_first*`` pools, each file checked on its own, NIXL failures as
misses, and a clear error without NIXL. (The shared contract: test_storage_backends.py.)"""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.config import MemLayout
from hicache.keys import Namespace, PageKey, page_keys
from hicache.memory import HostPool
from hicache.spec import KVSpec
from hicache.storage import SetOutcome, StorageError, StorageOptions, create_storage
from hicache.storage.backends import nixl as nixl_mod
from hicache.storage.backends.file import PARTIAL_GRACE_S, FileStorage
from hicache.storage.backends.nixl import NixlStorage
from hicache.storage.backends.nixl_config import ENV_DIR, POSIX_IO, NixlConfig
from hicache.storage.record import HEADER_SIZE
from hicache.storage.registry import StorageConfig
from tests.helpers.storage_fixtures import require_nixl

REPO = Path(__file__).resolve().parents[2]
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")
PAGE = 4


@pytest.fixture(autouse=True)
def _nixl() -> None:
    require_nixl()


def ns(layout: MemLayout = MemLayout.PAGE_FIRST) -> Namespace:
    return Namespace.for_spec(
        SPEC, model="m", weights_fingerprint="nixl", layout=layout, page_size=PAGE
    )


def pool(seed: int, layout: MemLayout = MemLayout.PAGE_FIRST, pages: int = 8) -> HostPool:
    p = HostPool(SPEC, pages, PAGE, layout, pin_memory=False)
    g = torch.Generator().manual_seed(seed)
    p.buffer.copy_(torch.randn(p.buffer.shape, generator=g).to(p.dtype))
    return p


def keys(n: int, first: int = 0, layout: MemLayout = MemLayout.PAGE_FIRST) -> list[PageKey]:
    return page_keys(ns(layout), list(range(first, first + n * PAGE)))


def digest(p: HostPool, pages: list[int]) -> str:
    return hashlib.sha256(p.read_pages(pages).view(torch.uint8).numpy().tobytes()).hexdigest()


def storage(path: Path, layout: MemLayout = MemLayout.PAGE_FIRST, **extra: Any) -> NixlStorage:
    opts = StorageOptions(**{k: extra.pop(k) for k in list(extra) if k in StorageOptions.KEYS})
    st = create_storage(
        "nixl", namespace=ns(layout), extra_config={"file_path": str(path), **extra}, options=opts
    )
    assert isinstance(st, NixlStorage)
    return st


def test_settings_are_validated_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="posix_io='spdk' is invalid"):
        StorageConfig.parse("nixl", {"posix_io": "spdk"})
    with pytest.raises(ValueError, match="'agent_name'"):
        StorageConfig.parse("nixl", {"agent_name": "x"})
    with pytest.raises(ValueError, match="max_bytes=-1"):
        StorageConfig.parse("nixl", {"max_bytes": -1})
    cfg = StorageConfig.parse("nixl", {"file_path": str(tmp_path), "posix_io": "uring"})
    assert cfg.settings == NixlConfig(path=str(tmp_path), posix_io="uring")
    assert cfg.settings.plugin_params == {"use_uring": "true"}
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "env"))
    assert StorageConfig.parse("nixl").settings.path == str(tmp_path / "env")


@pytest.mark.parametrize("posix_io", sorted(POSIX_IO))
def test_every_io_queue_round_trips(tmp_path: Path, posix_io: str) -> None:
    src, dst = pool(1), pool(2)
    ks = keys(3, first=100)
    with storage(tmp_path, posix_io=posix_io) as st:
        assert st.batch_set(ks, src, [0, 1, 2]).all_ok
        assert st.batch_get(ks, dst, [5, 6, 7]) == [True] * 3
    assert digest(dst, [5, 6, 7]) == digest(src, [0, 1, 2])


@pytest.mark.parametrize(
    "layout", [MemLayout.PAGE_FIRST, MemLayout.PAGE_FIRST_DIRECT], ids=lambda x: x.value
)
def test_page_first_pools_move_in_place(tmp_path: Path, layout: MemLayout) -> None:
    """The pool's buffer is registered with the agent once, and records move between it
    and the files directly; the registration goes when the pool is freed."""
    src, dst = pool(1, layout), pool(2, layout)
    ks = keys(4, layout=layout)
    with storage(tmp_path, layout) as st:
        assert st.batch_set(ks, src, [0, 1, 2, 3]).all_ok
        assert st.batch_get(ks, dst, [4, 5, 6, 7]) == [True] * 4
        ranges = st.registered_ranges()
        for p in (src, dst):
            assert ranges[p.buffer.data_ptr()] == p.buffer.numel() * p.buffer.element_size()
        assert digest(dst, [4, 5, 6, 7]) == digest(src, [0, 1, 2, 3])
        ptr = src.buffer.data_ptr()
        del src
        gc.collect()
        assert ptr not in st.registered_ranges()
        assert dst.buffer.data_ptr() in st.registered_ranges()


def test_a_layer_first_pool_is_staged(tmp_path: Path) -> None:
    layout = MemLayout.LAYER_FIRST
    src, dst = pool(1, layout), pool(2, layout)
    ks = keys(3, layout=layout)
    with storage(tmp_path, layout) as st:
        assert st.batch_set(ks, src, [0, 1, 2]).all_ok
        assert st.batch_get(ks, dst, [3, 4, 5]) == [True] * 3
        pools = {src.buffer.data_ptr(), dst.buffer.data_ptr()}
        assert not pools & set(st.registered_ranges())  # only staging arenas
    assert digest(dst, [3, 4, 5]) == digest(src, [0, 1, 2])


def test_records_are_the_file_backends(tmp_path: Path) -> None:
    """Same directory, same records: each backend reads what the other wrote."""
    src, dst = pool(1), pool(2)
    ks = keys(4, first=200)
    file_st = create_storage("file", namespace=ns(), extra_config={"file_path": str(tmp_path)})
    assert isinstance(file_st, FileStorage)
    with file_st, storage(tmp_path) as st:
        assert file_st.batch_set(ks[:2], src, [0, 1]).all_ok
        written, skipped = SetOutcome.WRITTEN, SetOutcome.SKIPPED
        assert st.batch_set(ks, src, [0, 1, 2, 3]).outcomes == (skipped, skipped, written, written)
        assert st.batch_get(ks, dst, [4, 5, 6, 7]) == [True] * 4
        assert file_st.batch_get(ks, dst, [0, 1, 2, 3]) == [True] * 4
        assert st.path_of(ks[3].key) == file_st.path_of(ks[3].key)
        assert st.path_of(ks[3].key).stat().st_size == src.page_bytes + HEADER_SIZE
    assert digest(dst, [4, 5, 6, 7]) == digest(src, [0, 1, 2, 3])
    assert digest(dst, [0, 1, 2, 3]) == digest(src, [0, 1, 2, 3])


def test_a_short_record_is_a_miss_and_the_rest_of_the_batch_hits(tmp_path: Path) -> None:
    """One NIXL transfer carries the whole chunk and fails whole on a short read, so each
    file's size is checked first: a record cut short is not read (``absent`` while young,
    a record being written as for ``file``; ``corrupt`` past the grace), and the others of
    the batch still arrive."""
    src, dst = pool(1), pool(2)
    ks = keys(4, first=300)
    with storage(tmp_path) as st:
        assert st.batch_set(ks, src, [0, 1, 2, 3]).all_ok
        path = st.path_of(ks[1].key)
        path.write_bytes(path.read_bytes()[:-1])
        assert st.batch_get(ks, dst, [4, 5, 6, 7]) == [True, False, True, True]
        assert st.stats().miss("absent") == 1 and st.stats().miss("corrupt") == 0
        past = time.time() - PARTIAL_GRACE_S - 1
        os.utime(path, (past, past))
        assert st.batch_get(ks, dst, [4, 5, 6, 7]) == [True, False, True, True]
        s = st.stats()
        assert s.miss("corrupt") == 1 and s.errors == 0
        assert digest(dst, [4, 6, 7]) == digest(src, [0, 2, 3])
        assert st.batch_set(ks, src, [0, 1, 2, 3]).written == 1  # healed
        assert st.batch_get(ks, dst, [4, 5, 6, 7]) == [True] * 4
        assert st.stats().repaired == 1


def test_batches_larger_than_a_chunk(tmp_path: Path) -> None:
    src, dst = pool(1, pages=12), pool(2, pages=12)
    ks = keys(11, first=400)
    with storage(tmp_path, max_batch_pages=3) as st:
        assert st.batch_set(ks[:7], src, list(range(7))).all_ok
        assert st.batch_set(ks, src, list(range(11))).written == 4
        assert st.batch_get(ks, dst, list(range(11, 0, -1))) == [True] * 11
    assert digest(dst, list(range(11, 0, -1))) == digest(src, list(range(11)))


def test_a_failed_write_transfer_is_false_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real NIXL write failure: the temp files are opened on /dev/full, where every write
    fails with ENOSPC. The whole chunk is False, one error, no file left; then it works."""
    real_open = os.open

    def onto_full(path: Any, flags: int, *args: Any) -> int:
        if str(path).endswith(".tmp"):
            return real_open("/dev/full", os.O_WRONLY)
        return real_open(path, flags, *args)

    ks = keys(3, first=500)
    with storage(tmp_path) as st:
        monkeypatch.setattr(nixl_mod.os, "open", onto_full)
        assert st.batch_set(ks, pool(1), [0, 1, 2]).ok == [False] * 3
        s = st.stats()
        assert s.set_failed == 3 and s.errors == 1
        assert st.batch_exists(ks) == 0
        assert not [p for p in tmp_path.rglob("*") if p.is_file()]
        monkeypatch.undo()
        assert st.batch_set(ks, pool(1), [0, 1, 2]).all_ok


def test_a_failed_read_transfer_is_an_error_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real NIXL read failure (the record files opened write-only, so every read of the
    transfer fails): error misses, counted once, nothing raised; then it reads again."""
    real_open = os.open

    def write_only(path: Any, flags: int, *args: Any) -> int:
        return real_open(path, os.O_WRONLY | os.O_CLOEXEC, *args)

    src, dst = pool(1), pool(2)
    ks = keys(2, first=600)
    with storage(tmp_path) as st:
        assert st.batch_set(ks, src, [0, 1]).all_ok
        monkeypatch.setattr(nixl_mod.os, "open", write_only)
        assert st.batch_get(ks, dst, [2, 3]) == [False, False]
        s = st.stats()
        assert s.miss("error") == 2 and s.errors == 1
        monkeypatch.undo()
        assert st.batch_get(ks, dst, [2, 3]) == [True, True]
    assert digest(dst, [2, 3]) == digest(src, [0, 1])


def test_size_cap_evicts_least_recently_used(tmp_path: Path) -> None:
    rec = pool(0).page_bytes + HEADER_SIZE
    ks = keys(3, first=700)
    src = pool(1)
    with storage(tmp_path, max_bytes=2 * rec) as st:
        assert st.batch_set(ks[:2], src, [0, 1]).all_ok
        assert st.batch_get(ks[:1], pool(2), [0]) == [True]  # key 0 is now the newest
        assert st.batch_set(ks[2:], src, [2]).all_ok
        assert [st.path_of(k.key).exists() for k in ks] == [True, False, True]


def test_without_nixl_start_names_the_requirements(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['nixl._api'] = None\n"
        "from hicache.storage import StorageError, create_storage\n"
        "from tests.storage.test_storage_nixl import ns\n"
        f"st = create_storage('nixl', namespace=ns(), extra_config={{'file_path': {str(tmp_path)!r}}})\n"
        "try:\n"
        "    st.start()\n"
        "except StorageError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert "nixl backend needs NIXL" in proc.stdout, proc.stderr
    assert "pip install --no-deps -r requirements/nixl.txt" in proc.stdout, proc.stderr
    assert not list(tmp_path.iterdir())  # refused before touching the directory


def test_unusable_directory_fails_start(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(StorageError, match="cannot use directory"):
        storage(tmp_path / "f" / "sub").start()


def test_no_socket_is_opened(tmp_path: Path) -> None:
    """The agent is made without NIXL's listener thread and with the POSIX plugin alone:
    nothing listens (docs/security.md)."""
    from hicache.storage.backends.mooncake_net import tcp_listeners

    before = set(tcp_listeners())
    with storage(tmp_path) as st:
        assert st.batch_set(keys(1, first=800), pool(1), [0]).all_ok
        assert set(tcp_listeners()) <= before
