"""CPU copy threads: torch copies run serially on hand-made threads, work claimed dynamically.

A CPU load is cut into *steps* (a layer or a group of layers, reported in order) of
*units* (a few MiB of copies: a ``memmove`` batch or one serial torch copy call).
:func:`run_steps` hands every unit to a shared pool of ``torch.get_num_threads()`` copy
threads; each claims the next unclaimed unit, and the caller reports a step once all its
units have landed. Each copy thread sets its own OpenMP thread count to 1 (libgomp's
per-thread ``nthreads`` ICV, through ctypes), so a ``copy_`` there never opens an OpenMP
team. Where libgomp is not torch's OpenMP runtime (or absent),
:func:`serial_torch_threads` is False and callers keep torch copies on the caller's thread.
Why: ``docs/architecture.md``, "Copies between L1 and L2".
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache

import torch

__all__ = ["copy_threads", "host_busy", "run_steps", "serial_torch_threads"]

Unit = Callable[[], object]
"""One piece of copy work; its return value is ignored."""

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_pid = 0
_serial = False
_pool_lock = threading.Lock()


@cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """libgomp's ``omp_set_num_threads`` from the copy torch loaded, or None."""
    if not sys.platform.startswith("linux"):
        return None
    path = None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                name = line.rsplit(None, 1)[-1]
                if "libgomp" in os.path.basename(name):
                    path = name
                    break
    except OSError:
        return None
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).omp_set_num_threads
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = None
    setter: Callable[[int], None] = fn
    return setter


def _serial_thread() -> None:
    """Pool initializer: torch ops on this thread run on it alone (see the module doc)."""
    torch.get_num_threads()  # torch's per-thread lazy init first, so it cannot undo ours
    setter = _omp_set_num_threads()
    if setter is not None:
        setter(1)


def _probe() -> int:
    return torch.get_num_threads()


def copy_threads(n: int) -> ThreadPoolExecutor:
    """The shared pool of at least ``n`` (>= 1) serial copy threads, started lazily (and
    again in a forked child, which inherits the pool but not its threads)."""
    global _pool, _pool_size, _pool_pid, _serial
    with _pool_lock:
        forked = _pool_pid != os.getpid()
        if _pool is None or _pool_size < n or forked:
            old = None if forked else _pool
            pool = ThreadPoolExecutor(
                max_workers=n, thread_name_prefix="hicache-copy", initializer=_serial_thread
            )
            # every thread must be up (and serial) before the probe answers for all of them
            barrier = threading.Barrier(n)
            probes = [pool.submit(lambda: (barrier.wait(), _probe())[1]) for _ in range(n)]
            _serial = all(p.result() == 1 for p in probes)
            _pool, _pool_size, _pool_pid = pool, n, os.getpid()
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def serial_torch_threads() -> bool:
    """Whether torch ops on the copy threads run serially (libgomp found and obeyed);
    starts the pool (``torch.get_num_threads()`` threads) if it is not up."""
    copy_threads(max(1, torch.get_num_threads()))
    return _serial


def host_busy(loadavg: str = "/proc/loadavg") -> bool:
    """Whether more threads are runnable on the host right now than this process has CPUs
    (the running count of Linux's ``/proc/loadavg``, this thread and any spinning OpenMP
    worker included): then an OpenMP team would wait at its barriers for a descheduled
    thread. False where the count is unknown (``loadavg``: the file to read).

    Why it matters (docs/benchmarks/transfer.md, "Page-first loads (issue 27)"): on a quiet 2-vCPU
    host torch's own OpenMP copies beat the serial copy threads by ~25% (the copy threads
    share a core with OpenMP's worker, which spins for up to ~7 ms after each parallel
    region), while on a busy one a chain of OpenMP copies falls to a tenth of that speed.
    """
    try:
        with open(loadavg) as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return False
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return running > cpus


def run_steps(
    steps: Sequence[Sequence[Unit]],
    done: Callable[[int], None],
    *,
    threads: int | None = None,
) -> None:
    """Run every unit of ``steps`` on ``threads`` copy threads (default
    ``torch.get_num_threads()``), claimed in order (step 0's units first), and call
    ``done(s)`` on the caller's thread for ``s = 0, 1, ...`` once every unit of step ``s``
    has ended. With one thread the caller runs the units itself.

    On an error no further unit is claimed; once every unit started has ended, the steps
    whose units all ended are reported (in order, up to the first that did not) and the
    first error is raised; later steps may be partly copied.
    """
    want = torch.get_num_threads() if threads is None else threads
    if want <= 1:
        for s, units in enumerate(steps):
            for unit in units:
                unit()
            done(s)
        return
    flat = [(s, unit) for s, units in enumerate(steps) for unit in units]
    left = [len(units) for units in steps]
    claim = itertools.count()
    cond = threading.Condition()
    errors: list[BaseException] = []

    def work() -> None:
        while not errors:
            i = next(claim)  # atomic under the GIL
            if i >= len(flat):
                return
            s, unit = flat[i]
            try:
                unit()
            except BaseException as exc:
                with cond:
                    errors.append(exc)
                    cond.notify_all()
                return
            with cond:
                left[s] -= 1
                if left[s] == 0:
                    cond.notify_all()

    pool = copy_threads(want)
    futures: list[Future[None]] = [pool.submit(work) for _ in range(min(want, len(flat)))]
    reported = 0
    try:
        for s in range(len(steps)):
            with cond:
                while left[s] and not errors:
                    cond.wait()
                if left[s]:
                    break
            done(s)
            reported += 1
    except BaseException as exc:
        with cond:
            errors.append(exc)  # stop the threads claiming more
        raise
    finally:
        for f in futures:
            f.result()
    if not errors:
        return
    # a unit failed: the steps whose units had all ended are still reported, in order
    while reported < len(steps) and not left[reported]:
        done(reported)
        reported += 1
    raise errors[0]
