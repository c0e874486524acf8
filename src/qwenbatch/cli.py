"""The ``qwenbatch`` command line: ``generate | serve | run-batch | rerank | bench | tune``."""

from __future__ import annotations

import argparse
import logging
import sys

from qwenbatch.commands import bench, generate, rerank, run_batch, serve, tune


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwenbatch", description="Batch inference for Qwen models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (generate, serve, run_batch, rerank, bench, tune):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    from qwenbatch.batch.backends import ServersUnavailableError
    from qwenbatch.loader.default_model import DefaultModelError

    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, DefaultModelError) as e:
        print(f"qwenbatch: error: {e}", file=sys.stderr)
        return 2
    except ServersUnavailableError as e:
        print(f"qwenbatch: error: {e}; what is done is saved, run the same command again to resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
