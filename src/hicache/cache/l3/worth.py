"""Whether an L3 hit is worth waiting for and reading, by this rank's measured rates.

Seconds for ``n`` tokens (:mod:`hicache.rates`, all per rank): restoring them costs their
read from L3 into L2 (the ``storage`` cost line over ``n * token_bytes``) and their load
back into L1 (the ``host`` line; 0 while unmeasured: it overlaps the forward layer by
layer); waiting for a prefetch costs its lookup (the ``lookup`` line at one lookup) and
the restore; recomputing costs ``n`` times the prefill's seconds per token (the slope of
its cost line: a forward's fixed cost is paid whatever is loaded); what a read saves
over recomputing is a straight line in ``n`` too (:meth:`RestoreCosts.read_gain`), which
bounds a lookup's wait for announced pages. A rate never
measured, or last measured more than ``max_age_s`` ago, is unknown, and so is every
answer that needs it (None): the caller then reads (to measure) and waits as configured
(:mod:`hicache.cache.l3.reads`). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.rates import RateFit, RestoreMeter, Throughput

__all__ = ["DEFAULT_RATE_MAX_AGE_S", "RestoreCosts"]

DEFAULT_RATE_MAX_AGE_S = 30.0
"""A restore rate last measured longer ago than this is not trusted: the L3 it measured
may have recovered (or slowed) since, and a decision taken by it would never measure it
again."""


def _fresh(meter: Throughput, now: float, max_age_s: float) -> RateFit | None:
    if meter.last_at is None or now - meter.last_at > max_age_s:
        return None
    return meter.estimate()


@dataclass(frozen=True, slots=True)
class RestoreCosts:
    """This rank's cost lines at one point (see the module docstring): ``read`` and
    ``load`` in bytes (L3 -> L2, L2 -> L1), ``lookup`` in lookups, ``prefill`` in tokens;
    ``token_bytes``: the bytes of one token's KV on this rank (> 0)."""

    token_bytes: int
    read: RateFit | None = None
    load: RateFit | None = None
    lookup: RateFit | None = None
    prefill: RateFit | None = None

    @classmethod
    def measured(
        cls,
        meter: RestoreMeter,
        prefill: RateFit | None,
        now: float,
        max_age_s: float = DEFAULT_RATE_MAX_AGE_S,
    ) -> RestoreCosts:
        """The meters' estimates not older than ``max_age_s`` at ``now`` (their clock)."""
        return cls(
            token_bytes=meter.token_bytes,
            read=_fresh(meter.storage, now, max_age_s),
            load=_fresh(meter.host, now, max_age_s),
            lookup=_fresh(meter.lookup, now, max_age_s),
            prefill=prefill,
        )

    def restore_s(self, tokens: int) -> float | None:
        """Seconds to read ``tokens`` from L3 and load them into L1; None: unknown."""
        if self.read is None:
            return None
        nbytes = tokens * self.token_bytes
        return self.read.seconds(nbytes) + (0.0 if self.load is None else self.load.seconds(nbytes))

    def recompute_s(self, tokens: int) -> float | None:
        """Seconds computing ``tokens`` more adds to a forward; None: unknown."""
        return None if self.prefill is None else tokens * self.prefill.seconds_per_unit

    def worth_reading(self, tokens: int) -> bool | None:
        """Whether reading a hit of ``tokens`` (> 0) from L3 beats recomputing it (its
        lookup is paid already); None: unknown."""
        restore, recompute = self.restore_s(tokens), self.recompute_s(tokens)
        if restore is None or recompute is None:
            return None
        return restore < recompute

    def read_gain(self) -> tuple[float, float] | None:
        """What reading a hit saves over recomputing it, as the line ``(fixed_s,
        per_token_s)``: ``recompute_s(n) - restore_s(n) == n * per_token_s - fixed_s``
        (``fixed_s >= 0``: the read's and load's fixed costs; ``per_token_s`` may be <= 0:
        no hit pays). Positive exactly where :meth:`worth_reading` is True: the longest a
        hit of ``n`` tokens may be waited for and still beat recomputing it. None: unknown."""
        if self.read is None or self.prefill is None:
            return None
        tb = self.token_bytes
        fixed = self.read.overhead_s
        per_token = self.prefill.seconds_per_unit - tb * self.read.seconds_per_unit
        if self.load is not None:
            fixed += self.load.overhead_s
            per_token -= tb * self.load.seconds_per_unit
        return fixed, per_token

    def worth_waiting(self, tokens: int) -> bool | None:
        """Whether a request should wait for the prefetch of up to ``tokens`` (> 0): its
        lookup, then the restore of a whole hit, take less than recomputing it (else the
        request goes on at once, and recomputes). None: unknown."""
        restore, recompute = self.restore_s(tokens), self.recompute_s(tokens)
        if restore is None or recompute is None:
            return None
        lookup = 0.0 if self.lookup is None else self.lookup.seconds(1)
        return lookup + restore < recompute
