"""``fastelastic`` command (and ``python -m fastelastic``): tools around a running job.

Subcommands:
    watch ENDPOINT   live view of every agent publishing to ENDPOINT (``fastrun
                     --events-endpoint``); ``--once`` prints one snapshot and exits.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fastelastic", description="Tools for fastelastic jobs.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    w = sub.add_parser(
        "watch",
        help="show every agent of a job live",
        description="Bind ENDPOINT and show every agent that publishes to it "
        "(start jobs with `fastrun --events-endpoint ENDPOINT`). The watcher binds and the "
        "agents connect, so all agents of a job share the endpoint.",
    )
    w.add_argument("endpoint", help="tcp://HOST:PORT (HOST: an address of this machine, or *)")
    w.add_argument("--once", action="store_true", help="print one snapshot and exit")
    w.add_argument("--expect", type=int, default=0,
                   help="with --once: print as soon as this many agents have joined the job")
    w.add_argument("--timeout", type=float, default=None,
                   help="with --once: longest wait (default 2 s, or 60 s with --expect); "
                   "live: stop after this many seconds")
    w.add_argument("--until-done", action="store_true",
                   help="live: exit once every agent has SUCCEEDED or FAILED")
    w.add_argument("--refresh", type=float, default=0.25, help="redraw period in seconds")
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``fastelastic`` console script."""
    p = _parser()
    args = p.parse_args(argv)
    if args.command == "watch":
        if not args.endpoint.startswith(("tcp://", "ipc://")):
            p.error(f"endpoint {args.endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
        if args.expect < 0 or (args.timeout is not None and args.timeout <= 0):
            p.error("--expect must be >= 0 and --timeout > 0")
        if args.refresh <= 0:
            p.error("--refresh must be > 0")
        from fastelastic.watch.view import watch

        try:
            code = watch(args.endpoint, once=args.once, expect=args.expect,
                         timeout=args.timeout, refresh=args.refresh, until_done=args.until_done)
        except OSError as e:
            print(f"fastelastic watch: error: {e.strerror or e}", file=sys.stderr)
            code = 1
        sys.exit(code)


if __name__ == "__main__":
    main()
