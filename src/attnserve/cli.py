"""`attnserve <command>`: each command lives in its own module under attnserve.commands.

A command module defines `add_parser(subparsers)` (which returns the parser) and
`run(args) -> int`. Modules are imported only when listed here, so a command's
heavy imports happen inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = [
    "generate",
    "serve",
    "bench",
    "select",
    "kv_calc",
    "backends",
]


def _load(name: str):
    try:
        return importlib.import_module(f"attnserve.commands.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"attnserve.commands.{name}":
            return None  # command not built yet
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        mod = _load(name)
        if mod is not None:
            p = mod.add_parser(sub)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"attnserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
