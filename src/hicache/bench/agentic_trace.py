"""The agentic trace of ``hicache bench agentic``: sessions, turns, subagents, one-offs.

Pure, seeded code (no IO, no clock): :func:`make_trace` turns a :class:`TraceShape` and
``(seed, repetition)`` into a :class:`Trace`. Shape: one system prompt shared by every
session; ``sessions`` root sessions, each a task then ``turns`` turns whose new tokens are
a tool result (``tool_tokens`` ids) after a tool pause (seconds, log-normal, clipped);
exactly ``round(subagent_share * sessions)`` roots fork one subagent after one of their
turns (its prompt: the parent's history so far + a task of its own); one-off prompts of
``oneoff_tokens`` unique ids at Poisson times, no session. Units: tokens, seconds.
Invariants: the same (shape, seed, repetition) gives the same trace; two repetitions
share no token run (fresh ids); a session has >= 1 turn; pauses lie in
``[pause_min_s, pause_max_s]``; a subagent forks before its parent's last turn.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["OneOff", "SessionTrace", "Trace", "TraceShape", "make_trace"]


@dataclass(frozen=True, kw_only=True)
class TraceShape:
    """The trace's shape; ranges are inclusive ``(low, high)`` drawn uniformly."""

    sessions: int
    turns: tuple[int, int]
    """Turns of a root session (the first one is the task, without a pause)."""
    subagent_turns: tuple[int, int]
    system_tokens: int
    task_tokens: int
    tool_tokens: tuple[int, int]
    output_tokens: int
    """Tokens of every answer (the model's own ids, appended to the history)."""
    pause_median_s: float
    pause_sigma: float
    """Log-normal tool pause: ``median * exp(sigma * N(0, 1))``, clipped below."""
    pause_min_s: float
    pause_max_s: float
    start_spread_s: float
    """Root sessions start uniformly in ``[0, start_spread_s]``."""
    subagent_share: float = 0.44
    oneoffs: int = 0
    oneoff_tokens: tuple[int, int] = (1, 1)
    oneoff_rate: float = 1.0
    """One-off requests per second (Poisson), from time 0."""

    def __post_init__(self) -> None:
        ranges = {"turns": self.turns, "subagent_turns": self.subagent_turns,
                  "tool_tokens": self.tool_tokens, "oneoff_tokens": self.oneoff_tokens}  # fmt: skip
        for name, (lo, hi) in ranges.items():
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}={(lo, hi)!r} is invalid; need 1 <= low <= high")
        counts = {"sessions": self.sessions, "system_tokens": self.system_tokens,
                  "task_tokens": self.task_tokens, "output_tokens": self.output_tokens}  # fmt: skip
        for name, n in counts.items():
            if n < 1:
                raise ValueError(f"{name}={n!r} is invalid; must be >= 1")
        if self.oneoffs < 0:
            raise ValueError(f"oneoffs={self.oneoffs!r} is invalid; must be >= 0")
        secs = {"pause_median_s": self.pause_median_s, "pause_sigma": self.pause_sigma,
                "pause_min_s": self.pause_min_s, "start_spread_s": self.start_spread_s}  # fmt: skip
        for name, s in secs.items():
            if not (math.isfinite(s) and s >= 0):
                raise ValueError(f"{name}={s!r} is invalid; must be a finite number >= 0")
        if not self.pause_min_s <= self.pause_max_s < math.inf:
            raise ValueError(f"pause_max_s={self.pause_max_s!r} must be in [pause_min_s, inf)")
        if not 0.0 <= self.subagent_share <= 1.0:
            raise ValueError(f"subagent_share={self.subagent_share!r} must be in [0, 1]")
        if not (math.isfinite(self.oneoff_rate) and self.oneoff_rate > 0):
            raise ValueError(f"oneoff_rate={self.oneoff_rate!r} must be a finite number > 0")
        if self.turns[0] < 2 and self.subagent_share > 0:
            raise ValueError("a root with a subagent needs >= 2 turns: turns low must be >= 2")


@dataclass(frozen=True)
class SessionTrace:
    """One session: a root (``parent is None``) or a subagent of root ``parent``."""

    index: int
    parent: int | None
    fork_turn: int
    """A subagent starts when its parent's turn ``fork_turn`` has answered (0 for roots)."""
    start_s: float
    """A root's first request time (s from the run's start); 0.0 for subagents."""
    task: tuple[int, ...]
    """The first turn's new ids (after the system prompt, or the parent's history)."""
    tools: tuple[tuple[int, ...], ...]
    """``tools[i]``: the tool result that opens turn ``i + 1``."""
    pauses_s: tuple[float, ...]
    """``pauses_s[i]``: the tool's run time before turn ``i + 1``."""

    @property
    def turns(self) -> int:
        return 1 + len(self.tools)

    def new_tokens(self) -> int:
        """Tokens this session adds to its context (task, tool results; answers apart)."""
        return len(self.task) + sum(len(t) for t in self.tools)


@dataclass(frozen=True)
class OneOff:
    """A sessionless request: ``ids`` at ``at_s`` seconds from the run's start."""

    at_s: float
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    shape: TraceShape
    system: tuple[int, ...]
    sessions: tuple[SessionTrace, ...]
    """Roots first (indices ``0 .. shape.sessions - 1``), then subagents."""
    oneoffs: tuple[OneOff, ...]

    @property
    def roots(self) -> tuple[SessionTrace, ...]:
        return tuple(s for s in self.sessions if s.parent is None)

    def subagents_of(self, index: int) -> tuple[SessionTrace, ...]:
        return tuple(s for s in self.sessions if s.parent == index)

    def requests(self) -> int:
        """Every request of the trace: each session's turns and each one-off."""
        return sum(s.turns for s in self.sessions) + len(self.oneoffs)

    def working_set_tokens(self) -> int:
        """Distinct tokens the trace's prompts and answers hold at the end: the system
        prompt once, each session's own tokens and answers (a subagent's forked prefix
        is its parent's), each one-off."""
        out = self.shape.output_tokens
        own = sum(s.new_tokens() + s.turns * out for s in self.sessions)
        return len(self.system) + own + sum(len(o.ids) for o in self.oneoffs)

    def longest_context(self) -> int:
        """The longest prompt plus answer of any request (tokens)."""
        out = self.shape.output_tokens
        longest = 0
        for s in self.sessions:
            base = len(self.system)
            if s.parent is not None:
                p = self.sessions[s.parent]
                base += len(p.task) + sum(len(t) for t in p.tools[: s.fork_turn])
                base += (s.fork_turn + 1) * out
            longest = max(longest, base + s.new_tokens() + s.turns * out)
        return max([longest, *(len(o.ids) + out for o in self.oneoffs)])


def make_trace(
    shape: TraceShape, seed: int, repetition: int = 0, vocab: tuple[int, int] = (1000, 30000)
) -> Trace:
    """The trace of ``shape`` for ``(seed, repetition)``; ids drawn from ``[vocab)``."""
    rng = random.Random(f"agentic/{seed}/{repetition}")
    lo, hi = vocab

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(lo, hi) for _ in range(n))

    def pause() -> float:
        x = shape.pause_median_s * math.exp(shape.pause_sigma * rng.gauss(0.0, 1.0))
        return min(shape.pause_max_s, max(shape.pause_min_s, x))

    def body(turns: int) -> tuple[tuple[tuple[int, ...], ...], tuple[float, ...]]:
        tools = tuple(ids(rng.randint(*shape.tool_tokens)) for _ in range(turns - 1))
        return tools, tuple(pause() for _ in range(turns - 1))

    system = ids(shape.system_tokens)
    sessions: list[SessionTrace] = []
    for i in range(shape.sessions):
        start = rng.uniform(0.0, shape.start_spread_s)
        task = ids(shape.task_tokens)
        tools, pauses = body(rng.randint(*shape.turns))
        sessions.append(SessionTrace(i, None, 0, start, task, tools, pauses))
    forking = sorted(
        rng.sample(range(shape.sessions), round(shape.subagent_share * shape.sessions))
    )
    for parent in forking:
        fork = rng.randrange(sessions[parent].turns - 1)
        task = ids(shape.task_tokens)
        tools, pauses = body(rng.randint(*shape.subagent_turns))
        sessions.append(SessionTrace(len(sessions), parent, fork, 0.0, task, tools, pauses))
    oneoffs: list[OneOff] = []
    t = 0.0
    for _ in range(shape.oneoffs):
        t += rng.expovariate(shape.oneoff_rate)
        oneoffs.append(OneOff(t, ids(rng.randint(*shape.oneoff_tokens))))
    return Trace(shape, system, tuple(sessions), tuple(oneoffs))
