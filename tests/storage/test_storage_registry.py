"""Registry, extra-config parsing, options and lifecycle rules shared by all backends."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from hicache.keys import Namespace, PageKey
from hicache.storage import (
    HiCacheStorage,
    MemoryStorage,
    StorageConfig,
    StorageError,
    StorageOptions,
    backend_names,
    create_storage,
    parse_extra_config,
    register_backend,
    storage_config_from_args,
)
from hicache.storage.backends.file import FileConfig, FileStorage
from hicache.storage.backends.memory import MemorySettings
from hicache.storage.base import Deadline
from hicache.storage.pageio import Payloads
from hicache.storage.stats import MissReason, SetOutcome

NS = Namespace(
    model="m", weights_fingerprint="w", kv_dtype="float32", layout="page_first", page_size=2
)


class CustomStorage(HiCacheStorage):
    """A do-nothing custom backend loaded as 'tests.storage.test_storage_registry:CustomStorage'."""

    name = "custom"

    def _start(self) -> None:
        pass

    def _close(self) -> None:
        pass

    def _exists(self, keys: Sequence[PageKey], deadline: Deadline) -> int:
        raise RuntimeError("backend bug")  # must not escape

    def _get(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[MissReason | None]:
        return [MissReason.ABSENT] * len(keys)

    def _set(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
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
    st = create_storage("tests.storage.test_storage_registry:CustomStorage", namespace=NS)
    assert isinstance(st, CustomStorage)
    with st:
        assert st.batch_exists([PageKey("hc1-00", b"\0" * 32, b"\0" * 8)]) == 0
        assert st.stats().errors == 1
    with pytest.raises(ValueError, match="not a subclass of HiCacheStorage"):
        create_storage("tests.storage.test_storage_registry:NotStorage", namespace=NS)
    with pytest.raises(ValueError, match="cannot import module"):
        create_storage("no_such_module_xyz:Thing", namespace=NS)
    with pytest.raises(ValueError, match="has no attribute"):
        create_storage("tests.storage.test_storage_registry:Missing", namespace=NS)
    with pytest.raises(ValueError, match="'x' \\(value 1\\) is unknown; accepted: option keys"):
        create_storage(
            "tests.storage.test_storage_registry:CustomStorage", namespace=NS, extra_config={"x": 1}
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


class OneStepStorage(CustomStorage):
    """A custom class on the older one-step protocol: only ``from_extra_config``."""

    @classmethod
    def from_extra_config(
        cls, namespace: Namespace, extra_config: Mapping[str, Any], options: StorageOptions
    ) -> HiCacheStorage:
        if set(extra_config) - {"color"}:
            raise ValueError(f"bad keys {sorted(extra_config)}")
        return cls(namespace, options)


def test_storage_config_parses_once_and_splits(tmp_path: Path) -> None:
    text = json.dumps(
        {"file_path": str(tmp_path), "max_bytes": 4096, "timeout_s": 2, "prefetch_threshold": 8}
    )
    cfg = StorageConfig.parse("file", text)
    assert cfg.backend == "file"
    assert cfg.options == StorageOptions(timeout_s=2)
    assert cfg.settings == FileConfig(path=str(tmp_path), max_bytes=4096)
    assert dict(cfg.prefetch_extra) == {"prefetch_threshold": 8}
    assert cfg.prefetch_config("timeout").prefetch_threshold == 8
    st = cfg.create(NS)
    assert isinstance(st, FileStorage) and st.options.timeout_s == 2 and not st.started
    assert StorageConfig.parse("memory").settings == MemorySettings()


def test_storage_config_errors_name_key_value_and_accepted() -> None:
    with pytest.raises(ValueError) as info:
        StorageConfig.parse("redis", {"uri": "redis://x"})
    msg = str(info.value)
    assert "redis backend" in msg and "'uri'" in msg and "'redis://x'" in msg
    assert "'url'" in msg and "'timeout_s'" in msg and "'prefetch_threshold'" in msg
    with pytest.raises(ValueError, match=r"^file backend: max_bytes=-1 is invalid"):
        StorageConfig.parse("file", {"max_bytes": -1})
    with pytest.raises(ValueError, match=r"^memory backend: timeout_s=0 is invalid"):
        StorageConfig.parse("memory", {"timeout_s": 0})
    with pytest.raises(ValueError, match="unknown; choose one of"):
        StorageConfig.parse("s3")
    with pytest.raises(ValueError, match="not valid JSON"):
        StorageConfig.parse("file", "{nope")


def test_extra_config_without_a_backend_is_refused() -> None:
    assert storage_config_from_args(None, None) is None
    assert storage_config_from_args(None, "  ") is None
    assert storage_config_from_args(None, {}) is None
    with pytest.raises(ValueError, match=r"without --hicache-storage-backend.*'file_path'"):
        storage_config_from_args(None, '{"file_path": "/tmp/x"}')
    cfg = storage_config_from_args("memory", '{"store": "s"}')
    assert cfg is not None and cfg.settings == MemorySettings(store="s")


def test_factories_and_one_step_classes_validate_when_built() -> None:
    register_backend("raw-for-test", lambda ns, extra, opts: MemoryStorage(ns, opts))
    cfg = StorageConfig.parse("raw-for-test", {"anything": 1, "timeout_s": 0.5})
    assert cfg.settings == {"anything": 1} and cfg.options.timeout_s == 0.5
    one = StorageConfig.parse(
        "tests.storage.test_storage_registry:OneStepStorage", {"color": "red"}
    )
    assert isinstance(one.create(NS), OneStepStorage)
    bad = StorageConfig.parse("tests.storage.test_storage_registry:OneStepStorage", {"size": 1})
    with pytest.raises(ValueError, match="bad keys"):
        bad.create(NS)


def test_storage_config_pickles_for_the_rank_processes() -> None:
    """An engine config with an L3 backend goes to every tensor-parallel rank process
    (spawn pickles it): the parsed storage config, its mapping proxy included, round-trips."""
    import pickle

    from hicache.engine.front.engine import EngineConfig

    cfg = EngineConfig(
        model_path="tiny-random-llama",
        device="cpu",
        storage_backend="file",
        storage_extra_config={"file_path": "/tmp/l3", "prefetch_threshold": 8},
    )
    back = pickle.loads(pickle.dumps(cfg))
    assert back.storage == cfg.storage and back.storage is not None
    assert dict(back.storage.prefetch_extra) == {"prefetch_threshold": 8}
    with pytest.raises(TypeError):
        back.storage.prefetch_extra["x"] = 1  # type: ignore[index]
