"""Standalone store server: ``python -m fastelastic.store --host H --port P``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from fastelastic.errors import StoreError
from fastelastic.store._hosting import (
    DEFAULT_HANDSHAKE_MS,
    HANDSHAKE_ENV,
    SPIN_ENV,
    handshake_ms,
    host_server,
    spin_us,
)
from fastelastic.store.auth import TOKEN_FILE_ENV, read_token, token_from_env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fastelastic.store",
        description="Run a fastelastic TCPStore server (torch TCPStore wire protocol).",
    )
    parser.add_argument("--host", default="", help="address to listen on (default: all)")
    parser.add_argument("--port", type=int, default=29400, help="port (0 picks a free one)")
    parser.add_argument("--max-key", type=int, default=8192, help="longest key, bytes")
    parser.add_argument("--max-value", type=int, default=8 << 20, help="longest value, bytes")
    parser.add_argument("--max-keys", type=int, default=131072,
                        help="most keys in one multi-key request")
    parser.add_argument("--max-reply", type=int, default=64 << 20,
                        help="largest reply built for one request (MULTI_GET, LIST_KEYS), bytes; "
                             "larger ones close that client's connection")
    parser.add_argument("--max-unsent", type=int, default=1 << 20,
                        help="a client with more unsent reply bytes than this is not read until "
                             "it drains them (backpressure)")
    parser.add_argument("--buffer-budget", type=int, default=256 << 20,
                        help="bytes all connections' buffers may hold together; above it the "
                             "connection holding the most is closed")
    parser.add_argument("--max-actions", type=int, default=65536,
                        help="most disconnect actions one client connection may hold; the one "
                             "over it closes that connection (its actions run)")
    parser.add_argument("--max-action-bytes", type=int, default=16 << 20,
                        help="most bytes of disconnect actions per connection (keys, values, "
                             "64 per action), counted in its buffers; over it, the same")
    parser.add_argument("--handshake-ms", type=int, default=None,
                        help="close connections that have not completed the handshake this long "
                             f"after connecting, milliseconds (default: ${HANDSHAKE_ENV} or "
                             f"{DEFAULT_HANDSHAKE_MS})")
    parser.add_argument("--token-file", default=None,
                        help="serve only clients that prove they know the secret in this file "
                             f"(default: ${TOKEN_FILE_ENV} if set; else no token)")
    parser.add_argument("--spin-us", type=int, default=None,
                        help="how long the loop polls before it sleeps, microseconds "
                             f"(default: ${SPIN_ENV} or 50; 0: never)")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    if args.spin_us is not None and args.spin_us < 0:
        parser.error(f"--spin-us must be 0 or more, got {args.spin_us}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        spin = spin_us() if args.spin_us is None else args.spin_us
        token = read_token(args.token_file) if args.token_file else token_from_env()
        handle = host_server(args.host, args.port, max_key=args.max_key,
                             max_value=args.max_value, max_keys=args.max_keys, spin_us=spin,
                             max_reply=args.max_reply, max_unsent=args.max_unsent,
                             buffer_budget=args.buffer_budget,
                             max_actions=args.max_actions,
                             max_action_bytes=args.max_action_bytes,
                             handshake_ms=(handshake_ms() if args.handshake_ms is None
                                           else args.handshake_ms),
                             token=token or b"")
    except (StoreError, ValueError) as e:
        print(f"fastelastic.store: error: {e}", file=sys.stderr)
        return 1
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    print(f"fastelastic store listening on {args.host or '*'}:{handle.port}", flush=True)
    if token:
        logging.getLogger("fastelastic.store").info("clients must prove the store token")
    done.wait()
    handle.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
