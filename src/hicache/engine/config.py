"""What an engine serves and how: :class:`EngineConfig`, frozen and validated once.

Under tensor parallelism the config travels to every rank process as plain fields
(:func:`config_fields`; a follower rebuilds and revalidates it with ``EngineConfig(**fields)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.config import (
    DEFAULT_NEGATIVE_ENTRIES,
    DEFAULT_NEGATIVE_TTL_S,
    CacheConfig,
    PrefetchPolicy,
    WritePolicy,
)
from hicache.disagg.config import DisaggConfig, DisaggMode
from hicache.engine.admission import DEFAULT_MAX_QUEUED_REQUESTS
from hicache.engine.memory_trim import DEFAULT_TRIM_INTERVAL_S
from hicache.engine.nodes import NodeConfig
from hicache.engine.ranks import COLLECTIVE_TIMEOUT_S, DEFAULT_DIST_INIT_TIMEOUT_S
from hicache.engine.restore_book import DEFAULT_RESTORE_MAX_OPS
from hicache.engine.schedule_config import SchedulerConfig
from hicache.engine.tp_fit import check_tp_fits
from hicache.kv_events.config import KvEventsConfig
from hicache.runner.kernels import AttentionBackend
from hicache.storage.registry import StorageConfig, storage_config_from_args
from hicache.validate import int_at_least, is_finite_number, is_int, require

__all__ = ["EngineConfig", "config_fields"]


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What to serve and how. ``model_path`` None = the default model (SmolLM2-135M);
    any architecture :func:`~hicache.runner.loader.load_model` accepts (Llama / Qwen2 /
    Qwen3, and the hybrids Gemma 3 text, GPT-OSS, Qwen3-Next, Nemotron-H)."""

    model_path: str | None = None
    dtype: str | None = None
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    cache: CacheConfig = field(
        default_factory=lambda: CacheConfig(page_size=16, device_tokens=16384)
    )
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    context_length: int | None = None
    device_cache_gb: float | None = None
    """L1 size in GB (10**9 bytes); overrides ``cache.device_tokens`` when set."""
    storage_backend: str | None = None
    """L3 backend name (``file``, ``mooncake``, ``redis``, ``module:Class``), or None."""
    storage_prefetch_policy: str = "timeout"
    storage_extra_config: Mapping[str, Any] = field(default_factory=dict)
    storage_negative_ttl_s: float | None = None
    """Seconds an L3 lookup miss is remembered so that lookups through it do not ask the
    store again (:mod:`hicache.storage.negative`); 0: off. A finite number >= 0, or None:
    :data:`~hicache.config.DEFAULT_NEGATIVE_TTL_S`, but 0 on the prefill instance of
    prefill/decode disaggregation, whose next turns' pages its decode peer writes right
    after this instance looked them up (see :attr:`negative_ttl_s`)."""
    storage_negative_entries: int = DEFAULT_NEGATIVE_ENTRIES
    """L3 misses remembered at most (least recently used first out); at least 1."""
    storage_tp_lcm: int | None = None
    """A number every TP size of the servers sharing this L3 divides (their least common
    multiple, SGLang's ``tp_lcm_size``): an MHA page is stored as one record per group of
    ``H_kv / gcd(storage_tp_lcm, H_kv)`` K/V heads (:func:`~hicache.heads.record_group`),
    so every such server's ranks hold whole records. None: this server's ``tp_size``
    (one record per rank's heads: a page record's cost, shared with servers of this TP
    size alone). A multiple of ``H_kv``: one record per K/V head,
    shared by every TP size."""
    storage: StorageConfig | None = field(init=False, default=None)
    """``storage_backend`` and ``storage_extra_config`` parsed and validated once (None:
    no L3). An extra config without a backend is refused."""
    attention_backend: str = "auto"
    """Attention over the pool (decode and extend of full-attention layers): ``sdpa``
    (gather + torch SDPA, the reference), ``triton`` (the kernels read K/V in place through
    the page table), ``auto`` (``triton`` on CUDA when installed and its probe against SDPA
    passes there, else ``sdpa``)."""
    cuda_graph_max_bs: int | None = None
    """Largest decode batch served through CUDA graphs (:mod:`hicache.runner.decode_graphs`),
    captured at start for buckets 1, 2, 4, 8, 12, 16, 24, ... up to it; None: the
    scheduler's ``max_running_requests``; 0: off. Larger values are capped at
    ``max_running_requests``. Used on CUDA with the Triton backend and a plain
    Llama / Qwen2 / Qwen3 model, after a probe against the SDPA forward; else decode
    runs eagerly (a warning says why when the capture or the probe failed)."""
    unhealthy_after_failed_steps: int = 3
    """:meth:`Engine.health` (and ``/health``) reports the engine unhealthy once this many
    steps in a row failed: a scheduler step that raised, or a forward that raised (which
    fails its batch's requests, say a kernel that breaks in one dtype). Healthy again once
    a step succeeds. At least 1."""
    max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS
    """Sequences (every ``n`` copy and batched prompt counted) that may wait for their first
    admission at once; a client request whose sequences do not all fit is refused at once
    (:meth:`Engine.reserve`: :class:`~hicache.engine.admission.QueueFull`, or
    :class:`~hicache.engine.admission.EngineUnhealthy` when the engine is not healthy).
    None: unbounded. At least 1."""
    stats_interval_s: float = 0.25
    """The loop publishes an engine stats record at most this often (seconds; each read
    walks the tree), at the end of a round: what ``/metrics`` and the router's load reports
    read (:attr:`Engine.published_stats`). Greater than 0."""
    memory_trim_interval_s: float = DEFAULT_TRIM_INTERVAL_S
    """Give freed heap memory back to the OS (glibc ``malloc_trim``) once the loop has been
    idle for a second after being busy, and once more this many seconds later if it is
    still idle; never twice within this many seconds; 0: never (see
    :mod:`hicache.engine.memory_trim`). A no-op where there is no glibc."""
    prompt_logprobs_top: int | None = 1
    """Scoring entries (:mod:`hicache.cache.components.logprob`): the cache keeps, with
    the pages a scoring request (prompt logprobs: ``echo`` with ``logprobs``) computed,
    each position's prompt-token logprob and this many alternatives, so that a later
    scoring request reuses the cached prefix instead of recomputing it. A request asking
    more alternatives recomputes its prompt as before. ``4 * (2 + 2 * top)`` bytes per
    token of L1 (and L2). None: off. Only with one rank (``tp_size`` 1): under tensor
    parallelism rank 0 alone computes logprobs, so it is off there. An int >= 0 or None."""
    tp_size: int = 1
    """Tensor-parallel ranks, each a process with its own model shard, cache and scheduler
    (see :mod:`hicache.engine.ranks`); 1: this process alone. On CUDA one per device (from
    ``device``'s index on); on CPU as many as the available memory holds (they may share
    cores); it must divide the model's query heads and MLP sizes, and divide its K/V
    heads or be a multiple of them (then they are replicated; checked at start)."""
    dist_init_timeout_s: float = DEFAULT_DIST_INIT_TIMEOUT_S
    """Seconds every rank has to join the process group, and then to build its engine;
    a rank that does not fails the start, named."""
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    """Seconds one collective of the model or of the step exchange waits for the other
    ranks once started (the longest forward included); a rank that stalls past it makes
    the others fail (the server exits). Independent of ``dist_init_timeout_s``. A frozen
    rank shows in ``/health`` within seconds (its heartbeat), not at this bound."""
    nodes: NodeConfig = field(default_factory=NodeConfig)
    """The nodes (machines) the ``tp_size`` ranks span and this one's place among them
    (:mod:`hicache.engine.nodes`; default: this node alone). ``nnodes`` must divide
    ``tp_size``; each node runs ``tp_size / nnodes`` ranks, on CUDA from ``device``'s
    index on."""
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    """The prefill/decode disaggregation role (:mod:`hicache.disagg`; default: none)."""
    restore_max_ops: int = DEFAULT_RESTORE_MAX_OPS
    """Restores (``POST /hicache/prefetch``) not ended at most; one more is refused (429).
    At least 1."""
    restore_max_bytes: int | None = None
    """L2 bytes restores may hold at most (the whole pages of their prefixes, per rank);
    one that would pass it is refused (429). None: half the L2 pool. At least 1."""
    kv_events: KvEventsConfig | None = None
    """KV events (``--kv-events-config``): rank 0 reports the pages its instance holds to
    :attr:`Engine.kv_events <hicache.engine.front.engine.Engine.kv_events>` (and over ZMQ
    with ``publisher="zmq"``); None: off, at no cost."""

    def __post_init__(self) -> None:
        check_tp_fits(self.tp_size, "cpu")  # an int >= 1; the devices are per node:
        check_tp_fits(self.nodes.local_size(self.tp_size), self.device)
        if (
            self.disagg.mode is DisaggMode.DECODE
            and self.storage_backend is not None
            and not self.disagg.decode_offload
        ):
            raise ValueError(
                "decode_offload=False is invalid with an L3 backend on a decode instance: it"
                " writes L3 only with decode offload (each finished conversation, whole); add"
                " it, or leave the L3 backend out"
            )
        if self.disagg.decode_offload and self.cache.write_policy is not WritePolicy.WRITE_THROUGH:
            raise ValueError(
                f"write_policy={self.cache.write_policy.value!r} is invalid with decode_offload:"
                " a decode instance writes each finished conversation to L3 at once, so its"
                " write policy must be write_through"
            )
        if self.disagg.decode_offload and self.storage_backend is None:
            raise ValueError(
                "decode_offload=True is invalid; it writes finished conversations to L3, so"
                " it needs an L3 backend (storage_backend)"
            )
        dit = self.dist_init_timeout_s
        require(
            is_finite_number(dit) and dit > 0,
            "dist_init_timeout_s",
            dit,
            "must be a finite number of seconds > 0",
        )
        ct = self.collective_timeout_s
        require(
            is_finite_number(ct) and ct > 0,
            "collective_timeout_s",
            ct,
            "must be a finite number of seconds > 0",
        )
        int_at_least("unhealthy_after_failed_steps", self.unhealthy_after_failed_steps, 1)
        int_at_least("restore_max_ops", self.restore_max_ops, 1)
        require(
            self.kv_events is None or isinstance(self.kv_events, KvEventsConfig),
            "kv_events",
            self.kv_events,
            "must be a KvEventsConfig or None",
        )
        if self.restore_max_bytes is not None:
            int_at_least("restore_max_bytes", self.restore_max_bytes, 1, "(half of L2: None)")
        require(
            is_finite_number(self.stats_interval_s) and self.stats_interval_s > 0,
            "stats_interval_s",
            self.stats_interval_s,
            "must be a finite number of seconds > 0",
        )
        trim = self.memory_trim_interval_s
        require(
            is_finite_number(trim) and trim >= 0,
            "memory_trim_interval_s",
            trim,
            "must be a finite number of seconds >= 0 (0: off)",
        )
        if self.max_queued_requests is not None:
            int_at_least(
                "max_queued_requests",
                self.max_queued_requests,
                1,
                "(unbounded: None; on the command line 0)",
            )
        object.__setattr__(
            self,
            "storage",
            storage_config_from_args(self.storage_backend, self.storage_extra_config),
        )
        PrefetchPolicy(self.storage_prefetch_policy)  # ValueError naming the bad policy
        ttl = self.storage_negative_ttl_s
        require(
            ttl is None or (is_finite_number(ttl) and ttl >= 0),
            "storage_negative_ttl_s",
            ttl,
            "must be a finite number of seconds >= 0 (0: off)",
        )
        int_at_least("storage_negative_entries", self.storage_negative_entries, 1)
        if self.storage_tp_lcm is not None:
            int_at_least("storage_tp_lcm", self.storage_tp_lcm, 1)
            require(
                self.storage_tp_lcm % self.tp_size == 0,
                "storage_tp_lcm",
                self.storage_tp_lcm,
                f"must be a multiple of this server's tp_size={self.tp_size}",
            )
        top = self.prompt_logprobs_top
        require(
            top is None or (is_int(top) and top >= 0),
            "prompt_logprobs_top",
            top,
            "must be an int >= 0, or None (off)",
        )
        if self.attention_backend not in {b.value for b in AttentionBackend}:
            raise ValueError(
                f"attention_backend={self.attention_backend!r} is invalid; must be one of"
                f" {', '.join(b.value for b in AttentionBackend)}"
            )
        if self.cuda_graph_max_bs is not None:
            int_at_least("cuda_graph_max_bs", self.cuda_graph_max_bs, 0, "(0: off)")
        if self.device_cache_gb is not None and not self.device_cache_gb > 0:
            raise ValueError(f"device_cache_gb={self.device_cache_gb!r} is invalid; must be > 0")
        if self.context_length is not None and (
            not isinstance(self.context_length, int) or self.context_length < 2
        ):
            raise ValueError(f"context_length={self.context_length!r} is invalid; must be >= 2")

    @property
    def negative_ttl_s(self) -> float:
        """The negative lookup cache's TTL in force (seconds; 0: off):
        ``storage_negative_ttl_s``, or when None its default for this role."""
        if self.storage_negative_ttl_s is not None:
            return float(self.storage_negative_ttl_s)
        return 0.0 if self.disagg.mode is DisaggMode.PREFILL else DEFAULT_NEGATIVE_TTL_S


def plain_value(value: Any) -> Any:
    """``value`` with every mapping (a frozen ``mappingproxy`` included) a plain dict, so
    that it pickles."""
    if isinstance(value, Mapping):
        return {k: plain_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain_value(v) for v in value)
    return value


def config_fields(config: EngineConfig) -> dict[str, Any]:
    """``config``'s init fields as a picklable dict (``EngineConfig(**fields)`` rebuilds
    and revalidates it in a follower)."""
    return {
        f.name: plain_value(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init
    }
