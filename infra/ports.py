"""Loopback and TCP ports: the one copy of the small address helpers every local server and client uses.

Everything Leeway starts on one machine (the embedded stack, `--nproc` ranks, a local Ray head, the test
servers) listens on `LOOPBACK` only, so other hosts cannot reach it. `is_loopback` is how a component
decides whether an address it was given is such a local one (the endpoint's API key, the rank group's
store, a fleet's nodes). `free_ports` asks the OS for ports that are free *now*; a server that can bind
port 0 and report what it got (nats-server, `infra.nats_server.run`) needs none of it, so prefer that.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket

LOOPBACK = "127.0.0.1"
"""The address `free_port` probes by default: the stack, `--nproc` ranks and local clusters listen only there."""


def is_loopback(host: str) -> bool:
    """True for a host that only this machine can reach: `localhost` or a loopback IP (127.0.0.0/8, `::1`).

    `host` is a bare host, without port or IPv6 brackets. A name other than `localhost` is not resolved,
    so it counts as remote: the callers use this to demand a key or refuse a shortcut, where guessing
    "local" would be the unsafe mistake.
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct TCP ports the OS reports free on `host` (`""`: on every interface).

    The sockets are held until all are picked, so no two are the same. A port is free when asked, not
    reserved: whoever binds it later may find it taken, and then says so (the stack with the server's log).
    """
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
    return ports


def free_port(host: str = LOOPBACK) -> int:
    """One TCP port the OS reports free on `host` (see `free_ports`)."""
    return free_ports(1, host)[0]
