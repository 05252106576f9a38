"""TCP as the simulator models it: a stream's rate per congestion control, and loss recovery.

Theory of operation
-------------------
A stream's long-run rate on a path of round-trip time RTT (s) and random packet loss p, before
the path's capacity is shared (:mod:`sim.network` shares it), is W x MSS / RTT for an average
window of W packets, never above the socket's window (``window_bytes`` / RTT). W comes from
the congestion control's published response (reno: Mathis et al. 1997; cubic: RFC 8312; bbr:
BBRv1, loss-blind up to :data:`BBR_MAX_LOSS`), see :func:`window_packets`.

Loss recovery at the end of a flight follows RFC 8985 RACK-TLP with Linux's constants:
:func:`tail_delay` is how much later than the fluid end a stream's last packet arrives;
:func:`message_delay` the same for a message of one packet (a control message). Losses in one
tail are recovered in parallel, so the latest lost packet decides; two losses among the last
two packets (probability ~p^2) are not modelled."""

from __future__ import annotations

import math

import numpy as np

from aurora.topology import CONGESTION

DEFAULT_CONGESTION = "reno"
"""The simulator's model when a topology names none: the loss-based response every paper-trace
result was made with (docs/SIMULATOR.md says why)."""
CUBIC_C = 0.4
"""RFC 8312 §4.1: CUBIC's scaling constant (packets / s^3)."""
CUBIC_BETA = 0.7
"""RFC 8312 §4.5: CUBIC's multiplicative decrease factor."""
BBR_MAX_LOSS = 0.2
"""Loss at which BBRv1's probing phase (pacing gain 5/4) no longer delivers the bottleneck rate:
5/4 x (1 - p) = 1."""
RTO_MIN_S = 0.2
"""Linux's TCP_RTO_MIN (s): the floor of the variance term of the RTO, and the extra wait of a
tail-loss probe while one packet is out (RFC 8985 §7.2's WCDelAckT, Linux's choice)."""
DUP_THRESH = 3
"""Delivered packets after a hole that make RACK mark it lost without waiting (RFC 8985 §6.2)."""


def check(congestion: str, loss: float) -> None:
    """Raise ``ValueError`` where the model of ``congestion`` does not hold at ``loss``."""
    if congestion not in CONGESTION:
        raise ValueError(f"congestion must be one of {list(CONGESTION)}, got {congestion!r}")
    if congestion == "bbr" and loss >= BBR_MAX_LOSS:
        raise ValueError(
            f"the bbr model holds below {BBR_MAX_LOSS:g} loss (BBRv1's bandwidth probe at gain "
            f"5/4 stops reaching the bottleneck rate there), got {loss:g}"
        )


def window_packets(congestion: str, *, rtt_s: float, loss: float) -> float:
    """A stream's average congestion window (packets) on a path with ``loss``; ``inf`` where
    loss does not limit it (no loss, or ``bbr``).

    Per congestion control:

    * ``reno``: W = sqrt(3 / (2p)), the Mathis et al. (1997) relation for AIMD(1, 1/2).
    * ``cubic``: RFC 8312 §5.1 (Eq. 6), W = (C (3 + b) / (4 (1 - b)))^(1/4) RTT^(3/4) / p^(3/4)
      with C = 0.4 and b = 0.7 (RTT in seconds); in its TCP-friendly region (§4.2: increase
      3 (1 - b) / (1 + b) per RTT, decrease to b) the average is reno's, and CUBIC takes the
      larger window of the two, so W = max(W_cubic, W_reno).
    * ``bbr`` (BBRv1, Cardwell et al. 2016, Linux's ``tcp_bbr``): it paces at its bottleneck-rate
      estimate, the largest delivery-rate sample of the last 10 round trips, and bounds inflight
      at 2 BDP. Loss enters neither (a lost packet is sent again and counted when delivered), so
      a stream is limited by its window and its share of the path only. The estimate holds while
      the probing phase (pacing gain 5/4) still delivers the bottleneck rate: 5/4 (1 - p) >= 1,
      i.e. p < 1/5 (:data:`BBR_MAX_LOSS`); above it the estimate decays and this model refuses.
    """
    check(congestion, loss)
    if loss <= 0 or congestion == "bbr":
        return math.inf
    reno = math.sqrt(1.5 / loss)
    if congestion == "reno":
        return reno
    return max(_cubic_window(rtt_s, loss), reno)


def _cubic_window(rtt_s: float, loss: float) -> float:
    """RFC 8312 Eq. 6: CUBIC's average window (packets) outside its TCP-friendly region."""
    k = (CUBIC_C * (3 + CUBIC_BETA) / (4 * (1 - CUBIC_BETA))) ** 0.25
    return k * rtt_s**0.75 / loss**0.75


def stream_rate(
    congestion: str, *, rtt_s: float, loss: float, window_bytes: float, mss_bytes: float
) -> float:
    """Bytes/s one stream reaches on a path, ignoring the path's capacity."""
    check(congestion, loss)
    if rtt_s <= 0:
        return math.inf
    rate = window_bytes / rtt_s
    if loss > 0 and congestion != "bbr":
        # reno's term written as the simulator always computed it (bit for bit).
        mathis = mss_bytes * math.sqrt(1.5) / (rtt_s * math.sqrt(loss))
        if congestion == "cubic":  # the larger of its own window and reno's (RFC 8312 §4.2)
            mathis = max(mathis, _cubic_window(rtt_s, loss) * mss_bytes / rtt_s)
        rate = min(rate, mathis)
    return rate


def tcp_cap(
    *,
    streams: int,
    rtt_s: float,
    loss: float,
    window_bytes: float,
    mss_bytes: float,
    congestion: str = DEFAULT_CONGESTION,
) -> float:
    """Bytes/s that ``streams`` parallel TCP streams can reach on a path, ignoring its capacity."""
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    return streams * stream_rate(
        congestion, rtt_s=rtt_s, loss=loss, window_bytes=window_bytes, mss_bytes=mss_bytes
    )


def payload_share(loss: float) -> float:
    """Share of a saturated link's packets that carry new data when ``loss`` of them are lost
    after the bottleneck (each is sent again): 1 - p."""
    return 1.0 - loss


def bulk_goodput(
    congestion: str,
    *,
    streams: int,
    rtt_s: float,
    loss: float,
    capacity: float,
    window_bytes: float,
    mss_bytes: float,
) -> float:
    """Goodput (bytes/s) of ``streams`` long-lived streams on one path of payload ``capacity``
    (bytes/s) whose losses happen after the bottleneck (the emulator's): the streams' rates
    shared on the path, less what is sent twice."""
    cap = tcp_cap(
        streams=streams,
        rtt_s=rtt_s,
        loss=loss,
        window_bytes=window_bytes,
        mss_bytes=mss_bytes,
        congestion=congestion,
    )
    return min(cap, capacity * payload_share(loss))


def rto_s(srtt_s: float) -> float:
    """Linux's retransmission timeout on a steady path: SRTT + max(4 RTTVAR, RTO_min), where a
    steady path's variance term is the floor."""
    return srtt_s + RTO_MIN_S


def probe_timeout_s(srtt_s: float, *, one_out: bool) -> float:
    """RFC 8985 §7.2 as Linux arms it: 2 SRTT (+ RTO_min while a single packet is out), never
    later than the RTO."""
    return min(2 * srtt_s + (RTO_MIN_S if one_out else 0.002), rto_s(srtt_s))


def tail_cost(k: int, *, rtt_s: float, gap_s: float) -> float:
    """Seconds by which a stream's last packet arrives after the fluid end when the last lost
    packet of its flight is ``k`` packets before the end (k = 0: the last one), packets leaving
    ``gap_s`` apart."""
    if k == 0:
        # The ACK of the packet before it comes back, one packet is out: the probe follows.
        return max(0.0, rtt_s + probe_timeout_s(rtt_s, one_out=True) - gap_s)
    if k < DUP_THRESH:
        return max(0.0, 1.25 * rtt_s - k * gap_s)  # RACK's reordering window of min_RTT / 4
    return max(0.0, rtt_s - (k - DUP_THRESH) * gap_s)


def tail_delay(
    rng: np.random.Generator, *, loss: float, rtt_s: float, rate: float, streams: int, mss: float
) -> float:
    """A draw of how late (s) the last of ``streams`` streams finishes a flight sent at
    ``rate`` bytes/s in all: the stream whose last loss is nearest its end decides (the
    smallest of ``streams`` geometric positions is geometric with 1 - (1 - p)^streams).

    RACK-TLP with Linux's constants: a lost packet with at least DupThresh (3) delivered packets
    after it is sent again when the third one's SACK arrives; with one or two after it RACK also
    waits a reordering window of min_RTT / 4; the last packet is recovered by the tail-loss
    probe, PTO = min(2 SRTT + RTO_min, RTO) after the last ACK while one packet is out, with RTO
    = SRTT + max(4 RTTVAR, RTO_min), RTO_min = 200 ms; a lost probe waits an RTO, doubled after
    each further loss.
    """
    if loss <= 0 or rtt_s <= 0 or rate <= 0:
        return 0.0
    gap = streams * mss / rate  # per stream
    q = 1.0 - (1.0 - loss) ** streams
    k = int(rng.geometric(q)) - 1  # 0, 1, 2, ...: packets before the end
    return tail_cost(k, rtt_s=rtt_s, gap_s=gap)


def message_delay(rng: np.random.Generator, *, loss: float, rtt_s: float) -> float:
    """A draw of how late (s) a one-packet message arrives: nothing unless it is lost; then the
    tail-loss probe (one packet out), and after each further loss an RTO, doubled each time."""
    if loss <= 0:
        return 0.0
    late, wait = 0.0, probe_timeout_s(rtt_s, one_out=True)
    backoff = rto_s(rtt_s)
    while rng.random() < loss:
        late += wait
        wait, backoff = backoff, 2 * backoff
    return late


__all__ = [
    "BBR_MAX_LOSS",
    "CONGESTION",
    "DEFAULT_CONGESTION",
    "RTO_MIN_S",
    "bulk_goodput",
    "check",
    "message_delay",
    "payload_share",
    "probe_timeout_s",
    "rto_s",
    "stream_rate",
    "tail_cost",
    "tail_delay",
    "tcp_cap",
    "window_packets",
]
