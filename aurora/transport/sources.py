"""Which source a receiver uses next, and when it gives a version up (one state machine).

A receiver has an ordered list of sources (its relay, peer relays, the Trainer). For every
version it is waiting for, :class:`SourceChoice` remembers per source whether it was *refuted*
(it sent something that contradicts the Trainer's signed announcement: never used again for that
version, since an honest source never forwards what it has not verified) and how many *tries* it
was left while the version was incomplete (unreachable, connections broken, or no verified
progress within ``TransportConfig.progress_s``; after ``attempts`` tries it is not used again for
that version either). The next source is the usable one with the fewest strikes; when none is
usable the version is refused with a one-line reason instead of waited for forever; between
rounds that found no source at all the node backs off exponentially. Nothing here does I/O or
reads a clock: the node passes ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _VersionSources:
    refuted: dict[int, str] = field(default_factory=dict)
    """Source index -> why it is not used again for this version."""
    tries: dict[int, list[str]] = field(default_factory=dict)
    """Source index -> why it was left, once per try."""


class SourceChoice:
    """Per-version refutations and tries over ``names``.

    **refuted**: the source sent something that contradicts the Trainer's signed announcement (a
    segment of another delta, a trailer with another ``id(D_v)``, bytes that do not hash to their
    checksum). **tries**: the source was left while the version was incomplete: it could not be
    reached, every connection to it broke, or it made no verified progress within the progress
    window.

    :meth:`next` returns the usable source with the fewest *strikes* (a refutation or a try left
    behind counts one; a version completed from a source clears its strikes), the first after
    the current one in list order among equals, so a source that keeps failing is tried last
    instead of once per version. :meth:`refusal` says, in one line naming every source, why a
    version cannot be completed anywhere once no source is usable. Between rounds that found no
    source at all, :meth:`delay` backs off exponentially (``backoff_s``, doubled per failed
    round, at most ``max_backoff_s``); verified progress resets it. A round fails when every
    source in turn either could not be reached or was left before anything verified arrived from
    it (:meth:`left` with ``now``): a source that answers the handshake and then sends an
    announcement that fails verification is a failure too, or a node whose only source does that
    reconnects in a tight loop.
    """

    def __init__(
        self, names: list[str], *, attempts: int, backoff_s: float, max_backoff_s: float
    ) -> None:
        if attempts < 1 or backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError("SourceChoice needs attempts >= 1 and 0 < backoff_s <= max_backoff_s")
        self.names = list(names)
        self.attempts = attempts
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.current: int | None = None
        self.strikes = [0] * len(self.names)
        """Per source: refutations and tries left behind since it last completed a version."""
        self._versions: dict[int, _VersionSources] = {}
        self._failed_rounds = 0
        self._failed_in_round = 0
        """Sources that failed in a row (unreachable, or left with nothing verified) since
        verified bytes last arrived."""
        self._progress_since_connect = False
        self._retry_at = 0.0

    def _check(self, source: int) -> None:
        if isinstance(source, bool) or not isinstance(source, int):
            raise ValueError(f"source must be an index into {self.names}, got {source!r}")
        if not 0 <= source < len(self.names):
            raise ValueError(f"no source {source}: there are {len(self.names)} ({self.names})")

    # -- what happened ------------------------------------------------------------------------

    def refute(self, version: int, source: int, reason: str) -> bool:
        """``source`` sent something for ``version`` that the announcement refutes; returns
        True the first time (a new refutation)."""
        self._check(source)
        vs = self._versions.setdefault(version, _VersionSources())
        if source in vs.refuted:
            return False
        vs.refuted[source] = reason
        self.strikes[source] += 1
        return True

    def left(self, source: int, versions: list[int], reason: str, now: float | None = None) -> None:
        """The node left ``source`` while ``versions`` were incomplete: one try each. With
        ``now`` (the node left a source it had connected to), leaving it before anything
        verified arrived from it also counts as a failure towards the backoff, as an
        unreachable source does."""
        self._check(source)
        if now is not None and not self._progress_since_connect:
            self._fail(now)
        if versions:
            self.strikes[source] += 1
        for v in versions:
            self._versions.setdefault(v, _VersionSources()).tries.setdefault(source, []).append(
                reason
            )

    def unreachable(self, source: int, versions: list[int], reason: str, now: float) -> None:
        """Connecting to ``source`` failed: one try for each waiting version, and one more
        failure towards a backoff once every source failed in a row."""
        self._check(source)
        self.left(source, versions, reason)
        self._fail(now)

    def _fail(self, now: float) -> None:
        self._failed_in_round += 1
        if self._failed_in_round >= len(self.names):
            self._failed_in_round = 0
            self._failed_rounds += 1
            self._retry_at = now + self.delay()

    def connected(self, source: int) -> None:
        """A connection to ``source`` answered (not yet a success: that is verified bytes)."""
        self._check(source)
        self.current = source
        self._progress_since_connect = False

    def progressed(self) -> None:
        """Verified bytes arrived: backoff starts again from zero."""
        self._failed_rounds = 0
        self._failed_in_round = 0
        self._progress_since_connect = True
        self._retry_at = 0.0

    def done(self, version: int, source: int | None = None) -> None:
        """``version`` is complete (from ``source``, whose strikes are cleared) or given up:
        forget its history."""
        if source is not None:
            self._check(source)
            self.strikes[source] = 0
        self._versions.pop(version, None)

    def forget(self, version: int) -> None:
        """Try ``version`` again from scratch (the runtime asked for it again)."""
        self._versions.pop(version, None)

    # -- decisions ----------------------------------------------------------------------------

    def usable(self, version: int, source: int) -> bool:
        vs = self._versions.get(version)
        if vs is None:
            return True
        return source not in vs.refuted and len(vs.tries.get(source, ())) < self.attempts

    def next(self, waiting: list[int]) -> int | None:
        """The source to connect to next: among those usable for the oldest waiting version
        (any source when none waits), the one with the fewest strikes, the first after the
        current one in list order among equals; None when there is none."""
        n = len(self.names)
        if n == 0:
            return None
        start = 0 if self.current is None else self.current + 1
        oldest = min(waiting) if waiting else None
        order = [(start + i) % n for i in range(n)]
        usable = [s for s in order if oldest is None or self.usable(oldest, s)]
        return min(usable, key=lambda s: self.strikes[s]) if usable else None

    def delay(self) -> float:
        """Seconds to wait before the next round after ``_failed_rounds`` failed rounds."""
        if self._failed_rounds == 0:
            return 0.0
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** (self._failed_rounds - 1))

    def ready(self, now: float) -> bool:
        """Whether a connection may be tried now (not inside a backoff)."""
        return now >= self._retry_at

    def refusal(self, version: int) -> str | None:
        """Why ``version`` cannot be completed from any source (one line), or None."""
        if any(self.usable(version, s) for s in range(len(self.names))):
            return None
        vs = self._versions.get(version, _VersionSources())
        parts = []
        for s, name in enumerate(self.names):
            if s in vs.refuted:
                parts.append(f"{name} sent {vs.refuted[s]}")
            else:
                tries = vs.tries.get(s, [])
                parts.append(f"{name} failed {len(tries)} tries (last: {tries[-1]})")
        return "no source can complete it: " + "; ".join(parts)
