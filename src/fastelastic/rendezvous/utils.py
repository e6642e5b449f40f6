"""Parsing of rendezvous endpoints and ``rdzv_conf`` strings, and the "is this host me" check."""

from __future__ import annotations

import ipaddress
import re
import socket

__all__ = ["parse_rendezvous_endpoint"]

_PORT_RE = re.compile(r"^[0-9]{1,5}$")
_HOST_RE = re.compile(r"^[\w\.:-]+$")


def _parse_rendezvous_config(config_str: str) -> dict[str, str]:
    """Extracts key-value pairs from ``<key1>=<value1>,...,<keyN>=<valueN>``.

    Raises:
        ValueError: A key is empty or has no value.
    """
    config: dict[str, str] = {}
    config_str = config_str.strip()
    if not config_str:
        return config
    for kv in config_str.split(","):
        key, *values = kv.split("=", 1)
        key = key.strip()
        if not key:
            raise ValueError(
                "The rendezvous configuration string must be in format "
                "<key1>=<value1>,...,<keyN>=<valueN>."
            )
        value = values[0].strip() if values else ""
        if not value:
            raise ValueError(
                f"The rendezvous configuration option '{key}' must have a value specified."
            )
        config[key] = value
    return config


def parse_rendezvous_endpoint(endpoint: str | None, default_port: int) -> tuple[str, int]:
    """Extracts the host name and port from ``<hostname>[:<port>]`` (IPv6 in brackets).

    Args:
        endpoint: The endpoint string; empty means ``localhost``.
        default_port: The port to use if the endpoint has none.

    Returns:
        ``(host, port)``.

    Raises:
        ValueError: The port is not an integer in [0, 65536) or the host name is malformed.
    """
    if endpoint is not None:
        endpoint = endpoint.strip()
    if not endpoint:
        return ("localhost", default_port)
    rest: list[str]
    if endpoint[0] == "[" and endpoint[-1] == "]":
        host, rest = endpoint, []
    else:
        host, *rest = endpoint.rsplit(":", 1)
    if len(host) > 1 and host[0] == "[" and host[-1] == "]":
        host = host[1:-1]
    if len(rest) == 1:
        port = int(rest[0]) if _PORT_RE.match(rest[0]) else None
        if port is None or port >= 2**16:
            raise ValueError(
                f"The port number of the rendezvous endpoint '{endpoint}' must be an integer "
                "between 0 and 65536."
            )
    else:
        port = default_port
    if not _HOST_RE.match(host):
        raise ValueError(
            f"The hostname of the rendezvous endpoint '{endpoint}' must be a dot-separated list of "
            "labels, an IPv4 address, or an IPv6 address."
        )
    return host, port


def _matches_machine_hostname(host: str) -> bool:
    """Tells whether ``host`` names this machine (loopback, its host name, FQDN or an address).

    Called once per handler at setup, never on a hot path. Literal addresses are checked
    without any lookup; only a host *name* that is not ours triggers resolution.
    """
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        addr = None
    if addr is not None and addr.is_loopback:
        return True
    this_host = socket.gethostname()
    if host == this_host:
        return True
    try:
        host_ips = {ai[4][0] for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (ValueError, OSError):
        host_ips = set()
    try:
        mine = socket.getaddrinfo(
            this_host, None, proto=socket.IPPROTO_TCP, flags=socket.AI_CANONNAME
        )
    except (ValueError, OSError):
        return False
    for family, _type, _proto, canonname, sockaddr in mine:
        del family, _type, _proto
        if canonname and canonname == host:
            return True
        if addr is not None and sockaddr[0] == str(addr):
            return True
        if sockaddr[0] in host_ips:
            return True
    return False
