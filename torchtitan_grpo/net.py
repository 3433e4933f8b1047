"""Small networking helpers shared by the launcher and the weight push.

Neither side owns them: the launcher picks ports for the servers it starts,
the weight push picks one for a rendezvous of its own, so they live below
both (``fleet`` and ``weight_sync`` import this module, never each other
for it).
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free right now (the caller may still lose a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
