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


def test_the_end_ids_survive_json_and_a_spec_from_before_them_ends_at_its_eos_id(tmp_path):
    spec = job_spec(tmp_path, eos_id=2, eos_ids=[2, 9])
    again = JobSpec.decode(json.loads(json.dumps(spec.encode())))
    assert again == spec and again.eos_ids == (2, 9) and again.end_ids() == (2, 9)
    older = {k: v for k, v in spec.encode().items() if k != "eos_ids"}
    assert JobSpec.decode(older).end_ids() == (2,)
    assert job_spec(tmp_path).end_ids() is None  # not known: not checked


def test_an_unknown_or_missing_key_is_refused_naming_it(tmp_path):
    data = job_spec(tmp_path).encode()
    with pytest.raises(ValueError, match="unknown key.*stanin_hidden"):
        JobSpec.decode({**data, "stanin_hidden": 8})
    del data["store"]
    with pytest.raises(ValueError, match="store"):
        JobSpec.decode(data)
    with pytest.raises(ValueError, match="unknown key"):
        job_spec(tmp_path, no_such_setting=1)


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("steps", "3", "steps must be int"),
        ("steps", True, "steps must be int"),
        ("temperature", "hot", "temperature must be float"),
        ("ledger_in_memory", 1, "ledger_in_memory must be bool"),
        ("model", None, "model must be str"),
        ("max_new_tokens", 8.5, "max_new_tokens must be int"),
        ("strategy", "aurora", "strategy must be a mapping"),
        ("eos_ids", 2, "eos_ids must be a list of ints"),
        ("eos_ids", [2, "3"], "eos_ids must be a list of ints"),
        ("eos_ids", [True], "eos_ids must be a list of ints"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(tmp_path, key, value, named):
    data = job_spec(tmp_path).encode()
    with pytest.raises(ValueError, match=named):
        JobSpec.decode({**data, key: value})


def test_a_strategy_field_of_the_wrong_type_is_refused_naming_it(tmp_path):
    data = job_spec(tmp_path).encode()
    data["strategy"] = {**data["strategy"], "streams": "4"}
    with pytest.raises(ValueError, match="strategy.streams must be int"):
        JobSpec.decode(data)
    data["strategy"] = {**data["strategy"], "streams": 4, "stream": 4}
    with pytest.raises(ValueError, match=r"unknown key.*strategy\.stream'"):
        JobSpec.decode(data)


def test_an_int_is_taken_for_a_float_field_and_none_where_the_field_allows_it(tmp_path):
    data = job_spec(tmp_path).encode()
    spec = JobSpec.decode({**data, "start_wait_s": 30, "learning_rate": None, "threads": None})
    assert spec.start_wait_s == 30.0 and isinstance(spec.start_wait_s, float)
    assert spec.learning_rate is None and spec.threads is None


def test_every_field_has_a_docstring_and_the_required_ones_no_default():
    import ast
    import dataclasses
    import inspect

    import aurora.jobspec as mod

    tree = ast.parse(inspect.getsource(mod))
    for cls in (mod.JobSpec, mod.StrategySpec):
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
        documented = {
            prev.target.id
            for prev, doc in zip(node.body, node.body[1:], strict=False)
            if isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        }
        names = {f.name for f in dataclasses.fields(cls)}
        assert names == documented, names ^ documented
    # Required: everything a run cannot do without (no silent default for them).
    required = {f.name for f in dataclasses.fields(mod.JobSpec) if f.default is dataclasses.MISSING}
    assert {"job_id", "model", "backend", "seed", "steps", "store", "strategy"} <= required


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


OLD_JOB_JSON_SPEC = {
    # What aurora real wrote to job.json before the spec was a dataclass: make_spec's keys, the
    # launcher's start_actors, nothing for the settings left at their defaults.
    "job_id": "t-aurora-s0-0123456789abcdef",
    "name": "t",
    "backend": "standin",
    "model": "tiny",
    "engine": "transformers",
    "device": "cpu",
    "task": "arithmetic",
    "regime": "learn",
    "learning_rate": None,
    "seed": 0,
    "steps": 4,
    "prompts_per_step": 4,
    "group_size": 4,
    "max_new_tokens": None,
    "temperature": 1.0,
    "snapshot_interval": 50,
    "digest_interval": 1,
    "lease_initial_s": 60,
    "threads": 1,
    "eval_prompts": 0,
    "store": "runs/t/store",
    "trainer_region": "us",
    "strategy": {
        "name": "aurora",
        "payload": "delta",
        "codec": "aurora",
        "streams": 4,
        "relays": True,
        "max_lag": 1,
        "cut_through": True,
        "staging_grace_s": 2.0,
        "shaped": True,
    },
    "window_s": 30.0,
    "dense_bytes": 21504,
    "start_actors": 2,
}


def test_a_job_json_written_before_the_dataclass_still_loads():
    spec = JobSpec.decode(OLD_JOB_JSON_SPEC)
    assert spec.start_actors == 2 and spec.lease_initial_s == 60.0 and spec.segment_bytes == 4 << 20
    # Encoded again it holds the same values under the same keys, plus the defaults spelled out.
    again = spec.encode()
    assert {k: again[k] for k in OLD_JOB_JSON_SPEC} == OLD_JOB_JSON_SPEC


def test_no_module_reads_the_job_spec_by_string_key():
    """The spec is read by attribute after :meth:`JobSpec.decode`; a ``spec["key"]`` or
    ``spec.get("key")`` outside aurora/jobspec.py would be a read the decoder does not check."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    pattern = re.compile(r"""\bspec(\[["']|\.get\(["'])""")
    allowed = {"aurora/jobspec.py"}
    found = []
    for path in sorted([*root.glob("aurora/**/*.py"), *root.glob("sim/**/*.py")]):
        rel = path.relative_to(root).as_posix()
        if rel in allowed:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert found == [], "\n".join(found)


def test_aurora_without_relays_runs_real_processes_with_no_relay_and_routes_to_the_trainer():
    from pathlib import Path

    from aurora.runtime.job import plan_processes, strategy_spec
    from aurora.topology import load_topology

    geo = load_topology(Path(__file__).resolve().parent.parent / "examples" / "geo.yaml")
    assert not strategy_spec("aurora-norelay").relays
    assert strategy_spec("aurora").relays
    with_relays = plan_processes(geo)
    without = plan_processes(geo, relays=False)
    assert with_relays.relays and not without.relays
    assert without.actors == with_relays.actors


def test_the_topologys_congestion_control_reaches_every_data_socket(tmp_path):
    import asyncio
    from pathlib import Path

    from aurora.transport.wire import tune_socket

    spec = job_spec(tmp_path).with_settings(congestion="reno")
    cfg = transport_config(spec, secret=b"s" * 32, public_key=b"k" * 32)
    assert cfg.congestion == "reno"
    assert (
        transport_config(job_spec(tmp_path), secret=b"s" * 32, public_key=b"k" * 32).congestion
        is None
    )
    with pytest.raises(ValueError, match="congestion must be one of"):
        job_spec(tmp_path).with_settings(congestion="vegas")

    async def granted() -> dict:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return tune_socket(writer, buffer_bytes=1 << 20, congestion=cfg.congestion)
        finally:
            writer.close()
            server.close()

    offered = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text()
    if "reno" not in offered.split():
        pytest.skip("this kernel offers no reno")
    assert asyncio.run(granted())["congestion"] == "reno"
