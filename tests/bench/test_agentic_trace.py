"""The agentic trace generator (:mod:`hicache.bench.agentic_trace`): exact on a seed."""

from __future__ import annotations

import dataclasses

import pytest

from hicache.bench.agentic_trace import TraceShape, make_trace

SHAPE = TraceShape(
    sessions=25, turns=(4, 9), subagent_turns=(2, 3), system_tokens=64, task_tokens=16,
    tool_tokens=(100, 300), output_tokens=8, pause_median_s=2.0, pause_sigma=0.8,
    pause_min_s=0.5, pause_max_s=6.0, start_spread_s=3.0, oneoffs=7,
    oneoff_tokens=(500, 900), oneoff_rate=2.0,
)  # fmt: skip


def test_exact_on_a_seed() -> None:
    t = make_trace(SHAPE, seed=0)
    roots, subs = t.roots, [s for s in t.sessions if s.parent is not None]
    assert len(roots) == 25 and len(subs) == 11  # round(0.44 * 25)
    assert [s.turns for s in roots] == [4, 7, 8, 9, 5, 6, 6, 8, 4, 5, 4, 6, 6, 9, 4, 9,
                                        8, 9, 5, 4, 6, 7, 6, 4, 6]  # fmt: skip
    assert [s.parent for s in subs] == [3, 7, 8, 9, 10, 11, 15, 19, 21, 23, 24]
    assert [s.fork_turn for s in subs] == [3, 0, 2, 0, 2, 2, 5, 2, 3, 2, 4]
    assert t.requests() == sum(s.turns for s in t.sessions) + 7
    assert make_trace(SHAPE, seed=0) == t


def test_shape_invariants() -> None:
    t = make_trace(SHAPE, seed=3)
    assert len(t.system) == 64
    assert [s.index for s in t.sessions] == list(range(len(t.sessions)))
    pauses = [p for s in t.sessions for p in s.pauses_s]
    assert min(pauses) >= 0.5 and max(pauses) <= 6.0
    assert any(p == 0.5 for p in pauses) and any(p == 6.0 for p in pauses)  # clipped both ends
    assert all(100 <= len(tool) <= 300 for s in t.sessions for tool in s.tools)
    assert all(len(s.pauses_s) == len(s.tools) == s.turns - 1 for s in t.sessions)
    for s in t.sessions:
        if s.parent is None:
            assert 4 <= s.turns <= 9 and 0.0 <= s.start_s <= 3.0
        else:
            assert 2 <= s.turns <= 3 and 0 <= s.fork_turn < t.sessions[s.parent].turns - 1
            assert t.sessions[s.parent].parent is None
    at = [o.at_s for o in t.oneoffs]
    assert at == sorted(at) and at[0] > 0
    assert all(500 <= len(o.ids) <= 900 for o in t.oneoffs)
    # working set: the system prompt once, every session's own tokens and answers, one-offs
    own = sum(s.new_tokens() + 8 * s.turns for s in t.sessions)
    assert t.working_set_tokens() == 64 + own + sum(len(o.ids) for o in t.oneoffs)
    assert t.longest_context() <= t.working_set_tokens()


def test_repetitions_share_no_prefix_and_seeds_differ() -> None:
    a, b = make_trace(SHAPE, seed=0), make_trace(SHAPE, seed=0, repetition=1)
    assert a.system != b.system and a.sessions[0].task != b.sessions[0].task
    assert make_trace(SHAPE, seed=1).system != a.system


def test_subagent_share_over_many_seeds() -> None:
    shape = dataclasses.replace(SHAPE, sessions=50, oneoffs=0)
    for seed in range(5):
        t = make_trace(shape, seed)
        assert len(t.sessions) - len(t.roots) == 22  # exactly 44% of 50 roots fork


@pytest.mark.parametrize(
    "change",
    [dict(turns=(0, 3)), dict(turns=(5, 3)), dict(sessions=0), dict(pause_max_s=0.1),
     dict(pause_sigma=float("nan")), dict(subagent_share=1.5), dict(oneoff_rate=0.0),
     dict(turns=(1, 3)), dict(oneoffs=-1)],
)  # fmt: skip
def test_bad_shapes_are_refused(change: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(SHAPE, **change)  # type: ignore[arg-type]
