"""Bad input is refused when SGLang constructs or registers the backend, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache.integrations.sglang.namespace import ShardIdentity, sglang_namespace
from tests.integrations.sglang.pools import attach, host_pool, storage_config


def _create(extra: dict[str, object], **cfg: object) -> object:
    return StorageBackendFactory.create_backend(
        "dynamic",
        storage_config(extra, **cfg),
        None,  # type: ignore[arg-type]
    )


def test_unknown_backend_names_it_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'nosuch' is unknown; choose one of \[.*'file'.*'redis'"):
        _create({"hicache_backend": "nosuch"})


def test_unknown_key_names_it_and_the_accepted_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'file_pth'.*'file_path'.*timeout_s.*hicache_backend"):
        _create({"hicache_backend": "file", "file_pth": str(tmp_path)})
    with pytest.raises(ValueError, match=r"'hiccache_backend'"):
        _create({"hiccache_backend": "file"})


def test_bad_option_value_names_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"timeout_s=-1"):
        _create({"file_path": str(tmp_path), "timeout_s": -1})
    with pytest.raises(ValueError, match=r"hicache_weights_fingerprint=''"):
        _create({"file_path": str(tmp_path), "hicache_weights_fingerprint": ""})


def test_no_model_name_asks_for_hicache_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hicache_model"):
        _create({"file_path": str(tmp_path)}, model=None)
    be = _create({"file_path": str(tmp_path), "hicache_model": "m"}, model=None)
    assert be.shard.model == "m"  # type: ignore[attr-defined]


def test_dtype_that_cannot_be_stored_is_refused_at_registration(tmp_path: Path) -> None:
    pool = host_pool("mha", "page_first", dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"dtype '(float8_e4m3fn|uint8)' cannot be stored"):
        attach(pool, {"file_path": str(tmp_path)})


def test_layout_that_cannot_be_stored_is_refused_at_registration(tmp_path: Path) -> None:
    """page_head is an MHA layout: an MLA (rank-replicated) config cannot store it."""
    pool = host_pool("mha", "page_head")
    with pytest.raises(ValueError, match=r"MLA host pool layout 'page_head' cannot be stored"):
        attach(pool, {"file_path": str(tmp_path)}, mla=True)
    shard = ShardIdentity(model="m", tp_rank=0, tp_size=1, rank_replicated=True)
    with pytest.raises(ValueError, match=r"'page_first_kv_split' cannot be stored"):
        sglang_namespace(
            shard,
            weights_fingerprint="w",
            dtype=torch.bfloat16,
            layout="page_first_kv_split",
            page_size=4,
        )
