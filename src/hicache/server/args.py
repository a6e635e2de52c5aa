"""Command-line flags of the engine and the server, with SGLang's names where they exist.

A bad flag is refused before anything is loaded, with one line naming the flag, the value
and what is accepted (:class:`FlagError`); errors raised by the configs name their field,
which :func:`flag_message` turns back into the flag.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import torch

from hicache.config import (
    DEFAULT_NEGATIVE_ENTRIES,
    DEFAULT_NEGATIVE_TTL_S,
    CacheConfig,
    EvictionPolicy,
    IOBackend,
    MemLayout,
    PrefetchPolicy,
    WritePolicy,
)
from hicache.disagg.allow import ANY, LOOPBACK
from hicache.disagg.config import DEFAULT_BOOTSTRAP_PORT, DisaggConfig, DisaggMode, TransferBackend
from hicache.engine.admission import DEFAULT_MAX_QUEUED_REQUESTS
from hicache.engine.front.engine import EngineConfig
from hicache.engine.memory_trim import DEFAULT_TRIM_INTERVAL_S
from hicache.engine.nodes import NodeConfig
from hicache.engine.ranks import COLLECTIVE_TIMEOUT_S, DEFAULT_DIST_INIT_TIMEOUT_S
from hicache.engine.restore_book import DEFAULT_RESTORE_MAX_OPS
from hicache.engine.step.scheduler import SchedulePolicy, SchedulerConfig
from hicache.kv_events.config import KvEventsConfig
from hicache.memory import PoolSizeError, check_fits
from hicache.server.http_base import DEFAULT_MAX_REQUEST_BYTES
from hicache.storage.registry import parse_extra_config


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags that shape the model, the cache tiers and batching."""
    m = p.add_argument_group("model")
    m.add_argument("--model-path", default=None, help="HF dir, .gguf, tiny-random-*, or default")
    m.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    m.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    m.add_argument("--context-length", type=int, default=None)
    m.add_argument(
        "--attention-backend",
        choices=["auto", "sdpa", "triton"],
        default="auto",
        help="attention over the pool: triton reads K/V in place (CUDA); sdpa gathers "
        "them; auto picks triton on CUDA when installed and its probe against SDPA passes",
    )
    m.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="largest decode batch replayed as a CUDA graph (captured at start; default:"
        " --max-running-requests; 0: off); CUDA, triton attention, Llama/Qwen2/Qwen3 only",
    )
    m.add_argument(
        "--disable-cuda-graph", action="store_true", help="decode eagerly (no CUDA graphs)"
    )
    t = p.add_argument_group("tensor parallelism")
    t.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel ranks, one process each (rank 0 is this one); must divide the"
        " model's attention and KV heads; at most one per CPU core, or one per CUDA device",
    )
    t.add_argument(
        "--dist-init-timeout",
        type=float,
        default=DEFAULT_DIST_INIT_TIMEOUT_S,
        help="seconds every rank has to join the process group, and then to load its"
        " model; a rank that does not fails the start",
    )
    t.add_argument(
        "--collective-timeout",
        type=float,
        default=COLLECTIVE_TIMEOUT_S,
        help="seconds one collective (the model's, or the ranks' step exchange) waits for"
        " the other ranks while serving; a rank that stalls past it stops the server",
    )
    c = p.add_argument_group("cache")
    c.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    c.add_argument("--max-total-tokens", type=int, default=16384, help="L1 size in tokens")
    c.add_argument("--device-cache-size", type=float, default=None, help="L1 size in GB")
    c.add_argument("--disable-radix-cache", action="store_true", help="no prefix reuse at all")
    c.add_argument(
        "--prompt-logprobs-top",
        type=int,
        default=1,
        help="alternatives kept per prompt position with the cached pages for scoring"
        " requests (echo + logprobs), so a cached prefix answers their logprobs; a request"
        " asking more recomputes; -1: off",
    )
    c.add_argument("--enable-hierarchical-cache", action="store_true", help="add the L2 tier")
    c.add_argument("--hicache-ratio", type=float, default=2.0, help="L2 size = ratio x L1")
    c.add_argument("--hicache-size", type=float, default=0.0, help="L2 GB per rank (overrides)")
    c.add_argument(
        "--hicache-write-policy", choices=[e.value for e in WritePolicy], default="write_through"
    )
    c.add_argument("--hicache-write-through-threshold", type=int, default=2)
    c.add_argument(
        "--hicache-session-ratio",
        type=float,
        default=0.5,
        help="share of L2 idle agent sessions' KV may stay pinned in (0: none)",
    )
    c.add_argument(
        "--hicache-session-ttl-ms",
        type=int,
        default=300_000,
        help="how long an idle session's KV is kept (ms; a request's session_ttl_ms wins)",
    )
    c.add_argument(
        "--hicache-write-back-threshold",
        type=float,
        default=0.8,
        help="watermark: share of L2 pages in use past which L2 is written to L3 ahead of"
        " eviction, in (0, 1]",
    )
    c.add_argument("--hicache-io-backend", choices=[e.value for e in IOBackend], default="kernel")
    c.add_argument(
        "--hicache-mem-layout", choices=[e.value for e in MemLayout], default="page_first"
    )
    c.add_argument(
        "--radix-eviction-policy", choices=[e.value for e in EvictionPolicy], default="lru"
    )
    c.add_argument("--hicache-load-back-threshold", type=int, default=10, help="tokens")
    c.add_argument(
        "--hicache-storage-backend",
        default=None,
        help="file | mooncake | redis | aibrix | nixl | module:Class",
    )
    c.add_argument(
        "--hicache-storage-prefetch-policy",
        choices=[e.value for e in PrefetchPolicy],
        default="timeout",
    )
    c.add_argument(
        "--hicache-storage-negative-ttl",
        type=float,
        default=None,
        metavar="SECONDS",
        help="remember an L3 lookup miss this long, so lookups through it skip the store"
        f" (0: off; another instance's write is found at most this late; default"
        f" {DEFAULT_NEGATIVE_TTL_S:g}, 0 on a prefill instance of PD disaggregation)",
    )
    c.add_argument(
        "--hicache-storage-negative-entries",
        type=int,
        default=DEFAULT_NEGATIVE_ENTRIES,
        help="L3 lookup misses remembered at most (LRU)",
    )
    c.add_argument(
        "--hicache-storage-tp-lcm",
        type=int,
        default=None,
        metavar="N",
        help="a number every TP size of the servers sharing this L3 divides (their LCM):"
        " MHA pages are stored in records whole on every such server's ranks (default: this"
        " server's --tp-size, records as fast as page records; a multiple of the K/V heads:"
        " one record per head, shared by every TP size)",
    )
    c.add_argument(
        "--hicache-restore-max-ops",
        type=int,
        default=DEFAULT_RESTORE_MAX_OPS,
        help="restores (POST /hicache/prefetch) loading or held at most; one more is a 429",
    )
    c.add_argument(
        "--hicache-restore-max-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="L2 bytes restores may hold at most (per rank); one more is a 429 (default:"
        " half the L2 pool)",
    )
    c.add_argument(
        "--hicache-storage-backend-extra-config",
        default=None,
        help="JSON object or @file.json: backend keys plus prefetch_threshold, prefetch_timeout_*",
    )
    k = p.add_argument_group("KV events (routers that subscribe to the pages an instance holds)")
    k.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help='SGLang\'s and vLLM\'s flag: e.g. \'{"publisher": "zmq", "endpoint":'
        ' "tcp://*:5557", "topic": "kv"}\' also publishes over ZMQ; {"publisher": "null"}'
        " keeps them for gRPC subscribers only (default: off; with --grpc-mode,"
        ' {"publisher": "null"}; {"enable_kv_cache_events": false} turns them off)',
    )
    h = p.add_argument_group("hybrid models (sliding-window pools, recurrent-state snapshots)")
    h.add_argument(
        "--swa-full-tokens-ratio",
        type=float,
        default=0.8,
        help="L1 pages of the sliding-window layers' own pool per L1 page of the full pool",
    )
    h.add_argument(
        "--max-mamba-cache-size",
        type=int,
        default=0,
        help="L1 state-snapshot slots (0: sized by --mamba-full-memory-ratio)",
    )
    h.add_argument(
        "--mamba-full-memory-ratio",
        type=float,
        default=0.9,
        help="L1 snapshot bytes per byte of the L1 KV pool, when the slot count is 0",
    )
    h.add_argument(
        "--mamba-track-interval",
        type=int,
        default=256,
        help="tokens between state snapshots during a prefill (whole pages)",
    )
    p.add_argument_group("host memory").add_argument(
        "--memory-trim-interval",
        type=float,
        default=DEFAULT_TRIM_INTERVAL_S,
        help="seconds: give freed memory back to the OS (glibc malloc_trim) once the engine"
        " has been idle for 1 s after being busy, and once more this long after; at most"
        " this often; 0: never",
    )
    s = p.add_argument_group("scheduler")
    s.add_argument("--max-running-requests", type=int, default=32)
    s.add_argument("--chunked-prefill-size", type=int, default=512)
    s.add_argument(
        "--schedule-policy",
        default=SchedulePolicy.FCFS.value,
        help="admission order within a priority and fair-share class: fcfs (first come,"
        " first served) or lpm (longest cached prefix first)",
    )
    s.add_argument(
        "--max-running-requests-per-group",
        type=int,
        default=None,
        help="running slots one client request (its n copies and batched prompts) may hold;"
        " the group holding fewest goes first (default: half of --max-running-requests;"
        " 0: no group rule)",
    )
    s.add_argument(
        "--strict-group-cap",
        action="store_true",
        help="a group never holds more than its cap, even of idle slots (default: idle"
        " slots are lent past the cap and taken back when another request waits)",
    )
    s.add_argument(
        "--max-queued-requests",
        type=int,
        default=DEFAULT_MAX_QUEUED_REQUESTS,
        help="sequences (n copies counted) waiting for admission at most; a request that"
        f" does not fit gets a 429 with Retry-After, 503 when unhealthy (default"
        f" {DEFAULT_MAX_QUEUED_REQUESTS}; 0: unbounded)",
    )
    s.add_argument(
        "--unhealthy-after-failed-steps",
        type=int,
        default=3,
        help="/health answers 503 after this many steps in a row failed (a forward or a"
        " scheduler step that raised); 200 again once one succeeds",
    )


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Flags of the HTTP server (``hicache serve``)."""
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--served-model-name", default=None)
    s.add_argument(
        "--served-model-alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another name a request's 'model' may give (repeatable; listed by /v1/models);"
        " any name not served gets a 404 model_not_found",
    )
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the inference endpoints (/v1/*,"
        " /generate) and the docs (/docs, /redoc, /openapi.json)",
    )
    s.add_argument(
        "--admin-api-key",
        default=None,
        help="required by the routes that change or discard cached state (/flush_cache,"
        " /hicache/storage-backend); without it they are refused",
    )
    s.add_argument(
        "--metrics-require-api-key",
        action="store_true",
        help="put /metrics behind --api-key (open by default, as in SGLang and vLLM)",
    )
    s.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body accepted; larger ones get a 413 (default 8 MiB)",
    )
    s.add_argument(
        "--grpc-mode",
        action="store_true",
        help="also serve smg's SglangScheduler gRPC service (an smg gRPC worker:"
        " --worker-urls grpc://HOST:GRPC_PORT) on --host : --grpc-port; the HTTP API"
        " stays on --port; KV events on unless --kv-events-config (docs/router.md)",
    )
    s.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="the gRPC port with --grpc-mode (default --port + 10000, as SGLang's)",
    )

    n = p.add_argument_group("tensor parallelism across nodes (docs/deployment.md)")
    n.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="machines the --tp-size ranks span, as many ranks on each (it must divide"
        " --tp-size); start 'hicache serve' on each with the same flags but --node-rank",
    )
    n.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this machine's place, 0 .. --nnodes - 1: node 0 serves HTTP and runs rank 0;"
        " the others run their ranks and stop with it",
    )
    n.add_argument(
        "--dist-init-addr",
        default=None,
        metavar="HOST:PORT",
        help="node 0's rendezvous (needed with --nnodes > 1): node 0 listens there, the"
        " others connect within --dist-init-timeout; each node's ranks use the interface"
        " of its own --host (or GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)",
    )

    d = p.add_argument_group("prefill/decode disaggregation (docs/deployment.md)")
    d.add_argument(
        "--disaggregation-mode",
        choices=[m.value for m in DisaggMode],
        default=DisaggMode.NULL.value,
        help="prefill: compute prompts and send their KV to the decode instance a request's"
        " bootstrap room names; decode: receive it, decode and stream; null: both in one",
    )
    d.add_argument(
        "--disaggregation-transfer-backend",
        choices=[b.value for b in TransferBackend],
        default=TransferBackend.MOONCAKE.value,
        help="what moves the pages between a prefill and a decode instance",
    )
    d.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=DEFAULT_BOOTSTRAP_PORT,
        help="a prefill instance's bootstrap server (on --host); a decode instance uses it"
        " for requests whose bootstrap_port is null",
    )
    d.add_argument(
        "--disaggregation-decode-enable-offload-kvcache",
        action="store_true",
        help="a decode instance writes each finished conversation (prompt and output) to L3,"
        " so the next turn's prefill finds all of it; needs --hicache-storage-backend",
    )
    d.add_argument(
        "--disaggregation-bootstrap-key",
        default=None,
        help="the key a prefill instance's bootstrap server requires (Authorization: Bearer)"
        " for registrations, status polls and aborts, and a decode instance sends; the same"
        " on both instances of a pair (default: --api-key; without either, no key)",
    )
    d.add_argument(
        "--disaggregation-bootstrap-allow",
        default=None,
        metavar="ENTRY[,ENTRY...]",
        help="the bootstrap addresses a decode instance may contact: host[:port], IP[:port],"
        " CIDR or * ([v6]:port for IPv6); default: * with --api-key (only the router names"
        " addresses then), else loopback only (127.0.0.0/8, ::1, localhost)",
    )
    d.add_argument(
        "--disaggregation-max-links",
        type=int,
        default=64,
        help="the most prefill instances a decode instance follows at once (a thread and a"
        " connection each); a new address past it gets a 503 while every link has rooms"
        " (default 64)",
    )
    d.add_argument(
        "--disaggregation-link-idle-timeout",
        type=float,
        default=30.0,
        help="seconds after which a decode instance closes the link to a prefill instance"
        " it has no room with (default 30)",
    )
    d.add_argument(
        "--disaggregation-max-rooms-per-client",
        type=int,
        default=4096,
        help="the most open rooms one client address may register with a prefill"
        " instance's bootstrap server; past it a registration gets a 429 (default 4096)",
    )


class FlagError(ValueError):
    """A command-line flag with a value that cannot be served: names the flag, the value
    and what is accepted, in one line."""

    def __init__(self, flag: str, value: object, allowed: str) -> None:
        super().__init__(f"{flag} {value!r} is invalid; {allowed}")
        self.flag = flag


FIELD_FLAGS = {
    "page_size": "--page-size",
    "device_tokens": "--max-total-tokens",
    "hicache_ratio": "--hicache-ratio",
    "hicache_size": "--hicache-size",
    "write_policy": "--hicache-write-policy",
    "write_through_threshold": "--hicache-write-through-threshold",
    "session_ratio": "--hicache-session-ratio",
    "session_ttl_ms": "--hicache-session-ttl-ms",
    "write_back_threshold": "--hicache-write-back-threshold",
    "io_backend": "--hicache-io-backend",
    "mem_layout": "--hicache-mem-layout",
    "eviction_policy": "--radix-eviction-policy",
    "load_back_threshold": "--hicache-load-back-threshold",
    "max_running_requests": "--max-running-requests",
    "chunked_prefill_size": "--chunked-prefill-size",
    "schedule_policy": "--schedule-policy",
    "max_running_requests_per_group": "--max-running-requests-per-group",
    "max_queued_requests": "--max-queued-requests",
    "unhealthy_after_failed_steps": "--unhealthy-after-failed-steps",
    "context_length": "--context-length",
    "attention_backend": "--attention-backend",
    "cuda_graph_max_bs": "--cuda-graph-max-bs",
    "memory_trim_interval_s": "--memory-trim-interval",
    "tp_size": "--tp-size",
    "prompt_logprobs_top": "--prompt-logprobs-top",
    "dist_init_timeout_s": "--dist-init-timeout",
    "collective_timeout_s": "--collective-timeout",
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "dist_init_addr": "--dist-init-addr",
    "device_cache_gb": "--device-cache-size",
    "storage_prefetch_policy": "--hicache-storage-prefetch-policy",
    "storage_negative_ttl_s": "--hicache-storage-negative-ttl",
    "negative_ttl_s": "--hicache-storage-negative-ttl",
    "storage_negative_entries": "--hicache-storage-negative-entries",
    "storage_tp_lcm": "--hicache-storage-tp-lcm",
    "restore_max_ops": "--hicache-restore-max-ops",
    "kv_events": "--kv-events-config",
    "restore_max_bytes": "--hicache-restore-max-bytes",
    "negative_max_entries": "--hicache-storage-negative-entries",
    "prefetch_policy": "--hicache-storage-prefetch-policy",
    "swa_full_tokens_ratio": "--swa-full-tokens-ratio",
    "max_mamba_cache_size": "--max-mamba-cache-size",
    "mamba_full_memory_ratio": "--mamba-full-memory-ratio",
    "mamba_track_interval": "--mamba-track-interval",
    "host": "--host",
    "mode": "--disaggregation-mode",
    "transfer_backend": "--disaggregation-transfer-backend",
    "bootstrap_port": "--disaggregation-bootstrap-port",
    "decode_offload": "--disaggregation-decode-enable-offload-kvcache",
    "bootstrap_key": "--disaggregation-bootstrap-key",
    "bootstrap_allow": "--disaggregation-bootstrap-allow",
    "max_links": "--disaggregation-max-links",
    "link_idle_timeout_s": "--disaggregation-link-idle-timeout",
    "max_rooms_per_client": "--disaggregation-max-rooms-per-client",
}
"""Config field -> the flag that sets it, so an error names what the user typed."""


def flag_message(exc: Exception) -> str:
    """``exc``'s message with a leading ``field=value`` rewritten as the flag's name."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    m = re.match(r"(\w+)=", text)
    if m and m.group(1) in FIELD_FLAGS:
        return f"{FIELD_FLAGS[m.group(1)]} {text[m.end() :]}"
    return text


def _model_path_ok(path: str) -> bool:
    from hicache.runner.checkpoints import ALL_TINY_MODELS, DEFAULT_MODEL

    if path == DEFAULT_MODEL or path in ALL_TINY_MODELS:
        return True
    p = Path(path).expanduser()
    return (p.is_file() and p.suffix == ".gguf") or (p.is_dir() and (p / "config.json").is_file())


def check_flags(a: argparse.Namespace) -> None:
    """Refuse flag values that cannot work, before any model or pool is built
    (:class:`FlagError`). Covers what the configs cannot see: the device, the model path,
    the port, non-finite sizes, an extra config without a backend."""
    if a.device is not None:
        try:
            dev = torch.device(a.device)
        except (RuntimeError, ValueError):
            raise FlagError("--device", a.device, "use cpu, cuda or cuda:N") from None
        if dev.type not in ("cpu", "cuda"):
            raise FlagError("--device", a.device, "use cpu, cuda or cuda:N")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise FlagError("--device", a.device, "CUDA is not available here; use cpu")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise FlagError(
                    "--device", a.device, f"this host has {torch.cuda.device_count()} CUDA devices"
                )
    if a.model_path is not None and not _model_path_ok(a.model_path):
        from hicache.runner.checkpoints import ALL_TINY_MODELS, DEFAULT_MODEL

        raise FlagError(
            "--model-path",
            a.model_path,
            "give a Hugging Face directory with config.json, a .gguf file,"
            f" {DEFAULT_MODEL} or one of {', '.join(ALL_TINY_MODELS)}",
        )
    for flag, value in (
        ("--hicache-ratio", a.hicache_ratio),
        ("--hicache-size", a.hicache_size),
        ("--device-cache-size", a.device_cache_size),
    ):
        if value is not None and not math.isfinite(value):
            raise FlagError(flag, value, "must be a finite number")
    ttl = getattr(a, "hicache_storage_negative_ttl", None)
    if ttl is not None and not (math.isfinite(ttl) and ttl >= 0):
        raise FlagError(
            "--hicache-storage-negative-ttl",
            ttl,
            "must be a finite number of seconds >= 0 (0: off)",
        )
    entries = getattr(a, "hicache_storage_negative_entries", DEFAULT_NEGATIVE_ENTRIES)
    if entries < 1:
        raise FlagError("--hicache-storage-negative-entries", entries, "must be >= 1")
    if getattr(a, "metrics_require_api_key", False) and not getattr(a, "api_key", None):
        raise FlagError(
            "--metrics-require-api-key",
            True,
            "it puts /metrics behind --api-key, so it needs --api-key",
        )
    if a.hicache_storage_backend_extra_config and not a.hicache_storage_backend:
        raise FlagError(
            "--hicache-storage-backend-extra-config",
            a.hicache_storage_backend_extra_config,
            "it configures an L3 backend, so it needs --hicache-storage-backend"
            " (file, mooncake, redis, aibrix, nixl or module:Class)",
        )
    for flag, key in (
        ("--api-key", "api_key"),
        ("--admin-api-key", "admin_api_key"),
        ("--disaggregation-bootstrap-key", "disaggregation_bootstrap_key"),
    ):
        if getattr(a, key, None) == "":
            raise FlagError(
                flag,
                "",
                "an empty key would refuse every request; give a key or leave the flag out",
            )
    port = getattr(a, "port", None)
    if port is not None:
        if not 1 <= port <= 65535:
            raise FlagError("--port", port, "must be in [1, 65535]")
        max_bytes = a.max_request_bytes
        if max_bytes < 1024:
            raise FlagError("--max-request-bytes", max_bytes, "must be >= 1024")
        if getattr(a, "grpc_port", None) is not None and not a.grpc_mode:
            raise FlagError("--grpc-port", a.grpc_port, "it needs --grpc-mode")
        if getattr(a, "grpc_mode", False):
            grpc_port = grpc_port_of(a)
            if not 1 <= grpc_port <= 65535:
                raise FlagError(
                    "--grpc-port",
                    grpc_port,
                    "must be in [1, 65535] (without --grpc-port it is --port + 10000)",
                )
            if grpc_port == port:
                raise FlagError("--grpc-port", grpc_port, "must differ from --port")


def grpc_port_of(a: argparse.Namespace) -> int:
    """The gRPC port of ``hicache serve --grpc-mode``: ``--grpc-port``, else ``--port`` +
    10000 (SGLang's default for its ``--grpc-mode``)."""
    return int(a.grpc_port) if a.grpc_port is not None else int(a.port) + 10000


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """Build a validated config; a bad value raises ValueError naming the field
    (:class:`FlagError` naming the flag for what :func:`check_flags` sees)."""
    check_flags(a)
    cache = CacheConfig(
        page_size=a.page_size,
        device_tokens=a.max_total_tokens,
        enable_hierarchical_cache=bool(a.enable_hierarchical_cache),
        hicache_ratio=a.hicache_ratio,
        hicache_size=a.hicache_size,
        write_policy=a.hicache_write_policy,
        write_through_threshold=a.hicache_write_through_threshold,
        write_back_threshold=a.hicache_write_back_threshold,
        io_backend=a.hicache_io_backend,
        mem_layout=a.hicache_mem_layout,
        eviction_policy=a.radix_eviction_policy,
        load_back_threshold=a.hicache_load_back_threshold,
        swa_full_tokens_ratio=a.swa_full_tokens_ratio,
        max_mamba_cache_size=a.max_mamba_cache_size,
        mamba_full_memory_ratio=a.mamba_full_memory_ratio,
        mamba_track_interval=a.mamba_track_interval,
        session_ratio=a.hicache_session_ratio,
        session_ttl_ms=a.hicache_session_ttl_ms,
    )
    kwargs = {} if a.device is None else {"device": a.device}
    config = EngineConfig(
        model_path=a.model_path,
        dtype=a.dtype,
        cache=cache,
        scheduler=SchedulerConfig(
            max_running_requests=a.max_running_requests,
            chunked_prefill_size=a.chunked_prefill_size,
            disable_radix_cache=bool(a.disable_radix_cache),
            schedule_policy=a.schedule_policy,
            max_running_requests_per_group=a.max_running_requests_per_group,
            lend_idle_slots=not a.strict_group_cap,
        ),
        max_queued_requests=a.max_queued_requests or None,
        context_length=a.context_length,
        device_cache_gb=a.device_cache_size,
        storage_backend=a.hicache_storage_backend,
        storage_prefetch_policy=a.hicache_storage_prefetch_policy,
        storage_extra_config=_extra_config(a.hicache_storage_backend_extra_config),
        storage_negative_ttl_s=a.hicache_storage_negative_ttl,
        storage_negative_entries=a.hicache_storage_negative_entries,
        storage_tp_lcm=a.hicache_storage_tp_lcm,
        restore_max_ops=a.hicache_restore_max_ops,
        restore_max_bytes=a.hicache_restore_max_bytes,
        attention_backend=a.attention_backend,
        cuda_graph_max_bs=0 if a.disable_cuda_graph else a.cuda_graph_max_bs,
        unhealthy_after_failed_steps=a.unhealthy_after_failed_steps,
        memory_trim_interval_s=a.memory_trim_interval,
        tp_size=a.tp_size,
        prompt_logprobs_top=None if a.prompt_logprobs_top < 0 else a.prompt_logprobs_top,
        dist_init_timeout_s=a.dist_init_timeout,
        collective_timeout_s=a.collective_timeout,
        nodes=NodeConfig(
            nnodes=getattr(a, "nnodes", 1),
            node_rank=getattr(a, "node_rank", 0),
            dist_init_addr=getattr(a, "dist_init_addr", None),
        ),
        disagg=_disagg_config(a),
        kv_events=_kv_events_config(
            getattr(a, "kv_events_config", None), getattr(a, "grpc_mode", False)
        ),
        **kwargs,
    )
    check_sizes_in_gb(config)
    return config


def _disagg_config(a: argparse.Namespace) -> DisaggConfig:
    """The disaggregation role from the server's flags (none for ``hicache generate``)."""
    mode = getattr(a, "disaggregation_mode", DisaggMode.NULL.value)
    if mode == DisaggMode.NULL.value:
        if getattr(a, "disaggregation_decode_enable_offload_kvcache", False):
            raise FlagError(
                "--disaggregation-decode-enable-offload-kvcache",
                True,
                "it is for a decode instance; add --disaggregation-mode decode",
            )
        return DisaggConfig()
    key = a.disaggregation_bootstrap_key or a.api_key or None
    if a.disaggregation_bootstrap_allow is not None:
        allow = tuple(e.strip() for e in a.disaggregation_bootstrap_allow.split(","))
    elif a.api_key:
        allow = (ANY,)  # only the key's holder (the router) names bootstrap addresses
    else:
        allow = LOOPBACK
    return DisaggConfig(
        mode=DisaggMode(mode),
        transfer_backend=TransferBackend(a.disaggregation_transfer_backend),
        host=a.host,
        bootstrap_port=a.disaggregation_bootstrap_port,
        decode_offload=bool(a.disaggregation_decode_enable_offload_kvcache),
        bootstrap_key=key,
        bootstrap_allow=allow,
        max_links=a.disaggregation_max_links,
        link_idle_timeout_s=a.disaggregation_link_idle_timeout,
        max_rooms_per_client=a.disaggregation_max_rooms_per_client,
    )


def check_sizes_in_gb(config: EngineConfig) -> None:
    """Refuse ``--hicache-size`` / ``--device-cache-size`` beyond the memory available, with
    the numbers (:class:`~hicache.memory.PoolSizeError`), before the model is loaded.

    Sizes given in tokens (``--max-total-tokens``, ``--hicache-ratio``) need the model's
    bytes per token; the pools check them when they are built, before allocating.
    """
    host_bytes = 0
    if config.cache.enable_hierarchical_cache and config.cache.hicache_size > 0:
        host_bytes = int(config.cache.hicache_size * 1e9)
        check_fits(host_bytes, "cpu", what="the host (L2) KV pool", flags="--hicache-size")
    if config.device_cache_gb is None:
        return
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return  # loading the model fails first, with its own message
    device_bytes = int(config.device_cache_gb * 1e9)
    memory = check_fits(
        device_bytes, device, what="the device (L1) KV pool", flags="--device-cache-size"
    )
    if device.type != "cuda" and device_bytes + host_bytes > memory.allowed:
        raise PoolSizeError(
            "the device (L1) and host (L2) KV pools, both in RAM on a CPU-only host,",
            device_bytes + host_bytes,
            memory,
            "--device-cache-size or --hicache-size",
        )


def _kv_events_config(text: str | None, grpc_mode: bool = False) -> KvEventsConfig | None:
    """``--kv-events-config``'s config; without the flag, the hub alone with
    ``--grpc-mode`` (smg subscribes to every gRPC worker's events), else off."""
    if text is None:
        return KvEventsConfig() if grpc_mode else None
    try:
        return KvEventsConfig.parse(text)
    except ValueError as exc:
        raise FlagError("--kv-events-config", text, str(exc)) from None


def _extra_config(text: str | None) -> dict[str, object]:
    try:
        return parse_extra_config(text)
    except ValueError as exc:
        raise FlagError("--hicache-storage-backend-extra-config", text, str(exc)) from None
