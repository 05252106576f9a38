"""The job spec: one frozen dataclass, one encode/decode, and the one place a role's transport
settings come from."""

import json

import pytest

from aurora.jobspec import JobSpec
from aurora.runtime.job import cache_versions, transport_config
from tests.test_ledger_service import job_spec

KEY = bytes(range(32))
SECRET = b"s" * 32


def test_a_job_spec_survives_json_both_ways(tmp_path):
    spec = job_spec(tmp_path, start_actors=3, standin_tokens_per_s=50.0)
    again = JobSpec.decode(json.loads(json.dumps(spec.encode())))
    assert again == spec and again.start_actors == 3 and again.strategy.name == "aurora"


def test_an_unknown_or_missing_key_is_refused_naming_it(tmp_path):
    data = job_spec(tmp_path).encode()
    with pytest.raises(ValueError, match="unknown key.*stanin_hidden"):
        JobSpec.decode({**data, "stanin_hidden": 8})
    del data["store"]
    with pytest.raises(ValueError, match="store"):
        JobSpec.decode(data)
    with pytest.raises(ValueError, match="unknown key"):
        job_spec(tmp_path, no_such_setting=1)


def test_the_job_spec_is_frozen(tmp_path):
    spec = job_spec(tmp_path)
    with pytest.raises(AttributeError):
        spec.steps = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("strategy", "streams", "cut_through", "cache"),
    [("aurora", 4, True, 8), ("prime-full", 1, False, 8), ("prime-async4", 1, False, 8)],
)
def test_every_role_takes_its_transport_settings_from_the_strategy(
    tmp_path, strategy, streams, cut_through, cache
):
    from aurora.runtime.job import make_spec
    from aurora.topology import topology_from_dict

    topo = topology_from_dict(
        {
            "name": "t",
            "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
            "regions": [{"name": "us"}],
            "actors": [{"region": "us", "gpu": "A100", "count": 1}],
        }
    )
    spec = make_spec(
        topo, strategy=strategy, seed=0, steps=2, store=str(tmp_path), backend="standin"
    )
    config = transport_config(spec, secret=SECRET, public_key=KEY)
    assert (config.streams, config.cut_through, config.cache_versions) == (
        streams,
        cut_through,
        cache,
    )
    assert config.job == spec.job_id
    hooked = transport_config(spec, secret=SECRET, public_key=KEY, overrides={"cut_through": False})
    assert hooked.cut_through is False


def test_the_cache_holds_the_lag_bound_plus_two_and_at_least_eight():
    assert [cache_versions(lag) for lag in (1, 4, 6, 7, 10)] == [8, 8, 8, 9, 12]
