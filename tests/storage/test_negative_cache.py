"""The negative lookup cache as a data structure: runs, TTL, forgetting, the LRU bound
(an injected clock), and its configuration refused when it cannot work."""

from __future__ import annotations

import argparse

import pytest

from hicache.config import PrefetchConfig
from hicache.disagg.config import DisaggConfig, DisaggMode
from hicache.engine.config import EngineConfig
from hicache.keys import Namespace, PageKey, page_keys
from hicache.server.args import add_engine_args, engine_config_from_args, flag_message
from hicache.spec import KVSpec
from hicache.storage.negative import NegativeCache


class Clock:
    """Seconds the test sets by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


NS = Namespace.for_spec(
    KVSpec(num_layers=2, num_kv_heads=1, head_dim=4),
    model="m",
    weights_fingerprint="w",
    layout="page_first",
    page_size=2,
)


def run_of(tokens: list[int], salt: str = "") -> list[PageKey]:
    return page_keys(NS.with_salt(salt), tokens, 2)


A = run_of([1, 2, 3, 4, 5, 6, 7, 8])  # 4 pages
B = run_of([9, 9, 9, 9])


def test_a_run_is_asked_up_to_its_first_fresh_miss() -> None:
    clock = Clock()
    neg = NegativeCache(5.0, 16, clock=clock)
    assert neg.to_ask(A) == 4 and neg.to_ask([]) == 0
    neg.missed(A[2])
    assert neg.to_ask(A) == 2 and neg.to_ask(A[2:]) == 0 and neg.to_ask(B) == 2
    neg.missed(A[1])
    assert neg.to_ask(A) == 1 and len(neg) == 2
    assert A[1] in neg and A[0] not in neg


def test_a_miss_older_than_the_ttl_is_asked_again_and_dropped() -> None:
    clock = Clock()
    neg = NegativeCache(2.0, 16, clock=clock)
    neg.missed(A[0])
    clock.now += 2.0  # exactly the TTL: still trusted
    assert neg.to_ask(A) == 0
    clock.now += 0.001
    assert A[0] not in neg
    assert neg.to_ask(A) == 4 and len(neg) == 0
    neg.missed(A[0])  # asked again and missing again: a new stamp
    clock.now += 1.0
    assert neg.to_ask(A) == 0


def test_forget_drops_keys_at_once() -> None:
    neg = NegativeCache(60.0, 16, clock=Clock())
    neg.missed(A[0])
    neg.missed(B[0])
    neg.forget([A[0], A[3]])
    assert neg.to_ask(A) == 4 and neg.to_ask(B) == 0 and len(neg) == 1


def test_the_least_recently_used_miss_goes_first_past_the_bound() -> None:
    neg = NegativeCache(60.0, 2, clock=Clock())
    neg.missed(A[0])
    neg.missed(A[1])
    assert neg.to_ask(A) == 0  # A[0] used again: A[1] is now the oldest
    neg.missed(B[0])
    assert len(neg) == 2
    assert A[0] in neg and B[0] in neg and A[1] not in neg


def test_keys_of_other_namespaces_never_answer_for_each_other() -> None:
    neg = NegativeCache(60.0, 16, clock=Clock())
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    neg.missed(run_of(tokens, salt="acme")[0])
    assert neg.to_ask(run_of(tokens)) == 4 and neg.to_ask(run_of(tokens, salt="acme")) == 0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_a_cache_with_a_ttl_that_is_not_a_positive_finite_number_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        NegativeCache(bad)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "2"])
def test_a_bad_negative_ttl_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match="negative_ttl_s"):
        PrefetchConfig(negative_ttl_s=bad)
    with pytest.raises(ValueError, match="storage_negative_ttl_s"):
        EngineConfig(model_path="tiny-random-llama", storage_negative_ttl_s=bad)


def test_the_entry_bound_is_at_least_one() -> None:
    with pytest.raises(ValueError, match="negative_max_entries"):
        PrefetchConfig(negative_max_entries=0)
    with pytest.raises(ValueError, match="max_entries"):
        NegativeCache(1.0, 0)


def test_the_flags_reach_the_config_and_a_bad_ttl_names_the_flag() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cpu = ["--device", "cpu"]
    default = engine_config_from_args(p.parse_args(cpu))
    assert default.storage_negative_ttl_s is None
    assert (default.negative_ttl_s, default.storage_negative_entries) == (2.0, 65536)
    got = engine_config_from_args(
        p.parse_args(
            [*cpu, "--hicache-storage-negative-ttl", "0", "--hicache-storage-negative-entries", "9"]
        )
    )
    assert (got.negative_ttl_s, got.storage_negative_entries) == (0.0, 9)
    for bad, shown in (("nan", "nan"), ("-1", "-1.0"), ("inf", "inf")):
        with pytest.raises(ValueError) as err:
            engine_config_from_args(p.parse_args([*cpu, "--hicache-storage-negative-ttl", bad]))
        assert flag_message(err.value) == (
            f"--hicache-storage-negative-ttl {shown} is invalid; must be a finite number of"
            " seconds >= 0 (0: off)"
        )


def test_a_pd_prefill_instance_remembers_no_miss_unless_asked() -> None:
    """Its decode peer writes each conversation right after this instance looked its
    prompt up, and the next turn comes at once: a remembered miss would hide it."""
    prefill = DisaggConfig(mode=DisaggMode.PREFILL)
    assert EngineConfig(model_path="tiny-random-llama", disagg=prefill).negative_ttl_s == 0.0
    assert EngineConfig(model_path="tiny-random-llama").negative_ttl_s == 2.0
    asked = EngineConfig(model_path="tiny-random-llama", disagg=prefill, storage_negative_ttl_s=5)
    assert asked.negative_ttl_s == 5.0
