"""Registry, extra-config parsing, options and lifecycle rules shared by all backends."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from hicache.keys import Namespace, PageKey
from hicache.storage import (
    HiCacheStorage,
    MemoryStorage,
    StorageError,
    StorageOptions,
    backend_names,
    create_storage,
    parse_extra_config,
    register_backend,
)
from hicache.storage.base import Deadline
from hicache.storage.pageio import HostPages
from hicache.storage.stats import MissReason, SetOutcome

NS = Namespace(
    model="m", weights_fingerprint="w", kv_dtype="float32", layout="page_first", page_size=2
)


class CustomStorage(HiCacheStorage):
    """A do-nothing custom backend loaded as 'tests.test_storage_registry:CustomStorage'."""

    name = "custom"

    def _start(self) -> None:
        pass

    def _close(self) -> None:
        pass

    def _exists(self, keys: Sequence[PageKey], deadline: Deadline) -> int:
        raise RuntimeError("backend bug")  # must not escape

    def _get(
        self, keys: Sequence[PageKey], pages: HostPages, deadline: Deadline
    ) -> list[MissReason | None]:
        return [MissReason.ABSENT] * len(keys)

    def _set(
        self, keys: Sequence[PageKey], pages: HostPages, deadline: Deadline
    ) -> list[SetOutcome]:
        return [SetOutcome.FAILED] * len(keys)


class NotStorage:
    pass


def test_parse_extra_config(tmp_path: Path) -> None:
    assert parse_extra_config(None) == {}
    assert parse_extra_config("  ") == {}
    assert parse_extra_config('{"file_path": "/x", "max_bytes": 5}') == {
        "file_path": "/x",
        "max_bytes": 5,
    }
    f = tmp_path / "c.json"
    f.write_text('{"url": "redis://127.0.0.1:1/0"}')
    assert parse_extra_config(f"@{f}") == {"url": "redis://127.0.0.1:1/0"}
    with pytest.raises(ValueError, match=r"not valid JSON: .* line 1 column"):
        parse_extra_config("{'single': 'quotes'}")
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        parse_extra_config("[1, 2]")
    with pytest.raises(ValueError, match="cannot read extra config file"):
        parse_extra_config(f"@{tmp_path / 'missing.json'}")


def test_names_and_unknown_backend() -> None:
    assert {"file", "memory", "redis", "mooncake"} <= set(backend_names())
    with pytest.raises(ValueError, match="unknown; choose one of"):
        create_storage("s3", namespace=NS)


def test_custom_class_and_errors_do_not_escape() -> None:
    st = create_storage("tests.test_storage_registry:CustomStorage", namespace=NS)
    assert isinstance(st, CustomStorage)
    with st:
        assert st.batch_exists([PageKey("hc1-00", b"\0" * 32, b"\0" * 8)]) == 0
        assert st.stats().errors == 1
    with pytest.raises(ValueError, match="not a subclass of HiCacheStorage"):
        create_storage("tests.test_storage_registry:NotStorage", namespace=NS)
    with pytest.raises(ValueError, match="cannot import module"):
        create_storage("no_such_module_xyz:Thing", namespace=NS)
    with pytest.raises(ValueError, match="has no attribute"):
        create_storage("tests.test_storage_registry:Missing", namespace=NS)
    with pytest.raises(ValueError, match="takes no extra config"):
        create_storage(
            "tests.test_storage_registry:CustomStorage", namespace=NS, extra_config={"x": 1}
        )


def test_register_backend() -> None:
    register_backend("fake-for-test", lambda ns, extra, opts: MemoryStorage(ns, opts))
    st = create_storage("fake-for-test", namespace=NS, extra_config={"timeout_s": 0.5})
    assert isinstance(st, MemoryStorage) and st.options.timeout_s == 0.5
    with pytest.raises(ValueError, match="backend name"):
        register_backend("a:b", lambda ns, extra, opts: MemoryStorage(ns, opts))


def test_options_from_extra_and_validation() -> None:
    st = create_storage(
        "memory",
        namespace=NS,
        extra_config={"timeout_s": 2, "max_batch_pages": 8},
        options=StorageOptions(connect_timeout_s=3.0),
    )
    assert st.options == StorageOptions(timeout_s=2, connect_timeout_s=3.0, max_batch_pages=8)
    for field, bad in (
        ("timeout_s", 0),
        ("timeout_s", float("inf")),
        ("connect_timeout_s", -1),
        ("max_batch_pages", 0),
    ):
        with pytest.raises(ValueError, match=field):
            StorageOptions(**{field: bad})


def test_lifecycle_rules() -> None:
    st = MemoryStorage(NS)
    assert not st.started
    with pytest.raises(StorageError, match="not started"):
        st.batch_exists([])
    st.start()
    st.start()  # idempotent
    assert st.started
    st.close()
    st.close()  # idempotent
    with pytest.raises(StorageError, match="closed"):
        st.batch_exists([])
    with pytest.raises(StorageError, match="closed"):
        st.start()
