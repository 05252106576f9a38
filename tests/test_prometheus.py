"""A real Prometheus server scrapes a running ``aurora real`` and its HTTP API answers, in PromQL,
the step time, the lag of every Actor and the bytes of every version the run's own files say.

The server is the OS package (``apt-get install prometheus``; ``.ci/run`` installs it), started
here on a free port with the scrape config ``aurora real --metrics`` writes beside its targets
(file-based discovery), at a 250 ms interval. Every sample the Ledger serves carries the Ledger's
clock as its timestamp, so each sample can be checked against the run's event log exactly: the
version, step time and delta bytes against ``steps.csv``, each Actor's lag against the
activations and publications in ``events.csv`` at that instant.
"""

from __future__ import annotations

import bisect
import csv
import json
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from aurora.observe.targets import free_port, prometheus_config

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana-dashboard.json"
NOT_IN_THIS_RUN = {
    # verification is off in this job
    "aurora_actors_by_trust",
    "aurora_actor_excluded",
    # the stand-in compute has no policy to measure
    "aurora_kl",
    "aurora_entropy",
    "aurora_clip_fraction",
    "aurora_grad_norm",
    # set when the run finishes, after its last scrape; nothing was refused
    "aurora_heldout_reward",
    "aurora_node_refused_total",
    "aurora_results_refused_total",
}
"""Dashboard series this run has no data for, and why."""

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the prometheus server is not installed (apt-get install prometheus; .ci/run does)",
)
STEPS = 10
TOPOLOGY = f"""
name: prom
trainer: {{region: us, model: qwen3-8b, gpu: H100, gpus: 1, egress_gbps: 10}}
regions: [{{name: us}}, {{name: ca}}, {{name: eu}}]
links: [{{a: us, b: ca, gbps: 1.0, rtt_ms: 40, loss: 0}}, {{a: us, b: eu, gbps: 1.0, rtt_ms: 80}}]
actors:
  - {{region: ca, gpu: A100, count: 2}}
  - {{region: eu, gpu: A100, count: 1}}
real: {{steps: {STEPS}, prompts_per_step: 12, group_size: 4}}
"""


def api(base: str, query: str, at: float) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query, "time": at})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def samples(base: str, name: str, at: float) -> list[tuple[dict, float, float]]:
    """Every raw sample of ``name`` (a range query over the whole run): (labels, t, value)."""
    out = []
    for series in api(base, f"{name}[1h]", at):
        for t, value in series["values"]:
            out.append((series["metric"], float(t), float(value)))
    return out


class Log:
    """What the Ledger's state was at any instant, from the run's events.csv."""

    def __init__(self, folder: Path) -> None:
        self.latest: list[tuple[float, int]] = []
        self.active: dict[str, list[tuple[float, int]]] = {}
        self.gone: dict[str, float] = {}
        """Actor -> when it left or was lost (no longer live: no series of its own)."""
        with open(folder / "events.csv") as f:
            for row in csv.DictReader(f):
                if row["kind"] != "event":
                    continue
                rec, t = json.loads(row["record"]), float(row["time"])
                if rec["type"] == "DeltaPublished":
                    self.latest.append((t, int(rec["version"])))
                elif rec["type"] in ("VersionActivated", "CaughtUp"):
                    self.active.setdefault(rec["actor"], []).append((t, int(rec["version"])))
                elif rec["type"] == "ActorJoined" and rec.get("active") is not None:
                    self.active.setdefault(rec["actor"], []).append((t, int(rec["active"])))
                elif rec["type"] in ("ActorLeft", "ActorLost"):
                    self.gone.setdefault(rec["actor"], t)

    @staticmethod
    def _at(series: list[tuple[float, int]], t: float) -> int | None:
        i = bisect.bisect_right([x[0] for x in series], t)
        return series[i - 1][1] if i else None

    def scraped(self, actor: str, scrapes: list[float]) -> tuple[set[float], set[float]]:
        """Of the Ledger's scrapes (their timestamps, truncated to ms), those at which
        ``actor`` was surely live with an active version, and those at which it may have been
        (its first activation or its leaving within the scrape's millisecond)."""
        start = self.active[actor][0][0]
        end = self.gone.get(actor, float("inf"))
        surely = {t for t in scrapes if start < t and t + 0.001 <= end}
        maybe = {t for t in scrapes if start < t + 0.001 and t < end}
        return surely, maybe

    def lags(self, actor: str, t_ms: float) -> set[int]:
        """The Actor's lag at every instant of the millisecond [t_ms, t_ms + 1 ms) the sample's
        timestamp names (the Ledger's clock, truncated to ms)."""
        times = [t_ms] + [
            t for t, _ in self.latest + self.active.get(actor, []) if t_ms <= t < t_ms + 0.001
        ]
        out = set()
        for t in times:
            latest, active = self._at(self.latest, t), self._at(self.active.get(actor, []), t)
            if latest is not None and active is not None:
                out.add(latest - active)
        return out


def port_below_ephemeral(host: str) -> int:
    """A free port below the kernel's ephemeral range. The run's roles hold ports picked by
    binding port 0 (``free_port``) and bind them only as each starts; a server started meanwhile
    on another port so picked can take one of theirs (a relay then fails with "address already
    in use"). Ports below the range are never handed out by a bind to port 0."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for candidate in random.Random().sample(range(max(1024, low - 8000), low), 200):
        with socket.socket() as s:
            try:
                s.bind((host, candidate))
            except OSError:
                continue
            return candidate
    return free_port(host)


def test_a_prometheus_server_scraping_aurora_real_answers_what_the_runs_files_say(tmp_path):
    topo = tmp_path / "prom.yaml"
    topo.write_text(TOPOLOGY)
    folder = tmp_path / "out" / "prom-aurora-s0"
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aurora.cli",
            "real",
            "--topology",
            str(topo),
            "--backend",
            "standin",
            "--out",
            str(tmp_path / "out"),
            "--quiet",
            "--extra",
            json.dumps({"standin_tokens_per_s": 150.0}),
            "--metrics",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    server = None
    try:
        targets = folder / "prometheus" / "targets.json"
        deadline = time.monotonic() + 120
        while not targets.exists():
            assert run.poll() is None, run.communicate()
            assert time.monotonic() < deadline, "no targets written"
            time.sleep(0.05)
        config = tmp_path / "prometheus.yml"
        config.write_text(prometheus_config(targets.resolve(), interval="250ms"))
        port = port_below_ephemeral("127.0.0.1")
        base = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        out, err = run.communicate(timeout=180)
        assert run.returncode == 0, err
        end = time.time() + 5
        with urllib.request.urlopen(f"{base}/-/ready", timeout=10) as resp:
            assert resp.status == 200
        version = {t: int(v) for _, t, v in samples(base, "aurora_version", end)}
        step_s = {t: v for _, t, v in samples(base, "aurora_step_seconds", end)}
        delta = {t: v for _, t, v in samples(base, "aurora_delta_bytes", end)}
        total = {t: v for _, t, v in samples(base, "aurora_delta_bytes_total", end)}
        lags = samples(base, "aurora_actor_lag_versions", end)
        # Every query of the shipped dashboard is valid PromQL and draws the run.
        panels = json.loads(DASHBOARD.read_text())["panels"]
        empty, during = set(), max(version) - 0.5  # the roles' own gauges go stale at exit
        for target in (t for panel in panels for t in panel.get("targets", [])):
            if not api(base, target["expr"], during):
                empty.add(target["expr"].split("(")[-1].split("[")[0].split(")")[0])
    finally:
        for proc in (run, server):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(10)
    with open(folder / "steps.csv") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == list(range(1, STEPS + 1))
    # Bytes per version and step time: every sample, at its instant, is the run's own row.
    assert len({v for v in version.values() if v > 0}) >= 3, version
    checked = 0
    for t, v in version.items():
        if v == 0:
            continue
        assert delta[t] == float(rows[v]["delta_bytes"]), (t, v)
        assert total[t] == sum(float(rows[u]["delta_bytes"]) for u in range(1, v + 1))
        if v > 1:  # the run's first step is timed from its log's start, the Ledger's from v0
            assert step_s[t] == pytest.approx(float(rows[v]["step_time_s"]), rel=1e-9, abs=1e-9)
        checked += 1
    assert checked >= 3
    # Lag per Actor: each sample is what the log says at that instant.
    log = Log(folder)
    by_actor: dict[str, set[float]] = {}
    for labels, t, value in lags:
        actor = labels["actor"]
        assert labels["role"] == "trainer" and labels["id"] == "trainer"
        assert int(value) in log.lags(actor, t), (actor, t, value, log.lags(actor, t))
        by_actor.setdefault(actor, set()).add(t)
    assert set(by_actor) == {"ca-a100-0", "ca-a100-1", "eu-a100-0"}
    # And no scrape left one out: every scrape of the Ledger (each gives aurora_version) while
    # an Actor was live with an active version has its lag, and no other scrape does.
    for actor, seen in by_actor.items():
        surely, maybe = log.scraped(actor, sorted(version))
        assert surely <= seen <= maybe, (actor, sorted(surely - seen), sorted(seen - maybe))
    assert {int(v) for _, _, v in lags} & {1, 2}  # Actors were seen behind, not only level
    assert empty <= NOT_IN_THIS_RUN, empty - NOT_IN_THIS_RUN
