"""The tests' service ports: below the kernel's ephemeral range, one window per xdist worker, in turn."""
from __future__ import annotations

import socket

import pytest

from loopback_ports import FIRST_PORT, WINDOW, PortPicker, ephemeral_range, free_port, worker_index


def test_ports_come_from_this_workers_window_below_the_ephemeral_range():
    picker = PortPicker.for_this_worker()
    if picker is None:
        pytest.skip("this worker's window would reach into the kernel's ephemeral range")
    ports = [free_port() for _ in range(8)]
    low = FIRST_PORT + worker_index() * WINDOW
    assert all(low <= port < low + WINDOW for port in ports)
    assert max(ports) < ephemeral_range()[0]
    # picked, not yet bound by anyone: the next picks still differ from them
    assert len(set(ports)) == len(ports)


def test_windows_of_two_workers_do_not_overlap(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    first = PortPicker.for_this_worker()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    second = PortPicker.for_this_worker()
    assert first.start + first.size <= second.start


def test_a_port_in_use_is_passed_over():
    picker = PortPicker(FIRST_PORT + 20 * WINDOW, 3)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", picker.start))
        held.listen()
        assert [picker(), picker()] == [picker.start + 1, picker.start + 2]
        assert picker() == picker.start + 1  # around again, past the held one
