"""The Trainer's side of publishing a delta: it signs, the data plane carries.

Theory of operation
-------------------
Every node believes a version only through the Trainer's signed announcement
(:mod:`aurora.delta.announce`: ``id(D_v)``, ``h(v)``, size, segment grid). The signing key is
the Trainer role's alone: it never enters the transport, whose nodes only carry the
announcements they are given and verify every one against the job's public key.
:class:`TrainerNode` is the Trainer's data-plane node with the key beside it: :meth:`publish`
signs the announcement from segment 0 (the header) and the trailer (the leaf hashes and
``id(D_v)``) and hands the signed bytes to :meth:`aurora.transport.Node.publish`, which sends
them ahead of the trailer - ahead of every segment when the delta exists whole, so each hop
verifies each segment on arrival; when the Trainer streams segments as it extracts them
(cut-through), the announcement goes out the moment the trailer is produced.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from aurora.delta import Segment
from aurora.delta.announce import describe_parts, public_key_of, sign
from aurora.transport import Node, TransportConfig
from aurora.transport.table import is_whole


def sign_parts(job: str, version: int, first: Segment, trailer: Segment, key: bytes) -> bytes:
    """The signed announcement of ``D_version`` from its segment 0 and its trailer; ValueError
    if they are of another version."""
    ann = describe_parts(job, first.data, trailer.data)
    if ann.version != version:
        raise ValueError(f"publish v{version}: the segments are of D_{ann.version}")
    return sign(ann, key)


class TrainerNode(Node):
    """The Trainer's data-plane node and its signing key (see the module docstring)."""

    def __init__(
        self, node_id: str, config: TransportConfig, *, signing_key: bytes, **kw: Any
    ) -> None:
        if public_key_of(signing_key) != config.public_key:
            raise ValueError(
                f"node {node_id}: the signing key does not match TransportConfig.public_key"
            )
        super().__init__(node_id, config, **kw)
        self._signing_key = signing_key

    async def publish(
        self, version: int, segments: Iterable[Segment], *, announcement: bytes | None = None
    ) -> bytes | None:
        """:meth:`aurora.transport.Node.publish`, signing the announcement when none is given:
        before any segment when ``segments`` is the whole delta, else when the trailer comes."""
        st = self.versions.get(version)
        if announcement is not None or (st is not None and st.signed is not None):
            return await super().publish(version, segments, announcement=announcement)
        if is_whole(segments):
            assert isinstance(segments, Sequence)
            whole = self._sign(version, segments[0], segments[-1])
            return await super().publish(version, segments, announcement=whole)
        out = None
        for seg in segments:
            signed = None
            st = self.versions.get(version)
            if seg.trailer and (st is None or st.signed is None):
                first = self.segment(version, 0)
                if first is None:
                    raise ValueError(f"publish v{version}: the trailer came before segment 0")
                signed = self._sign(version, first, seg)
            out = await super().publish(version, [seg], announcement=signed) or out
        return out

    def _sign(self, version: int, first: Segment, trailer: Segment) -> bytes:
        return sign_parts(self.config.job, version, first, trailer, self._signing_key)
