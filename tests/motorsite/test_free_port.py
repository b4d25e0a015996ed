"""``free_port`` with a ledger (``MOTOR_PORT_LEDGER``): what two test sessions of one run share.

Each port is handed out once per run, whichever process asks, and never from the kernel's
ephemeral range, where another session's ``bind(("127.0.0.1", 0))`` could take it before the
process it is meant for binds it (a vLLM engine binds 20-50 s after its spawn).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from motorsite.processes import LEDGER_PORTS, PORT_LEDGER_ENV, _ephemeral_range, free_port

ROOT = Path(__file__).resolve().parents[2]
TAKE = "from motorsite.processes import free_port; print(*(free_port() for _ in range(100)))"


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ports"
    monkeypatch.setenv(PORT_LEDGER_ENV, str(path))
    return path


def test_it_never_hands_out_a_port_the_kernel_picks_itself(ledger: Path) -> None:
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert [p for p in ports if low <= p <= high] == []


def test_it_hands_out_each_port_once_across_processes(ledger: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    takers = [subprocess.Popen([sys.executable, "-c", TAKE], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    mine = [free_port() for _ in range(100)]
    theirs = [int(p) for taker in takers for p in taker.communicate(timeout=60)[0].split()]
    assert len(theirs) == 200
    assert len(set(mine + theirs)) == 300
    assert sorted(int(p) for p in ledger.read_text().split()) == sorted(mine + theirs)


def test_it_passes_over_a_port_something_listens_on(ledger: Path) -> None:
    low, high = _ephemeral_range()
    ports = [p for p in range(LEDGER_PORTS[0], LEDGER_PORTS[1] + 1) if not low <= p <= high]
    with _listener(ports) as listener:
        taken = listener.getsockname()[1]
        free = next(p for p in ports if p > taken and _bindable(p))
        # The ledger has handed out every other port: what is left is one taken, one free.
        ledger.write_text("".join(f"{p}\n" for p in ports if p not in (taken, free)))
        assert free_port() == free
        with pytest.raises(RuntimeError, match="no port left"):
            free_port()


def _listener(ports: list[int]) -> socket.socket:
    """A socket listening on the first of ``ports`` that can be bound."""
    for port in ports:
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        sock.listen()
        return sock
    raise AssertionError("no port to listen on")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_without_a_ledger_it_takes_what_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORT_LEDGER_ENV, raising=False)
    low, high = _ephemeral_range()
    assert low <= free_port() <= high
