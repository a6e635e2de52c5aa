"""The ``aibrix`` backend beyond the shared contract (tests/storage/test_storage_backends.py):
its settings, its stores on disk, and what two processes see of one store.

SHFS is a shared directory: a second process reads what the first wrote, and a flipped
byte in a record's file is a miss. ROCKSDB is one database that RocksDB lets one process
open at a time: a second process is refused with a StorageError while the first holds it,
and reads the records once the first has closed it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hicache.config import MemLayout
from hicache.keys import Namespace, PageKey, page_keys
from hicache.memory import HostPool
from hicache.spec import KVSpec
from hicache.storage import HiCacheStorage, StorageConfig, create_storage
from hicache.storage.backends.aibrix_client import (
    block_bytes_for,
    open_manager,
    root_listing_version,
)
from hicache.storage.backends.aibrix_config import AibrixConfig
from hicache.storage.base import StorageError
from hicache.storage.record import HEADER_SIZE
from tests.helpers.storage_fixtures import require_aibrix

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16")
PAGE = 2
LAYOUT = MemLayout.PAGE_FIRST
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _aibrix() -> None:
    require_aibrix()


def namespace() -> Namespace:
    return Namespace.for_spec(
        SPEC, model="tiny", weights_fingerprint="aibrix-test", layout=LAYOUT, page_size=PAGE
    )


def pool(seed: int) -> HostPool:
    p = HostPool(SPEC, 4, PAGE, LAYOUT, pin_memory=False)
    g = torch.Generator().manual_seed(seed)
    p.buffer.copy_(torch.randn(p.buffer.shape, generator=g).to(p.dtype))
    return p


def keys(n: int, seed: int) -> list[PageKey]:
    return page_keys(namespace(), [seed * 1000 + i for i in range(n * PAGE)])


def digest(p: HostPool, pages: list[int]) -> str:
    return hashlib.sha256(p.read_pages(pages).view(torch.uint8).numpy().tobytes()).hexdigest()


def store(connector: str, root: Path, **extra: object) -> HiCacheStorage:
    return create_storage(
        "aibrix",
        namespace=namespace(),
        extra_config={"connector": connector, "root": str(root), **extra},
    )


CHILD = """
import json, sys
from tests.storage.test_storage_aibrix import digest, keys, pool, store
from hicache.storage.base import StorageError
connector, root, op = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    st = store(connector, root)
    st.start()
except StorageError as e:
    print(json.dumps({"refused": str(e)}))
    sys.exit(0)
with st:
    if op == "write":
        out = {"set": st.batch_set(keys(3, seed=2), pool(2), [0, 1, 2]).ok}
    else:
        ks, dst = keys(3, seed=1), pool(9)
        out = {"exists": st.batch_exists(ks), "got": st.batch_get(ks, dst, [0, 1, 2]),
               "digest": digest(dst, [0, 1, 2])}
print(json.dumps(out), flush=True)
from hicache.lifecycle import skip_final_collection
skip_final_collection()
"""


def child(connector: str, root: Path, op: str) -> dict[str, object]:
    """Run ``op`` (``write`` seed-2 pages, or ``read`` seed-1 pages) in a new process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, connector, str(root), op],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# -- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"connector": "S3"}, r"connector='S3' is invalid; choose one of \['SHFS', 'ROCKSDB'\]"),
        ({"connector": 3}, "connector=3 is invalid"),
        ({"root": 5}, "root=5 is invalid"),
        ({"aibrix_namespace": "a/b"}, "aibrix_namespace='a/b' is invalid"),
        ({"aibrix_namespace": ""}, "aibrix_namespace='' is invalid"),
        ({"rocksdb_ttl_s": -1}, "rocksdb_ttl_s=-1 is invalid"),
        ({"rocksdb_ttl_s": True}, "rocksdb_ttl_s=True is invalid"),
        ({"op_batch": 0}, "op_batch=0 is invalid; must be an int >= 1"),
        ({"async_workers": 1.5}, "async_workers=1.5 is invalid"),
        ({"bucket": "x"}, "key 'bucket' \\(value 'x'\\) is unknown; accepted: backend keys"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(extra: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named) as info:
        StorageConfig.parse("aibrix", extra)
    assert str(info.value).startswith("aibrix backend")


def test_settings_become_aibrix_environment(tmp_path: Path) -> None:
    cfg = StorageConfig.parse(
        "aibrix",
        {"connector": "rocksdb", "root": str(tmp_path), "rocksdb_ttl_s": 0, "timeout_s": 2.5},
    )
    assert cfg.settings == AibrixConfig(connector="ROCKSDB", root=str(tmp_path), rocksdb_ttl_s=0)
    env = cfg.settings.environment(block_bytes=130, timeout_s=cfg.options.timeout_s)
    assert env["AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND"] == "ROCKSDB"
    assert env["AIBRIX_KV_CACHE_OL_ROCKSDB_ROOT"] == str(tmp_path)
    assert env["AIBRIX_KV_CACHE_OL_ROCKSDB_TTL_S"] == "0"
    assert env["AIBRIX_KV_CACHE_OL_L2_CACHE_NAMESPACE"] == "hicache-r130"
    assert env["AIBRIX_KV_CACHE_OL_L1_CACHE_ENABLED"] == "0"
    assert env["AIBRIX_KV_CACHE_OL_L2_CACHE_PER_TOKEN_TIMEOUT_MS"] == "2500"
    assert env["AIBRIX_KV_CACHE_OL_L2_CACHE_INGESTION_MAX_INFLIGHT_TOKENS"] == "0"


def test_the_environment_is_put_back_after_opening(tmp_path: Path) -> None:
    os.environ["AIBRIX_KV_CACHE_OL_SHFS_ROOT"] = "/elsewhere"
    try:
        with store("SHFS", tmp_path) as st:
            assert st.batch_set(keys(1, seed=3), pool(3), [0]).all_ok
            assert os.environ["AIBRIX_KV_CACHE_OL_SHFS_ROOT"] == "/elsewhere"
            assert "AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND" not in os.environ
    finally:
        del os.environ["AIBRIX_KV_CACHE_OL_SHFS_ROOT"]
    assert not Path("/elsewhere").exists()


def test_the_probed_lookup_counts_the_leading_present_run(tmp_path: Path) -> None:
    """A put's lookup asks for the first key alone, then the rest only if it is present:
    the same leading run as one lookup, for every pattern of present keys (op_batch 2, so
    the rest spans AIBrix's batches)."""
    config = AibrixConfig.from_extra({"connector": "rocksdb", "root": str(tmp_path), "op_batch": 2})
    m = open_manager(config, 64, timeout_s=5.0, concurrency=16)
    try:
        n = [f"probe-{i}" for i in range(7)]
        stored = [n[0], n[1], n[2], n[4], n[6]]
        assert m.put_from(stored, [bytes([i]) * 64 for i in range(len(stored))]) == 5
        cases = [
            ([], 0),
            ([n[0]], 1),
            ([n[3]], 0),
            (n[:4], 3),
            ([n[4], n[2], n[3], n[6]], 2),
            ([n[3], n[0], n[1], n[2]], 0),  # the first absent: none, however many follow
            (stored, 5),
        ]
        for ks, want in cases:
            assert (m.exists_probed(ks), m.exists(ks)) == (want, want), ks
    finally:
        m.close()


# -- on disk ------------------------------------------------------------------------------------


def record_file(root: Path, key: PageKey) -> Path:
    """The SHFS file of ``key``'s record (AIBrix names it by the key bytes' hex)."""
    name = key.key.encode().hex()
    (found,) = root.glob(f"hicache-r*_*/{name[:2]}/{name[2:4]}/{name}")
    return found


def test_shfs_records_are_files_of_one_block_and_a_flipped_byte_is_a_miss(
    tmp_path: Path,
) -> None:
    src, dst = pool(1), pool(2)
    ks = keys(2, seed=4)
    with store("SHFS", tmp_path) as st:
        assert st.batch_set(ks, src, [0, 1]).all_ok
        path = record_file(tmp_path, ks[1])
        record_len = HEADER_SIZE + src.page_bytes
        assert path.stat().st_size == block_bytes_for(record_len)
        assert path.parent.parent.parent.name.startswith(f"hicache-r{block_bytes_for(record_len)}_")
        data = bytearray(path.read_bytes())
        data[HEADER_SIZE + 5] ^= 0x01  # one bit of the payload
        path.write_bytes(bytes(data))
        untouched = digest(dst, [3])
        before = st.stats()
        assert st.batch_get(ks, dst, [2, 3]) == [True, False]
        assert digest(dst, [3]) == untouched  # a bad record never reaches the pool
        assert st.stats().misses["corrupt"] - before.misses["corrupt"] == 1
        assert digest(dst, [2]) == digest(src, [0])


def test_a_record_cut_short_is_a_miss(tmp_path: Path) -> None:
    src, dst = pool(1), pool(2)
    ks = keys(1, seed=5)
    with store("SHFS", tmp_path) as st:
        assert st.batch_set(ks, src, [0]).all_ok
        path = record_file(tmp_path, ks[0])
        path.write_bytes(path.read_bytes()[:10])
        assert st.batch_get(ks, dst, [1]) == [False]
        # AIBrix's SHFS refuses a file of the wrong size, and its L2 cache reports a batch
        # with no block read as NOT_FOUND: the miss is counted as absent
        assert st.stats().misses["absent"] == 1


# -- two instances, two processes -----------------------------------------------------------


def test_two_processes_share_an_shfs_directory(tmp_path: Path) -> None:
    src = pool(1)
    with store("SHFS", tmp_path) as st:
        assert st.batch_set(keys(3, seed=1), src, [0, 1, 2]).all_ok
        # another process, which has opened nothing yet, finds the store and reads it
        seen = child("SHFS", tmp_path, "read")
        assert seen == {"exists": 3, "got": [True] * 3, "digest": digest(src, [0, 1, 2])}
        # and what it writes, this one reads
        assert child("SHFS", tmp_path, "write") == {"set": [True] * 3}
        dst = pool(8)
        assert st.batch_get(keys(3, seed=2), dst, [0, 1, 2]) == [True] * 3
        assert digest(dst, [0, 1, 2]) == digest(pool(2), [0, 1, 2])


def test_rocksdb_is_one_process_at_a_time_and_outlives_it(tmp_path: Path) -> None:
    src = pool(1)
    with store("ROCKSDB", tmp_path) as st:
        assert st.batch_set(keys(3, seed=1), src, [0, 1, 2]).all_ok
        refused = child("ROCKSDB", tmp_path, "read")
        assert "cannot open the ROCKSDB store" in str(refused["refused"])
    # closed: the next process opens the database and reads every page
    seen = child("ROCKSDB", tmp_path, "read")
    assert seen == {"exists": 3, "got": [True] * 3, "digest": digest(src, [0, 1, 2])}


def test_instances_of_one_process_share_one_manager(tmp_path: Path) -> None:
    """Two instances on one RocksDB store (RocksDB's lock would refuse a second open); the
    store closes with the last of them and opens again."""
    src, dst = pool(1), pool(2)
    ks = keys(2, seed=6)
    a, b = store("ROCKSDB", tmp_path), store("ROCKSDB", tmp_path)
    with a, b:
        assert a.batch_set(ks, src, [0, 1]).all_ok
        assert b.batch_get(ks, dst, [2, 3]) == [True, True]
        a.close()
        assert b.batch_exists(ks) == 2
    with store("ROCKSDB", tmp_path) as c:
        assert c.batch_get(ks, dst, [0, 1]) == [True, True]
    assert digest(dst, [0, 1]) == digest(src, [0, 1])


def test_one_store_opened_with_other_settings_is_refused(tmp_path: Path) -> None:
    with store("ROCKSDB", tmp_path) as a:
        assert a.batch_set(keys(1, seed=7), pool(1), [0]).all_ok
        with pytest.raises(StorageError, match="open in this process with other settings"):
            store("ROCKSDB", tmp_path, op_batch=4).start()


def test_a_stalled_store_costs_the_deadline_and_gives_misses(tmp_path: Path) -> None:
    """AIBrix's calls block; one that stalls (here: its acquire held for 1.5 s, a slow
    disk) ends the batch at hicache's deadline with timeout misses, and the late call's
    page writes are reported unsettled until it returns."""
    src, dst = pool(1), pool(2)
    ks = keys(2, seed=8)
    with store("SHFS", tmp_path, timeout_s=0.3) as st:
        assert st.batch_set(ks, src, [0, 1]).all_ok
        (manager,) = st._managers.values()  # type: ignore[attr-defined]
        aibrix = manager._shared.manager
        real = aibrix.acquire
        release = threading.Event()

        def stalled(*args: object, **kwargs: object) -> object:
            release.wait(1.5)
            return real(*args, **kwargs)

        aibrix.acquire = stalled
        try:
            t = time.monotonic()
            assert st.batch_get(ks, dst, [2, 3]) == [False, False]
            assert time.monotonic() - t < 1.0
            assert st.stats().misses["timeout"] == 2
            assert not st.host_writes_settled(0)
            release.set()
            assert st.host_writes_settled(5.0)
        finally:
            aibrix.acquire = real
        assert st.batch_get(ks, dst, [2, 3]) == [True, True]
        assert digest(dst, [2, 3]) == digest(src, [0, 1])


def test_a_store_that_appears_after_start_is_found(tmp_path: Path) -> None:
    """Stores are per record size; a reader started before any was written finds the one a
    writer makes later (a lookup that hits nothing looks under ``root`` again)."""
    src, dst = pool(1), pool(2)
    ks = keys(2, seed=9)
    with store("SHFS", tmp_path) as reader:
        assert reader.batch_exists(ks) == 0
        with store("SHFS", tmp_path) as writer:
            assert writer.batch_set(ks, src, [0, 1]).all_ok
        assert reader.batch_exists(ks) == 2
        assert reader.batch_get(ks, dst, [2, 3]) == [True, True]
    assert digest(dst, [2, 3]) == digest(src, [0, 1])


def test_a_new_root_is_private(tmp_path: Path) -> None:
    root = tmp_path / "new" / "kv"
    with store("SHFS", root) as st:
        assert st.batch_set(keys(1, seed=10), pool(1), [0]).all_ok
    assert root.stat().st_mode & 0o777 == 0o700


def test_without_the_package_start_names_the_requirements(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['aibrix_kvcache'] = None\n"
        "from tests.storage.test_storage_aibrix import store\n"
        "from hicache.storage.base import StorageError\n"
        "try:\n"
        f"    store('SHFS', {str(tmp_path)!r}).start()\n"
        "except StorageError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert "pip install --no-deps -r requirements/aibrix.txt" in proc.stdout, proc.stderr


def test_the_root_listing_is_trusted_only_once_its_timestamp_settled(tmp_path: Path) -> None:
    """A lookup that misses lists ``root`` again only when its version changed; a root
    changed within the settling time (a coarse timestamp could hide a second change) has
    no version, so it is always listed again; a missing root has none either."""
    cfg = AibrixConfig.from_extra({"root": str(tmp_path / "kv")})
    assert root_listing_version(cfg) is None  # missing
    (tmp_path / "kv").mkdir()
    mtime = os.stat(tmp_path / "kv").st_mtime_ns
    assert root_listing_version(cfg, now=mtime / 1e9 + 0.5) is None  # just changed
    assert root_listing_version(cfg, now=mtime / 1e9 + 3.0) == mtime
    (tmp_path / "kv" / "hicache-r64_x").mkdir()
    after = os.stat(tmp_path / "kv").st_mtime_ns
    assert root_listing_version(cfg, now=after / 1e9 + 3.0) == after  # the new listing's
