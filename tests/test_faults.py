"""One fault spelling for the simulator and the real-process injector (aurora.faults)."""

import pytest

from aurora.faults import EXAMPLES, FAULT_KINDS, Fault, check_faults, link_ends, parse_fault
from aurora.topology import load_topology

GEO = load_topology("examples/geo.yaml")


def test_every_kind_has_an_example_that_parses_and_spells_back_the_same():
    kinds = {parse_fault(e).kind for e in EXAMPLES}
    assert kinds == set(FAULT_KINDS)
    for text in EXAMPLES:
        fault = parse_fault(text)
        assert parse_fault(fault.spec()) == fault
        assert fault.spec() == text


def test_a_recorded_time_spells_back_to_the_same_float_not_six_digits():
    # A replay writes the Ledger's measured join time; six significant digits moved it 5 us.
    f = Fault(kind="link_cut", target="us-ca", at_s=4.229145050048828, duration_s=1 / 3)
    assert parse_fault(f.spec()) == f
    assert parse_fault("link_cut:us-ca@t=4,for=20").spec() == "link_cut:us-ca@t=4,for=20"


def test_parse_reads_targets_times_and_options():
    assert parse_fault("preempt:ca-a100-1@step=6") == Fault(
        kind="preempt", target="ca-a100-1", at_step=6
    )
    f = parse_fault("preempt_notice:ca-a100-2@t=120,notice=45")
    assert (f.at_s, f.notice_s) == (120.0, 45.0)
    j = parse_fault("join:new-1:ca:A100@step=14")
    assert (j.target, j.region, j.gpu, j.at_step) == ("new-1", "ca", "A100", 14)
    c = parse_fault("link_cut:us-ca@t=60,for=20")
    assert (c.target, c.duration_s) == ("us-ca", 20.0)
    assert parse_fault("trainer_crash@t=500").target == ""


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("preempt:x", "expected KIND:TARGET@step=N"),
        ("nope:x@step=1", "unknown kind 'nope'"),
        ("preempt:x@step=a", "step='a' is not a number"),
        ("preempt:x@t=-5", "t must be >= 0 seconds"),
        ("preempt:x@step=0", "step must be >= 1"),
        ("preempt:x@t=1,notice=3", "unexpected 'notice'"),
        ("join:new-1:ca@step=2", "expected KIND:TARGET@step=N"),
        ("trainer_crash:t0@t=5", "expected KIND:TARGET@step=N"),
        ("link_cut:usca@t=1", "target must be REGION-REGION"),
        ("link_cut:us-ca@t=1,for=0", "duration must be > 0 s"),
    ],
)
def test_a_malformed_spec_is_refused_naming_it(text, why):
    with pytest.raises(ValueError) as err:
        parse_fault(text)
    assert str(err.value).startswith(f"--fault {text!r}: ")
    assert why in str(err.value)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("region_loss:mars@step=2", "unknown region 'mars'"),
        ("region_loss:us@step=2", "the Trainer's region cannot be lost"),
        ("preempt:ca-a100-1@step=31", "step 31 is after the last step of the run (30)"),
        ("preempt:ca-a100-8@step=3", "unknown Actor 'ca-a100-8'"),
        ("relay_fail:relay-eu@t=3", "unknown relay or Actor 'relay-eu'"),
        ("join:ca-a100-0:ca:A100@step=3", "(a return needs an earlier loss)"),
        ("join:new-0:eu:A100@step=3", "unknown region 'eu'"),
        ("link_cut:us-eu@t=1", "no link 'us-eu' (links: us-ca)"),
    ],
)
def test_a_fault_the_deployment_cannot_carry_out_is_refused_before_the_run(text, why):
    with pytest.raises(ValueError) as err:
        check_faults([parse_fault(text)], GEO, steps=30)
    assert why in str(err.value)


def test_a_joined_actor_can_be_targeted_later_and_seed_actors_count_as_relays():
    check_faults(
        [
            parse_fault("join:new-0:ca:A100@step=3"),
            parse_fault("preempt:new-0@step=5"),
            parse_fault("relay_fail:ca-a100-0@t=9"),
            parse_fault("link_cut:ca-us@t=9"),
        ],
        GEO,
        steps=30,
    )


def test_a_preempted_actor_may_return_under_its_own_id():
    check_faults(
        [parse_fault("preempt:ca-a100-1@step=3"), parse_fault("join:ca-a100-1:ca:A100@step=6")],
        GEO,
        steps=30,
    )


def test_link_ends_splits_region_names_that_contain_hyphens():
    from aurora.topology import topology_from_dict

    topo = topology_from_dict(
        {
            "name": "t",
            "trainer": {
                "region": "us-east",
                "model": "qwen3-8b",
                "gpu": "H100",
                "gpus": 1,
                "egress_gbps": 10,
            },
            "regions": [{"name": "us-east"}, {"name": "ca-central-1"}],
            "links": [{"a": "us-east", "b": "ca-central-1", "gbps": 1.0, "rtt_ms": 40, "loss": 0}],
            "actors": [{"region": "ca-central-1", "gpu": "A100"}],
        }
    )
    assert link_ends("us-east-ca-central-1", topo) == ("us-east", "ca-central-1")
    assert link_ends("ca-central-1-us-east", topo) == ("ca-central-1", "us-east")
    assert link_ends("us-east-eu", topo) is None
