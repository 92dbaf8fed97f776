"""attnserve: attention backends over a paged KV cache, and an inference engine around them.

Each command lives in its own module under attnserve.commands, which defines
`add_parser(subparsers)` (returning the parser) and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import sys

from attnserve.commands import backends, bench, generate, kv_calc, select, serve, traffic, tune

COMMANDS = [generate, serve, bench, tune, select, kv_calc, traffic, backends]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnserve", description=__doc__.splitlines()[0].removeprefix("attnserve: "))
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub).set_defaults(_run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # the exact command, for reports
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
