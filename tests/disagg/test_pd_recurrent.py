"""Recurrent-state models (Qwen3-Next's Gated DeltaNet, Nemotron-H's Mamba2) through a
prefill/decode pair in one process: the prefill side sends each rank's state after the
prompt with the last pages (:mod:`hicache.engine.roles.state_slots`), the decode side
resumes from it. Greedy answers equal a plain engine's, also when the decode side's own
cache holds part of the prompt; every state slot is free again once the rooms end; a
pair of two TP sizes is refused naming both. TP 2 pairs: tests/disagg/test_pd_tp.py."""

from __future__ import annotations

import ctypes

import pytest
import torch

from hicache.disagg.config import Bootstrap
from hicache.disagg.layout import (
    InstanceLayout,
    LayoutMismatch,
    RankTarget,
    Registration,
    StoreLayout,
    StoreTarget,
    check_pair,
)
from hicache.disagg.rooms import RoomResult
from hicache.disagg.sender import SendJob, SourcePages, plan_spans
from hicache.engine.front.engine import Engine
from hicache.engine.roles.decode import DecodeRole
from hicache.engine.roles.prefill import PrefillRole
from hicache.engine.roles.state_slots import StateSlots
from hicache.extras import KeptState
from hicache.spec import SnapshotSpec, StateTensor
from tests.disagg.test_pd_engine import (
    GREEDY,
    PROMPT,
    assert_idle,
    make_engine,
    pair,
    reference,
    run_room,
)

MODELS = ("tiny-random-qwen3-next", "tiny-random-nemotron-h")


def free_state_slots(e: Engine) -> tuple[int, int]:
    """(free, all) state slots of ``e``'s role."""

    def count() -> tuple[int, int]:
        role = e.core.scheduler.role
        assert isinstance(role, PrefillRole | DecodeRole)
        states = role.carried[1] if isinstance(role, PrefillRole) else role.states
        assert states is not None, "a recurrent model's role has state slots"
        alloc = states.pool.allocator
        return alloc.free_pages, alloc.num_pages

    return e.call(count).result(timeout=30)


@pytest.mark.parametrize("model", MODELS)
def test_a_recurrent_pair_answers_as_a_plain_engine(model: str) -> None:
    want = reference(model)
    with pair(model) as (prefill, decode):
        p, d = run_room(prefill, decode, 1)
        assert p.error is None and d.error is None, (p.error, d.error)
        assert p.output_ids == want[:1]
        assert d.output_ids == want
        # again, the decode side first: the prefill side resumes from its own snapshot
        p, d = run_room(prefill, decode, 2, decode_first=True, delay=0.2)
        assert d.output_ids == want and p.error is None
        assert p.cached.device > 0
        # a longer prompt the decode side's cache holds part of (the first answer's
        # conversation, its state snapshot at a page boundary past the prompt): the decode
        # side skips those pages, the prefill sends the rest and the state after all of it
        longer = PROMPT + want[:7] + list(range(500, 509))
        want_longer = reference(model, longer)
        p, d = run_room(prefill, decode, 3, prompt=longer)
        assert p.error is None and d.error is None, (p.error, d.error)
        assert d.cached.device > 0, "the decode side hit its own cache"
        assert d.output_ids == want_longer
        assert_idle(prefill, decode)
        for e in (prefill, decode):
            free, total = free_state_slots(e)
            assert free == total, (e.config.disagg.mode, free, total)


def test_a_recurrent_pair_of_two_tp_sizes_is_refused_naming_both() -> None:
    def layout(tp: int) -> InstanceLayout:
        stores = (
            StoreLayout("full", 2, 1, 64 // tp, "float32", kv_heads=2),
            StoreLayout("state.conv", 1, 1, 96 // tp, "float32", state=True),
        )
        return InstanceLayout("m", "f", 4, tp, False, "mooncake", stores, num_heads=4)

    check_pair(layout(2), layout(2))
    with pytest.raises(LayoutMismatch, match="tp_size differs") as err:
        check_pair(layout(1), layout(2))
    assert "has 1" in str(err.value) and "decode instance 2" in str(err.value)
    assert "recurrent state" in str(err.value)
    again = InstanceLayout.from_json(layout(2).to_json())
    assert again == layout(2)  # the state flag crosses the bootstrap's JSON


def test_a_recurrent_engine_pair_starts_with_its_state_slots() -> None:
    """The decode side's state slots: one per running request (a parked request holds a
    running slot), so a registration never waits for one."""
    with make_engine("tiny-random-nemotron-h", "decode", transfer_backend="mooncake") as d:
        free, total = free_state_slots(d)
        assert free == total == d.config.scheduler.max_running_requests
        alone = Bootstrap("2.2.2.2", 8998, 5)  # the router's no-transfer host
        out = d.generate(PROMPT, GREEDY, bootstrap=alone)
        assert out.output_ids == reference("tiny-random-nemotron-h")


def test_a_state_slot_crosses_whole_past_the_decode_sides_prefix() -> None:
    """The prefill's slot 2 lands in the decode's slot 1, every tensor whole (conv in
    the model's dtype, ssm in fp32), though the decode side holds 3 pages already."""
    spec = SnapshotSpec(
        num_layers=3,
        tensors=(
            StateTensor(name="conv", shape=(6, 3), dtype="bfloat16"),
            StateTensor(name="ssm", shape=(2, 4, 5)),
        ),
    )
    src, dst = StateSlots(spec, 4, "cpu"), StateSlots(spec, 3, "cpu")
    g = torch.Generator().manual_seed(0)
    state = KeptState(
        13,
        (
            torch.randn(1, 3, 6, 3, generator=g).to(torch.bfloat16),
            torch.randn(1, 3, 2, 4, 5, generator=g),
        ),
    )
    assert src.claim("a") == 0 and src.claim("b") == 1 and src.claim("x") == 2
    src.write(2, state)
    assert dst.claim("y") == 0 and dst.claim("x") == 1
    stores = tuple(
        StoreLayout(n, g.num_kv, g.layers, g.row_bytes, g.dtype, state=True)
        for n, g in src.geometry().items()
    )
    layout = InstanceLayout("m", "f", 4, 1, False, "mooncake", stores)
    geo = dst.geometry()
    reg = Registration(
        room=1,
        layout=layout,
        ranks=(RankTarget("d0", {n: g.to_dict() for n, g in geo.items()}),),
        prompt_len=13,
        prompt_hash="h",
        skip_pages=3,
        targets=tuple(StoreTarget(n, 0, (1,)) for n in dst.names),
    )
    sources = tuple(SourcePages(n, g, 0, (2,), stable=False) for n, g in src.geometry().items())
    partial = SendJob(rid="x", room=1, prompt_len=13, prompt_hash="h", sources=sources, upto=3)
    assert plan_spans(partial, reg, layout=layout) == []  # the state goes with the last job
    done = RoomResult(first_token=7)
    final = SendJob(rid="x", room=1, prompt_len=13, prompt_hash="h", sources=sources, result=done)
    [(endpoint, spans)] = plan_spans(final, reg, 3, layout=layout)
    assert endpoint == "d0" and len(spans) == 2  # one run per tensor
    for span in spans:
        ctypes.memmove(span.dst, span.src, span.nbytes)
    got = dst.read(1, 13)
    assert got.tokens == 13
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, state.tensors, strict=True))
    assert not dst.read(0, 1).tensors[1].any()  # the other slot untouched
    dst.free("x")
    dst.free("x")  # a no-op
    assert dst.pool.allocator.free_pages == 2
