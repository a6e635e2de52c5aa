"""Exact state of :class:`hicache.storage.allowed.AllowedNamespaces`: which digest a key's
record must carry, and which keys are whole records."""

from __future__ import annotations

from hicache.heads import HeadSplit
from hicache.keys import Namespace, PageKey, page_keys
from hicache.spec import KVSpec
from hicache.storage.allowed import AllowedNamespaces

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
NS = Namespace.for_spec(SPEC, model="m", weights_fingerprint="w", layout="page_first", page_size=4)


def key(ns: Namespace) -> PageKey:
    return page_keys(ns, [1, 2, 3, 4])[0]


def test_own_namespace_is_accepted_and_others_are_foreign() -> None:
    allowed = AllowedNamespaces(NS)
    tenant, mamba = NS.with_salt("b"), NS.with_component("mamba")
    assert allowed.digest_of(key(NS)) == NS.digest
    assert allowed.digest_of(key(tenant)) == NS.digest  # foreign: checked against ours
    assert allowed.digest_of(key(mamba)) == NS.digest
    assert not allowed.whole(key(NS))


def test_every_allowed_tenant_with_every_allowed_component() -> None:
    allowed = AllowedNamespaces(NS)
    allowed.allow_component("mamba", slots=True)
    allowed.allow_tenant("b")  # after the component: the pair is accepted all the same
    both = NS.with_salt("b").with_component("mamba")
    for ns in (NS.with_salt("b"), NS.with_component("mamba"), both):
        assert allowed.digest_of(key(ns)) == ns.digest
    assert allowed.whole(key(both)) and allowed.whole(key(NS.with_component("mamba")))
    assert not allowed.whole(key(NS.with_salt("b")))
    assert allowed.digest_of(key(NS.with_salt("c"))) == NS.digest


def test_a_slot_component_under_heads_is_the_ranks_shard() -> None:
    heads = Namespace.for_spec(
        SPEC, model="m", weights_fingerprint="w", layout="page_first", page_size=4,
        head_records=True,
    )  # fmt: skip
    allowed = AllowedNamespaces(heads)
    allowed.allow_component("mamba", slots=True)
    allowed.use_heads(HeadSplit(4, 2, 2, 1))
    shard = heads.with_component("mamba").for_slots(2, 1)
    assert allowed.digest_of(key(shard)) == shard.digest and allowed.whole(key(shard))
    other = heads.with_component("mamba").for_slots(2, 0)
    assert allowed.digest_of(key(other)) == heads.digest and not allowed.whole(key(other))


def test_a_namespace_allowed_whole_keeps_the_instances_digest() -> None:
    allowed = AllowedNamespaces(NS)
    side = NS.with_component("side")
    allowed.allow_whole(side)
    assert allowed.whole(key(side))
    assert allowed.digest_of(key(side)) == NS.digest
