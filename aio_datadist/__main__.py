"""Command line: ``python -m aio_datadist demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aio_datadist",
                                     description="asyncio-native KV-cache transfer (LLM-DataDist API)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="a PROMPT and a DECODER process on loopback moving a real KV cache")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from aio_datadist.demo import main as demo

        return demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
