"""``hicache`` command line: ``hicache bench tree|transfer`` and ``hicache demo``."""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHES = {
    "tree": "hicache.bench.tree",
    "transfer": "hicache.bench.transfer",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="hicache", description="hierarchical KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark (pass --help after its name)")
    bench.add_argument("name", choices=sorted(BENCHES))
    sub.add_parser("demo", help="a scripted walk through L1, L2 and load back")
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        module = importlib.import_module(BENCHES[args.name])
        return int(module.main(rest))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from hicache import demo

    return demo.main()


if __name__ == "__main__":
    raise SystemExit(main())
