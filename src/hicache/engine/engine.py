"""The engine: a model, the hierarchical cache and the scheduler, driven by one thread.

Other threads (the HTTP server, the CLI) talk to it through :meth:`Engine.submit`,
:meth:`Engine.abort` and :meth:`Engine.call` (run a function on the engine thread, e.g. a
cache flush); outputs come back through each request's callback, called on the engine
thread.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from hicache.cache import HiCache
from hicache.config import PREFETCH_KEYS, CacheConfig, PrefetchConfig
from hicache.controller.storage_controller import StorageController
from hicache.engine.loader import LoadedModel, default_dtype, load_model
from hicache.engine.output import OutputProcessor
from hicache.engine.request import OutputCallback, Request, RequestOutput
from hicache.engine.runner import ModelRunner, kv_spec_from_hf_config
from hicache.engine.sampling import SamplingParams
from hicache.engine.scheduler import Scheduler, SchedulerConfig
from hicache.keys import Namespace
from hicache.lifecycle import Lifecycle
from hicache.storage.registry import create_storage

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What to serve and how. ``model_path`` None = the default model (SmolLM2-135M)."""

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

    def __post_init__(self) -> None:
        if self.device_cache_gb is not None and not self.device_cache_gb > 0:
            raise ValueError(f"device_cache_gb={self.device_cache_gb!r} is invalid; must be > 0")
        if self.context_length is not None and (
            not isinstance(self.context_length, int) or self.context_length < 2
        ):
            raise ValueError(f"context_length={self.context_length!r} is invalid; must be >= 2")


class Engine(Lifecycle):
    """Lifecycle: ``start()`` loads the model and starts the loop; ``close()`` stops it."""

    def __init__(self, config: EngineConfig, *, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self._loaded = loaded
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.model: LoadedModel
        self.cache: HiCache
        self.scheduler: Scheduler
        self.context_length = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Engine:
        """Load the model, build the cache and start the loop. Idempotent."""
        if self._thread is not None:
            return self
        cfg = self.config
        dtype = cfg.dtype or default_dtype(cfg.device)
        self.model = self._loaded or load_model(cfg.model_path, dtype=dtype, device=cfg.device)
        spec = kv_spec_from_hf_config(self.model.hf_config, self.model.dtype)
        cache_cfg = cfg.cache
        if cfg.device_cache_gb is not None:
            tokens = int(cfg.device_cache_gb * 1e9) // spec.token_bytes
            cache_cfg = dataclasses.replace(cache_cfg, device_tokens=tokens)
        self.cache = HiCache(cache_cfg, spec, cfg.device).start()
        if cfg.storage_backend is not None:
            try:
                self._attach(
                    cfg.storage_backend, cfg.storage_extra_config, cfg.storage_prefetch_policy
                )
            except BaseException:
                self.cache.close()
                raise
        runner = ModelRunner(self.model.model, self.cache.device_pool)
        max_pos = int(getattr(self.model.hf_config, "max_position_embeddings", 2048))
        self.context_length = min(cfg.context_length or max_pos, max_pos)
        tok = self.model.tokenizer
        eos = _eos_ids(self.model)
        output = OutputProcessor(tok, eos, self.context_length)
        self.scheduler = Scheduler(self.cache, runner, output, cfg.scheduler)
        self._thread = threading.Thread(target=self._loop, name="hicache-engine", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Abort what is left, stop the loop, close the cache. Idempotent."""
        if self._thread is None:
            return
        self.call(self._abort_all).result(timeout=30)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        self._thread = None
        self.cache.close()

    # ------------------------------------------------------------------ API (any thread)

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError naming the problem when a request cannot be served."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = int(self.model.hf_config.vocab_size)
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.context_length:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the context length is"
                f" {self.context_length} (at least one token must be generated)"
            )

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        on_output: OutputCallback | None = None,
        *,
        cache_salt: str = "",
    ) -> str:
        """Queue a request; returns its id. ``on_output`` runs on the engine thread."""
        self.validate(prompt_ids, params)
        req = Request(list(prompt_ids), params, on_output, cache_salt=cache_salt)
        self._post(lambda: self.scheduler.add(req))
        return req.rid

    def abort(self, rid: str) -> None:
        self._post(lambda: self.scheduler.abort(rid))

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, timeout: float | None = None
    ) -> RequestOutput:
        """Blocking helper: the final output of one request."""
        done: Future[RequestOutput] = Future()

        def on_output(out: RequestOutput) -> None:
            if out.finished:
                done.set_result(out)

        self.submit(prompt_ids, params, on_output)
        return done.result(timeout=timeout)

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread between steps; its result comes in the future."""
        fut: Future[T] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self._post(run)
        return fut

    def flush_cache(self) -> bool:
        """Empty L1 and L2 when no request is in flight; False (nothing done) otherwise."""

        def flush() -> bool:
            if not self.scheduler.idle:
                return False
            self.cache.reset()
            return True

        return self.call(flush).result(timeout=60)

    # ------------------------------------------------------------------ L3

    def _attach(self, backend: str, extra: Mapping[str, Any], policy: str) -> None:
        extra = dict(extra)
        prefetch = PrefetchConfig.from_extra(policy, extra)
        backend_extra = {k: v for k, v in extra.items() if k not in PREFETCH_KEYS}
        if self.cache.host_pool is None:
            raise ValueError("an L3 storage backend needs --enable-hierarchical-cache")
        namespace = Namespace.for_spec(
            self.cache.spec,
            model=self.model.name,
            weights_fingerprint=self.model.fingerprint,
            layout=self.cache.config.mem_layout,
            page_size=self.cache.page_size,
        )
        storage = create_storage(backend, namespace=namespace, extra_config=backend_extra)
        controller = StorageController(storage, self.cache.host_pool)
        try:
            self.cache.attach_storage(controller, namespace, prefetch)
        except BaseException:
            controller.close()
            raise

    def attach_storage(
        self, backend: str, extra_config: Mapping[str, Any] | None = None, policy: str = "timeout"
    ) -> None:
        """Attach an L3 backend at runtime (when idle). Raises ValueError on a bad config,
        RuntimeError when busy or already attached, StorageError when unreachable."""

        def attach() -> None:
            if not self.scheduler.idle:
                raise RuntimeError("requests are in flight; attach storage when idle")
            self._attach(backend, extra_config or {}, policy)

        self.call(attach).result(timeout=120)

    def detach_storage(self) -> bool:
        """Detach the L3 backend (when idle); False when none was attached."""

        def detach() -> bool:
            if not self.scheduler.idle:
                raise RuntimeError("requests are in flight; detach storage when idle")
            had = self.cache.l3 is not None
            self.cache.detach_storage()
            return had

        return self.call(detach).result(timeout=120)

    # ------------------------------------------------------------------ loop

    def _post(self, fn: Callable[[], None]) -> None:
        if self._thread is None:
            raise RuntimeError("the engine is not running")
        self._inbox.put(fn)
        self._wake.set()

    def _abort_all(self) -> None:
        for req in [*self.scheduler.waiting, *self.scheduler.running]:
            req.aborted = True
        while not self.scheduler.idle:
            self.scheduler.step()

    def _loop(self) -> None:
        while not self._stop.is_set():
            while True:
                try:
                    self._inbox.get_nowait()()
                except queue.Empty:
                    break
            try:
                busy = self.scheduler.step()
            except Exception:
                log.exception("scheduler step failed; aborting in-flight requests")
                busy = False
                self._abort_all()
            if not busy:  # idle, or only waiting for L3 prefetches: poll those often
                self._wake.wait(timeout=0.002 if self.scheduler.waiting else 0.05)
                self._wake.clear()


def _eos_ids(model: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (model.hf_config, getattr(model.model, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    tok_eos = getattr(model.tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return ids
