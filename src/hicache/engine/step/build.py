"""What every rank builds alike: the model, the cache (with L3 when configured), the
runner, the instance's role (rank 0 of a prefill/decode instance) and the scheduler, put
together as an :class:`~hicache.engine.step.core.EngineCore`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from hicache.cache import HiCache
from hicache.cache.components.base import ServingLimits
from hicache.controller.rank_group import RankGroup
from hicache.engine.config import EngineConfig
from hicache.engine.ranks import StepChannel
from hicache.engine.role import Role
from hicache.engine.step.core import EngineCore, attach_l3
from hicache.engine.step.graph_setup import GraphSetup, enable_for_cache
from hicache.engine.step.output import OutputProcessor
from hicache.engine.step.scheduler import Scheduler
from hicache.runner.loader import LoadedModel, default_dtype, load_model
from hicache.runner.model_runner import ModelRunner, cache_spec_of
from hicache.runner.parallel import TPGroup
from hicache.spec import LogprobSpec

log = logging.getLogger(__name__)

RoleMaker = Callable[[HiCache, LoadedModel, ModelRunner, StepChannel | None], Role]
"""Builds (and starts) an instance's role from its cache, model and runner
and its channel (:func:`~hicache.engine.roles.role_setup.role_maker`)."""


def load_engine_model(config: EngineConfig, channel: StepChannel | None) -> LoadedModel:
    """This rank's shard of the model (the whole model with one rank)."""
    dtype = config.dtype or default_dtype(config.device)
    tp = (
        TPGroup.single()
        if channel is None
        else TPGroup(channel.rank, config.tp_size, channel.model_group)
    )
    return load_model(config.model_path, dtype=dtype, device=config.device, tp=tp)


def build_core(
    config: EngineConfig,
    *,
    loaded: LoadedModel | None = None,
    channel: StepChannel | None = None,
    make_role: RoleMaker | None = None,
) -> EngineCore:
    """Build one rank's :class:`EngineCore`: ``loaded`` (or this rank's shard, loaded
    now), the cache over it (agreeing over ``channel``'s group with several ranks, L3
    attached when ``config.storage`` is set), the runner (decode CUDA graphs captured on
    CUDA), the role (``make_role``'s; without it a plain instance's) and the scheduler. A
    failure closes what was built."""
    model = load_engine_model(config, channel) if loaded is None else loaded
    spec = cache_spec_of(model.model, model.dtype)  # full KV and one spec per component
    top = config.prompt_logprobs_top
    if top is not None and config.tp_size == 1:  # scoring entries: the engine's, not the model's
        spec = dataclasses.replace(spec, components=(*spec.components, LogprobSpec(top=top)))
    cache_cfg = config.cache
    if config.device_cache_gb is not None:  # every component's L1 pool counted
        token_bytes = spec.device_token_bytes(cache_cfg)
        tokens = int(int(config.device_cache_gb * 1e9) // token_bytes)
        cache_cfg = dataclasses.replace(cache_cfg, device_tokens=tokens)
    limits = ServingLimits(
        chunk_tokens=config.scheduler.chunked_prefill_size,
        max_running=config.scheduler.max_running_requests,
    )
    ranks = None if channel is None else RankGroup(channel.group)
    cache = HiCache(cache_cfg, spec, config.device, limits=limits, ranks=ranks).start()
    try:
        if config.storage is not None:
            rank = 0 if channel is None else channel.rank
            attach_l3(cache, model, config, rank, config.storage, config.storage_prefetch_policy)
        return _assemble(config, model, cache, channel, make_role)
    except BaseException:
        close_alone(cache)
        raise


def close_alone(cache: HiCache) -> None:
    """Close the cache of a rank whose start failed (its build, or another rank's). The
    other ranks never join a collective for it (they build on, wait for this rank, or are
    gone), so its agreed last flush is refused at once
    (:class:`~hicache.controller.rank_group.LocalOnlyError`) and skipped; its workers and
    backend are closed all the same. Never raises: the start's error is the one that
    counts."""
    with cache.context.ranks.local_only("while closing the cache of a rank whose build failed"):
        try:
            cache.close()
        except Exception as exc:
            log.debug("closing the cache of a failed build: %r", exc)


def _assemble(
    config: EngineConfig,
    model: LoadedModel,
    cache: HiCache,
    channel: StepChannel | None,
    make_role: RoleMaker | None,
) -> EngineCore:
    runner = ModelRunner(
        model.model,
        cache.full.pages.device_pool,
        cache.stores.runner_pools(),
        attention_backend=config.attention_backend,
    )
    if runner.recurrent:
        log.info(
            "%s has recurrent layers: cached prefixes resume from state snapshots taken"
            " at the last page boundary of each prompt",
            model.name,
        )
    max_pos = int(getattr(model.hf_config, "max_position_embeddings", 2048))
    context_length = min(config.context_length or max_pos, max_pos)
    decode_graphs = _enable_decode_graphs(config, runner, cache, context_length)
    output = OutputProcessor(model.tokenizer, eos_ids(model), context_length)
    role = Role() if make_role is None else make_role(cache, model, runner, channel)
    try:
        scheduler = Scheduler(cache, runner, output, config.scheduler, role=role, tokens=channel)
        return EngineCore(
            config,
            model,
            cache,
            scheduler,
            context_length=context_length,
            decode_graphs=decode_graphs,
            channel=channel,
        )
    except BaseException:
        role.close()  # its threads read and write the pools: before the cache closes
        raise


def _enable_decode_graphs(
    config: EngineConfig, runner: ModelRunner, cache: HiCache, context_length: int
) -> GraphSetup | None:
    """Capture decode CUDA graphs (``cuda_graph_max_bs``) on a CUDA device, before the
    loop starts; None when off or not on CUDA. A failure leaves decode eager."""
    max_running = config.scheduler.max_running_requests
    max_bs = max_running if config.cuda_graph_max_bs is None else config.cuda_graph_max_bs
    if max_bs == 0 or torch.device(config.device).type != "cuda":
        return None
    try:
        return enable_for_cache(
            runner, cache, max_bs=min(max_bs, max_running), context_length=context_length
        )
    except Exception as exc:  # capture and probe failures are handled inside; any other
        log.warning("CUDA graphs for decode are off: %r; decode runs eagerly", exc)
        runner.use_decode_graphs(None)
        return GraphSetup(enabled=False, reason=f"set-up failed: {exc!r}")


def eos_ids(model: LoadedModel) -> set[int]:
    """Every end-of-sequence id the model's configs and tokenizer name."""
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


__all__ = ["build_core", "close_alone", "eos_ids", "load_engine_model"]
