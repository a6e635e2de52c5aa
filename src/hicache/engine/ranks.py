"""The engine's rank processes under tensor parallelism (``tp_size`` > 1).

Rank 0 is the server's process and its engine; ranks 1 .. N-1 are spawned here
(``torch.multiprocessing``, ``spawn``; with several nodes each node spawns its own share,
:mod:`hicache.engine.nodes`) and run the same engine machinery in a follower loop,
without HTTP, joined by ``torch.distributed``: the default group (timeout
``dist_init_timeout_s``) serves the join alone; the model's collectives (gloo on CPU, NCCL
on CUDA) and the engine's and cache's agreements (gloo) run on groups of their own with
``collective_timeout_s``. Every step, on every rank in the same order
(:class:`StepChannel`): rank 0's :class:`~hicache.engine.step_inputs.StepInputs` (one
broadcast, also when empty), the cache's agreements, and after each sampling forward rank
0's tokens (:meth:`StepChannel.agree_tokens`). Every collective has a timeout; a frozen
follower shows first in its heartbeat (:mod:`hicache.engine.heartbeat`,
:meth:`RankProcesses.silent`); a dead one is reported once (:attr:`RankProcesses.failure`,
``on_failure``) and stops the engine. Start and stop (:class:`RankProcesses`):
docs/architecture.md, "Tensor-parallel ranks (the engine's side)".
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hicache.engine.heartbeat import Heartbeats
from hicache.engine.node_link import NodeLinks
from hicache.engine.nodes import (
    LINK_KEY,
    NodeCard,
    NodeConfig,
    NodeStartError,
    check_listenable,
    check_nodes,
    interface_of,
)
from hicache.engine.step_inputs import StepInputs

log = logging.getLogger(__name__)

DEFAULT_DIST_INIT_TIMEOUT_S = 120.0
"""Seconds every rank has to join the process group, and then to build its engine."""
COLLECTIVE_TIMEOUT_S = 600.0
"""Longest one collective waits for the other ranks (a forward of the longest prefill
included), by default (``--collective-timeout``): a rank that stalls past it makes the
others fail, not hang."""
STORE_CONNECT_S = 10.0
"""Least time rank 0's rendezvous store gives its own connection to itself."""
CLOSE_TIMEOUT_S = 30.0
"""Longest :meth:`RankProcesses.close` waits for the followers before killing them."""


class RankStartError(RuntimeError):
    """The ranks could not start; the message is one line naming the rank at fault."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSetup:
    """How rank ``rank`` of ``size`` joins the group: ``init_method``
    (``tcp://HOST:PORT``, 127.0.0.1 on one node), the model's ``backend`` (``gloo``, or ``nccl`` on CUDA),
    the join timeout ``init_timeout_s`` and every later collective's
    ``collective_timeout_s``; ``heartbeats``: where a follower beats (None: it does not)."""

    rank: int
    size: int
    init_method: str
    backend: str
    init_timeout_s: float
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    heartbeats: Heartbeats | None = None
    local_rank: int | None = None
    """Its index among its node's ranks (None: ``rank``, one node)."""
    interface: str | None = None
    """The network interface its gloo groups use (``GLOO_SOCKET_IFNAME``, unless set
    already; None: gloo's default)."""

    @property
    def local(self) -> int:
        return self.rank if self.local_rank is None else self.local_rank


def use_interface(interface: str | None) -> None:
    """Make this process's gloo (and NCCL) connections use ``interface`` unless the
    environment names one already (None: leave the default)."""
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)


def rank_device(device: str, rank: int) -> str:
    """The device of a node's rank ``rank`` (its index among the node's ranks) when the
    node's first rank runs on ``device``: ``cpu`` for every rank; ``cuda:(k + rank)`` for
    ``cuda:k`` (``cuda`` = ``cuda:0``)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return device
    return f"cuda:{(dev.index or 0) + rank}"


def cpu_threads_per_rank(size: int) -> int:
    """Torch threads each of ``size`` CPU ranks uses: the cores shared out, at least 1."""
    return max(1, (os.cpu_count() or 1) // size)


class StepChannel:
    """One rank's end of what the ranks exchange each step, over a gloo group.

    Every method is a collective: every rank calls it the same number of times in the
    same order; rank 0's values win."""

    def __init__(self, rank: int, size: int, group: Any, model_group: Any = None) -> None:
        self.rank = rank
        self.size = size
        self.group = group
        """The gloo group of the step exchange; also the cache's agreement group."""
        self.model_group = model_group
        """The group the model's collectives run on (None: the default group)."""
        self.seconds = 0.0
        """Seconds spent so far in :meth:`inputs` and :meth:`agree_tokens` (the engine's
        agreement overhead, with ``cache.sync()``: ``Engine.agreement``)."""

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def inputs(self, inputs: StepInputs | None) -> StepInputs:
        """Rank 0's ``inputs`` on every rank (a follower passes None)."""
        box: list[Any] = [inputs]
        began = time.perf_counter()
        dist.broadcast_object_list(box, src=0, group=self.group)
        self.seconds += time.perf_counter() - began
        got = box[0]
        if not isinstance(got, StepInputs):
            raise RuntimeError(f"rank {self.rank} received {type(got).__name__}, not StepInputs")
        return got

    def gather(self, value: str) -> list[str]:
        """Every rank's ``value``, by rank (on every rank)."""
        out: list[object] = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return [str(v) for v in out]

    def exchange(self, value: object) -> list[object]:
        """Every rank's ``value`` (picklable), by rank, on every rank."""
        out: list[object] = [None] * self.size
        began = time.perf_counter()
        dist.all_gather_object(out, value, group=self.group)
        self.seconds += time.perf_counter() - began
        return out

    def agree_tokens(
        self, token_ids: Sequence[int], failed: Sequence[int]
    ) -> tuple[list[int], set[int]]:
        """Rank 0's sampled ``token_ids`` (one per sampled row) and its ``failed`` rows (those
        it could not sample) on every rank. Every rank passes as many token ids (the same
        rows); a follower's own values are ignored."""
        n = len(token_ids)
        t = torch.zeros(2, n, dtype=torch.int64)
        if self.leader:
            t[0] = torch.tensor(list(token_ids), dtype=torch.int64)
            for j in failed:
                t[1, j] = 1
        began = time.perf_counter()
        dist.broadcast(t, src=0, group=self.group)
        self.seconds += time.perf_counter() - began
        return t[0].tolist(), {j for j in range(n) if t[1, j]}


def open_store(size: int, timeout_s: float, host: str = "127.0.0.1", port: int = 0) -> Any:
    """Rank 0's rendezvous store (a ``TCPStore`` server) for ``size`` ranks, listening on
    ``host`` at ``port`` (0: one the system picks as it binds, ``.port``): bound and kept
    from the start, so nothing can take it between the choice and the bind, and an error
    here is rank 0's own. ``timeout_s`` bounds its waits for the other ranks' keys; its
    own connection to itself gets :data:`STORE_CONNECT_S` at least (a busy host)."""
    store = dist.TCPStore(
        host,
        port,
        size,
        is_master=True,
        timeout=timedelta(seconds=max(timeout_s, STORE_CONNECT_S)),
        wait_for_workers=False,
    )
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def join_group(setup: RankSetup, store: Any = None) -> StepChannel:
    """Join the process group as ``setup.rank`` (blocks until every rank has joined, at most
    ``init_timeout_s``) and return this rank's :class:`StepChannel`. ``store``: rank 0's
    own (:func:`open_store`); a follower connects to the one ``setup.init_method`` names."""
    timeout = timedelta(seconds=setup.init_timeout_s)
    if store is None:
        where = urlsplit(setup.init_method)
        if where.hostname is None or where.port is None:
            raise ValueError(f"init_method={setup.init_method!r} is not tcp://HOST:PORT")
        store = dist.TCPStore(
            where.hostname, where.port, setup.size, is_master=False, timeout=timeout
        )
    dist.init_process_group(
        setup.backend, store=store, rank=setup.rank, world_size=setup.size, timeout=timeout
    )
    # the default group's timeout is the join's: every later collective runs on a group
    # with the collective timeout, the model's (NCCL on CUDA) and the agreement's (gloo)
    timeout = timedelta(seconds=setup.collective_timeout_s)
    model_group = dist.new_group(backend=setup.backend, timeout=timeout)
    group = dist.new_group(backend="gloo", timeout=timeout)
    return StepChannel(setup.rank, setup.size, group, model_group)


def leave_group() -> None:
    """Destroy this process's group (idempotent; errors of a broken group are ignored)."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


FollowerTarget = Callable[[RankSetup, Any, Any], None]
"""A follower process's main: ``(setup, payload, conn)``; it sends ``("joining",)`` on
``conn`` right before it joins the group (rank 0 joins only once every follower has),
``("joined",)`` once in the group, ``("ready",)`` once its engine is built, or ``("error", line)``
before it exits on a failure."""


class RankProcesses:
    """A node's handle on its follower ranks (see the module docstring): on node 0 (one
    node: the only one) ranks 1 .. local-1, joined with rank 0 by :meth:`start`; on
    another node all of its ranks, spawned by :meth:`spawn` (docs/architecture.md, "Ranks
    on several nodes").

    ``target`` runs in each follower with ``(RankSetup, payload, conn)``; ``payload`` is
    pickled to it (the engine's config). ``nodes``: this node's place (one node by
    default); ``host``: where this node's ranks listen with several nodes (``--host``);
    ``card``: what this node was started with (node 0 compares the others' with it)."""

    def __init__(
        self,
        size: int,
        target: FollowerTarget,
        payload: Any,
        *,
        backend: str = "gloo",
        init_timeout_s: float = DEFAULT_DIST_INIT_TIMEOUT_S,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
        nodes: NodeConfig | None = None,
        host: str = "127.0.0.1",
        card: NodeCard | None = None,
    ) -> None:
        if size < 2:
            raise ValueError(f"RankProcesses needs at least 2 ranks, got {size}")
        self.size = size
        self.nodes = nodes if nodes is not None else NodeConfig()
        self._local = self.nodes.ranks(size)
        self._host = host
        self._card = card
        self._target = target
        self._payload = payload
        self.backend = backend
        self.init_timeout_s = init_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self._procs: dict[int, Any] = {}  # rank -> mp process
        self._conns: dict[int, Any] = {}  # rank -> rank 0's end of its pipe
        self._said: dict[int, list[tuple[Any, ...]]] = {}  # rank -> messages received
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self.failure: str | None = None
        """Why a follower died (naming the rank), once one has; None while all live."""
        self.channel: StepChannel | None = None
        self._heartbeats: Heartbeats | None = None
        self._links: NodeLinks | None = None
        """Node 0's links to the other nodes (None with one node, and on the others)."""

    @property
    def interface(self) -> str | None:
        """The network interface this node's ranks use (None: gloo's default; one node)."""
        return interface_of(self._host) if self.nodes.nnodes > 1 else None

    # ------------------------------------------------------------------ start

    def start(self) -> StepChannel:
        """Spawn the followers and join the group as rank 0; returns rank 0's channel.
        :class:`RankStartError` (one line naming the rank, or the node) when a rank does
        not join within ``init_timeout_s`` or dies first, or another node was started
        otherwise; the followers are stopped then."""
        if dist.is_initialized():  # the default group is per process
            raise RankStartError(
                "this process is in a process group already: one engine with tp_size > 1"
                " per process"
            )
        several = self.nodes.nnodes > 1
        host, port = self.nodes.address if several else ("127.0.0.1", 0)
        if several:
            try:
                check_listenable(self.nodes)
            except NodeStartError as exc:
                raise RankStartError(str(exc)) from exc
        try:
            store = open_store(self.size, self.init_timeout_s, host, port)
        except Exception as exc:
            where = f"--dist-init-addr {host}:{port}" if several else "127.0.0.1"
            raise RankStartError(
                f"{'node 0: ' if several else ''}rank 0 could not open the process group's"
                f" rendezvous on {where}: {str(exc).splitlines()[0] if str(exc) else exc!r}"
            ) from exc
        began = time.monotonic()
        try:
            if several:
                self._links = NodeLinks(self.nodes.nnodes, len(self._local))
                store.set(LINK_KEY, self._links.start(host))
            self.spawn(f"tcp://{host}:{store.port}")
            if several:
                assert self._card is not None, "node 0 compares the nodes' cards"
                try:
                    check_nodes(store, self._card, began + self.init_timeout_s)
                except NodeStartError as exc:
                    raise RankStartError(str(exc)) from exc
            use_interface(self.interface)
            self.channel = self._join(self._setup(0, f"tcp://{host}:{store.port}"), store)
        except BaseException:
            self.close(timeout=1.0, broken=True)
            raise
        return self.channel

    def spawn(self, init_method: str) -> None:
        """Start this node's followers, joining through ``init_method`` (node 0 opened
        the rendezvous there), each with its heartbeat."""
        ctx = mp.get_context("spawn")
        self._heartbeats = Heartbeats(self.size, ctx)
        for rank in self._local:
            if rank == 0:
                continue
            setup = self._setup(rank, init_method)
            ours, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=self._target,
                args=(setup, self._payload, theirs),
                name=f"hicache-rank-{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self._procs[rank] = proc
            self._conns[rank] = ours
            self._said[rank] = []

    def _join(self, setup: RankSetup, store: Any) -> StepChannel:
        """Join as rank 0 (over its ``store``) once every follower is about to (it said
        ``joining``): a follower that dies first fails the start at once, one that never
        gets there at the timeout, and rank 0 never waits in a rendezvous it could not
        leave."""
        began = time.monotonic()
        deadline = began + self.init_timeout_s
        self._wait_for(
            "joining",
            "before joining the process group",
            deadline,
            f"did not join the process group within {self.init_timeout_s:g} s"
            " (--dist-init-timeout)",
        )
        try:
            return join_group(setup, store)
        except Exception as exc:
            raise RankStartError(self._join_failure(exc, began)) from exc

    def _wait_for(self, kind: str, doing: str, deadline: float, missing: str) -> None:
        """Wait until every follower has sent a ``kind`` message (by ``deadline``,
        ``time.monotonic()``); :class:`RankStartError` for the first that failed (``doing``
        what) or has not (``rank N missing``)."""
        for rank in self._procs:
            while self._said_kind(rank, kind) is None:
                problem = self._rank_problem(rank, doing)
                if problem is not None:
                    raise RankStartError(problem)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RankStartError(f"rank {rank} {missing}")
                self._read(rank, min(left, 0.2))

    def _setup(self, rank: int, init_method: str) -> RankSetup:
        return RankSetup(
            local_rank=rank - self._local.start,
            interface=self.interface,
            rank=rank,
            size=self.size,
            init_method=init_method,
            backend=self.backend,
            init_timeout_s=self.init_timeout_s,
            collective_timeout_s=self.collective_timeout_s,
            heartbeats=self._heartbeats if rank > 0 else None,
        )

    def _read(self, rank: int, wait_s: float = 0.0) -> None:
        """Collect what ``rank`` has sent (waiting up to ``wait_s`` for something)."""
        conn = self._conns[rank]
        with contextlib.suppress(EOFError, OSError):
            if conn.poll(wait_s):
                while True:
                    self._said[rank].append(tuple(conn.recv()))
                    if not conn.poll(0):
                        break

    def _said_kind(self, rank: int, kind: str) -> tuple[Any, ...] | None:
        return next((m for m in self._said[rank] if m and m[0] == kind), None)

    def _rank_problem(self, rank: int, doing: str) -> str | None:
        """Why ``rank`` failed (its error line or its exit code), None while it lives."""
        self._read(rank)
        error = self._said_kind(rank, "error")
        if error is not None:
            return f"rank {rank} failed {doing}: {error[1]}"
        code = self._procs[rank].exitcode
        if code is not None:
            return f"rank {rank} (pid {self._procs[rank].pid}) exited with code {code} {doing}"
        return None

    def _join_failure(self, exc: BaseException, began: float) -> str:
        """The one line for a join that failed on rank 0 with ``exc`` (``began``: when the
        join started, ``time.monotonic()``): a follower that failed, else followers missing
        at the join timeout, else rank 0's own error (naming who had not joined yet)."""
        for rank in self._procs:
            problem = self._rank_problem(rank, "before joining the process group")
            if problem is not None:
                return problem
        problem = None if self._links is None else self._links.problem()
        if problem is not None:
            return problem
        missing = [r for r in self._procs if self._said_kind(r, "joined") is None]
        who = ", ".join(str(r) for r in missing)
        if missing and time.monotonic() - began >= self.init_timeout_s:
            return (
                f"rank {who} did not join the process group within"
                f" {self.init_timeout_s:g} s (--dist-init-timeout)"
            )
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        waiting = f" (rank {who} had not joined yet)" if missing else ""
        return f"rank 0 could not join the process group: {type(exc).__name__}: {first}{waiting}"

    def wait_joined(self) -> None:
        """Wait until every follower has joined the group (within ``init_timeout_s``; on
        a node other than node 0, where no rank joins with them);
        :class:`RankStartError` naming the first rank that failed or did not make it."""
        self._wait_for(
            "joined",
            "while joining the process group",
            time.monotonic() + self.init_timeout_s,
            f"did not join the process group within {self.init_timeout_s:g} s"
            " (--dist-init-timeout)",
        )

    def wait_ready(self) -> None:
        """Wait until every follower has built its engine (within ``init_timeout_s``);
        :class:`RankStartError` naming the first rank that failed or did not make it."""
        self._wait_for(
            "ready",
            "while building its engine",
            time.monotonic() + self.init_timeout_s,
            f"did not build its engine within {self.init_timeout_s:g} s (--dist-init-timeout)",
        )
        if self._links is not None:
            try:
                self._links.wait_ready(time.monotonic() + self.init_timeout_s, self.init_timeout_s)
            except RuntimeError as exc:
                raise RankStartError(str(exc)) from exc

    # ------------------------------------------------------------------ watch

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Start the thread that watches the followers: the first one to die while not
        closing sets :attr:`failure` and calls ``on_failure(failure)`` (once)."""
        if self._watcher is not None:
            return
        if self._links is not None:
            self._links.watch(on_failure)

        def run() -> None:
            sentinels = {self._procs[r].sentinel: r for r in self._procs}
            while not self._closing.is_set():
                ready = multiprocessing.connection.wait(list(sentinels), timeout=0.2)
                if not ready or self._closing.is_set():
                    continue
                rank = sentinels[ready[0]]
                proc = self._procs[rank]
                proc.join(timeout=1.0)
                self.failure = (
                    self._rank_problem(rank, "while serving")
                    or f"rank {rank} (pid {proc.pid}) stopped"
                )
                log.critical("%s; the engine stops", self.failure)
                try:
                    on_failure(self.failure)
                except Exception:
                    log.exception("reporting the death of rank %d failed", rank)
                return

        self._watcher = threading.Thread(target=run, name="hicache-rank-watch", daemon=True)
        self._watcher.start()

    def terminate(self, grace_s: float = 2.0) -> None:
        """Stop every follower now (SIGTERM, then SIGKILL after ``grace_s`` seconds) without
        reporting it as a failure: rank 0 failed on its own, and a follower waiting in a
        collective would otherwise wait for its timeout (leaving the group does not close
        the connections of a group still referenced)."""
        self._closing.set()
        if self._links is not None:
            self._links.close()
        for proc in self._procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self._procs.values():
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)

    def dead_rank(self, wait_s: float = 0.0) -> str | None:
        """:attr:`failure`, or why a follower has died, waiting up to ``wait_s`` for one
        to be seen dead (a collective that failed on rank 0 may precede the exit)."""
        deadline = time.monotonic() + wait_s
        while True:
            if self.failure is not None:
                return self.failure
            lost = None if self._links is None else self._links.failure()
            if lost is not None:
                return lost
            for rank in self._procs:
                problem = self._rank_problem(rank, "while serving")
                if problem is not None:
                    return problem
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def silent(self) -> str | None:
        """One line naming each follower that has stopped answering (its heartbeat, see
        :mod:`hicache.engine.heartbeat`), None while all answer (or before the start)."""
        if self._heartbeats is None or self._closing.is_set():
            return None
        quiet = [self._heartbeats.silent(self.pids)]
        if self._links is not None:
            quiet.append(self._links.silent())
        said = [q for q in quiet if q is not None]
        return "; ".join(said) if said else None

    def ages(self) -> dict[int, float]:
        """Seconds since each follower of this node last beat, by rank."""
        if self._heartbeats is None:
            return {}
        return self._heartbeats.ages(list(self._procs))

    def exit_codes(self) -> dict[int, int | None]:
        """Each follower's exit code, by rank (None: running)."""
        return {r: p.exitcode for r, p in self._procs.items()}

    @property
    def sentinels(self) -> list[Any]:
        """What :func:`multiprocessing.connection.wait` waits on for a follower's exit."""
        return [p.sentinel for p in self._procs.values()]

    @property
    def pids(self) -> dict[int, int]:
        """rank -> pid of each follower."""
        return {r: int(p.pid) for r, p in self._procs.items() if p.pid is not None}

    # ------------------------------------------------------------------ close

    def close(self, timeout: float = CLOSE_TIMEOUT_S, *, broken: bool = False) -> None:
        """Join the followers within ``timeout`` seconds, kill those still running, and
        leave the group. Idempotent. (The engine broadcasts a stop before this.) ``broken``:
        the group failed (or never finished starting): leave it first, so that a follower
        waiting in a collective fails at once instead of at its timeout."""
        self._closing.set()
        if self._links is not None:
            self._links.close()
        if broken:
            leave_group()
        deadline = time.monotonic() + timeout
        for rank, proc in self._procs.items():
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.error("rank %d did not stop within %.0f s; killing it", rank, timeout)
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self._conns.values():
            with contextlib.suppress(OSError):
                conn.close()
        if self._watcher is not None:
            self._watcher.join(timeout=2.0)
        leave_group()


__all__ = [
    "CLOSE_TIMEOUT_S",
    "COLLECTIVE_TIMEOUT_S",
    "DEFAULT_DIST_INIT_TIMEOUT_S",
    "RankProcesses",
    "RankSetup",
    "RankStartError",
    "StepChannel",
    "cpu_threads_per_rank",
    "join_group",
    "leave_group",
    "rank_device",
    "use_interface",
]
