"""The L3 key spec: doc test vectors, an independent re-implementation, field sensitivity."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hicache.config import MemLayout
from hicache.keys import (
    KEY_PREFIX,
    KEY_SPEC_VERSION,
    Namespace,
    PageKey,
    head_key,
    page_keys,
    previous_page_key,
    token_fingerprint,
)
from hicache.spec import KVSpec

DOC = Path(__file__).resolve().parents[2] / "docs" / "l3-keys.md"


def doc_vectors() -> list[dict[str, Any]]:
    text = DOC.read_text(encoding="utf-8")
    m = re.search(r"<!-- test-vectors -->\s*```json\n(.*?)\n```", text, re.S)
    assert m, "docs/l3-keys.md lost its test-vector block"
    vectors = json.loads(m.group(1))
    assert len(vectors) >= 5
    return list(vectors)


def ns(**kw: Any) -> Namespace:
    base: dict[str, Any] = dict(
        model="m", weights_fingerprint="w", kv_dtype="float16", layout="page_first", page_size=2
    )
    base.update(kw)
    return Namespace(**base)


@pytest.mark.parametrize("vec", doc_vectors(), ids=lambda v: v["name"].split(":")[0])
def test_doc_vectors(vec: dict[str, Any]) -> None:
    n = Namespace(**vec["namespace"])
    assert n.encode().decode("ascii") == vec["encoding"]
    assert n.digest.hex() == vec["digest"]
    keys = page_keys(n, vec["tokens"])
    assert [k.key for k in keys] == vec["keys"]
    assert [k.fingerprint.hex() for k in keys] == vec["fingerprints"]
    if "head_keys" in vec:
        heads = range(vec["kv_heads"])
        assert [[head_key(k, j).key for j in heads] for k in keys] == vec["head_keys"]


@pytest.mark.parametrize("vec", doc_vectors(), ids=lambda v: v["name"].split(":")[0])
def test_doc_vectors_independently(vec: dict[str, Any]) -> None:
    """Recompute the vectors from the spec text with hashlib/struct only."""
    enc = json.dumps(
        {**vec["namespace"], "spec": 3}, sort_keys=True, separators=(",", ":"), ensure_ascii=True
    ).encode()
    assert enc.decode() == vec["encoding"]
    h = hashlib.sha256(enc).digest()
    assert h.hex() == vec["digest"]
    p = vec["namespace"]["page_size"]
    toks = vec["tokens"]
    want = []
    for i in range(len(toks) // p):
        page = struct.pack(f"<{p}I", *toks[i * p : (i + 1) * p])
        h = hashlib.sha256(h + page).digest()
        want.append(("hc3-" + h.hex(), hashlib.sha256(page).digest()[:8].hex()))
        if "head_keys" in vec:
            got = [
                "hc3-" + hashlib.sha256(h + b"kv_head" + struct.pack("<I", j)).hexdigest()
                for j in range(vec["kv_heads"])
            ]
            assert got == vec["head_keys"][i]
    assert [(k, f) for k, f in zip(vec["keys"], vec["fingerprints"], strict=True)] == want


FIELD_VARIANTS: dict[str, Any] = {
    "model": "m2",
    "weights_fingerprint": "w2",
    "kv_dtype": "bfloat16",
    "layout": "page_first_direct",
    "tp_size": 2,
    "tp_rank": None,
    "component": "swa",
    "tenant_salt": "tenant",
}


@pytest.mark.parametrize("field", sorted(FIELD_VARIANTS))
def test_any_field_changes_every_key(field: str) -> None:
    tokens = list(range(8))
    a = page_keys(ns(), tokens)
    b = page_keys(ns(**{field: FIELD_VARIANTS[field]}), tokens)
    assert len(a) == len(b) == 4
    assert all(x.key != y.key for x, y in zip(a, b, strict=True))
    assert [x.fingerprint for x in a] == [y.fingerprint for y in b]


def test_page_size_changes_keys() -> None:
    tokens = list(range(8))
    a = page_keys(ns(page_size=2), tokens)
    b = page_keys(ns(page_size=4), tokens)
    assert {k.key for k in a}.isdisjoint(k.key for k in b)


def test_prefix_sharing_and_chain_continuation() -> None:
    n = ns()
    full = page_keys(n, [5, 6, 7, 8, 9, 10])
    assert page_keys(n, [5, 6, 7, 8]) == full[:2]
    assert page_keys(n, [9, 10], prior=full[1]) == full[2:]
    other = page_keys(n, [5, 6, 0, 8, 9, 10])  # page 2 differs: pages 2.. all differ
    assert other[0] == full[0]
    assert other[1].key != full[1].key and other[2].key != full[2].key
    assert other[2].fingerprint == full[2].fingerprint  # same tokens in page 3


def test_tail_page_not_keyed() -> None:
    n = ns(page_size=4)
    assert page_keys(n, [1, 2, 3]) == []
    assert len(page_keys(n, list(range(11)))) == 2
    assert page_keys(n, list(range(11))) == page_keys(n, list(range(8)))
    assert page_keys(n, []) == []


def test_key_shape() -> None:
    k = page_keys(ns(), [1, 2])[0]
    assert isinstance(k, PageKey) and str(k) == k.key
    assert k.key.startswith(KEY_PREFIX) and len(k.key) == 68
    assert len(k.digest) == 32 and len(k.fingerprint) == 8
    assert k.fingerprint == token_fingerprint([1, 2])


@pytest.mark.parametrize(
    "bad", [[1, 2**32], [-1, 0], [2**70, 1], [1.5, 2.0], ["a", "b"], [True, False]]
)
def test_out_of_range_or_non_integer_ids_rejected(bad: list[Any]) -> None:
    with pytest.raises(ValueError, match="token id"):
        page_keys(ns(), bad)


def test_array_inputs_match_lists() -> None:
    tokens = [0, 7, 2**32 - 1, 3]
    want = page_keys(ns(), tokens)
    assert page_keys(ns(), np.array(tokens, dtype=np.uint32)) == want
    assert page_keys(ns(), np.array(tokens, dtype=np.int64)) == want
    assert page_keys(ns(), torch.tensor(tokens, dtype=torch.int64)) == want
    with pytest.raises(ValueError, match="1-D"):
        page_keys(ns(), [[1, 2]])


def test_page_size_must_match_namespace() -> None:
    with pytest.raises(ValueError, match="page_size"):
        page_keys(ns(page_size=2), [1, 2, 3, 4], 4)
    assert page_keys(ns(page_size=2), [1, 2], 2) == page_keys(ns(page_size=2), [1, 2])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", ""),
        ("weights_fingerprint", ""),
        ("kv_dtype", "int8"),
        ("layout", "diagonal"),
        ("page_size", 0),
        ("tp_size", 0),
        ("tp_rank", 2),
        ("tp_rank", -1),
        ("component", ""),
        ("tenant_salt", None),
    ],
)
def test_namespace_validation_names_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        ns(**{field: value, "tp_size": 2} if field == "tp_rank" else {field: value})


def test_shared_namespace_has_no_tp_size() -> None:
    with pytest.raises(ValueError, match="tp_size"):
        ns(tp_size=2, tp_rank=None)


def test_for_spec_drops_rank_for_mla() -> None:
    mha = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4)
    mla = KVSpec(num_layers=2, attention="mla", kv_lora_rank=8, qk_rope_head_dim=4)
    kw: dict[str, Any] = dict(
        model="m", weights_fingerprint="w", layout=MemLayout.PAGE_FIRST, page_size=4, tp_size=2
    )
    r0 = Namespace.for_spec(mla, tp_rank=0, **kw)
    r1 = Namespace.for_spec(mla, tp_rank=1, **kw)
    assert r0 == r1 and r0.tp_rank is None and r0.digest == r1.digest
    # latent KV does not depend on TP: an MLA server of another TP size shares the keys
    solo = Namespace.for_spec(mla, tp_rank=0, **{**kw, "tp_size": 1})
    assert solo == r0 and solo.tp_size == r0.tp_size == 1
    m0 = Namespace.for_spec(mha, tp_rank=0, **kw)
    m1 = Namespace.for_spec(mha, tp_rank=1, **kw)
    assert m0.digest != m1.digest and m1.tp_rank == 1 and m0.kv_dtype == "float32"


def test_head_records_namespace_is_one_for_every_tp_size() -> None:
    mha = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4)
    mla = KVSpec(num_layers=2, attention="mla", kv_lora_rank=8, qk_rope_head_dim=4)
    kw: dict[str, Any] = dict(
        model="m", weights_fingerprint="w", layout=MemLayout.PAGE_FIRST, page_size=4
    )
    every = {
        Namespace.for_spec(mha, tp_size=n, tp_rank=r, head_records=True, **kw)
        for n in (1, 2, 4)
        for r in range(n)
    }
    assert len(every) == 1
    (one,) = every
    assert (one.records, one.tp_size, one.tp_rank) == ("head", 1, None)
    assert one.digest != Namespace.for_spec(mha, **kw).digest  # page records: another key
    latent = Namespace.for_spec(mla, tp_size=2, tp_rank=1, head_records=True, **kw)
    assert latent.records == "page" and latent.tp_rank is None  # MLA: one latent record
    with pytest.raises(ValueError, match="records"):
        ns(records="rank")


def test_state_slot_records_are_per_rank_under_head_records() -> None:
    mha = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4)
    kw: dict[str, Any] = dict(
        model="m", weights_fingerprint="w", layout=MemLayout.PAGE_FIRST, page_size=4
    )
    heads = Namespace.for_spec(mha, head_records=True, **kw).with_component("mamba")
    shards = {heads.for_slots(n, r) for n in (1, 2, 4) for r in range(n)}
    assert len({s.digest for s in shards}) == 7  # one namespace per (size, rank)
    assert all(s.records == "page" and s.component == "mamba" for s in shards)
    assert heads.for_slots(2, 1) == dataclasses.replace(heads, records="page", tp_size=2, tp_rank=1)
    page = Namespace.for_spec(mha, tp_size=2, tp_rank=1, **kw).with_component("mamba")
    assert page.for_slots(2, 1) is page  # a page namespace is per rank already


def test_head_keys_and_previous_keys() -> None:
    n = ns(tp_rank=None, records="head")
    k = page_keys(n, list(range(4)))
    heads = [head_key(x, j) for x in k for j in range(3)]
    assert len({h.key for h in heads} | {x.key for x in k}) == 8  # all distinct
    assert heads[4].fingerprint == k[1].fingerprint and heads[4].namespace_digest == n.digest
    with pytest.raises(ValueError, match="kv_head"):
        head_key(k[0], -1)
    # the previous spec's key: "spec": 2, no records field, the rank's TP fields
    enc = json.dumps(
        {**dataclasses.asdict(n), "spec": 2, "tp_size": 2, "tp_rank": 1, "layout": "page_first"},
        sort_keys=True,
        separators=(",", ":"),
    )
    doc = json.loads(enc)
    del doc["records"], doc["engine_layout"], doc["head_group"]
    d2 = hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).digest()
    assert n.previous_digest(2, 1) == d2
    h = d2
    for i in range(2):
        h = hashlib.sha256(h + struct.pack("<2I", 2 * i, 2 * i + 1)).digest()
    old = previous_page_key(d2, list(range(4)), 2)
    assert old.key == "hc2-" + h.hex() and old.fingerprint == k[1].fingerprint


def test_namespace_is_frozen_and_salt_helper() -> None:
    n = ns()
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.model = "x"
    s = n.with_salt("t1")
    assert s.tenant_salt == "t1" and s.digest != n.digest
    assert s.with_salt("") == n


def test_spec_version_3_and_component_namespaces() -> None:
    assert KEY_SPEC_VERSION == 3 and KEY_PREFIX == "hc3-"
    assert b'"spec":3' in ns().encode() and b'"records":"page"' in ns().encode()
    full = ns()
    mamba = full.with_component("mamba")
    assert mamba.component == "mamba" and mamba.with_component("full") == full
    tokens = list(range(8))
    a, b = page_keys(full, tokens), page_keys(mamba, tokens)
    assert {k.key for k in a}.isdisjoint(k.key for k in b)  # never collide
    assert [k.fingerprint for k in a] == [k.fingerprint for k in b]
    assert b[1].namespace_digest == mamba.digest
    assert full.with_salt("t").with_component("mamba") == mamba.with_salt("t")
