"""vLLM chunks' namespace and keys (hicache.integrations.vllm.namespace), from vLLM's own
``OffloadingConfig``."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys

import pytest

from hicache.config import MemLayout
from hicache.integrations.vllm.namespace import ChunkLayout, vllm_namespace, vllm_page_key
from hicache.keys import KEY_PREFIX
from tests.integrations.vllm.drive import ROW_BYTES, TIER, key, make_config


def layout(**kw: object) -> ChunkLayout:
    return ChunkLayout.from_config(make_config(TIER, **kw), ROW_BYTES)  # type: ignore[arg-type]


def test_layout_from_vllm_config_and_namespace_fields() -> None:
    lay = layout(tp_size=2)
    assert lay.topology == (2, 1, 1, 1, 2)
    assert lay.tokens_per_chunk == 16
    ns = vllm_namespace(lay, weights_fingerprint="rev1")
    assert (ns.model, ns.kv_dtype, ns.layout, ns.page_size) == (
        "tiny/model",
        "bfloat16",
        MemLayout.PAGE_FIRST,
        16,
    )
    assert (ns.tp_size, ns.tp_rank, ns.component, ns.tenant_salt) == (1, None, "full", "")
    names = hashlib.sha256(b"l0\nl1\n").hexdigest()[:16]
    assert ns.engine_layout == (
        f"vllm:chunk;row=4096;hash=4x4;kvb=512;groups=4/2/0;layers={names};par=tp2pp1pcp1dcp1w2"
    )
    assert vllm_namespace(lay, weights_fingerprint="rev1", model="other").model == "other"


def test_what_changes_the_bytes_changes_the_namespace() -> None:
    base = layout()
    digest = vllm_namespace(base, weights_fingerprint="x").digest
    variants = [
        dataclasses.replace(base, row_bytes=8192),
        dataclasses.replace(base, dtype="float16"),
        dataclasses.replace(base, model="m2"),
        dataclasses.replace(base, blocks_per_chunk=2),
        dataclasses.replace(base, worker_kv_bytes_per_block=256),
        dataclasses.replace(base, topology=(2, 1, 1, 1, 2)),
        dataclasses.replace(base, replicated=True),
        dataclasses.replace(base, canonical="NHD"),
        dataclasses.replace(
            base, groups=(dataclasses.replace(base.groups[0], layer_names=("l0", "l2")),)
        ),
    ]
    digests = {vllm_namespace(v, weights_fingerprint="x").digest for v in variants}
    assert digest not in digests and len(digests) == len(variants)
    assert vllm_namespace(base, weights_fingerprint="y").digest != digest


def test_parallelism_agnostic_bytes_share_one_namespace_across_topologies() -> None:
    one = vllm_namespace(layout(agnostic=True), weights_fingerprint="x")
    assert "par=" not in one.engine_layout
    # worker bytes per block differ with TP, so fix them to compare topology alone
    two = dataclasses.replace(layout(agnostic=True, tp_size=2), worker_kv_bytes_per_block=1024)
    assert vllm_namespace(two, weights_fingerprint="x").digest == one.digest


def test_page_key_is_sha256_of_namespace_digest_and_offload_key() -> None:
    ns = vllm_namespace(layout(), weights_fingerprint="x")
    k = key(7, group=1)
    assert k == (7).to_bytes(32, "big") + b"\x00\x00\x00\x01"
    pk = vllm_page_key(ns, k)
    h = hashlib.sha256(ns.digest + k).digest()
    assert pk.key == KEY_PREFIX + h.hex() and pk.digest == h
    assert pk.fingerprint == hashlib.sha256(k).digest()[:8]
    assert pk.namespace_digest == ns.digest
    assert vllm_page_key(ns, key(7, group=0)).key != pk.key
    other = vllm_namespace(layout(model="m2"), weights_fingerprint="x")
    assert vllm_page_key(other, k).key != pk.key


def test_bad_input_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"dtype 'fp8_e4m3' cannot be stored.*bfloat16"):
        vllm_namespace(layout(dtype="fp8_e4m3"), weights_fingerprint="x")
    ns = vllm_namespace(layout(), weights_fingerprint="x")
    with pytest.raises(ValueError, match="offload key"):
        vllm_page_key(ns, b"\x00\x01")
    with pytest.raises(ValueError, match="row_bytes=0"):
        dataclasses.replace(layout(), row_bytes=0)


def test_the_pure_submodules_import_without_vllm() -> None:
    code = (
        "import sys, hicache.integrations.vllm as p\n"
        "import hicache.integrations.vllm.namespace, hicache.integrations.vllm.settings\n"
        "import hicache.integrations.vllm.rows, hicache.integrations.vllm.transfers\n"
        "assert 'vllm' not in sys.modules, 'vllm was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
