"""The suite runs offline: conftest's guard refuses any connection off this machine and fails the test
that tried (the package downloads nothing at run time)."""

from __future__ import annotations

import socket

import pytest

import conftest


def test_a_connection_off_the_machine_is_refused_and_recorded():
    before = len(conftest._network_attempts)
    with socket.socket() as s, pytest.raises(ConnectionRefusedError, match="offline"):
        s.connect(("192.0.2.1", 80))  # TEST-NET-1: never routed, and never tried
    assert conftest._network_attempts[before:] == ["('192.0.2.1', 80)"]
    del conftest._network_attempts[before:]  # this test meant it; do not fail it


def test_loopback_is_allowed():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        socket.create_connection(server.getsockname(), timeout=5).close()
