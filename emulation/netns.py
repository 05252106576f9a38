"""Two hosts and a router with an htb bottleneck: the data plane's benchmark link.

Theory of operation
-------------------
``sender`` -- router -- ``receiver``, built by :func:`emulation.network.build_network` as a
two-region network with one link at ``rate_mbit`` (both directions), a bottleneck queue of
``queue_packets`` MTU frames, no added delay and no loss, and super-packets (GSO) kept as the
host's defaults make them. The bottleneck sits on the router, so TCP sees real drops and
queueing, not the local backpressure it would feel if the sender's own interface were shaped
(``docs/journal/early-measurements.md``). The namespaces are tagged like every
emulated network's, so :func:`emulation.cleanup.cleanup_leftovers` removes those of a killed
run. For delay, loss and whole topologies use :func:`emulation.network.build_network`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from emulation.capabilities import check_available, netem_available
from emulation.network import Network, build_network
from emulation.plan import MTU_FRAME_BYTES, EmulationError, EmulationUnavailable, PlanLink

__all__ = [
    "EmulatedLink",
    "EmulationError",
    "EmulationUnavailable",
    "check_available",
    "netem_available",
]


@dataclass
class EmulatedLink:
    """A shaped path from ``sender`` to ``receiver``; use as a context manager."""

    rate_mbit: float
    """Bottleneck rate on the router (Mbit/s)."""
    queue_packets: int = 1000
    """Bottleneck queue (MTU frames; a bfifo of this many 1514-byte frames)."""
    net: Network | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {self.rate_mbit}")
        if self.queue_packets < 1:
            raise ValueError(f"queue_packets must be >= 1, got {self.queue_packets}")

    def __enter__(self) -> EmulatedLink:
        self.net = build_network(
            None,
            links=[
                PlanLink(index=0, a="sender", b="receiver", gbps=self.rate_mbit / 1e3, rtt_ms=0)
            ],
            regions=["sender", "receiver"],
            verify=False,
            segmentation="gso",
            queue_bytes=self.queue_packets * MTU_FRAME_BYTES,
        )
        net = self.net
        self.sender, self.receiver = net.namespace("sender"), net.namespace("receiver")
        self.router = net.router_namespace
        self.sender_ip, self.receiver_ip = net.address("sender"), net.address("receiver")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.net is not None:
            self.net.close()

    def bottleneck_bytes(self) -> int:
        """Bytes sent so far through the router's rate-limited class toward the receiver."""
        assert self.net is not None
        return self.net.class_bytes("sender", "receiver")

    def popen(self, ns: str, argv: Sequence[str], **kw: object) -> subprocess.Popen:
        """Start ``argv`` inside namespace ``ns``."""
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kw)  # type: ignore[call-overload]
