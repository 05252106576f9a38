"""The job spec: what every role of a real run reads (model, task, sampling, strategy, store URL,
job id, backend settings), as one frozen dataclass.

:func:`aurora.runtime.job.make_spec` builds it from a topology; the Trainer registers it with
the Ledger, the Ledger hands it to every peer that joins, and ``aurora real`` writes it to the
run's ``job.json``. On the wire and on disk it is :meth:`JobSpec.encode`'s JSON-ready dict, read
back by :meth:`JobSpec.decode`, which refuses an unknown or missing key and a value of the wrong
type with a ValueError naming the field (an int is taken for a float): this module is the one
place its keys are spelled. Every role decodes the spec where it arrives (the Ledger's ``job``
message before it is logged, the ``welcome``, ``job.json``) and reads attributes after that.
It sits below the simulator and the runtime because both read it (``sim/runtrace`` turns a
real run's folder into the simulator's inputs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from aurora.topology import CONGESTION

ACTORS = ("local", "remote")
"""Where a job's Actors come from (:attr:`JobSpec.actors`)."""


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """A transfer strategy as the runtime runs it (:func:`strategy_spec`)."""

    name: str
    """The strategy's name (:data:`REAL_STRATEGIES`)."""
    payload: str
    """``delta`` or ``dense`` (a full bf16 copy per version)."""
    codec: str | None
    """Delta codec (None for a dense payload)."""
    streams: int
    """Parallel TCP streams per transfer."""
    relays: bool
    """Remote regions fetch through a relay."""
    max_lag: int
    """Lag bound of the pacer."""
    cut_through: bool
    """Relays forward each segment as it is verified (else store-and-forward)."""
    staging_grace_s: float
    """How long a ready batch waits for Actors still staging its version (s)."""
    shaped: bool
    """The links are shaped (False for ``ideal-singledc``)."""


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """The job every role reads (see the module docstring); build with :func:`make_spec`.

    Its keys are the ones older ``job.json`` files and Ledger logs hold, so those decode
    unchanged; :meth:`encode` spells out the settings left at their defaults too
    (``segment_bytes``, ``trainer_data``: None, ...).
    """

    job_id: str
    """Scope of the job's signed announcements and control-plane admission."""
    name: str
    """The topology's name."""
    backend: str
    """Compute: ``rl`` (real models) or ``standin``."""
    model: str
    """Model name or Hugging Face directory."""
    engine: str
    """The Actors' inference engine (an Actor's own overrides it)."""
    device: str
    """The Trainer's device."""
    task: str
    """The RL task."""
    regime: str
    """``learn`` or ``transfer`` (learning-rate choice)."""
    learning_rate: float | None
    """None: the regime's."""
    seed: int
    """Seed of every random draw of the job."""
    steps: int
    """Training steps."""
    prompts_per_step: int
    """Prompts in one batch."""
    group_size: int
    """Completions per prompt (GRPO group)."""
    max_new_tokens: int | None
    """Generation length; None: the task's (the Trainer fills it in before registering)."""
    temperature: float
    """Sampling temperature."""
    snapshot_interval: int
    """A full snapshot every this many versions."""
    digest_interval: int
    """Content digests every this many versions (:func:`digest_due`)."""
    lease_initial_s: float
    """Lease length until completions are known (s)."""
    threads: int | None
    """Compute threads per process."""
    eval_prompts: int
    """Held-out prompts for the reward before and after."""
    store: str
    """The Checkpoint Store's URL."""
    trainer_region: str
    """Region of the Trainer (and its Ledger)."""
    strategy: StrategySpec
    """How versions travel."""
    window_s: float
    """The regime check's window (s)."""
    dense_bytes: int
    """bf16 bytes of the model (a dense broadcast per step)."""
    start_actors: int = 1
    """The first batch waits for this many ready Actors ..."""
    start_wait_s: float = 120.0
    """... or this long (s)."""
    standin_tokens_per_s: float = 0.0
    """The stand-in engine's generation rate (0: as fast as it can)."""
    standin_hidden: int = 64
    """The stand-in model's width."""
    standin_density: float = 0.02
    """Fraction of the stand-in's weights each step changes."""
    shapes_density: float | None = None
    """Fraction of the ``shapes`` backend's weights each step changes; None: the backend's
    default (:data:`aurora.runtime.shapes.DEFAULT_DENSITY`)."""
    segment_bytes: int = 4 << 20
    """Segment size of a published delta (stand-in backend)."""
    ledger_in_memory: bool = False
    """Keep the Ledger's log in memory (load benchmarks)."""
    vllm_gpu_memory_utilization: float | None = None
    """vLLM's share of GPU memory; None: the backend's default."""
    trainer_data: str | None = None
    """The Trainer's data-plane address (set by the Trainer when it registers the job)."""
    vocab_size: int | None = None
    """Token ids a result may carry are below this; it also sets the floor of plausible
    log-probs (:func:`aurora.policy.refusals.logprob_floor`). Set by the Trainer when it
    registers the job, from its model; None: not checked."""
    eos_id: int | None = None
    """The tokenizer's end-of-sequence token id (set by the Trainer when it registers the
    job)."""
    eos_ids: tuple[int, ...] | None = None
    """Every id a completion ends at: the tokenizer's end of sequence and the model's
    generation config's, the ids every engine stops at (``aurora.engines.base.end_ids``); a
    completion ends at its first one. Set by the Trainer when it registers the job; None: only
    ``eos_id`` (a spec from before), or not checked (:meth:`end_ids`)."""
    actors: str = "local"
    """Where the job's Actors come from: ``local`` (the job's own launcher, ``aurora real``,
    starts them on its host or its emulated regions) or ``remote`` (they join from other hosts,
    run by others: untrusted). Decided when the spec is made
    (:func:`aurora.runtime.job.make_spec`); ``remote`` turns :attr:`verify` on by default."""
    verify: bool = False
    """Verified rollouts (docs/VERIFICATION.md): the Trainer recomputes a sample of each
    Actor's admitted results under the claimed version and the Ledger excludes an Actor whose
    result fails (``aurora.policy.verification``). Needs the ``rl`` backend. Made on for
    ``remote`` Actors unless the job says ``verify: false`` (then the Trainer and a standalone
    Ledger warn at start)."""
    verify_fraction: float | None = None
    """Fraction of a trusted Actor's results checked; None: the rule's default (0.1)."""
    verify_probation: int | None = None
    """Checks a new Actor passes (every result checked) before it is trusted; None: the
    rule's default (8)."""
    congestion: str | None = None
    """TCP congestion control set on every data-plane socket (the topology's ``congestion``);
    None: the host's default."""

    def encode(self) -> dict[str, Any]:
        """The JSON-ready dict sent to peers and written to files."""
        return asdict(self)

    @classmethod
    def decode(cls, data: Mapping[str, Any]) -> JobSpec:
        """Inverse of :meth:`encode`; a ValueError names a missing or unknown key or a value
        of the wrong type."""
        if not isinstance(data, Mapping):
            raise ValueError(f"job spec: a mapping expected, got {type(data).__name__}")
        values = _checked(cls, data, "")
        strat = values["strategy"]
        if not isinstance(strat, Mapping):
            raise ValueError("job spec: strategy must be a mapping")
        values["strategy"] = StrategySpec(**_checked(StrategySpec, strat, "strategy."))
        if values.get("actors", "local") not in ACTORS:
            raise ValueError(
                f"job spec: actors must be one of {list(ACTORS)}, got {values['actors']!r:.40}"
            )
        if values.get("congestion") not in (None, *CONGESTION):
            # Every socket of the job would refuse it: say so where the spec arrives.
            raise ValueError(
                f"job spec: congestion must be one of {list(CONGESTION)} or null, got "
                f"{values['congestion']!r:.40}"
            )
        return cls(**values)

    def end_ids(self) -> tuple[int, ...] | None:
        """The ids a completion ends at, as the payload rule checks them (None: not known)."""
        if self.eos_ids is not None:
            return self.eos_ids
        return None if self.eos_id is None else (self.eos_id,)

    def with_settings(self, **changes: Any) -> JobSpec:
        """A copy with ``changes`` (validated like :meth:`decode`)."""
        return JobSpec.decode({**self.encode(), **changes})


def _checked(cls: type, data: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """``data``'s values for the fields of ``cls``, each checked against the field's type (an
    int is taken for a float and made one: YAML and JSON write ``120`` for ``120.0``)."""
    hints = get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"job spec: unknown key(s) {[prefix + k for k in unknown]}")
    missing = sorted(
        name
        for name, f in known.items()
        if name not in data and f.default is MISSING and f.default_factory is MISSING
    )
    if missing:
        raise ValueError(f"job spec: missing key(s) {[prefix + k for k in missing]}")
    out: dict[str, Any] = {}
    for name, value in data.items():
        out[name] = _typed(hints[name], value, prefix + name)
    return out


def _typed(hint: Any, value: Any, name: str) -> Any:
    """``value`` if it is of type ``hint`` (float from int); ValueError naming ``name``."""
    args = get_args(hint)
    if isinstance(hint, UnionType) or get_origin(hint) is Union:
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
    if hint is StrategySpec:
        return value  # checked field by field by the caller
    if get_origin(hint) is tuple:  # tuple[int, ...]: a JSON list of ints
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ValueError(f"job spec: {name} must be a list of ints, got {value!r:.40}")
        return tuple(value)
    ok = (
        isinstance(value, bool)
        if hint is bool
        else isinstance(value, (int, float)) and not isinstance(value, bool)
        if hint is float
        else isinstance(value, int) and not isinstance(value, bool)
        if hint is int
        else isinstance(value, hint)
    )
    if not ok:
        raise ValueError(
            f"job spec: {name} must be {getattr(hint, '__name__', hint)}, "
            f"got {type(value).__name__} {value!r:.40}"
        )
    return float(value) if hint is float else value
