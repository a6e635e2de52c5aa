"""``hicache`` command line.

* ``hicache serve``: the OpenAI-compatible server (binds 127.0.0.1 unless told otherwise);
* ``hicache generate``: one prompt, one completion, printed;
* ``hicache bench NAME``: a benchmark (``tree``, ``transfer``; ``--help`` after the name);
* ``hicache demo-tiers``: the scripted walk through the tiers (``make demo`` chats);
* ``hicache store mooncake``: ``mooncake_master`` plus a segment-holding client on
  127.0.0.1, so that L3 outlives any one engine; ``hicache store redis``: a Redis/Valkey
  server on 127.0.0.1 (both from :mod:`hicache.services`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import signal
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

from hicache.lifecycle import skip_final_collection

BENCHES = {
    "tree": "hicache.bench.tree",
    "transfer": "hicache.bench.transfer",
    "multiturn": "hicache.bench.multiturn",
    "agentic": "hicache.bench.agentic",
    "long-context": "hicache.bench.long_context",
    "full-hit": "hicache.bench.full_hit",
    "slow-l3": "hicache.bench.slow_l3",
    "logprob-reuse": "hicache.bench.logprob_reuse",
    "storage": "hicache.bench.storage",
    "engine": "hicache.bench.engine",
    "shared-prefix": "hicache.bench.shared_prefix",
    "tp-stress": "hicache.bench.tp_stress",
    "agreement": "hicache.bench.agreement",
    "detok": "hicache.bench.detok",
    "fairness": "hicache.bench.fairness",
    "negative": "hicache.bench.negative",
    "memory": "hicache.bench.memory",
    "pd-transfer": "hicache.bench.pd_transfer",
    "pd": "hicache.bench.pd",
    "pd-load": "hicache.bench.pd_load",
    "write-policies": "hicache.bench.write_policies",
    "routing": "hicache.bench.routing",
}

STORES = {
    "mooncake": "hicache.services.mooncake",
    "redis": "hicache.services.redis",
}
"""``hicache store NAME``: the service module whose ``main(argv)`` runs it (hicache.services)."""


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
log = logging.getLogger("hicache")


class StartupError(Exception):
    """A start that cannot go on; its message is the one line printed (exit code 2)."""


def _start_engine(args: argparse.Namespace) -> Any:
    """The started engine, or :class:`StartupError` naming the flag at fault."""
    from hicache.engine.front.engine import Engine
    from hicache.engine.ranks import RankStartError
    from hicache.server.args import FlagError, engine_config_from_args, flag_message
    from hicache.storage.base import StorageError

    try:
        config = engine_config_from_args(args)
    except FlagError as exc:
        raise StartupError(str(exc)) from exc
    except ValueError as exc:
        raise StartupError(flag_message(exc)) from exc
    engine = Engine(config)
    try:
        return engine.start()
    except StorageError as exc:
        raise StartupError(
            f"--hicache-storage-backend {args.hicache_storage_backend!r}: the backend could not"
            f" be started: {exc}; check --hicache-storage-backend-extra-config"
        ) from exc
    except FileNotFoundError as exc:
        raise StartupError(f"--model-path {args.model_path!r}: {exc}") from exc
    except RankStartError as exc:  # one line naming the rank
        raise StartupError(f"--tp-size {args.tp_size}: {exc}") from exc
    except (ValueError, RuntimeError, OSError, ImportError) as exc:
        raise StartupError(f"the engine could not start: {flag_message(exc)}") from exc


def _describe(engine: Any, host: str, port: int) -> str:
    """The one INFO line at start: model, dtype, device, tiers and sizes, address."""
    from hicache.cache.report import cache_stats

    stats = engine.call(lambda: cache_stats(engine.core.cache)).result(timeout=30)
    spec = engine.core.cache.context.spec
    gb = spec.token_bytes / 1e9
    l2 = (
        f"L2 {stats.host_total_tokens} tokens ({stats.host_total_tokens * gb:.2f} GB)"
        if stats.host_total_tokens
        else "L2 off"
    )
    l3 = engine.config.storage_backend or "off"
    tp = f", {engine.config.tp_size} ranks" if engine.config.tp_size > 1 else ""
    nnodes = engine.config.nodes.nnodes
    tp += f" on {nnodes} nodes" if nnodes > 1 else ""
    return (
        f"serving {engine.model.name} ({engine.model.dtype}, {engine.config.device}{tp});"
        f" L1 {stats.device_total_tokens} tokens ({stats.device_total_tokens * gb:.2f} GB),"
        f" {l2}, L3 {l3}; page {stats.page_size} tokens, context {engine.context_length};"
        f" listening on http://{host}:{port}"
    )


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit(143) instead of killing the process. uvicorn
    catches SIGTERM, shuts down, then raises it again under the handler it found: this
    one, so the engine is closed on the way out (its ranks told to stop) as for Ctrl-C,
    instead of vanishing under them."""

    def stop(sig: int, frame: object) -> None:
        raise SystemExit(128 + sig)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve_node(args: argparse.Namespace) -> int:
    """``hicache serve --node-rank R`` (R > 0): this node's ranks, no HTTP server; returns
    once rank 0 stopped them (0), or 1 when they ended on a failure (printed)."""

    from hicache.engine.drivers.node import NodeEnd, run_node
    from hicache.engine.nodes import NodeStartError
    from hicache.engine.ranks import RankStartError
    from hicache.engine.roles.role_setup import follower_roles
    from hicache.server.args import FlagError, engine_config_from_args, flag_message

    try:
        config = engine_config_from_args(args)
    except FlagError as exc:
        raise StartupError(str(exc)) from exc
    except ValueError as exc:
        raise StartupError(f"node {args.node_rank}: {flag_message(exc)}") from exc
    roles = follower_roles(config)
    log.info(
        "node %d of %d: ranks %s, joining node 0 at %s",
        args.node_rank,
        args.nnodes,
        list(config.nodes.ranks(config.tp_size)),
        args.dist_init_addr,
    )
    try:
        with _exit_on_sigterm():
            run_node(config, roles)
    except (NodeStartError, RankStartError) as exc:
        raise StartupError(f"--tp-size {args.tp_size} --nnodes {args.nnodes}: {exc}") from exc
    except (ValueError, FileNotFoundError) as exc:
        raise StartupError(f"node {args.node_rank}: {flag_message(exc)}") from exc
    except NodeEnd as exc:
        print(f"hicache serve: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from hicache.server.app import create_app
    from hicache.server.args import FlagError, check_flags, grpc_port_of
    from hicache.server.listen import listen_on

    if args.nnodes > 1 and args.node_rank != 0:
        return _serve_node(args)
    try:
        check_flags(args)
        listener = listen_on(args.host, args.port)  # held from here on, served by uvicorn
    except FlagError as exc:
        raise StartupError(str(exc)) from exc
    grpc_port = grpc_port_of(args) if args.grpc_mode else None
    if grpc_port is not None:
        try:  # checked now, before the model loads; bound again once it has
            listen_on(args.host, grpc_port, "--grpc-port").close()
        except FlagError as exc:
            listener.close()
            raise StartupError(str(exc)) from exc
    with listener, _start_engine(args) as engine:
        app = create_app(
            engine,
            args.served_model_name,
            model_aliases=args.served_model_alias,
            admin_api_key=args.admin_api_key,
            api_key=args.api_key,
            max_request_bytes=args.max_request_bytes,
            metrics_require_api_key=args.metrics_require_api_key,
        )
        address = _describe(engine, args.host, args.port)
        if grpc_port is not None:
            address += f", and gRPC (smg's SglangScheduler) on {args.host}:{grpc_port}"
        log.info("%s", address)
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                log_level=args.log_level,
                access_log=args.log_level == "debug",
            )
        )

        def rank_died(why: str) -> None:  # the engine has stopped: so does the server
            server.should_exit = True

        engine.on_rank_failure(rank_died)
        with _exit_on_sigterm():
            if grpc_port is None:
                server.run(sockets=[listener])
            else:
                asyncio.run(_serve_with_grpc(server, listener, app.state.hicache, args, grpc_port))
        if engine.rank_failure is not None:
            print(f"hicache serve: error: {engine.rank_failure}", file=sys.stderr)
            return 1
    return 0


async def _serve_with_grpc(
    server: Any, listener: Any, state: Any, args: argparse.Namespace, port: int
) -> None:
    """Serve HTTP (uvicorn's ``server`` on ``listener``) and smg's gRPC service on
    ``args.host:port`` on one event loop, sharing ``state`` (the HTTP app's); the gRPC
    server stops once uvicorn has (its calls cancelled after a second)."""
    from hicache.engine.step.build import eos_ids
    from hicache.server.grpc_worker.keys import GrpcKeys
    from hicache.server.grpc_worker.server import GrpcWorker
    from hicache.server.grpc_worker.servicer import SchedulerServicer

    keys = GrpcKeys(
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        metrics_require_api_key=args.metrics_require_api_key,
    )
    servicer = SchedulerServicer(state, keys, eos_ids(state.engine.model))
    try:
        worker = await GrpcWorker(servicer, args.host, port).start()
    except OSError as exc:
        raise StartupError(f"--grpc-port {port}: {exc}") from exc
    try:
        await server.serve(sockets=[listener])
    finally:
        await worker.stop()


def _generate(args: argparse.Namespace) -> int:
    from hicache.engine.sampling import SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
        )
    except ValueError as exc:
        field, _, rest = str(exc).partition("=")
        raise StartupError(f"--{field.replace('_', '-')} {rest}") from exc
    given_ids: list[int] | None = None
    if args.prompt_ids:
        try:
            given_ids = [int(t) for t in args.prompt_ids.split(",")]
        except ValueError:
            raise StartupError(
                f"--prompt-ids {args.prompt_ids!r} is invalid; give comma-separated token ids"
                " (the text goes in the positional prompt)"
            ) from None
    with _start_engine(args) as engine:
        tok = engine.model.tokenizer
        if given_ids is not None:
            ids = given_ids
        elif args.chat:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": args.prompt}],
                add_generation_prompt=True,
                tokenize=True,
            )
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tok.encode(args.prompt, add_special_tokens=False)
        out = engine.generate(list(ids), params)
        print(out.text)
        print(
            f"[{out.prompt_tokens} prompt tokens, {out.completion_tokens} generated,"
            f" TTFT {out.ttft_s or 0:.3f} s, finish: {out.finish_reason}]",
            file=sys.stderr,
        )
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (``prog: error: ...``), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _log_level_arg(p: argparse.ArgumentParser, default: Any) -> None:
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=default,
        help="log verbosity (default info: one line at start; debug: one per request,"
        " tracebacks on startup errors)",
    )


def build_parser() -> argparse.ArgumentParser:
    from hicache.server.args import add_engine_args, add_server_args

    parser = _Parser(prog="hicache", description="hierarchical KV cache")
    _log_level_arg(parser, "info")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible server")
    add_engine_args(serve)
    add_server_args(serve)
    _log_level_arg(serve, argparse.SUPPRESS)
    gen = sub.add_parser("generate", help="complete one prompt")
    add_engine_args(gen)
    _log_level_arg(gen, argparse.SUPPRESS)
    gen.add_argument("prompt", nargs="?", default="")
    gen.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    bench = sub.add_parser(
        "bench", help="run a benchmark (pass --help after its name)", add_help=False
    )
    bench.add_argument("name", choices=sorted(BENCHES))
    sub.add_parser("demo-tiers", help="a scripted walk through L1, L2 and load back")
    store = sub.add_parser(
        "store", help="run an L3 store service (pass --help after its name)", add_help=False
    )
    store.add_argument("name", choices=sorted(STORES))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "bench":
        module = importlib.import_module(BENCHES[args.name])
        return int(module.main(rest))
    if args.command == "store":
        module = importlib.import_module(STORES[args.name])
        return int(module.main(rest))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "generate":
            return _generate(args)
    except StartupError as exc:  # say what is wrong in one line, not a traceback
        if args.log_level == "debug":
            log.error("startup failed", exc_info=exc.__cause__ or exc)
        print(f"hicache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    from hicache import demo_tiers

    return demo_tiers.main()


def _main_and_exit() -> NoReturn:
    """``python -m hicache.cli``: :func:`main` (which closes the engine, its ranks and the
    services), then exit without the interpreter's last collection."""
    try:
        code = main()
    finally:
        skip_final_collection()
    raise SystemExit(code)


if __name__ == "__main__":
    _main_and_exit()
