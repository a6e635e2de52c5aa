"""A check that an optional fast path works on a device, run once per device.

Custom kernels (Triton) that cannot be tested on every GPU, driver and compiler version a
deployment meets are guarded the same way: before first use on a device, a probe runs
them on a small case against the reference path; a failure, an error or a wrong result
logs one warning and the caller keeps its reference path on that device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

__all__ = ["DeviceProbe"]


class DeviceProbe:
    """``probe(device) -> bool``: ``check(device)`` run once per device, its result kept.

    ``what`` names the fast path and ``fallback`` the path used instead, for the warning
    logged (once per device) when ``check`` returns False or raises."""

    def __init__(
        self,
        what: str,
        fallback: str,
        check: Callable[[torch.device], bool],
        log: logging.Logger,
    ) -> None:
        self.what = what
        self.fallback = fallback
        self._check = check
        self._log = log
        self._results: dict[torch.device, bool] = {}

    def __call__(self, device: torch.device) -> bool:
        if device in self._results:
            return self._results[device]
        ok = False
        try:
            ok = bool(self._check(device))
            if not ok:
                self._log.warning(
                    "%s gave wrong results on %s; using %s", self.what, device, self.fallback
                )
        except Exception as exc:  # not installed, a compile or launch error: fall back
            self._log.warning(
                "%s cannot run on %s (%s); using %s", self.what, device, exc, self.fallback
            )
        self._results[device] = ok
        return ok
