"""Verification on by default where Actors are untrusted (issue 39, part 9): a job whose Actors
join from other hosts (its Trainer or Ledger listens on, or is advertised at, an address other
hosts reach, or the job says ``actors: remote``) verifies unless it says ``verify: false``, and
then every role warns; a job whose Actors its own launcher starts on this host does not."""

import argparse
import json
import logging

import pytest

from aurora.runtime.job import loopback, make_spec, resolve_actors, unverified_warning
from aurora.topology import topology_from_dict


def topology(**real):
    return topology_from_dict(
        {
            "name": "t",
            "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
            "regions": [{"name": "us"}],
            "actors": [{"region": "us", "gpu": "A100", "count": 2}],
            "real": real,
        }
    )


def spec(tmp_path, *, backend="rl", extra=None, listen=None, **real):
    return make_spec(
        topology(**real),
        strategy="aurora",
        seed=0,
        steps=None,
        store=str(tmp_path),
        backend=backend,
        extra=extra,
        listen=listen,
    )


def test_loopback_addresses_are_local_and_every_other_address_is_remote():
    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert loopback(host), host
    for host in ("0.0.0.0", "", "::", "10.0.0.5", "192.168.1.2", "example.org", "2001:db8::1"):
        assert not loopback(host), host
    assert resolve_actors(None, ["127.0.0.1"]) == "local"
    assert resolve_actors(None, ["127.0.0.1", "10.0.0.5"]) == "remote"  # advertised elsewhere
    assert resolve_actors("remote", ["127.0.0.1"]) == "remote"  # a tunnel to loopback
    assert resolve_actors("local", ["0.0.0.0"]) == "local"


def test_a_job_whose_actors_join_from_other_hosts_verifies_by_default(tmp_path):
    mine = spec(tmp_path)  # aurora real: every role on real.host, 127.0.0.1
    assert (mine.actors, mine.verify) == ("local", False)
    assert unverified_warning(mine) is None
    public = spec(tmp_path, listen=["0.0.0.0"])
    assert (public.actors, public.verify) == ("remote", True)
    assert unverified_warning(public) is None
    assert spec(tmp_path, host="0.0.0.0").verify  # aurora real listening on every interface
    said = spec(tmp_path, extra={"actors": "remote"})
    assert (said.actors, said.verify) == ("remote", True)
    # Asked for on a local job, it is on; the spec written to job.json says all of it.
    assert spec(tmp_path, extra={"verify": True}).verify
    assert json.loads(json.dumps(public.encode()))["verify"] is True


def test_an_explicit_opt_out_on_a_remote_job_stays_off_and_is_warned(tmp_path):
    for off in (
        spec(tmp_path, listen=["0.0.0.0"], verify=False),  # the topology's real.verify
        spec(tmp_path, listen=["0.0.0.0"], extra={"verify": False}),
    ):
        assert (off.actors, off.verify) == ("remote", False)
        assert "verify: false" in unverified_warning(off)
    # A backend that cannot recompute cannot verify: off, and said why.
    standin = spec(tmp_path, backend="standin", listen=["0.0.0.0"])
    assert (standin.actors, standin.verify) == ("remote", False)
    assert "standin backend cannot recompute" in unverified_warning(standin)


def test_a_job_spec_refuses_an_unknown_kind_of_actors_and_old_specs_are_local(tmp_path):
    from aurora.jobspec import JobSpec

    data = spec(tmp_path).encode()
    with pytest.raises(ValueError, match="actors"):
        JobSpec.decode({**data, "actors": "everywhere"})
    old = {k: v for k, v in data.items() if k != "actors"}  # a job.json from before the field
    assert JobSpec.decode(old).actors == "local"


def test_the_trainer_command_resolves_from_its_address_and_keeps_it_in_job_json(tmp_path):
    from aurora.runtime.cli import _load_job

    topo = tmp_path / "t.yaml"
    topo.write_text(
        json.dumps(
            {
                "name": "t",
                "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
                "regions": [{"name": "us"}],
                "actors": [{"region": "us", "gpu": "A100", "count": 2}],
            }
        )
    )

    def args(run: str, **kw) -> argparse.Namespace:
        base = {
            "job": None,
            "topology": str(topo),
            "strategy": "aurora",
            "seed": 0,
            "steps": None,
            "store": None,
            "backend": "rl",
            "run_dir": str(tmp_path / run),
            "host": "127.0.0.1",
            "advertise": None,
            "ledger": None,
            "actors": None,
        }
        return argparse.Namespace(**{**base, **kw})

    assert not _load_job(args("a"), keep=True).verify
    public = _load_job(args("b", host="0.0.0.0"), keep=True)
    assert (public.actors, public.verify) == ("remote", True)
    kept = json.loads((tmp_path / "b" / "job.json").read_text())["spec"]
    assert kept["verify"] is True and kept["actors"] == "remote"
    # A restart reads the job back (the same job id), whatever its address now.
    assert _load_job(args("b"), keep=True) == public
    assert _load_job(args("c", ledger="10.0.0.5:7000"), keep=True).verify  # a remote Ledger
    assert _load_job(args("d", actors="remote"), keep=True).verify


def test_the_trainer_warns_when_remote_actors_are_trained_on_unchecked(tmp_path, caplog):
    from aurora.delta.announce import public_key_of
    from aurora.runtime.trainer import TrainerProcess, TrainerRun

    key = bytes(range(32))
    off = spec(tmp_path / "s", backend="standin", listen=["0.0.0.0"])
    run = TrainerRun(
        spec=off,
        run_dir=str(tmp_path / "run"),
        secret=b"s" * 32,
        signing_key=key,
        public_key=public_key_of(key),
    )
    with caplog.at_level(logging.WARNING, logger="aurora.runtime.trainer"):
        TrainerProcess(run)
    assert "verification is off" in caplog.text
    caplog.clear()
    local = TrainerRun(
        spec=spec(tmp_path / "s", backend="standin"),
        run_dir=str(tmp_path / "run2"),
        secret=b"s" * 32,
        signing_key=key,
        public_key=public_key_of(key),
    )
    with caplog.at_level(logging.WARNING, logger="aurora.runtime.trainer"):
        TrainerProcess(local)
    assert "verification is off" not in caplog.text
