"""TCP goodput against loss, RTT and streams on the emulated WAN, per congestion control, beside the
simulator's model of it (:mod:`sim.tcp`).

    python -m experiments.tcp_loss            # root: the quick grid (24 points)
    python -m experiments.tcp_loss --full     # root: the whole grid (192 points)
    python -m experiments.tcp_loss --figures  # redraw from the rows on file

Theory of operation
-------------------
For each (RTT, loss) one emulated link is built; on it, for each congestion control and number
of streams, bulk TCP streams run and the goodput is counted at the receiver (:func:`measure`).
The model's value for the same point is :func:`sim.tcp.bulk_goodput` (:func:`model_mbit`).
Nothing measured here is an input of the model: the comparison is the model's test. Every row
records the machine's load before and after its point and the sender's TCP counters. One figure
per algorithm (:func:`figures`)."""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from aurora.provenance import git_sha
from experiments.common import RESULTS, files_only, plain

NAME = "tcp_loss"
ROOT = Path(__file__).resolve().parent.parent
EVIDENCE = ROOT / "evidence" / NAME
RATE_MBIT = 100.0
"""The link's htb rate (Mbit/s): MTU-sized packets (the delay line sees each), and fast enough
that a loss-limited stream is far below it at the grid's losses and RTTs."""
WINDOW = 4 << 20
"""The regions' ``tcp_wmem``/``tcp_rmem`` ceiling (bytes), the simulator's ``tcp_window_bytes``."""
MSS = 1448
TRANSPORT_BUFFER = 8 << 20
"""``aurora.transport.TransportConfig.buffer_bytes``: SO_SNDBUF/SO_RCVBUF the data plane asks."""
CONGESTION = ("reno", "cubic", "bbr")
FULL = {
    "loss": (0.001, 0.005, 0.01, 0.02),
    "rtt_ms": (20.0, 40.0, 80.0, 150.0),
    "streams": (1, 2, 4, 8),
}
"""The range measured: loss 0.1-2%, RTT 20-150 ms, 1-8 streams (x 3 algorithms: 192 points)."""
QUICK = {"loss": (0.001, 0.01), "rtt_ms": (40.0, 150.0), "streams": (1, 4)}
"""Corners of the range (x 3 algorithms: 24 points)."""


def load() -> tuple[float, float, float]:
    return os.getloadavg()


def efficiency() -> float:
    from experiments import wire_overhead

    got = wire_overhead.load()
    if got is None:
        raise SystemExit(f"no {wire_overhead.EVIDENCE}: run python -m experiments.wire_overhead")
    return float(got)


def window_bytes(profile: dict[str, Any] | None, rtt_ms: float, buffer: int) -> float:
    """One stream's window at this rate and ``rtt_ms`` (bytes): the host profile's, measured
    with the data plane's buffers, where the point uses them; else the 4 MiB ceiling."""
    if profile is None or buffer != TRANSPORT_BUFFER:
        return float(WINDOW)
    from sim.hostprofile import link_window

    return link_window(profile, RATE_MBIT, rtt_ms)[0]


def model_mbit(
    cc: str, *, rtt_ms: float, loss: float, streams: int, eff: float, window: float = WINDOW
) -> float:
    """The simulator's goodput for a point (Mbit/s).

    The streams' rates under that algorithm, shared on a link whose payload capacity is the htb
    rate times the measured payload share of a frame (``evidence/wire_overhead.json``), less
    what is sent twice; one stream's window is the host profile's (measured on a lossless link
    at the nearest rate and RTT, :mod:`sim.hostprofile`), else the regions' 4 MiB ceiling.
    """
    from sim.tcp import bulk_goodput

    got = bulk_goodput(
        cc,
        streams=streams,
        rtt_s=rtt_ms / 1e3,
        loss=loss,
        capacity=RATE_MBIT * 1e6 / 8 * eff,
        window_bytes=window,
        mss_bytes=MSS,
    )
    return got * 8 / 1e6


def topology(rtt_ms: float, loss: float) -> Any:
    from aurora.topology import topology_from_dict

    return topology_from_dict(
        {
            "name": "tcp-loss",
            "trainer": {"region": "us", "model": "m", "gpus": 1},
            "regions": [{"name": "us"}, {"name": "ca"}],
            "links": [
                {"a": "us", "b": "ca", "gbps": RATE_MBIT / 1e3, "rtt_ms": rtt_ms, "loss": loss}
            ],
            "actors": [{"region": "ca", "gpu": "A100"}],
        },
        source=NAME,
    )


def seconds_for(rtt_ms: float, least: float) -> float:
    """At least ``least`` s and 200 RTTs."""
    return max(least, 200 * rtt_ms / 1e3)


def measure(
    grid: dict[str, Sequence[Any]],
    *,
    seconds: float,
    out: Path,
    ccs: Sequence[str],
    buffer: int,
    profile: dict[str, Any] | None,
    repeats: int = 1,
) -> pd.DataFrame:
    """Every point of ``grid`` measured ``repeats`` times in ``out`` (resumable: only what is
    missing), appended as it is measured.

    The link: two regions, ``RATE_MBIT``, a bottleneck queue of one BDP, the loss as random
    drops at the receiver's ingress, i.e. after the bottleneck. ``streams`` bulk TCP streams
    with ``TCP_CONGESTION`` set per socket and the data plane's socket buffers (``--buffer``, 8
    MiB asked: no autotuning) run for ``seconds`` (at least 200 RTTs: a loss-based stream needs
    many loss events to forget its slow-start overshoot) and the goodput is counted at the
    receiver over the second half (:func:`emulation.measure.tcp`). The sender's TCP counters:
    retransmissions, tail-loss probes, timeouts.
    """
    from emulation.network import build_network

    path = out / "rows.csv"
    old = pd.read_csv(path) if path.exists() else pd.DataFrame()
    eff = efficiency()

    def done(cc: str, rtt: float, loss: float, s: int) -> int:
        if old.empty or "buffer_bytes" not in old:
            return 0
        sel = old[
            (old.cc == cc)
            & (old.rtt_ms == rtt)
            & (old.loss == loss)
            & (old.streams == s)
            & (old.seconds == seconds_for(rtt, seconds))
            & (old.buffer_bytes == buffer)
        ]
        return len(sel)

    for rtt, loss in itertools.product(grid["rtt_ms"], grid["loss"]):
        todo = [
            (cc, s, r)
            for r in range(repeats)
            for cc in ccs
            for s in grid["streams"]
            if done(cc, rtt, loss, s) <= r
        ]
        if not todo:
            continue
        with build_network(topology(rtt, loss), verify=False, tcp_window_bytes=WINDOW) as net:
            desc = net.describe()
            secs = seconds_for(rtt, seconds)
            window = window_bytes(profile, rtt, buffer)
            for cc, s, r in todo:
                before, t0 = load(), time.time()
                c0 = net.counters()["tcp"]["us"]
                got = net.tcp(
                    "us",
                    "ca",
                    streams=s,
                    seconds=secs,
                    cc=cc,
                    skip_fraction=0.5,
                    buffer_bytes=buffer,
                    abort=True,
                )
                c1 = net.counters()["tcp"]["us"]
                after = load()
                m = got["gbps"] * 1e3
                pred = model_mbit(cc, rtt_ms=rtt, loss=loss, streams=s, eff=eff, window=window)
                row = {
                    "cc": cc,
                    "cc_used": got["cc"],
                    "rate_mbit": RATE_MBIT,
                    "rtt_ms": rtt,
                    "loss": loss,
                    "streams": s,
                    "repeat": r,
                    "seconds": secs,
                    "buffer_bytes": buffer,
                    "measured_mbit": m,
                    "model_mbit": pred,
                    "model_over_measured": pred / m if m > 0 else math.nan,
                    "wire_efficiency": eff,
                    "window_bytes": window,
                    "retrans_segs": c1.get("RetransSegs", 0) - c0.get("RetransSegs", 0),
                    "loss_probes": c1.get("TCPLossProbes", 0) - c0.get("TCPLossProbes", 0),
                    "timeouts": c1.get("TCPTimeouts", 0) - c0.get("TCPTimeouts", 0),
                    "out_segs": c1.get("OutSegs", 0) - c0.get("OutSegs", 0),
                    "mechanism": desc["links"][0]["mechanism"],
                    "load_before": " ".join(f"{x:.2f}" for x in before),
                    "load_after": " ".join(f"{x:.2f}" for x in after),
                    "unix": t0,
                    "git_sha": git_sha(),
                }
                print(
                    f"{NAME}: {cc:5s} rtt {rtt:5.0f} ms loss {loss:<6g} S={s}: "
                    f"{m:6.1f} Mbit/s measured, {pred:6.1f} model ({pred / m - 1:+.0%}); "
                    f"load {row['load_before']}",
                    flush=True,
                )
                cur = pd.read_csv(path) if path.exists() else pd.DataFrame()
                pd.concat([cur, pd.DataFrame([row])], ignore_index=True).to_csv(path, index=False)
    return pd.read_csv(path)


def host_profile(path: str | None) -> dict[str, Any] | None:
    """This host's profile (``evidence/host_profile/<host>.json``), if measured."""
    import socket

    from sim.hostprofile import load_profile

    p = Path(path) if path else ROOT / "evidence" / "host_profile" / f"{socket.gethostname()}.json"
    return load_profile(p) if p.exists() else None


def figures(rows: pd.DataFrame, out: Path) -> list[Path]:
    """One figure per algorithm: goodput against loss, a panel per RTT.

    ``tcp_loss_<cc>.png``: goodput against loss, one panel per RTT, a line per stream count for
    the model and markers for the measurements.
    """
    files_only()
    import matplotlib.pyplot as plt
    import numpy as np

    eff = float(rows["wire_efficiency"].iloc[0]) if len(rows) else efficiency()
    if "buffer_bytes" in rows:  # the latest measurement of each point with the data plane's buffers
        rows = rows[rows["buffer_bytes"] == TRANSPORT_BUFFER]
    paths = []
    for cc in [c for c in CONGESTION if c in set(rows["cc"])]:
        mine = rows[rows["cc"] == cc]
        rtts = sorted(mine["rtt_ms"].unique())
        fig, axes = plt.subplots(1, len(rtts), figsize=(4.2 * len(rtts), 3.8), squeeze=False)
        grid = np.geomspace(5e-4, 3e-2, 60)
        for ax, rtt in zip(axes[0], rtts, strict=True):
            at = mine[mine["rtt_ms"] == rtt]
            window = float(at["window_bytes"].iloc[0]) if "window_bytes" in at else WINDOW
            for i, s in enumerate(sorted(at["streams"].unique())):
                model = [
                    model_mbit(cc, rtt_ms=rtt, loss=p, streams=int(s), eff=eff, window=window)
                    for p in grid
                ]
                ax.plot(grid * 100, model, color=f"C{i}", lw=1.2, label=f"model S={s}")
                pts = at[at["streams"] == s].groupby("loss")["measured_mbit"]
                mean, lo, hi = pts.mean(), pts.min(), pts.max()
                ax.errorbar(
                    mean.index * 100,
                    mean.values,
                    yerr=[mean.values - lo.values, hi.values - mean.values],
                    fmt="o",
                    color=f"C{i}",
                    capsize=2,
                    label=f"emulator S={s} (mean, range)",
                )
            ax.axhline(RATE_MBIT * eff, color="grey", ls=":", lw=1)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("loss (%)")
            ax.set_title(f"{cc}, RTT {rtt:g} ms", fontsize=9)
            ax.grid(True, alpha=0.3)
        axes[0][0].set_ylabel(f"goodput (Mbit/s) on a {RATE_MBIT:g} Mbit/s link")
        axes[0][-1].legend(fontsize=6)
        fig.suptitle(
            f"{cc}: emulator (points) vs the simulator's model (lines); load "
            f"{mine['load_before'].iloc[0]} .. {mine['load_after'].iloc[-1]}",
            fontsize=9,
        )
        fig.tight_layout()
        path = out / f"{NAME}_{cc}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def points_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per point (with the data plane's buffers): the measurements' mean, range and count, the
    model, and the model's error against the mean."""
    if "buffer_bytes" in rows:
        rows = rows[rows["buffer_bytes"] == TRANSPORT_BUFFER]
    keys = ["cc", "rtt_ms", "loss", "streams"]
    g = rows.groupby(keys, sort=False)
    out = g.agg(
        runs=("measured_mbit", "size"),
        measured=("measured_mbit", "mean"),
        low=("measured_mbit", "min"),
        high=("measured_mbit", "max"),
        model=("model_mbit", "last"),
        seconds=("seconds", "last"),
        load=("load_before", "first"),
    ).reset_index()
    out["error"] = out["model"] / out["measured"] - 1
    return out


def summary(rows: pd.DataFrame) -> str:
    table = points_table(rows)
    lines = [f"{'cc':6s}{'points':>7s}{'within 10%':>12s}{'median err':>12s}{'worst':>9s}"]
    for cc, g in table.groupby("cc", sort=False):
        err = g["error"]
        lines.append(
            f"{cc:6s}{len(g):7d}{(err.abs() <= 0.10).sum():12d}{err.median():+12.1%}"
            f"{err.iloc[err.abs().argmax()]:+9.1%}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=plain((__doc__ or NAME).split("\n\n")[0]))
    p.add_argument("--full", action="store_true", help="the whole grid (192 points)")
    p.add_argument("--seconds", type=float, default=20.0, help="per point, at least (and 200 RTTs)")
    p.add_argument(
        "--buffer",
        type=int,
        default=TRANSPORT_BUFFER,
        help="SO_SNDBUF/SO_RCVBUF of every stream (0: autotuned)",
    )
    p.add_argument("--rtt", default=None, help="only these RTTs (ms, comma-separated)")
    p.add_argument("--loss", default=None, help="only these losses (comma-separated)")
    p.add_argument("--streams", default=None, help="only these stream counts")
    p.add_argument("--profile", default=None, help="host profile (default: this host's)")
    p.add_argument("--repeats", type=int, default=1, help="measurements of each point")
    p.add_argument("--cc", default=",".join(CONGESTION), help="algorithms to measure")
    p.add_argument("--out", default=None, help="folder of rows.csv (default results/tcp_loss)")
    p.add_argument("--figures", action="store_true", help="only redraw from the rows on file")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else RESULTS / NAME
    out.mkdir(parents=True, exist_ok=True)
    if args.figures:
        rows = pd.read_csv(out / "rows.csv")
    else:
        from experiments.sim_vs_real import emulation_available

        if not emulation_available():
            print(f"{NAME}: needs root with ip and tc (the emulated WAN)", file=sys.stderr)
            return 2
        grid = dict(FULL if args.full else QUICK)
        for key, arg, kind in (
            ("rtt_ms", args.rtt, float),
            ("loss", args.loss, float),
            ("streams", args.streams, int),
        ):
            if arg:
                grid[key] = tuple(kind(x) for x in arg.split(","))
        rows = measure(
            grid,
            seconds=args.seconds,
            out=out,
            ccs=args.cc.split(","),
            buffer=args.buffer,
            profile=host_profile(args.profile),
            repeats=args.repeats,
        )
    for path in figures(rows, out):
        print(f"figure: {path}")
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        print(points_table(rows).to_string(index=False, float_format="%.3g"))
    print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
