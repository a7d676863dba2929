"""Free TCP ports for tests whose processes bind them.

A port from bind(("127.0.0.1", 0)) is an ephemeral one (Linux: 32768-60999), and between the
check and a child's bind seconds later any process's outgoing connection may take it: with two
xdist workers, the other worker's ZMQ connections. These ports come from below the ephemeral
range, from a block of their own per xdist worker, so no outgoing connection and no other
worker takes one; within a worker tests run one at a time.
"""

from __future__ import annotations

import os
import random
import socket

_LOW = 20000  # up to 32000: six worker blocks below the ephemeral range
_BLOCK = 2000


def _block() -> tuple[int, int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    low = _LOW + (int(worker) % 6 if worker.isdigit() else 0) * _BLOCK
    return low, low + _BLOCK


def free_ports(n: int = 1) -> int:
    """A port P with P .. P + n - 1 free now (bound and released)."""
    low, high = _block()
    for _ in range(200):
        port = random.randrange(low, high - n)
        taken = []
        try:
            for p in range(port, port + n):
                s = socket.socket()
                taken.append(s)
                s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for s in taken:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports in {low}..{high}")


def free_port() -> int:
    return free_ports(1)
