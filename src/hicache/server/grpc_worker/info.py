"""What smg reads from a gRPC worker besides generations, from the same bodies the HTTP
routes answer (:mod:`hicache.server.router_routes`): ``GetModelInfo``, ``GetServerInfo``
(its ``server_args`` are ``/server_info``'s fields: smg labels the worker with them,
``page_size`` among them) and ``GetLoads`` (``/v1/loads``' entry and aggregate, in the
protocol's sections: ``memory`` (``kv_cache_gb``, ``token_capacity``: L1), ``queues``
(``waiting``), ``disaggregation`` (``mode``)). A figure hicache has no value for stays at
the protocol's 0 (``weight_gb``, ``gen_throughput``, ...).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from hicache.engine.front.engine import EngineStats
from hicache.server.router_routes import (
    LOAD_SECTIONS,
    loads_body,
    model_info_body,
    server_info_body,
)
from hicache.server.state import ServerState

__all__ = ["loads_reply", "model_info_reply", "server_info_reply"]


def _struct(values: dict[str, Any]) -> Struct:
    """``values`` as a protobuf Struct (values that are not JSON scalars, lists or dicts as
    strings; None as null)."""

    def plain(v: Any) -> Any:
        if v is None or isinstance(v, bool | int | float | str):
            return v
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        return str(v)

    out = Struct()
    out.update(plain(values))
    return out


def model_info_reply(state: ServerState, eos_ids: Iterable[int]) -> pb.GetModelInfoResponse:
    """``GetModelInfo``: ``/model_info``'s fields, with the context length (tokens, prompt
    and output), the vocabulary, the end-of-sequence, padding and BOS ids."""
    body = model_info_body(state)
    engine = state.engine
    tok = engine.model.tokenizer
    ctx = engine.context_length

    def token_id(name: str) -> int:
        value = getattr(tok, name, None)
        return value if isinstance(value, int) else -1

    return pb.GetModelInfoResponse(
        model_path=body["model_path"],
        tokenizer_path=body["tokenizer_path"],
        is_generation=True,
        served_model_name=body["served_model_name"],
        max_context_length=ctx,
        vocab_size=int(engine.model.hf_config.vocab_size),
        supports_vision=False,
        model_type=body["model_type"] or "",
        architectures=body["architectures"],
        eos_token_ids=sorted(int(e) for e in eos_ids),
        pad_token_id=token_id("pad_token_id"),
        bos_token_id=token_id("bos_token_id"),
        max_req_input_len=max(0, ctx - 1),
    )


def server_info_reply(
    state: ServerState, stats: EngineStats, started_at: float
) -> pb.GetServerInfoResponse:
    """``GetServerInfo``: ``/server_info``'s fields as ``server_args``, the requests in
    the engine (``active_requests``: running and waiting), the uptime since
    ``started_at`` (a ``time.time()``), hicache's version (in ``sglang_version``)."""
    body = server_info_body(state, stats)
    start = Timestamp()
    start.FromSeconds(int(started_at))
    return pb.GetServerInfoResponse(
        server_args=_struct(body),
        scheduler_info=_struct({"max_total_num_tokens": body["max_total_num_tokens"]}),
        active_requests=stats.running + stats.waiting,
        is_paused=False,
        uptime_seconds=time.time() - started_at,
        sglang_version=str(body["version"]),
        server_type="grpc",
        start_time=start,
        max_total_num_tokens=body["max_total_num_tokens"],
    )


def loads_reply(
    state: ServerState, stats: EngineStats, include: Iterable[str]
) -> pb.GetLoadsResponse:
    """``GetLoads``: the sections ``include`` names (``all``, or none: every one)."""
    asked = set(include)
    sections = LOAD_SECTIONS if not asked or "all" in asked else ("core", *asked)
    body = loads_body(state, stats, sections)
    entry = body["loads"][0]
    load = pb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=entry["num_running_reqs"],
        num_waiting_reqs=entry["num_waiting_reqs"],
        num_total_reqs=entry["num_total_reqs"],
        num_used_tokens=entry["num_used_tokens"],
        max_total_num_tokens=entry["max_total_num_tokens"],
        token_usage=entry["token_usage"],
        cache_hit_rate=entry["cache_hit_rate"],
        utilization=entry["utilization"],
        max_running_requests=entry["max_running_requests"],
    )
    if "memory" in entry:
        mem = entry["memory"]
        load.memory.CopyFrom(
            pb.MemoryMetrics(kv_cache_gb=mem["kv_cache_gb"], token_capacity=mem["token_capacity"])
        )
    if "queues" in entry:
        load.queues.CopyFrom(pb.QueueMetrics(waiting=entry["queues"]["waiting"]))
    if "disaggregation" in entry:
        load.disaggregation.CopyFrom(pb.DisaggregationMetrics(mode=entry["disaggregation"]["mode"]))
    agg = body["aggregate"]
    return pb.GetLoadsResponse(
        timestamp=body["timestamp"],
        version=str(body["version"]),
        dp_rank_count=1,
        loads=[load],
        aggregate=pb.AggregateMetrics(
            total_running_reqs=agg["total_running_reqs"],
            total_waiting_reqs=agg["total_waiting_reqs"],
            total_reqs=agg["total_reqs"],
            avg_token_usage=agg["avg_token_usage"],
            avg_utilization=agg["avg_utilization"],
        ),
    )
