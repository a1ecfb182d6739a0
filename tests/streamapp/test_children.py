"""streamapp.children: ports for the servers the project starts."""

from __future__ import annotations

import socket

from streamapp.children import free_port, free_ports


def test_free_ports_are_distinct_bindable_and_skip_the_excluded() -> None:
    """A Kafka cluster's nodes need 2 × N distinct ports; two free_port calls in a row once
    returned the same one (a node's client and controller listeners, test-kafka-slow)."""
    taken = free_port()
    ports = free_ports(64, exclude=[taken])
    assert len(set(ports)) == 64 and taken not in ports
    for port in ports[:4]:  # free a moment ago: a server can bind them
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
