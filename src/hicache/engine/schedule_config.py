"""The scheduler's limits and policies: :class:`SchedulerConfig`, :class:`SchedulePolicy`
(see :mod:`hicache.engine.step.scheduler`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hicache.validate import int_at_least, is_int, number_at_least, require

LPM_MAX_WAITING = 128
"""Above this many waiting requests ``lpm`` orders them as ``fcfs`` (as SGLang does): its
key costs one prefix match per waiting request per step."""


class SchedulePolicy(str, enum.Enum):
    """The order waiting requests are admitted in, within one priority and fair-share
    class (see :meth:`Scheduler.admission_order`)."""

    FCFS = "fcfs"
    """First come, first served (a retracted request first of all)."""
    LPM = "lpm"
    """Longest cached prefix first (L1 + L2, as the cache matches it now); ties first come."""


_UNSUPPORTED_POLICIES = ("dfs-weight", "lof", "random")
"""SGLang's other ``--schedule-policy`` names, refused with the supported ones."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Batching limits. ``chunked_prefill_size``: new prompt tokens per prefill step."""

    max_running_requests: int = 32
    chunked_prefill_size: int = 512
    disable_radix_cache: bool = False
    layer_wait_timeout_s: float = 60.0
    """Longest a forward waits for one layer of a prefix being loaded back from L2."""
    overlap_outputs: bool | None = None
    """Do a step's text work and reports while the next step's forward runs (see the
    module docstring); None: when the model runs on CUDA (a CPU forward is synchronous, so
    there deferring them would only delay them)."""
    schedule_policy: str = SchedulePolicy.FCFS.value
    """Admission order within a priority and fair-share class: ``fcfs`` or ``lpm``
    (:class:`SchedulePolicy`)."""
    max_running_requests_per_group: int | None = None
    """Running slots one client request (a group: its ``n`` copies and batched prompts)
    may hold at once; waiting requests of the group holding the fewest slots go first.
    None: half of ``max_running_requests`` (at least 1); 0: no group rule at all (the
    policy's order alone, as before groups existed)."""
    lend_idle_slots: bool = True
    """With a group rule: a group may run past its cap while no request of a group below
    its cap waits ready, and gives the lent slots back (its sequences past the cap are
    retracted, their KV kept cached) when one does (see the module docstring). False: the
    cap is strict, slots stay idle rather than lent."""

    def __post_init__(self) -> None:
        int_at_least("max_running_requests", self.max_running_requests, 1)
        if self.schedule_policy in _UNSUPPORTED_POLICIES:
            raise ValueError(
                f"schedule_policy={self.schedule_policy!r} is not supported; supported:"
                f" {', '.join(p.value for p in SchedulePolicy)}"
            )
        require(
            self.schedule_policy in tuple(p.value for p in SchedulePolicy),
            "schedule_policy",
            self.schedule_policy,
            f"choose one of {', '.join(p.value for p in SchedulePolicy)}",
        )
        cap = self.max_running_requests_per_group
        require(
            cap is None or (is_int(cap) and 0 <= cap <= self.max_running_requests),
            "max_running_requests_per_group",
            cap,
            f"must be None (half the running slots), 0 (no group rule) or an int in"
            f" [1, max_running_requests={self.max_running_requests}]",
        )
        require(
            isinstance(self.lend_idle_slots, bool),
            "lend_idle_slots",
            self.lend_idle_slots,
            "must be a bool",
        )
        int_at_least("chunked_prefill_size", self.chunked_prefill_size, 1, "(tokens)")
        require(
            isinstance(self.disable_radix_cache, bool),
            "disable_radix_cache",
            self.disable_radix_cache,
            "must be a bool",
        )
        number_at_least("layer_wait_timeout_s", self.layer_wait_timeout_s, 0.001, "of seconds")
        require(
            self.overlap_outputs is None or isinstance(self.overlap_outputs, bool),
            "overlap_outputs",
            self.overlap_outputs,
            "must be a bool or None",
        )

    @property
    def group_cap(self) -> int | None:
        """Running slots a group may hold (None: no group rule)."""
        cap = self.max_running_requests_per_group
        if cap is None:
            return max(1, self.max_running_requests // 2)
        return cap or None


__all__ = ["LPM_MAX_WAITING", "SchedulePolicy", "SchedulerConfig"]
