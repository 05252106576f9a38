"""The emulated link shapes traffic to its configured rate (skips, saying why, without root)."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest

from emulation.netns import EmulatedLink, EmulationUnavailable, check_available

SINK = """
import socket, time
srv = socket.create_server(("0.0.0.0", 7100)); print("ready", flush=True)
c, _ = srv.accept(); t = time.perf_counter(); n = 0
while (b := c.recv(1 << 20)):
    n += len(b)
print(n, time.perf_counter() - t, flush=True)
"""
SOURCE = """
import socket, sys
s = socket.create_connection((sys.argv[1], 7100)); s.sendall(b"x" * 5_000_000); s.close()
"""


def test_a_bad_rate_is_refused():
    with pytest.raises(ValueError, match="rate_mbit must be > 0"):
        EmulatedLink(rate_mbit=0)


def test_the_router_limits_the_path_to_the_configured_rate():
    stack = contextlib.ExitStack()
    try:
        check_available()
        link = stack.enter_context(EmulatedLink(rate_mbit=50))
    except EmulationUnavailable as exc:
        pytest.skip(f"cannot emulate a link here: {exc}")
    with stack:
        sink = link.popen(
            link.receiver, [sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True
        )
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        subprocess.run(
            ["ip", "netns", "exec", link.sender, sys.executable, "-c", SOURCE, link.receiver_ip],
            check=True,
        )
        n, seconds = sink.stdout.readline().split()
        sink.wait()
        mbit = int(n) * 8 / float(seconds) / 1e6
        assert int(n) == 5_000_000
        # The clock starts at accept(), before the first byte: no byte is counted outside the
        # timed span, so only htb's burst allowance can lift the rate above 50 Mbit/s. A stall of
        # the sink on a busy machine only lowers it (0.8 s of transfer: 0.7x allows ~0.34 s).
        assert 0.7 * 50 < mbit < 1.1 * 50
        assert link.bottleneck_bytes() >= 5_000_000
