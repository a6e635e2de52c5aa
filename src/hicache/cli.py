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
import importlib
import logging
import sys

BENCHES = {
    "tree": "hicache.bench.tree",
    "transfer": "hicache.bench.transfer",
    "multiturn": "hicache.bench.multiturn",
    "long-context": "hicache.bench.long_context",
    "full-hit": "hicache.bench.full_hit",
    "storage": "hicache.bench.storage",
}

STORES = {
    "mooncake": "hicache.services.mooncake",
    "redis": "hicache.services.redis",
}
"""``hicache store NAME``: the service module whose ``main(argv)`` runs it (hicache.services)."""


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from hicache.engine.args import engine_config_from_args
    from hicache.engine.engine import Engine
    from hicache.engine.server import create_app

    with Engine(engine_config_from_args(args)) as engine:
        app = create_app(engine, args.served_model_name, admin_api_key=args.admin_api_key)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from hicache.engine.args import engine_config_from_args
    from hicache.engine.engine import Engine
    from hicache.engine.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    with Engine(engine_config_from_args(args)) as engine:
        tok = engine.tokenizer
        if args.prompt_ids:
            ids = [int(t) for t in args.prompt_ids.split(",")]
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


def build_parser() -> argparse.ArgumentParser:
    from hicache.engine.args import add_engine_args

    parser = argparse.ArgumentParser(prog="hicache", description="hierarchical KV cache")
    parser.add_argument("--log-level", default="warning")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--admin-api-key", default=None, help="guards the admin endpoints")
    gen = sub.add_parser("generate", help="complete one prompt")
    add_engine_args(gen)
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
    logging.basicConfig(level=args.log_level.upper())
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
    except ValueError as exc:  # invalid configuration: say what, not a traceback
        parser.error(str(exc))
    from hicache import demo_tiers

    return demo_tiers.main()


if __name__ == "__main__":
    raise SystemExit(main())
