"""The data plane: authenticated, striped, verified delta transfer (aurora.transport.node).

Only the Trainer's signed announcements are believed (``docs/TRANSPORT.md``, "Trust")."""

from aurora.transport.node import Node, NodeMetrics, TransportConfig, VersionRefused, run

__all__ = ["Node", "NodeMetrics", "TransportConfig", "VersionRefused", "run"]
