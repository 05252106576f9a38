"""Verified rollouts in the runtime, piece by piece: only the Trainer's session can report a
check, a failed check disconnects the Actor and returns its leases, the Trainer's recompute of
an honest sample is within the bounds (and None for a version it does not keep), and every
dishonest Actor's result still passes the payload checks (only a recompute can tell; ``stale``
needs a trained version to differ from, so it is checked on real processes only:
tests/test_verification_real.py)."""

import asyncio
import dataclasses

import msgpack
import pytest

from aurora.keys import issue_identity
from aurora.policy.leases import LeaseConfig
from aurora.policy.ledger import LedgerConfig
from aurora.policy.verification import VerificationConfig, judge, measure
from aurora.runtime.ledger.config import LedgerServiceConfig
from aurora.runtime.ledger.service import LedgerService
from tests.test_control_identity import JOB_ID, JOB_KEY, JOB_PUB, join, rows, running, until

FAIL = {"max_delta": 5.0, "mean_delta": 1.0, "min_logprob": -3.0, "tokens": 8}


def verifying_service(tmp_path) -> LedgerService:
    config = LedgerServiceConfig(
        policy=LedgerConfig(
            trainer_region="us",
            lease=LeaseConfig(initial_s=30.0),
            verification=VerificationConfig(),
        ),
        log_path=str(tmp_path / "ledger.db"),
    )
    return LedgerService(config, public_key=JOB_PUB)


def test_only_the_trainer_can_report_a_failed_check_and_it_disconnects_the_actor(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(
        "tests.test_control_identity.service", lambda tmp, **kw: verifying_service(tmp)
    )

    async def main() -> tuple[bool, bool, bool, bool]:
        svc, port, trainer = await running(tmp_path)
        a1 = await join(
            port, "actor", "a1", issue_identity("actor", "a1", JOB_KEY, job=JOB_ID), active=0
        )
        a2 = await join(
            port, "actor", "a2", issue_identity("actor", "a2", JOB_KEY, job=JOB_ID), active=0
        )
        await until(lambda: svc.state.book.live("a1") and "a2" in svc.state.actors)
        lease = svc.state.book.live("a1")[0].id
        # An Actor cannot send what only the Trainer may: dropped, a1 untouched.
        a2.send_nowait({"op": "verified", "actor": "a1", "lease": lease, "version": 0, **FAIL})
        await asyncio.sleep(0.3)
        untouched = svc.state.actors["a1"].live and not svc.state.trust.excluded("a1")
        await trainer.send({"op": "verified", "actor": "a1", "lease": lease, "version": 0, **FAIL})
        await until(lambda: svc.state.trust.excluded("a1"))
        stopped = False
        try:
            while True:
                msg = await asyncio.wait_for(a1.recv(), 2.0)
                stopped = stopped or msg.get("op") == "stop"
        except (ConnectionError, TimeoutError):
            pass
        gone = not svc.state.book.live("a1") and not svc.state.actors["a1"].live
        survivor = bool(svc.state.book.live("a2")) and svc.state.actors["a2"].live
        await svc.close()
        return untouched, stopped, gone, survivor

    untouched, stopped, gone, survivor = asyncio.run(main())
    assert untouched and stopped and gone and survivor
    kinds = [r["type"] for r in rows(tmp_path, "policy")]
    assert kinds.count("ResultVerified") == 1


@pytest.fixture(scope="module")
def rl(tmp_path_factory):
    pytest.importorskip("torch")
    from aurora.runtime.job import make_spec
    from aurora.runtime.rlbackend import RLTrainer, make_rl_engine
    from aurora.topology import topology_from_dict

    tmp = tmp_path_factory.mktemp("rl")
    topo = topology_from_dict(
        {
            "name": "t",
            "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
            "regions": [{"name": "us"}],
            "actors": [{"region": "us", "gpu": "A100", "count": 1}],
            "real": {"group_size": 4, "prompts_per_step": 8},
        }
    )
    spec = make_spec(topo, strategy="aurora", seed=0, steps=None, store=str(tmp))
    spec = dataclasses.replace(spec, verify=True)
    trainer = RLTrainer(spec, workdir=str(tmp))
    engine = make_rl_engine(spec)
    engine.load(trainer.published(), version=0, weights_hash=trainer.weights_hash)
    return spec, trainer, engine


def sample(spec, trainer, engine, batch: int = 1):
    from aurora.runtime.compute import Sampling

    prompts = [(f"b{batch}-{i}", i) for i in range(8)]
    sampling = Sampling(n=4, max_new_tokens=trainer.max_new_tokens, temperature=1.0, seed=0)
    return prompts, engine.generate(prompts, sampling), sampling


def test_an_honest_sample_recomputes_within_the_bounds_and_an_unkept_version_is_none(rl):
    spec, trainer, engine = rl
    prompts, out, _ = sample(spec, trainer, engine)
    pairs = trainer.recompute(
        [(i, g.payload, 0) for (_, i), g in zip(prompts, out, strict=True)] + [(0, b"", 7)]
    )
    assert pairs[-1] is None  # v7 is not kept
    cfg = VerificationConfig()
    for pair in pairs[:-1]:
        m = measure(*pair)
        assert judge(m, cfg) is None and m.max_delta < 1e-4  # fp32 on both sides
    # What it keeps: the max_lag previous versions in bf16 and one fp32 copy.
    assert trainer.verification_bytes() == (1 * 2 + 4) * 494_464


@pytest.mark.parametrize("mode", ["random", "othermodel", "forged-lp", "partial:0.5"])
def test_every_cheat_passes_the_payload_checks_and_fails_the_recompute(rl, mode):
    from aurora.runtime.cheats import CheatingEngine
    from aurora.runtime.messages import decode_result_payload

    spec, trainer, engine = rl
    cheat = CheatingEngine(engine, mode, spec)
    prompts, out, _ = sample(spec, trainer, cheat)
    for (pid, i), g in zip(prompts, out, strict=True):
        decode_result_payload(
            g.payload,
            prompt=pid,
            index=i,
            group_size=4,
            max_new_tokens=trainer.max_new_tokens,
            vocab_size=trainer.vocab_size,
        )
    pairs = trainer.recompute([(i, g.payload, 0) for (_, i), g in zip(prompts, out, strict=True)])
    failed = [judge(measure(*p), VerificationConfig()) is not None for p in pairs]
    assert cheat.cheated >= 1
    if mode == "partial:0.5":
        assert 0 < sum(failed) < len(failed)
    elif mode == "forged-lp":
        # Halving the log-prob of a token the model is sure of (lp near 0) is a lie smaller
        # than the tolerances, accepted by design (it moves GRPO's ratio by at most
        # exp(mean_tolerance)): which results lie by more depends on what was sampled. Every
        # one that does, measured against the honest engine's own log-probs, must fail.
        cfg = VerificationConfig()
        _, honest, _ = sample(spec, trainer, engine)
        big = []
        for g, forged in zip(honest, out, strict=True):
            comps = msgpack.unpackb(g.payload)["completions"]
            assert [c["ids"] for c in comps] == [  # the same sample, seeded: only lp differ
                c["ids"] for c in msgpack.unpackb(forged.payload)["completions"]
            ]
            lies = [abs(x) / 2 for c in comps for x in c["lp"]]
            mean = sum(lies) / len(lies)
            big.append(max(lies) > cfg.token_tolerance or mean > cfg.mean_tolerance)
        assert sum(big) >= len(big) // 2, big  # the sample has lies to catch
        assert all(f for f, b in zip(failed, big, strict=True) if b), (failed, big)
    else:
        assert all(failed), failed


def test_a_cheat_mode_is_parsed_or_refused_in_one_line_and_partial_lies_on_its_share():
    from aurora.runtime.cheats import lies_on, parse

    assert parse("random") == ("random", 1.0) and parse("partial:0.1") == ("partial", 0.1)
    for bad in ("nonsense", "random:0.5", "partial:0", "partial:1.5"):
        with pytest.raises(ValueError, match="cheat"):
            parse(bad)
    prompts = [f"b{k}-{i}" for k in range(1, 101) for i in range(32)]
    share = sum(lies_on("partial:0.1", p) for p in prompts) / len(prompts)
    assert 0.09 < share < 0.11  # 3,200 prompts: sd 0.005
    assert all(lies_on("stale", p) for p in prompts[:50])


def test_without_verification_the_trainer_keeps_no_previous_version(tmp_path):
    """Off, a publish drops the version it replaces (a model's bf16 size each at max_lag)."""
    pytest.importorskip("torch")
    from aurora.runtime.job import make_spec
    from aurora.runtime.rlbackend import RLTrainer
    from aurora.topology import topology_from_dict

    topo = topology_from_dict(
        {
            "name": "t",
            "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
            "regions": [{"name": "us"}],
            "actors": [{"region": "us", "gpu": "A100", "count": 1}],
            "real": {"group_size": 4, "prompts_per_step": 8},
        }
    )
    spec = make_spec(topo, strategy="aurora", seed=0, steps=None, store=str(tmp_path))
    assert not spec.verify
    trainer = RLTrainer(spec, workdir=str(tmp_path))
    trainer.publish(lambda segment: None)
    assert trainer.kept == {} and trainer.verification_bytes() == 0
