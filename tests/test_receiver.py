"""The receive machine (``aurora.transport.receiver``) by exact action traces: no sockets, no
sleeps, a clock that is a number passed in. Each rule the socket tests of test_transport.py and
test_trust.py check under load is checked here at the instant it must fire, and one tick
before, and each illegal event raises with the state unchanged."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from aurora.delta import DeltaEncoder, Segment, weights_hash
from aurora.delta.announce import describe_parts, public_key_of, sign
from aurora.transport.actions import (
    Announce,
    Blame,
    Complete,
    Dropped,
    Fallback,
    Fetch,
    FetchWhenIdle,
    Forward,
    Refused,
    Staged,
    Switch,
)
from aurora.transport.arenas import ArenaPool
from aurora.transport.config import NodeMetrics, TransportConfig
from aurora.transport.receiver import Receiver

KEY = bytes(range(32))
JOB = "trace-job"
CFG = TransportConfig(
    secret=b"s" * 16, job=JOB, public_key=public_key_of(KEY), max_delta_bytes=8 << 20
)
SOURCES = ["relay:1", "trainer:2"]


def _chain(n: int = 2, seed: int = 1):
    """v0 weights and D_1..D_n as segments of 4 KiB (each on the one before); another ``seed``
    gives other deltas on the same v0."""
    w = {"w": np.random.default_rng(0).integers(0, 2**16, (64, 256), dtype=np.uint16)}
    rng = np.random.default_rng(seed)
    h0 = weights_hash(w)
    out, base_hash = [], h0
    for v in range(1, n + 1):
        new = {"w": w["w"].copy()}
        new["w"].reshape(-1)[rng.choice(new["w"].size, 3000, replace=False)] ^= 1
        enc = DeltaEncoder(
            w, new, model="toy", version=v, base_hash=base_hash, codec="naive", segment_size=4096
        )
        segs = list(enc.segments())
        out.append(segs)
        base_hash = bytes(segs[-1].data[-40:-8]).hex()  # h(v), from the trailer
        w = new
    return h0, out


H0, (D1, D2) = _chain()
_, (OTHER_D1,) = _chain(1, seed=2)
SIGNED = {v: sign(describe_parts(JOB, d[0].data, d[-1].data), KEY) for v, d in ((1, D1), (2, D2))}


def _rx(*, active=(0, H0), fallback=False, config=CFG, sources=SOURCES) -> Receiver:
    return Receiver(
        "ca-0",
        config,
        sources=list(sources),
        active=active,
        arenas=ArenaPool(config.max_delta_bytes),
        metrics=NodeMetrics(),
        now=0.0,
        fallback=fallback,
    )


def _announce(rx: Receiver, v: int, *, via: int | None = 0, now: float = 0.0):
    return rx.announcement(rx.verify(SIGNED[v]), SIGNED[v], via, now)


def _deliver(rx: Receiver, v: int, seg: Segment, *, source: int = 0, now: float = 0.0):
    """What a connection does with one segment frame: ask for a slot, fill it, hand it over."""
    view, acts = rx.slot(source, v, seg.key, seg.seq, seg.offset, len(seg.data), seg.trailer, now)
    if view is None:
        return acts
    view[:] = seg.data
    got = Segment(seg.key, seg.seq, seg.offset, view, seg.checksum, seg.trailer)
    return acts + rx.segment(source, v, got, now)


def _trailer_first(segs):
    return [segs[-1], *segs[:-1]]


def test_an_announced_delta_from_the_current_source_is_forwarded_verified_and_staged():
    rx = _rx()
    rx.connected(0, now=0.0)
    assert _announce(rx, 1, via=0) == (Announce(SIGNED[1]),)  # its own push: no fetch
    *first, last = _trailer_first(D1)
    for seg in first:
        assert _deliver(rx, 1, seg, now=0.1) == (Forward(1, (seg.seq,)),)
    acts = _deliver(rx, 1, last, now=0.2)
    assert acts[:2] == (Forward(1, (last.seq,)), Complete(1))
    (staged,) = acts[2:]
    assert isinstance(staged, Staged) and staged.delta.version == 1
    assert staged.ann == rx.announcements[1] and rx.staged == {1: staged.delta}
    assert rx.versions[1].received_at == 0.2 and rx.metrics.bytes_verified > 0


def test_an_announcement_learned_elsewhere_fetches_once_the_source_is_idle():
    rx = _rx()
    rx.connected(0, now=0.0)
    assert _announce(rx, 1, via=None) == (Announce(SIGNED[1]), FetchWhenIdle(1))
    assert rx.missing(1) == Fetch(1, ())
    assert _announce(rx, 1, via=None) == ()  # the same announcement again: nothing


def test_a_trailer_before_the_announcement_is_dropped_and_fetched_once_it_comes():
    rx = _rx()
    rx.connected(0, now=0.0)
    # Provisional: taken (and cut through, checked against its checksum) before the announcement.
    assert _deliver(rx, 1, D1[0]) == (Forward(1, (0,)),)
    assert _deliver(rx, 1, D1[-1]) == ()  # no trailer before the announcement
    assert _announce(rx, 1, via=0) == (Announce(SIGNED[1]), Fetch(1, (0,)))


def test_unannounced_segments_are_taken_only_for_the_next_version():
    rx = _rx()
    seg = D2[0]
    view, acts = rx.slot(0, 2, seg.key, seg.seq, seg.offset, len(seg.data), False, 0.0)
    assert view is None and acts == () and 2 not in rx.versions
    view, _ = rx.slot(0, 1, D1[0].key, 0, 0, len(D1[0].data), False, 0.0)
    assert view is not None


def test_a_segment_off_the_announced_grid_blames_the_current_source_and_switches():
    rx = _rx()
    rx.connected(0, now=0.0)
    _announce(rx, 1, via=0)
    seg = D2[1]  # another delta's key
    view, acts = rx.slot(0, 1, seg.key, seg.seq, seg.offset, len(seg.data), False, 1.0)
    assert view is None and len(acts) == 2
    blame, switch = acts
    assert blame == Blame(0, 1, blame.what) and "not of the announced D_1" in blame.what
    assert switch == Switch(0, f"it sent {blame.what} for v1")
    assert rx.current is None and not rx.choice.usable(1, 0)
    # A second frame from the same source, already left: blamed once, no second switch.
    assert rx.slot(0, 1, seg.key, seg.seq, seg.offset, len(seg.data), False, 1.0) == (None, ())


def test_a_source_refuted_by_every_source_goes_to_the_fallback_then_is_refused():
    rx = _rx(fallback=True, sources=["relay:1"])
    rx.connected(0, now=0.0)
    _announce(rx, 1, via=0)
    seg = D2[1]
    _, acts = rx.slot(0, 1, seg.key, seg.seq, seg.offset, len(seg.data), False, 1.0)
    assert [type(a) for a in acts] == [Blame, Switch, Fallback]
    reason = acts[2].reason
    assert reason.startswith("no source can complete it: relay:1 sent")
    assert rx.check_refusals() == ()  # the fallback is fetching: not refused meanwhile
    assert rx.fallback_failed(1, f"{reason}; the fallback failed too: gone") == (
        Refused(1, f"{reason}; the fallback failed too: gone"),
    )
    assert 1 in rx.refused and rx.metrics.refused["version"] == 1


def test_a_corrupt_segment_from_the_only_source_refuses_the_version_and_raises_nothing():
    rx = _rx(sources=["relay:1"])
    rx.connected(0, now=0.0)
    _announce(rx, 1, via=0)
    seg = D1[1]
    view, _ = rx.slot(0, 1, seg.key, seg.seq, seg.offset, len(seg.data), False, 1.0)
    view[:] = bytes(len(seg.data))  # not the bytes its checksum names
    got = Segment(seg.key, seg.seq, seg.offset, view, seg.checksum, False)
    acts = rx.segment(0, 1, got, 1.0)
    assert [type(a) for a in acts] == [Blame, Switch, Refused]
    assert acts[2].reason.startswith("no source can complete it: relay:1 sent segment 1")
    assert rx.versions[1].reassembler is None and rx.versions[1].segments == {}
    assert _deliver(rx, 1, D1[2], now=1.1) == ()  # a refused version takes nothing more


def test_the_progress_rule_leaves_a_source_that_delivers_nothing_after_progress_s():
    rx = _rx()
    rx.connected(0, now=0.0)
    _announce(rx, 1, via=0, now=0.0)
    ticks = [0.25 * i for i in range(1, 21)]  # every stall_s / 2, on time
    for now in ticks[:-1]:
        acts = rx.tick(now, connected=True, arriving=True)
        assert acts == (), now
    why = "0 wanted bytes in 5.0 s while v1 is incomplete (slower than 65536 B/s)"
    assert rx.tick(ticks[-1], connected=True, arriving=True) == (Switch(0, why),)
    assert rx.choice.refusal(1) is None and rx.current is None  # one try of three


def test_a_late_tick_judges_no_source_and_starts_the_progress_window_again():
    rx = _rx()
    rx.connected(0, now=0.0)
    _announce(rx, 1, via=0, now=0.0)
    assert rx.tick(0.25, connected=True, arriving=True) == ()
    assert rx.is_late(6.0)  # the process was paused for 5.75 s
    assert rx.tick(6.0, connected=True, arriving=True) == ()  # nothing delivered: no switch
    assert rx.progress_mark == (6.0, 0)
    # The window runs from the late tick: judged progress_s after it, by ticks on time.
    on_time = [6.0 + 0.25 * i for i in range(1, 21)]
    assert all(rx.tick(now, connected=True, arriving=True) == () for now in on_time[:-1])
    assert [type(a) for a in rx.tick(on_time[-1], connected=True, arriving=True)] == [Switch]


def test_a_stalled_version_is_fetched_with_what_is_held_unless_a_segment_is_arriving():
    rx = _rx()
    rx.connected(0, now=0.0)
    _announce(rx, 1, via=0, now=0.0)
    for seg in _trailer_first(D1)[:3]:
        _deliver(rx, 1, seg, now=0.1)
    held = tuple(sorted(rx.versions[1].segments))
    assert rx.tick(0.5, connected=True, arriving=False) == ()  # 0.4 s: not yet stall_s
    assert rx.tick(0.75, connected=True, arriving=True) == ()  # still arriving
    assert rx.tick(1.0, connected=True, arriving=False) == (Fetch(1, held),)
    assert rx.tick(1.25, connected=True, arriving=False) == ()  # asked at 1.0: wait again


def test_a_delta_on_a_base_not_held_is_refused_with_the_reason():
    rx = _rx(active=(0, "ab" * 32))
    rx.connected(0, now=0.0)
    _announce(rx, 1, via=0)
    acts = ()
    for seg in _trailer_first(D1):
        acts = _deliver(rx, 1, seg)
    assert acts[:2] == (Forward(1, (D1[-2].seq,)), Complete(1))
    (refused,) = acts[2:]
    assert refused.version == 1 and "which this node does not hold" in refused.reason
    assert rx.staged == {} and rx.refused == {1: refused.reason}


def test_a_delta_whose_base_is_still_coming_waits_and_is_staged_right_after_it():
    rx = _rx()
    rx.connected(0, now=0.0)
    _announce(rx, 1, via=0)
    _announce(rx, 2, via=0)
    for seg in _trailer_first(D2):
        acts = _deliver(rx, 2, seg)
    assert acts[-1] == Complete(2) and rx.staged == {}  # waits for D_1
    for seg in _trailer_first(D1):
        acts = _deliver(rx, 1, seg)
    assert [type(a) for a in acts] == [Forward, Complete, Staged, Staged]
    assert [a.delta.version for a in acts[2:]] == [1, 2]


def test_set_active_releases_what_it_covers_and_stages_what_builds_on_it():
    rx = _rx(active=None)  # no weights yet: receives, stages nothing
    rx.connected(0, now=0.0)
    _announce(rx, 1, via=0)
    for seg in _trailer_first(D1):
        _deliver(rx, 1, seg)
    _announce(rx, 2, via=0)
    for seg in _trailer_first(D2):
        acts = _deliver(rx, 2, seg)
    assert acts[-1] == Complete(2) and rx.staged == {}
    h1 = bytes(D1[-1].data[-40:-8]).hex()
    (staged,) = rx.set_active(1, h1)  # a catch-up to v1
    assert isinstance(staged, Staged) and staged.delta.version == 2
    assert sorted(rx.versions) == [2] and rx.active == (1, h1)


def test_moving_the_active_version_back_raises_and_changes_nothing():
    rx = _rx(active=(3, H0))
    before = (rx.active, dict(rx.versions), dict(rx.staged), dict(rx.refused))
    with pytest.raises(ValueError, match="cannot move the active version back from v3 to v2"):
        rx.set_active(2, H0)
    assert (rx.active, dict(rx.versions), dict(rx.staged), dict(rx.refused)) == before


def test_publishing_a_trailer_before_its_announcement_raises_and_changes_nothing():
    rx = _rx(active=None)
    table = rx.table
    assert table.own_segment(1, D1[0], 0.0) == (Forward(1, (0,)),)
    before = copy.copy(table.versions[1].segments)
    with pytest.raises(ValueError, match="before its signed announcement"):
        table.own_segment(1, D1[-1], 0.0)
    assert table.versions[1].segments == before and table.versions[1].signed is None


def test_a_second_different_own_announcement_raises_and_changes_nothing():
    rx = _rx(active=None)
    ann = rx.verify(SIGNED[1])
    assert rx.table.own_announcement(ann, SIGNED[1], 0.0) == (Announce(SIGNED[1]),)
    forged = sign(describe_parts(JOB, OTHER_D1[0].data, OTHER_D1[-1].data), KEY)
    with pytest.raises(ValueError, match="announced already"):
        rx.table.own_announcement(rx.verify(forged), forged, 0.0)
    assert rx.table.versions[1].signed == SIGNED[1] and rx.announcements[1] == ann


def test_a_relay_keeps_the_newest_cache_versions_whole_and_names_those_that_left():
    config = TransportConfig(
        secret=b"s" * 16, job=JOB, public_key=public_key_of(KEY), cache_versions=1
    )
    rx = _rx(active=None, config=config)
    for v, segs in ((1, D1), (2, D2)):
        rx.table.own_announcement(rx.verify(SIGNED[v]), SIGNED[v], 0.0)
        for seg in _trailer_first(segs):
            rx.table.own_segment(v, seg, 0.0)
        signed, acts = rx.table.own_done(v)
        assert signed == SIGNED[v]
    assert acts == (Dropped((1,)),) and rx.table.held() == [2]


def _on_time(start: float, end: float) -> list[float]:
    """Watchdog ticks every stall_s / 2 (0.25 s) after ``start``, up to ``end``."""
    n = round((end - start) / 0.25)
    return [start + 0.25 * i for i in range(1, n + 1)]


def test_a_source_left_for_no_progress_attempts_times_is_refused_naming_its_tries():
    config = TransportConfig(
        secret=b"s" * 16, job=JOB, public_key=public_key_of(KEY), attempts=2, progress_s=1.0
    )
    rx = _rx(config=config, sources=["relay:1"])
    rx.connected(0, now=0.0)
    _announce(rx, 1, via=0)
    switches, refusals = [], []
    for start in (0.0, 1.0):
        if start:
            rx.connected(0, now=start)  # the reconnection the switch asked for
        for now in _on_time(start, start + 1.0):
            switches += rx.tick(now, connected=True, arriving=True)
        refusals.append(rx.check_refusals())  # as the shell does after each reconnection
    why = "0 wanted bytes in 1.0 s while v1 is incomplete (slower than 65536 B/s)"
    assert switches == [Switch(0, why), Switch(0, why)]
    reason = f"no source can complete it: relay:1 failed 2 tries (last: {why})"
    assert refusals == [(), (Refused(1, reason),)] and rx.refused == {1: reason}


def test_leaving_a_source_before_anything_verified_backs_off_the_next_round():
    rx = _rx(sources=["trainer:2"])  # backoff_s 0.5, doubled per failed round
    for at, delay in ((0.0, 0.5), (1.0, 1.0), (3.0, 2.0)):
        rx.connected(0, now=at)
        assert rx.switch("it sent an announcement that does not verify", at) == (
            Switch(0, "it sent an announcement that does not verify"),
        )
        assert not rx.choice.ready(at + delay - 0.01) and rx.choice.ready(at + delay)
    rx.connected(0, now=6.0)
    _announce(rx, 1, via=0, now=6.0)
    _deliver(rx, 1, D1[-1], now=6.1)  # verified bytes: the backoff starts again from zero
    assert rx.choice.delay() == 0.0


def test_segments_over_the_unannounced_budget_are_fetched_once_it_is_announced():
    config = TransportConfig(
        secret=b"s" * 16, job=JOB, public_key=public_key_of(KEY), unannounced_bytes=4096
    )
    rx = _rx(config=config)
    rx.connected(0, now=0.0)
    assert _deliver(rx, 1, D1[0]) == (Forward(1, (0,)),)
    assert _deliver(rx, 1, D1[1]) == ()  # one page is the budget: dropped, noted
    assert _announce(rx, 1, via=0) == (Announce(SIGNED[1]), Fetch(1, (0,)))


def test_a_refused_version_asked_for_again_forgets_its_history_and_is_fetched():
    rx = _rx(sources=["relay:1"])
    rx.connected(0, now=0.0)
    _announce(rx, 1, via=0)
    seg = D2[1]
    rx.slot(0, 1, seg.key, seg.seq, seg.offset, len(seg.data), False, 1.0)
    assert 1 in rx.refused
    rx.connected(0, now=2.0)
    assert rx.request(1, 1, now=2.0) == (Fetch(1, ()),)
    assert 1 not in rx.refused and rx.choice.usable(1, 0) and rx.versions[1].ann is not None


def test_a_whole_file_is_checked_against_its_announcement_then_served_and_staged():
    rx = _rx()
    _announce(rx, 1, via=None)
    forged = b"".join(bytes(s.data) for s in OTHER_D1)
    with pytest.raises(Exception, match="id"):
        rx.add_file(forged, now=1.0)
    assert rx.versions[1].delta is None and rx.staged == {}
    delta, acts = rx.add_file(b"".join(bytes(s.data) for s in D1), now=1.0)
    order = tuple(s.seq for s in _trailer_first(D1))
    assert acts == (Announce(SIGNED[1]), Forward(1, order), Staged(delta, rx.announcements[1]))


def test_a_stream_silent_mid_frame_for_the_limit_is_closed_and_a_slow_one_is_not():
    from aurora.transport import wire
    from aurora.transport.config import RateLimitedLog
    from aurora.transport.upstream import Connector, Upstream

    class Reader:
        closed = False

        def __init__(self, frame_since, last_byte):
            self.frame_since, self.last_byte = frame_since, last_byte

        def stop(self):
            self.closed = True

    def up(frame_since, last_byte):
        u = Upstream(0, "relay:1", wire.TokenBucket(64.0, 256))
        u.reader = Reader(frame_since, last_byte)
        return u

    limit = 10 * CFG.stall_s
    c = Connector("ca-0", CFG, _rx(), None, log=RateLimitedLog(), sources=[("relay", 1)])
    silent, slow, idle = up(0.0, 0.0), up(0.0, limit - 0.1), up(None, 0.0)
    c.streams = [silent, slow, idle]
    c.close_stuck(limit - 0.01, limit)
    assert not (silent.aborted or slow.aborted or idle.aborted)
    c.close_stuck(limit, limit)
    assert silent.aborted and not slow.aborted and not idle.aborted  # between frames: not stuck
    assert c.live() == [slow, idle]
