"""free_port draws below the kernel's ephemeral range, where no outgoing connection can
take the port between the draw and the server's bind (the CI flake it fixes: a test
Sentinel's 'bind: Address already in use')."""

from __future__ import annotations

import socket

from specdec.serving import redis_embedded
from specdec.serving.redis_embedded import _ephemeral_low, free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_free():
    low = _ephemeral_low()
    assert low > 21024  # Linux's default 32768: the draw below it applies here
    ports = {free_port() for _ in range(50)}
    assert all(20000 <= port < low for port in ports)
    assert len(ports) > 40  # random draws, not one port again and again
    for port in list(ports)[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_range_file_that_leaves_no_room_falls_back_to_bind_zero(tmp_path, monkeypatch):
    """Negative control: where the ephemeral range starts low, the port comes from bind(0)
    (inside the range) — the assertion above would fail on such a port."""
    narrow = tmp_path / "range"
    narrow.write_text("1024\t65535\n")
    assert _ephemeral_low(str(narrow)) == 1024
    assert _ephemeral_low(str(tmp_path / "missing")) == 32768
    kernel_low = _ephemeral_low()  # this machine's real range, where bind(0) draws
    monkeypatch.setattr(redis_embedded, "_ephemeral_low", lambda: 1024)
    assert any(free_port() >= kernel_low for _ in range(5))


def test_a_port_in_use_is_never_drawn(monkeypatch):
    """A drawn port that is in use is skipped: the draws land twice on a held port, then on
    20007, which comes back."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        draws = iter([taken - 20000, taken - 20000, 7])
        monkeypatch.setattr(redis_embedded.secrets, "randbelow", lambda n: next(draws))
        assert free_port() == 20007
