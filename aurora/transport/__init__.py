"""The data plane: authenticated, striped, verified delta transfer (aurora.transport.node)."""

from aurora.transport.node import Node, TransportConfig, run

__all__ = ["Node", "TransportConfig", "run"]
