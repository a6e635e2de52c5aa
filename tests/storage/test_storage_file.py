"""The ``file`` backend's own guarantees: damage on disk, full disk, restart, cap, records
being written. Writers in other processes (paused, killed, racing): ``test_storage_file_writers``."""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.config import MemLayout
from hicache.keys import Namespace, PageKey, page_keys
from hicache.memory import HostPool
from hicache.spec import KVSpec
from hicache.storage import StorageError, StorageOptions, create_storage
from hicache.storage.backends import file as file_mod
from hicache.storage.backends.file import FileStorage
from hicache.storage.record import HEADER_SIZE
from hicache.storage.stats import SetOutcome

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
PAGE = 4
NS = Namespace.for_spec(
    SPEC, model="m", weights_fingerprint="w", layout="page_first", page_size=PAGE
)


def pool(seed: int = 0) -> HostPool:
    p = HostPool(SPEC, 8, PAGE, MemLayout.PAGE_FIRST, pin_memory=False)
    p.buffer.copy_(
        torch.randn(p.buffer.shape, generator=torch.Generator().manual_seed(seed)).to(p.dtype)
    )
    return p


def keys(n: int, first: int = 0, ns: Namespace = NS) -> list[PageKey]:
    return page_keys(ns, list(range(first, first + n * PAGE)))


def storage(path: Path, **extra: Any) -> FileStorage:
    st = create_storage("file", namespace=NS, extra_config={"file_path": str(path), **extra})
    assert isinstance(st, FileStorage)
    st.start()
    return st


def test_directory_created_private_and_env_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "a" / "b"
    with storage(target):
        assert stat.S_IMODE(target.stat().st_mode) == 0o700
    monkeypatch.setenv(file_mod.ENV_DIR, str(tmp_path / "env"))
    st = create_storage("file", namespace=NS)
    assert isinstance(st, FileStorage) and st.root == tmp_path / "env"
    monkeypatch.delenv(file_mod.ENV_DIR)
    st = create_storage("file", namespace=NS)
    assert isinstance(st, FileStorage) and str(st.root) == file_mod.DEFAULT_DIR


def test_restart_hits(tmp_path: Path) -> None:
    src, dst = pool(1), pool(2)
    ks = keys(3)
    with storage(tmp_path) as st:
        assert st.batch_set(ks, src, [0, 1, 2]).ok == [True] * 3
    with storage(tmp_path) as st2:
        assert st2.batch_exists(ks) == 3
        assert st2.batch_get(ks, dst, [3, 4, 5]) == [True] * 3
    assert torch.equal(
        src.read_pages([0, 1, 2]).view(torch.int16), dst.read_pages([3, 4, 5]).view(torch.int16)
    )


@pytest.mark.parametrize("offset", [0, 10, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 77, -1])
def test_flipped_byte_on_disk_is_corrupt(
    tmp_path: Path, offset: int, caplog: pytest.LogCaptureFixture
) -> None:
    ks = keys(2)
    with storage(tmp_path) as st:
        st.batch_set(ks, pool(1), [0, 1])
        path = st.path_of(ks[0].key)
        raw = bytearray(path.read_bytes())
        raw[offset] ^= 0x10
        path.write_bytes(raw)
        with caplog.at_level(logging.WARNING, logger="hicache.storage"):
            assert st.batch_get(ks, pool(2), [0, 1]) == [False, True]
        assert st.stats().miss("corrupt") == 1
        assert "1 corrupt" in caplog.text and ks[0].key in caplog.text


def age(path: Path, seconds: float) -> None:
    """Set ``path``'s modification time ``seconds`` in the past (its last write then)."""
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_short_record_is_being_written_then_corrupt_and_healed(tmp_path: Path) -> None:
    """A file shorter than its record is one being written while its last write is young:
    a miss ``absent`` that marks nothing (the write of the key skips it: its writer is
    finishing it). Past ``PARTIAL_GRACE_S`` its writer is taken for dead: ``corrupt``, and
    the next write of the key replaces it."""
    ks, src, dst = keys(1), pool(1), pool(2)
    with storage(tmp_path) as st:
        st.batch_set(ks, src, [0])
        path = st.path_of(ks[0].key)
        whole = path.read_bytes()
        path.write_bytes(whole[:-5])
        assert st.batch_get(ks, dst, [0]) == [False]
        assert st.stats().miss("absent") == 1 and st.stats().miss("corrupt") == 0
        assert st.batch_set(ks, src, [0]).outcomes == (SetOutcome.SKIPPED,)
        age(path, file_mod.PARTIAL_GRACE_S + 1)
        assert st.batch_get(ks, dst, [0]) == [False]
        assert st.stats().miss("corrupt") == 1
        assert st.batch_set(ks, src, [0]).outcomes == (SetOutcome.WRITTEN,)
        assert st.stats().repaired == 1 and path.read_bytes() == whole
        assert st.batch_get(ks, dst, [1]) == [True]
        assert torch.equal(src.read_pages([0]), dst.read_pages([1]))


def test_a_record_being_created_is_not_yet_present(tmp_path: Path) -> None:
    """A put creates the record file (``O_EXCL``), computes its checksum, then writes it in
    one ``writev``: the empty file in between is not counted present, or a lookup polling
    while pages land counts a page its read then misses."""
    ks, src = keys(3), pool(1)
    with storage(tmp_path) as st:
        st.batch_set(ks, src, [0, 1, 2])
        assert st.batch_exists(ks) == 3
        path = st.path_of(ks[1].key)
        whole = path.read_bytes()
        path.write_bytes(b"")  # created, not yet written
        assert st.batch_exists(ks) == 1
        path.write_bytes(whole)
        assert st.batch_exists(ks) == 3


def test_record_with_a_trailing_byte_is_corrupt(tmp_path: Path) -> None:
    """A read asks for one byte past the record (no fstat): a longer file shows."""
    ks = keys(1)
    with storage(tmp_path) as st:
        st.batch_set(ks, pool(1), [0])
        path = st.path_of(ks[0].key)
        path.write_bytes(path.read_bytes() + b"\0")
        assert st.batch_get(ks, pool(2), [0]) == [False]
        assert st.stats().miss("corrupt") == 1


def test_record_of_another_namespace_is_foreign(tmp_path: Path) -> None:
    other_ns = NS.with_salt("tenant-b")
    ks, other_keys = keys(1), keys(1, ns=other_ns)
    with (
        storage(tmp_path) as st,
        create_storage(
            "file", namespace=other_ns, extra_config={"file_path": str(tmp_path)}
        ) as other,
    ):
        assert isinstance(other, FileStorage)
        other.batch_set(other_keys, pool(1), [0])
        # Plant the other tenant's record under this namespace's key.
        st.path_of(ks[0].key).parent.mkdir(exist_ok=True)
        os.replace(other.path_of(other_keys[0].key), st.path_of(ks[0].key))
        assert st.batch_get(ks, pool(2), [0]) == [False]
        assert st.stats().miss("foreign") == 1


def test_full_disk_is_false_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real_writev = os.writev

    def full(fd: int, bufs: Any) -> int:
        calls["n"] += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    ks = keys(4)
    with storage(tmp_path) as st:
        monkeypatch.setattr(file_mod.os, "writev", full)
        assert st.batch_set(ks, pool(1), [0, 1, 2, 3]).ok == [False] * 4
        assert calls["n"] == 1  # the rest of the batch is not attempted
        s = st.stats()
        assert s.set_failed == 4 and s.errors == 1
        assert not list(tmp_path.rglob("*.tmp"))  # no temp file left behind
        assert st.batch_exists(ks) == 0
        monkeypatch.setattr(file_mod.os, "writev", real_writev)
        assert st.batch_set(ks, pool(1), [0, 1, 2, 3]).ok == [True] * 4


def test_heal_that_fails_before_its_rename_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A heal (the only write that replaces a file) goes through a temp file and a rename:
    one that fails before the rename leaves the bad record as it was and no temp file; the
    key stays marked and the next write heals it."""

    def crash(src: Any, dst: Any) -> None:
        raise OSError(errno.EIO, "simulated crash")

    ks, src = keys(1), pool(1)
    with storage(tmp_path) as st:
        st.batch_set(ks, src, [0])
        path = st.path_of(ks[0].key)
        bad = bytearray(path.read_bytes())
        bad[-1] ^= 0xFF
        path.write_bytes(bad)
        assert st.batch_get(ks, pool(2), [0]) == [False]
        monkeypatch.setattr(file_mod.os, "replace", crash)
        assert st.batch_set(ks, src, [0]).ok == [False]
        monkeypatch.undo()
        assert path.read_bytes() == bad and not list(tmp_path.rglob("*.tmp"))
        assert st.batch_set(ks, src, [0]).outcomes == (SetOutcome.WRITTEN,)
        assert st.batch_get(ks, pool(2), [0]) == [True]


def test_fsync_writes_create_and_heal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``fsync`` a create syncs its file and its folder, and so does a heal."""
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    ks, src, dst = keys(2), pool(1), pool(2)
    with storage(tmp_path, fsync=True) as st:
        monkeypatch.setattr(file_mod.os, "fsync", spy)
        assert st.batch_set(ks, src, [0, 1]).outcomes == (SetOutcome.WRITTEN,) * 2
        assert synced == ["file", "dir"] * 2
        path = st.path_of(ks[1].key)
        bad = bytearray(path.read_bytes())
        bad[-1] ^= 0xFF
        path.write_bytes(bad)
        assert st.batch_get(ks, dst, [0, 1]) == [True, False]
        synced.clear()
        assert st.batch_set(ks, src, [0, 1]).outcomes == (SetOutcome.SKIPPED, SetOutcome.WRITTEN)
        assert synced == ["file", "dir"]
        assert st.batch_get(ks, dst, [2, 3]) == [True, True]
        assert torch.equal(src.read_pages([0, 1]), dst.read_pages([2, 3]))


def test_stale_temp_files_removed_at_start(tmp_path: Path) -> None:
    """Temp files (of heals) and record files shorter than a header (a writer that died
    between its create and its write) are removed at start once stale; fresh ones stay."""
    sub = tmp_path / "ab"
    sub.mkdir(parents=True)
    old, new = sub / ".hc1-ab.1.2.tmp", sub / ".hc1-ab.3.4.tmp"
    empty, stub, fresh = sub / "hc3-ab01", sub / "hc3-ab02", sub / "hc3-ab03"
    old.write_bytes(b"x")
    new.write_bytes(b"y")
    empty.write_bytes(b"")
    stub.write_bytes(b"h" * HEADER_SIZE)  # a header's worth: left for a read to judge
    fresh.write_bytes(b"")
    for p in (old, empty, stub):
        age(p, file_mod.STALE_TMP_S + 10)
    with storage(tmp_path):
        assert [p.exists() for p in (old, new, empty, stub, fresh)] == [
            False,
            True,
            False,
            True,
            True,
        ]


def test_size_cap_evicts_least_recently_used(tmp_path: Path) -> None:
    rec = pool().page_bytes + HEADER_SIZE
    ks = keys(5)
    src = pool(1)
    with storage(tmp_path, max_bytes=3 * rec) as st:
        assert st.batch_set(ks[:3], src, [0, 1, 2]).ok == [True] * 3
        assert st.batch_get(ks[:1], pool(2), [0]) == [True]  # key 0 is now most recent
        assert st.batch_set(ks[3:4], src, [3]).ok == [True]  # evicts key 1
        present = [st.path_of(k.key).exists() for k in ks[:4]]
        assert present == [True, False, True, True]
    # A restart with a smaller cap trims the oldest records at start.
    os.utime(st.path_of(ks[2].key), (1, 1))
    with storage(tmp_path, max_bytes=2 * rec) as st2:
        present = [st2.path_of(k.key).exists() for k in ks[:4]]
        assert present == [True, False, False, True]


def test_expired_deadline_is_timeout(tmp_path: Path) -> None:
    ks = keys(3)
    with storage(tmp_path) as st:
        st.batch_set(ks, pool(1), [0, 1, 2])
    st = create_storage(
        "file",
        namespace=NS,
        extra_config={"file_path": str(tmp_path)},
        options=StorageOptions(timeout_s=1e-9),
    )
    with st:
        assert st.batch_get(ks, pool(2), [0, 1, 2]) == [False] * 3
        s = st.stats()
        assert s.miss("timeout") == 3 and s.timeouts == 1


def test_unusable_directory_fails_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    st = create_storage("file", namespace=NS, extra_config={"file_path": str(blocker / "sub")})
    with pytest.raises(StorageError, match="cannot use directory"):
        st.start()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        create_storage("file", namespace=NS, extra_config={"file_path": "/tmp/x", "max_bytes": -1})
    with pytest.raises(
        ValueError, match="'file_pth' \\(value '/tmp/x'\\) is unknown; accepted: backend keys"
    ):
        create_storage("file", namespace=NS, extra_config={"file_pth": "/tmp/x"})
