"""Deployment topology: regions, WAN links, the Trainer, Actors and relays.

Theory of operation
-------------------
One YAML file describes a deployment and is read by every mode: the simulator turns it into link
models and SimPy roles, the emulator into namespaces and qdiscs, the real runtime into hosts to
start. The file loads into the frozen dataclasses below. Loading checks everything a user can get
wrong (a key written twice, unknown or missing keys, wrong types, numbers out of range, references
to regions that do not exist, Actors with no WAN path to the Trainer) and raises one
``ValueError`` naming the file, the field (as a path such as ``actors[1].gpu``) and the expected
form. Building a dataclass has no side effects; nothing is opened or resolved until a driver
uses it.

Units are in the names: ``gbps`` is 10^9 bit/s, ``rtt_ms`` milliseconds, ``loss`` a packet loss
probability in [0, 1).
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True, kw_only=True)
class Fluctuation:
    """A link whose rate moves between two bounds, as the paper's 0.5-1 Gbps cross-cloud link."""

    low_gbps: float
    """Lowest rate of the link (Gbit/s)."""
    high_gbps: float
    """Highest rate of the link (Gbit/s)."""
    period_s: float = 10.0
    """Seconds between changes of rate; each new rate is drawn uniformly in [low, high]."""

    def __post_init__(self) -> None:
        _positive(self, "low_gbps", "period_s")
        if self.high_gbps < self.low_gbps:
            raise ValueError(f"high_gbps ({self.high_gbps}) must be >= low_gbps ({self.low_gbps})")


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """A WAN path between two regions, the same in both directions."""

    a: str
    """One end (a region name)."""
    b: str
    """The other end (a region name)."""
    gbps: float
    """Rate of the path's bottleneck (Gbit/s); with ``fluctuation``, only the nominal rate."""
    rtt_ms: float
    """Round-trip time (ms)."""
    loss: float = 0.0
    """Packet loss probability (random, independent per packet); limits each TCP stream as the
    topology's ``congestion`` responds to loss (``sim.tcp``)."""
    fluctuation: Fluctuation | None = None
    """Rate changes over time; ``None`` for a constant rate."""

    def __post_init__(self) -> None:
        _positive(self, "gbps", "rtt_ms")
        if not (0.0 <= self.loss < 1.0):
            raise ValueError(f"loss must be a probability in [0, 1), got {self.loss!r}")
        if self.a == self.b:
            raise ValueError(f"a link joins two different regions, got {self.a!r} twice")


@dataclass(frozen=True, kw_only=True)
class RegionSpec:
    """A datacenter or cloud region."""

    name: str
    """Region name, referenced by links, the Trainer, Actors and relays."""
    lan_gbps: float = 100.0
    """Rate of the region's internal network per host pair (Gbit/s)."""

    def __post_init__(self) -> None:
        _positive(self, "lan_gbps")
        if not self.name:
            raise ValueError("name must be a non-empty string")


@dataclass(frozen=True, kw_only=True)
class TrainerSpec:
    """The Trainer: where it runs, on what, and what it trains."""

    region: str
    """Region of the Trainer (and of the Checkpoint Store and Ledger)."""
    model: str
    """Model id, e.g. ``qwen3-8b``; the simulator looks its sizes up in the traces."""
    gpu: str = "H100"
    """GPU type of the training nodes."""
    gpus: int
    """Number of training GPUs."""
    egress_gbps: float = 100.0
    """Rate of the Trainer's network interface (Gbit/s), shared by all its outgoing flows."""

    def __post_init__(self) -> None:
        _positive(self, "gpus", "egress_gbps")


@dataclass(frozen=True, kw_only=True)
class ActorGroup:
    """``count`` identical Actors in one region."""

    region: str
    """Region of these Actors."""
    gpu: str
    """GPU type; the simulator looks its generation throughput up in the traces."""
    count: int = 1
    """Number of Actors in the group."""
    spot: bool = False
    """Preemptible capacity (the fault injector's hazard rate applies to these only)."""
    nic_gbps: float = 25.0
    """Rate of each Actor's network interface (Gbit/s)."""
    name: str | None = None
    """Prefix of the Actor ids (``<name>-<i>``); defaults to ``<region>-<gpu>``."""
    engine: str | None = None
    """Inference engine of these Actors in real mode (``transformers``, ``vllm``); None takes
    ``real.engine``."""

    def __post_init__(self) -> None:
        _positive(self, "count", "nic_gbps")

    @property
    def prefix(self) -> str:
        return self.name or f"{self.region}-{self.gpu.lower()}"


@dataclass(frozen=True, kw_only=True)
class RelaySpec:
    """A standalone relay process in a region (otherwise a seed Actor relays)."""

    region: str
    """Region of the relay."""
    nic_gbps: float = 25.0
    """Rate of the relay's network interface (Gbit/s), shared by its forwards."""
    name: str | None = None
    """Relay id; defaults to ``relay-<region>``."""

    def __post_init__(self) -> None:
        _positive(self, "nic_gbps")

    @property
    def id(self) -> str:
        return self.name or f"relay-{self.region}"


CONGESTION = ("reno", "cubic", "bbr")
"""TCP congestion controls a topology may name (Linux's names; the simulator models each)."""

ENGINES = ("transformers", "vllm", "standin")
"""Inference engines an Actor can run in real mode (``standin``: the labelled stand-in of
:mod:`aurora.runtime.standin`, for load and fault tests)."""


@dataclass(frozen=True, kw_only=True)
class RealSpec:
    """How ``aurora real`` runs this deployment on real processes (all optional)."""

    model: str = "tiny"
    """``tiny`` (a built-in tiny Qwen3 warm-started on the task), a local Hugging Face model
    directory, a hub id (loaded with ``from_pretrained``), or ``qwen3-0.6b-shapes`` /
    ``qwen3-1.7b-shapes``: that model's exact tensors with synthetic AdamW-like steps and the
    stand-in's timed generation (:mod:`aurora.runtime.shapes`; the data path at a real size)."""
    engine: str = "transformers"
    """Default inference engine of the Actors (one of ``transformers``, ``vllm``, ``standin``)."""
    device: str = "cpu"
    """Device of the Trainer (``cpu`` or ``cuda``)."""
    task: str = "arithmetic"
    """Procedural task with a rule-based reward (``aurora.rl.tasks``)."""
    regime: str = "learn"
    """``learn``: a learning rate at which the tiny model learns in minutes (dense deltas);
    ``transfer``: an RL-scale learning rate (sparse deltas, learning not expected), for transfer
    experiments; every output names the regime."""
    learning_rate: float | None = None
    """Overrides the regime's learning rate."""
    steps: int = 20
    """Training steps of a default run."""
    prompts_per_step: int = 32
    """Prompts per batch over all Actors (B); each prompt is one lease of ``group_size``
    completions."""
    group_size: int = 8
    """Completions per prompt (the GRPO group, G)."""
    max_new_tokens: int | None = None
    """Longest completion (tokens); None takes the task's."""
    temperature: float = 1.0
    """Sampling temperature of the Actors."""
    actors: int | None = 4
    """Actors started on one host: the topology's groups are scaled to this many in total
    (at least one per group, largest remainder); None starts every Actor of the topology."""
    relays: str = "standalone"
    """``standalone``: one relay process per remote region; ``seed``: an Actor of the region
    relays (the paper's seed Actor)."""
    snapshot_interval: int = 10
    """The Trainer writes a full snapshot every this many versions (joins start from one)."""
    digest_interval: int | None = None
    """The Trainer and every Actor compute a content digest of the whole weights (the check
    behind ``actor_digest_mismatches``) at every this many versions and at every snapshot.
    None: 1 on ``cpu`` (a few ms for the tiny model) and 10 on ``cuda``, where each digest
    copies the published weights to the host (~16 GB at 8B). The chain hash h(v) is checked at
    every version whatever this is."""
    lease_initial_s: float = 60.0
    """Lease length (s) until enough completions are timed to use k x median."""
    threads_per_process: int = 1
    """torch threads per role process (the roles share the host's cores)."""
    host: str = "127.0.0.1"
    """Address every role listens on when ``aurora real`` starts them on one host."""
    store: str | None = None
    """Checkpoint Store URL (a directory or an fsspec URL); None: ``<run dir>/store``."""
    eval_prompts: int = 200
    """Held-out prompts scored at the start and the end of the run."""
    verify: bool | None = None
    """Verified rollouts (``docs/VERIFICATION.md``); None: on when the job's Actors join from
    other hosts (:func:`aurora.runtime.job.make_spec`), ``false`` to opt out there (warned)."""
    window_s: float = 0.5
    """Generation window of one step of this run's model on this machine (s), used only to scale
    an emulated WAN to the paper's transfer regime (``aurora.runtime.regime``); ``summary.json``
    reports the window the run actually had."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {list(ENGINES)}, got {self.engine!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.regime not in ("learn", "transfer"):
            raise ValueError(f"regime must be learn or transfer, got {self.regime!r}")
        if self.relays not in ("standalone", "seed"):
            raise ValueError(f"relays must be standalone or seed, got {self.relays!r}")
        _positive(
            self,
            "steps",
            "prompts_per_step",
            "group_size",
            "temperature",
            "snapshot_interval",
            "lease_initial_s",
            "threads_per_process",
            "eval_prompts",
            "window_s",
        )
        for name in ("actors", "max_new_tokens", "learning_rate", "digest_interval"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A whole deployment."""

    name: str
    """Name of the deployment (used in result rows)."""
    trainer: TrainerSpec
    """The Trainer."""
    regions: tuple[RegionSpec, ...]
    """Every region used by the Trainer, Actors or relays."""
    links: tuple[LinkSpec, ...] = ()
    """WAN paths; the Trainer's region needs one to every region with Actors or relays."""
    actors: tuple[ActorGroup, ...]
    """Actor groups."""
    relays: tuple[RelaySpec, ...] = ()
    """Standalone relays."""
    real: RealSpec = field(default_factory=RealSpec)
    """Settings of ``aurora real`` (real processes); every field has a default."""
    congestion: str | None = None
    """TCP congestion control of the data plane's streams: ``reno``, ``cubic`` or ``bbr``.
    ``aurora real`` sets it on every data socket (``TCP_CONGESTION``) and the simulator takes
    that algorithm's response to loss (``sim.tcp``). None: the runtime keeps the host's
    default (bbr on the emulation host, cubic on most distributions) and the simulator takes
    reno's response, the one every paper-trace result was made with; name it whenever a link
    is lossy and the two must agree."""

    def __post_init__(self) -> None:
        if self.congestion is not None and self.congestion not in CONGESTION:
            raise ValueError(
                f"congestion: must be one of {list(CONGESTION)} or absent, got {self.congestion!r}"
            )
        names = [r.name for r in self.regions]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"regions: duplicate region names {dup}")
        known = set(names)

        def check_region(where: str, region: str) -> None:
            if region not in known:
                raise ValueError(
                    f"{where}: unknown region {region!r} (expected one of {sorted(known)})"
                )

        check_region("trainer.region", self.trainer.region)
        pairs: set[frozenset[str]] = set()
        for i, link in enumerate(self.links):
            check_region(f"links[{i}].a", link.a)
            check_region(f"links[{i}].b", link.b)
            pair = frozenset((link.a, link.b))
            if pair in pairs:
                raise ValueError(f"links[{i}]: a second link between {link.a!r} and {link.b!r}")
            pairs.add(pair)
        if not self.actors:
            raise ValueError("actors: at least one Actor group is needed")
        ids: set[str] = set()
        for i, group in enumerate(self.actors):
            check_region(f"actors[{i}].region", group.region)
            self._check_path(f"actors[{i}].region", group.region)
            if group.prefix in ids:
                raise ValueError(f"actors[{i}].name: two Actor groups named {group.prefix!r}")
            ids.add(group.prefix)
        for i, group in enumerate(self.actors):
            if group.engine is not None and group.engine not in ENGINES:
                raise ValueError(
                    f"actors[{i}].engine: must be one of {list(ENGINES)}, got {group.engine!r}"
                )
        for i, relay in enumerate(self.relays):
            check_region(f"relays[{i}].region", relay.region)
            self._check_path(f"relays[{i}].region", relay.region)
            if relay.id in ids:
                raise ValueError(f"relays[{i}].name: id {relay.id!r} is already in use")
            ids.add(relay.id)

    def _check_path(self, where: str, region: str) -> None:
        if region != self.trainer.region and self.link(self.trainer.region, region) is None:
            raise ValueError(
                f"{where}: no link between the Trainer's region {self.trainer.region!r} and "
                f"{region!r} (add one under links:)"
            )

    def link(self, a: str, b: str) -> LinkSpec | None:
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link
        return None

    def region(self, name: str) -> RegionSpec:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def actor_ids(self) -> list[tuple[str, ActorGroup]]:
        """Every Actor id with its group, in file order."""
        return [(f"{g.prefix}-{i}", g) for g in self.actors for i in range(g.count)]


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


# ------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping with a key written twice. PyYAML keeps the
    last value silently, so a duplicated section hid the first and surfaced, if at all, as an
    unrelated error about what was left."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # '<<' merges are resolved by flatten_mapping below, not duplicates
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: construct_mapping below names it
            if first is not None:
                why = f"duplicate key {key!r} (first at line {first})"
                raise yaml.constructor.ConstructorError(None, None, why, key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path, what: str) -> Any:
    """The plain data of a YAML file (a topology, a trace): one ``ValueError`` naming the file
    for a file that cannot be read, is not YAML, or writes a key twice in one mapping."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read {what} file: {exc.strerror}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise ValueError(f"{path}: {where}{exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None


def load_topology(path: str | Path) -> Topology:
    """Read a topology YAML file; any problem raises ``ValueError`` naming the file and field."""
    return topology_from_dict(load_yaml(path, "topology"), source=str(path))


def topology_from_dict(data: Any, *, source: str = "<dict>") -> Topology:
    """Build a :class:`Topology` from plain data (what ``yaml.safe_load`` returns)."""
    return build(Topology, data, source=source)


def build(cls: type, data: Any, *, source: str, where: str = "") -> Any:
    """Build the frozen dataclass ``cls`` from plain data, checking keys and types.

    Errors name ``source`` (a file), the field path and the expected form. Used for topologies
    and traces alike.
    """
    try:
        return _build(cls, data, where)
    except _FieldError as exc:
        raise ValueError(f"{source}: {exc}") from None


class _FieldError(Exception):
    pass


def _build(cls: type, data: Any, where: str) -> Any:
    label = where or "top level"
    if not isinstance(data, dict):
        raise _FieldError(f"{label}: expected a mapping for {cls.__name__}, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls) if f.init}
    unknown = sorted(set(map(str, data)) - set(known))
    if unknown:
        raise _FieldError(
            f"{label}: unknown field(s) {unknown} for {cls.__name__} "
            f"(expected some of {sorted(known)})"
        )
    kwargs = {}
    for name, f in known.items():
        path = f"{where}.{name}" if where else name
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise _FieldError(f"{path}: required field is missing")
            continue
        kwargs[name] = _convert(hints[name], data[name], path)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise _FieldError(f"{label}: {exc}") from None


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        assert len(inner) == 1, f"unsupported union {tp}"
        return _convert(inner[0], value, path)
    if origin is tuple:
        (item, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, list):
            raise _FieldError(f"{path}: expected a list, got {_kind(value)}")
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key_t, val_t = typing.get_args(tp)
        if not isinstance(value, dict):
            raise _FieldError(f"{path}: expected a mapping, got {_kind(value)}")
        return {
            _convert(key_t, k, path): _convert(val_t, v, f"{path}.{k}") for k, v in value.items()
        }
    if isinstance(tp, type) and hasattr(tp, "__dataclass_fields__"):
        return _build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise _FieldError(f"{path}: expected true or false, got {_kind(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _FieldError(f"{path}: expected an integer, got {_kind(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _FieldError(f"{path}: expected a number, got {_kind(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _FieldError(f"{path}: expected a string, got {_kind(value)}")
        return value
    raise AssertionError(f"unsupported field type {tp!r} at {path}")


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return f"{type(value).__name__} {value!r}"[:80]


__all__ = [
    "CONGESTION",
    "ActorGroup",
    "Fluctuation",
    "LinkSpec",
    "RealSpec",
    "RegionSpec",
    "RelaySpec",
    "TrainerSpec",
    "Topology",
    "build",
    "load_topology",
    "topology_from_dict",
]
