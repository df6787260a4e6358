"""`infra.ports`: which hosts count as this machine only, and free ports that are distinct."""

from __future__ import annotations

import pytest

from infra.ports import LOOPBACK, free_ports, is_loopback


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", LOOPBACK])
def test_loopback_hosts_are_local(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host",
    ["0.0.0.0", "::", "10.0.0.1", "192.168.1.5", "example.com", "LOCALHOST.example", "", "[::1]", "127.0.0.1:6379"],
)
def test_every_other_host_counts_as_remote(host: str) -> None:
    """Unresolved names, wildcards, and anything not a bare host are remote: the safe side for a key or a shortcut."""
    assert not is_loopback(host)


def test_free_ports_asked_together_are_distinct() -> None:
    """The stack gives each of its nine listeners one of them: two alike would be a bind failure at start."""
    ports = free_ports(9)
    assert len(set(ports)) == 9 and all(0 < port < 65536 for port in ports)
