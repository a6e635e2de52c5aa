"""The test vectors of docs/l3-keys.md, "Keys for SGLang pages" (pure: no sglang)."""

from __future__ import annotations

import pytest
import torch

from hicache.config import MemLayout
from hicache.integrations.sglang.namespace import (
    ShardIdentity,
    head_namespace,
    sglang_namespace,
    sglang_page_key,
    side_namespace,
)
from hicache.keys import Namespace, head_key
from hicache.spec import KVSpec

MHA = ShardIdentity(model="Qwen/Qwen3-8B", tp_rank=1, tp_size=2, rank_replicated=False)
MLA = ShardIdentity(
    model="deepseek-ai/DeepSeek-V3",
    tp_rank=3,
    tp_size=8,
    rank_replicated=True,
    pp_rank=1,
    pp_size=2,
)


def test_mha_page_head_vector() -> None:
    ns = sglang_namespace(
        MHA, weights_fingerprint="unset", dtype=torch.bfloat16, layout="page_head", page_size=64
    )
    assert ns.encode() == (
        b'{"component":"full","engine_layout":"sglang:page_head","kv_dtype":"bfloat16",'
        b'"layout":"page_first_direct","model":"Qwen/Qwen3-8B","page_size":64,"records":"page","spec":3,'
        b'"tenant_salt":"","tp_rank":1,"tp_size":2,"weights_fingerprint":"unset"}'
    )
    assert ns.digest.hex() == "d404e944b91cf9f87d39a0aa00111ab0915e5dea5c2ddfed0c407d5ebd46f3c3"
    key = sglang_page_key(ns, "a" * 64)
    assert key.key == "hc3-b27bf6839b499955a8f8f2c7d5bb202b2be5f2bad77adc895fb2b50d4dba37ce"
    assert key.fingerprint.hex() == "ffe054fe7ae0cb6d"
    assert key.namespace_digest == ns.digest


def test_mha_page_head_records_vectors() -> None:
    """A ``page_head`` pool's head records: at one head per record, a hicache server's
    ``page_first`` namespace of one-head records (same bytes); at two, SGLang's own."""
    rank = sglang_namespace(
        MHA, weights_fingerprint="unset", dtype=torch.bfloat16, layout="page_head", page_size=64
    )
    one = head_namespace(rank, 1)
    spec = KVSpec(num_layers=36, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert one == Namespace.for_spec(
        spec,
        model="Qwen/Qwen3-8B",
        weights_fingerprint="unset",
        layout=MemLayout.PAGE_FIRST,
        page_size=64,
        head_records=True,
    )
    assert one.encode() == (
        b'{"component":"full","kv_dtype":"bfloat16","layout":"page_first",'
        b'"model":"Qwen/Qwen3-8B","page_size":64,"records":"head","spec":3,'
        b'"tenant_salt":"","tp_rank":null,"tp_size":1,"weights_fingerprint":"unset"}'
    )
    assert one.digest.hex() == "2589b44c39d68c7614b004c2e49e7717803b24f4aa89c2e6822d45ae2a892e60"
    page = sglang_page_key(one, "a" * 64)
    assert page.key == "hc3-ff2c6d54cc38416413f95359cac9b8c42da746fe467932061894514c74a5878e"
    assert (
        head_key(page, 1).key
        == "hc3-c699df5d5698cc4c6333aa4206e31cb4427f1a1c76dd750aba89ee71505dbcd9"
    )
    two = head_namespace(rank, 2)
    assert (two.engine_layout, two.layout, two.head_group) == (
        "sglang:page_head",
        MemLayout.PAGE_FIRST_DIRECT,
        2,
    )
    assert two.digest.hex() == "373b681ef0f8e11407fc995af7ad5575d4a6eebcfb6dc89de5617c622b201df2"
    page = sglang_page_key(two, "a" * 64)
    assert (
        head_key(page, 1).key
        == "hc3-fe00d2794abb7d4e2af551474aad6bf825232a112ddbf36118006fbb1597200c"
    )


def test_head_namespace_keeps_sglang_order_under_pp_and_refuses_others() -> None:
    staged = ShardIdentity(
        model="m", tp_rank=0, tp_size=2, rank_replicated=False, pp_rank=1, pp_size=2
    )
    rank = sglang_namespace(
        staged, weights_fingerprint="w", dtype=torch.float16, layout="page_head", page_size=4
    )
    assert head_namespace(rank, 1).engine_layout == "sglang:page_head;pp=1/2"
    other = sglang_namespace(
        MHA, weights_fingerprint="w", dtype=torch.float16, layout="page_first", page_size=4
    )
    with pytest.raises(ValueError, match="page_head"):
        head_namespace(other, 1)
    mla = sglang_namespace(
        MLA, weights_fingerprint="w", dtype=torch.float16, layout="page_first", page_size=4
    )
    with pytest.raises(ValueError, match="page_head"):
        head_namespace(mla, 1)


def test_mla_page_unified_vector() -> None:
    ns = sglang_namespace(
        MLA,
        weights_fingerprint="rev-1",
        dtype=torch.bfloat16,
        layout="page_unified",
        page_size=64,
        unified_groups=1,
        unified_version="page-unified-v1",
    )
    assert ns.engine_layout == "sglang:page_unified;pp=1/2;groups=1;v=page-unified-v1"
    assert (ns.tp_rank, ns.tp_size) == (None, 1)  # every MLA rank, every TP size
    assert ns.digest.hex() == "a1f8c2199b651227c43d7c1fef42896221ac956d42dbe7d3a754ac88d88ef6ee"
    key = sglang_page_key(ns, "a" * 64)
    assert key.key == "hc3-4bdf3e0443acd6af5d72b3d01998ccbc68b4a59a9e9a2f7ab6ad82c54598dfbf"


def test_engine_layout_is_encoded_only_when_set() -> None:
    plain = Namespace(
        model="m", weights_fingerprint="w", kv_dtype="float16", layout="page_first", page_size=4
    )
    assert b"engine_layout" not in plain.encode()
    with pytest.raises(ValueError, match="engine_layout"):
        Namespace(
            model="m",
            weights_fingerprint="w",
            kv_dtype="float16",
            layout=MemLayout.PAGE_FIRST,
            page_size=4,
            engine_layout="page_head",
        )


def test_side_pools_pin_their_pool_and_mamba_its_rank() -> None:
    kv = sglang_namespace(
        MLA, weights_fingerprint="w", dtype=torch.bfloat16, layout="page_first", page_size=64
    )
    swa = side_namespace(
        kv, MLA, pool_name="indexer", pool_class="C", pool_layout="page_first", dtype="bfloat16"
    )
    mamba = side_namespace(
        kv, MLA, pool_name="mamba", pool_class="M", pool_layout="layer_first", dtype=torch.float32
    )
    assert (swa.component, swa.tp_rank) == ("indexer", None)
    assert (mamba.component, mamba.tp_rank, mamba.tp_size) == ("mamba", 3, 8)
    assert mamba.engine_layout.endswith(";pool=M/layer_first/float32")
    assert sglang_page_key(kv, "x").key != sglang_page_key(swa, "x").key


def test_importing_hicache_and_the_pure_modules_does_not_import_sglang() -> None:
    """With SGLang importable, ``import hicache`` and the integration's package and pure
    modules leave it unimported (only ``HiCacheL3``'s first access imports it)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from hicache.integrations.pinned import pinned_dir

    root = Path(__file__).resolve().parents[3]

    code = (
        "import sys, hicache, hicache.integrations.sglang as p\n"
        "import hicache.integrations.sglang.settings, hicache.integrations.sglang.namespace\n"
        "import hicache.integrations.sglang.pages, hicache.bench.storage\n"
        "import hicache.integrations.sglang.head_pages\n"
        "assert 'sglang' not in sys.modules, 'imported sglang'\n"
        "from hicache.integrations import pinned\n"
        "assert pinned.enable('sglang')\n"
        "p.HiCacheL3\n"
        "assert 'sglang' in sys.modules\n"
    )
    path = os.pathsep.join([str(root / "src"), str(root), str(pinned_dir("sglang"))])
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
