"""Fault-injection points for the reliability matrix, inert unless asked for.

Theory of operation
-------------------
Most faults of the matrix (``docs/RELIABILITY.md``) are injected from outside: a signal to a
process, a link cut. A few must strike *inside* a step of a process, at a moment no outside
timer can hit reliably on a fast machine: an Actor killed halfway through applying ``D_v``, or
while the segments of ``D_v`` are arriving; an Actor that submits stale or duplicate results.
Those are named here (:data:`ENV` lists them), and a process carries them out only when its
environment holds ``AURORA_FAULT_HOOKS`` (a JSON object; the launcher sets it for the process a
test names). A process without it is unaffected: :func:`get` returns None for every hook. The
relay hooks need the whole version before they serve it, so a relay carrying one is
store-and-forward (:func:`node_config_overrides`).
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

ENV = "AURORA_FAULT_HOOKS"
"""The environment variable that holds a process's hooks: a JSON object, hook -> value.

=======================  =========================================================================
hook                     effect
=======================  =========================================================================
``kill_mid_apply``       Actor: SIGKILL itself after writing part of ``D_v`` (value: v) into its
                         weights
``kill_mid_transfer``    Actor or relay: SIGKILL itself once part, not all, of ``D_v`` has arrived
                         (value: v; a relay is then killed mid-forward)
``late_results``         Actor: hold the results of version v back ``seconds`` (value: [v, s])
``stale_version``        Actor: report results of version v as generated on v-2 (value: v)
``duplicate_results``    Actor: send every result of version v twice (value: v)
``corrupt_forward``      relay: serve segment 0 of ``D_v`` with one byte flipped (value: v)
``forge_forward``        relay: serve a self-consistent forged ``D_v`` (other bytes, every hash
                         recomputed, the trailer's id no longer the signed one; value: v)
``wrong_base_forward``   relay: serve ``D_{v-1}``'s segments, a delta on another base, as ``D_v``
                         (value: v)
``fail_at_start``        Actor: exit with this message before it joins (value: the message)
``cheat``                Actor: lie about its completions or throughput (value: ``random``,
                         ``stale``, ``othermodel``, ``forged-lp``, ``partial:F``, ``forge-lp:X``,
                         ``vocab-id``, ``after-eos``, ``throughput-lie``; :mod:`aurora.runtime.
                         cheats`): the dishonest Actors the Trainer and Ledger must withstand
=======================  =========================================================================
"""

_HOOKS: dict[str, Any] = json.loads(os.environ.get(ENV, "") or "{}")


def get(name: str) -> Any:
    """The value of hook ``name`` for this process, or None."""
    return _HOOKS.get(name)


def die() -> None:
    """SIGKILL this process now (no cleanup, as a preemption would)."""
    os.kill(os.getpid(), signal.SIGKILL)


_RELAY_HOOKS = ("corrupt_forward", "forge_forward", "wrong_base_forward")


def node_config_overrides() -> dict[str, Any]:
    """TransportConfig fields a hooked relay needs (store-and-forward for the serving hooks)."""
    return {"cut_through": False} if any(get(h) is not None for h in _RELAY_HOOKS) else {}


def node_class() -> type:
    """:class:`aurora.transport.Node`, or a subclass carrying this process's data-plane hooks."""
    from aurora.transport import Node

    if not any(get(h) is not None for h in ("kill_mid_transfer", *_RELAY_HOOKS)):
        return Node
    return _hooked(Node)


def _hooked(base: type) -> type:
    from aurora.delta import Segment

    class HookedNode(base):
        """A node that misbehaves as the hooks say (fault injection only)."""

        _forged: dict[int, dict[int, Segment]] = {}
        _told: set[int] = set()

        def _tell(self, version: int, what: str) -> None:
            if version not in self._told:
                self._told.add(version)
                import logging

                logging.getLogger("aurora.runtime.hooks").warning(
                    "%s: fault hook: %s D_%d", self.id, what, version
                )

        def _accept(self, up: Any, version: int, seg: Segment) -> None:
            super()._accept(up, version, seg)
            if get("kill_mid_transfer") == version:
                st = self.versions.get(version)
                if st is not None and st.segments and not st.whole:
                    self._tell(version, "killed while receiving")
                    die()

        def _cached(self, version: int, seq: int) -> Segment | None:
            honest = super()._cached(version, seq)
            if honest is None:
                return None
            if get("corrupt_forward") == version and seq == 0 and not honest.trailer:
                self._tell(version, "flipping a byte of segment 0 of")
                data = bytearray(honest.data)
                data[len(data) // 2] ^= 0x01
                return Segment(honest.key, seq, honest.offset, bytes(data), honest.checksum)
            if get("forge_forward") == version:
                self._tell(version, "serving a forged")
                forged = self._forged.get(version) or self._forge(version)
                return forged.get(seq, honest)
            if get("wrong_base_forward") == version:
                self._tell(version, "serving D_(v-1) in place of")
                other = super()._cached(version - 1, seq)
                return other if other is not None else honest
            return honest

        def _forge(self, version: int) -> dict[int, Segment]:
            st = self.versions[version]
            segs = [st.segments[s] for s in sorted(st.segments)]
            self._forged[version] = forge(segs)
            return self._forged[version]

    return HookedNode


def forge(segments: list[Any]) -> dict[int, Any]:
    """A self-consistent forgery of a whole delta's segments: one byte of the last payload
    segment changed, its leaf hash, the Merkle root ``id(D_v)``, ``h(v)`` and the trailer
    recomputed; the header, and so the transfer key, unchanged. Only the signed announcement
    tells it from the Trainer's."""
    import struct

    from aurora.delta import H, Segment, leaf_hash, merkle_root
    from aurora.delta.records import MAGIC, TRAILER_MAGIC

    payload = [s for s in segments if not s.trailer]
    trailer = next(s for s in segments if s.trailer)
    last = payload[-1]
    data = bytearray(last.data)
    data[-1] ^= 0x01
    payload[-1] = Segment(last.key, last.seq, last.offset, bytes(data), leaf_hash(data).hex())
    tv = bytes(trailer.data)
    plen, seg_size, n = struct.unpack_from("<QII", tv, len(TRAILER_MAGIC))
    leaves = [bytes.fromhex(s.checksum) for s in payload]
    new_id = merkle_root(leaves)
    # h(v) = H(h(v-1) || id): h(v-1) is not in the trailer, only h(v); the forger recomputes it
    # from the header's base hash, which it can read like anyone.
    header_base = _header_base_hash(payload[0].data)
    h_v = H(bytes.fromhex(header_base), new_id)
    body = (
        TRAILER_MAGIC
        + struct.pack("<QII", plen, seg_size, n)
        + b"".join(leaves)
        + new_id
        + h_v
        + MAGIC
    )
    out = {s.seq: s for s in payload}
    out[trailer.seq] = Segment(
        trailer.key, trailer.seq, trailer.offset, body, H(body).hex(), trailer=True
    )
    return out


def _header_base_hash(first: bytes) -> str:
    from aurora.delta import parse_header

    head, _ = parse_header(first)
    return str(head["base_hash"])
