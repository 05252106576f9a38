"""``aurora emulate`` (emulation/cli.py): bad input, cleanup, and a real build of geo.yaml."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from emulation import cli
from emulation.capabilities import probe_capabilities
from emulation.plan import EmulationUnavailable

ROOT = Path(__file__).resolve().parent.parent


def args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    cli.add_parser(ap.add_subparsers(dest="command"))
    return ap.parse_args(["emulate", *argv])


def test_a_missing_topology_is_refused_with_one_line(capsys):
    assert cli.run(args()) == 2
    assert (
        capsys.readouterr().err.strip() == "aurora emulate: --topology is required (or --cleanup)"
    )


def test_an_unreadable_topology_names_the_file(capsys, tmp_path):
    missing = tmp_path / "nope.yaml"
    assert cli.run(args("--topology", str(missing))) == 2
    assert str(missing) in capsys.readouterr().err


def test_emulate_builds_geo_probes_it_and_writes_emulation_json(tmp_path, capsys):
    try:
        caps = probe_capabilities()
    except EmulationUnavailable as exc:
        pytest.skip(f"cannot emulate a network here: {exc}")
    if not (caps.netem or (caps.nfqueue and caps.statistic)):
        pytest.skip(f"no delay or loss mechanism here: {'; '.join(caps.missing)}")
    out = tmp_path / "emulation.json"
    # geo.yaml: 0.5-1 Gbit/s fluctuating, 40 ms, 1e-6 loss; scaled to 25-50 Mbit/s
    code = cli.run(
        args(
            "--topology", str(ROOT / "examples" / "geo.yaml"), "--scale", "0.05", "--out", str(out)
        )
    )
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["scale"] == 0.05 and len(data["links"]) == 2
    for link in data["links"]:
        assert {link["a"], link["b"]} == {"us", "ca"}
        assert link["gbps"] == pytest.approx(0.05)
        # the median may run long by what a busy 2-core machine adds (delay lines, probe), never
        # short by more than the delay line's half quantum per direction
        assert 40 - 1 <= link["measured_rtt_ms"] <= 40 + 3
        assert link["measured_gbps"] > 0.02
    assert cli.run(args("--cleanup")) == 0
