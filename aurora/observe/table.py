"""The table of metrics: every name a user can watch, named once.

One :class:`Metric` per row. Its ``name`` is the Prometheus name every role serves it under
(:mod:`aurora.observe.ledger`, :mod:`aurora.observe.node`); where it is also a per-step series
(``step``), that field of a step record (:mod:`aurora.observe.steps`) is written to TensorBoard
or W&B under the tag ``<group>/<step>`` by both the simulator and real runs
(:mod:`aurora.observe.steplog`). ``modes`` says who can produce the step series: a simulator has
no model, so the learning metrics exist only in real runs. ``docs/OBSERVABILITY.md`` prints this
table (:func:`markdown`), and a test holds the page to it. Per-Actor series (label ``actor``) are
bounded: :data:`PER_ACTOR_MAX` Actors at most, chosen by
:func:`aurora.observe.ledger.watched_actors`; per-region aggregates (label ``region``) cover
every Actor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GROUPS = ("training", "delta", "scheduling", "membership", "verification", "process")
"""The groups of the table, in the order the docs and the dashboard show them."""

PER_ACTOR_MAX = 64
"""Most Actors with series of their own on one scrape (per-region aggregates cover the rest)."""


@dataclass(frozen=True, kw_only=True)
class Metric:
    """One row of the table."""

    name: str
    """Prometheus name (``aurora_`` prefix; counters end in ``_total``)."""
    kind: str
    """``counter``, ``gauge`` or ``histogram``."""
    group: str
    """One of :data:`GROUPS`."""
    help: str
    """What it measures, with its unit."""
    role: str
    """Who serves it: ``ledger`` (the Job Ledger, in the Trainer's process by default),
    ``node`` (every data-plane node: Trainer, relay, Actor) or ``actor`` (an Actor process)."""
    labels: tuple[str, ...] = ()
    """Label names (``actor`` series are bounded, see the module docstring)."""
    step: str | None = None
    """Field of the step record written to TensorBoard/W&B each step (tag ``group/step``);
    None: a Prometheus series only."""
    modes: tuple[str, ...] = ("sim", "real")
    """Who writes the step series: both, or ``real`` only (needs a model): a simulator has no
    model, so the learning metrics (reward, loss, KL...) exist only in real runs; every other
    step series exists in both and overlays."""

    @property
    def tag(self) -> str | None:
        """The TensorBoard/W&B tag of its step series."""
        return None if self.step is None else f"{self.group}/{self.step}"


def _m(name: str, kind: str, group: str, role: str, help: str, **kw: Any) -> Metric:
    return Metric(name=name, kind=kind, group=group, role=role, help=help, **kw)


G, C, H = "gauge", "counter", "histogram"
REAL = ("real",)

METRICS: tuple[Metric, ...] = (
    # -- training ----------------------------------------------------------------------------
    _m("aurora_version", G, "training", "ledger", "newest published policy version"),
    _m(
        "aurora_step_seconds",
        G,
        "training",
        "ledger",
        "last step's time: its version's publication after the previous one's (s)",
        step="step_time_s",
    ),
    _m(
        "aurora_step_tokens",
        G,
        "training",
        "ledger",
        "tokens trained on in the last step",
        step="tokens",
    ),
    _m(
        "aurora_tokens_per_second",
        G,
        "training",
        "ledger",
        "last step's tokens over its step time (tokens/s)",
        step="tokens_per_s",
    ),
    _m("aurora_tokens_total", C, "training", "ledger", "tokens trained on since the start"),
    _m("aurora_steps_total", C, "training", "ledger", "steps published since the start"),
    _m(
        "aurora_reward",
        G,
        "training",
        "ledger",
        "mean reward of the last step's batch",
        step="reward",
        modes=REAL,
    ),
    _m(
        "aurora_heldout_reward",
        G,
        "training",
        "ledger",
        "held-out exact match before training (at=first) and after it (at=last)",
        labels=("at",),
    ),
    _m("aurora_loss", G, "training", "ledger", "last step's GRPO loss", step="loss", modes=REAL),
    _m(
        "aurora_kl",
        G,
        "training",
        "ledger",
        "last step's KL to the reference (nats/token)",
        step="kl",
        modes=REAL,
    ),
    _m(
        "aurora_entropy",
        G,
        "training",
        "ledger",
        "last batch's policy entropy, the mean -log p of its sampled tokens (nats/token)",
        step="entropy",
        modes=REAL,
    ),
    _m(
        "aurora_clip_fraction",
        G,
        "training",
        "ledger",
        "share of the last step's tokens whose ratio was clipped",
        step="clip_fraction",
        modes=REAL,
    ),
    _m(
        "aurora_grad_norm",
        G,
        "training",
        "ledger",
        "last step's global gradient norm",
        step="grad_norm",
        modes=REAL,
    ),
    _m("aurora_train_seconds", G, "training", "ledger", "last optimizer step (s)"),
    # -- delta path --------------------------------------------------------------------------
    _m(
        "aurora_delta_bytes",
        G,
        "delta",
        "ledger",
        "bytes of the newest version's delta D_v",
        step="delta_bytes",
    ),
    _m("aurora_delta_bytes_total", C, "delta", "ledger", "bytes of every delta published"),
    _m(
        "aurora_delta_changed_fraction",
        G,
        "delta",
        "ledger",
        "share of bf16 weights the newest version changed",
        step="changed_fraction",
        modes=REAL,
    ),
    _m("aurora_delta_dense_bytes", G, "delta", "ledger", "bytes of the dense bf16 weights"),
    _m("aurora_extract_seconds", G, "delta", "ledger", "extraction of the newest delta (s)"),
    _m(
        "aurora_actor_transfer_seconds",
        G,
        "delta",
        "ledger",
        "publication of the newest version an Actor staged until it reported it staged (s)",
        labels=("actor",),
    ),
    _m(
        "aurora_link_transfer_seconds",
        G,
        "delta",
        "ledger",
        "publication of the newest version until the last Actor fetching it over this link "
        "(source to region) staged it (s)",
        labels=("source", "region"),
    ),
    _m(
        "aurora_activation_pause_seconds",
        H,
        "delta",
        "ledger",
        "generation paused to activate a staged delta, every activation (s)",
    ),
    _m(
        "aurora_catch_ups_total",
        C,
        "delta",
        "ledger",
        "catch-ups (snapshot and/or chain) Actors completed",
    ),
    _m(
        "aurora_relay_fanout",
        G,
        "delta",
        "ledger",
        "live Actors routed to each relay",
        labels=("relay",),
    ),
    _m(
        "aurora_node_bytes_verified_total",
        C,
        "delta",
        "node",
        "delta segment bytes this node received and verified",
    ),
    _m(
        "aurora_node_refused_total",
        C,
        "delta",
        "node",
        "things this node refused, by kind (segment, announcement, ...)",
        labels=("kind",),
    ),
    _m(
        "aurora_node_source_switches_total",
        C,
        "delta",
        "node",
        "times this node left a source for another",
    ),
    _m("aurora_node_subscribers", G, "delta", "node", "subscribers this node serves (fan-out)"),
    _m("aurora_node_versions_staged", G, "delta", "node", "versions staged and not active"),
    # -- scheduling --------------------------------------------------------------------------
    _m("aurora_batch", G, "scheduling", "ledger", "newest batch requested"),
    _m(
        "aurora_batch_completion_ratio",
        G,
        "scheduling",
        "ledger",
        "admitted prompts of the newest batch over its prompts",
    ),
    _m(
        "aurora_staleness",
        G,
        "scheduling",
        "ledger",
        "versions between the last step's batch and the policy it trained (v - 1 - batch's)",
        step="staleness",
    ),
    _m("aurora_leases_outstanding", G, "scheduling", "ledger", "live leases"),
    _m("aurora_leases_pool", G, "scheduling", "ledger", "prompts waiting for a lease"),
    _m("aurora_leases_expired_total", C, "scheduling", "ledger", "leases that expired"),
    _m(
        "aurora_step_leases_expired",
        G,
        "scheduling",
        "ledger",
        "leases that expired during the last step",
        step="leases_expired",
    ),
    _m(
        "aurora_leases_released_total",
        C,
        "scheduling",
        "ledger",
        "leases handed back to the pool (leave, refusal, exclusion)",
    ),
    _m("aurora_results_accepted_total", C, "scheduling", "ledger", "results admitted"),
    _m(
        "aurora_results_refused_total",
        C,
        "scheduling",
        "ledger",
        "results refused, by reason",
        labels=("reason",),
    ),
    _m(
        "aurora_step_results_refused",
        G,
        "scheduling",
        "ledger",
        "results refused during the last step",
        step="results_refused",
    ),
    _m(
        "aurora_step_actors_contributing",
        G,
        "scheduling",
        "ledger",
        "Actors with an admitted result in the last step's batch",
        step="actors_contributing",
    ),
    _m(
        "aurora_step_actors_excluded",
        G,
        "scheduling",
        "ledger",
        "exclusions from the last step's batch (Actors not on an eligible version)",
        step="actors_excluded",
    ),
    _m(
        "aurora_actor_share_ratio",
        G,
        "scheduling",
        "ledger",
        "an Actor's share of the last completed batch's admitted results",
        labels=("actor",),
    ),
    _m(
        "aurora_region_share_ratio",
        G,
        "scheduling",
        "ledger",
        "a region's share of the last completed batch's admitted results",
        labels=("region",),
    ),
    _m(
        "aurora_actor_version_active",
        G,
        "scheduling",
        "ledger",
        "version an Actor generates on",
        labels=("actor",),
    ),
    _m(
        "aurora_actor_version_staged",
        G,
        "scheduling",
        "ledger",
        "newest version an Actor can activate (staged in order above its active one)",
        labels=("actor",),
    ),
    _m(
        "aurora_actor_lag_versions",
        G,
        "scheduling",
        "ledger",
        "newest published version minus the one an Actor generates on",
        labels=("actor",),
    ),
    _m(
        "aurora_region_lag_versions_max",
        G,
        "scheduling",
        "ledger",
        "the largest lag of a region's live Actors",
        labels=("region",),
    ),
    _m(
        "aurora_actor_throughput_tokens_per_second",
        G,
        "scheduling",
        "ledger",
        "an Actor's throughput estimate tau_a (tokens/s)",
        labels=("actor",),
    ),
    _m(
        "aurora_region_throughput_tokens_per_second",
        G,
        "scheduling",
        "ledger",
        "sum of a region's live throughput estimates (tokens/s)",
        labels=("region",),
    ),
    _m(
        "aurora_actor_leases",
        G,
        "scheduling",
        "ledger",
        "live leases an Actor holds",
        labels=("actor",),
    ),
    _m(
        "aurora_region_leases",
        G,
        "scheduling",
        "ledger",
        "live leases a region holds",
        labels=("region",),
    ),
    _m(
        "aurora_actor_stalled",
        G,
        "scheduling",
        "ledger",
        "1 while an Actor gets no new prompts (a lease expired or a result was wrong)",
        labels=("actor",),
    ),
    _m("aurora_engine_version", G, "scheduling", "actor", "version this Actor's engine runs"),
    _m("aurora_engine_queued_leases", G, "scheduling", "actor", "leases queued at this Actor"),
    _m("aurora_engine_tokens_total", C, "scheduling", "actor", "tokens this Actor generated"),
    _m(
        "aurora_engine_generate_seconds_total",
        C,
        "scheduling",
        "actor",
        "seconds this Actor spent generating",
    ),
    _m(
        "aurora_engine_activations_total",
        C,
        "scheduling",
        "actor",
        "staged deltas this Actor activated",
    ),
    # -- membership and faults ---------------------------------------------------------------
    _m(
        "aurora_actors",
        G,
        "membership",
        "ledger",
        "Actors by region and life (ready, ...)",
        labels=("region", "life"),
    ),
    _m(
        "aurora_relays",
        G,
        "membership",
        "ledger",
        "live standalone relays by region",
        labels=("region",),
    ),
    _m("aurora_actor_joins_total", C, "membership", "ledger", "Actor joins (returns included)"),
    _m("aurora_actor_leaves_total", C, "membership", "ledger", "graceful leaves"),
    _m("aurora_actor_preemption_notices_total", C, "membership", "ledger", "preemption notices"),
    _m(
        "aurora_actors_lost_total",
        C,
        "membership",
        "ledger",
        "Actors lost without a leave (killed, preempted without notice, cut off)",
    ),
    _m("aurora_relays_lost_total", C, "membership", "ledger", "relays lost"),
    _m(
        "aurora_trainer_connects_total",
        C,
        "membership",
        "ledger",
        "Trainer connections to this Ledger (1 + Trainer restarts and reconnects)",
    ),
    _m(
        "aurora_ledger_replayed_events",
        G,
        "membership",
        "ledger",
        "events this Ledger replayed from its log at start (> 0: it restarted)",
    ),
    # -- verification ------------------------------------------------------------------------
    _m(
        "aurora_verification_checked_total",
        C,
        "verification",
        "ledger",
        "results the Trainer recomputed",
    ),
    _m(
        "aurora_verification_failed_total",
        C,
        "verification",
        "ledger",
        "Actors excluded for good after a failed check",
    ),
    _m(
        "aurora_actors_by_trust",
        G,
        "verification",
        "ledger",
        "Actors by verification state (new, trusted, suspected, excluded)",
        labels=("state",),
    ),
    _m(
        "aurora_actor_excluded",
        G,
        "verification",
        "ledger",
        "1 for an Actor excluded for good by verification",
        labels=("actor",),
    ),
    # -- the process -------------------------------------------------------------------------
    _m("aurora_ledger_events_total", C, "process", "ledger", "events the Ledger decided"),
    _m(
        "aurora_ledger_decide_seconds_total",
        C,
        "process",
        "ledger",
        "seconds the Ledger spent in decide",
    ),
    _m(
        "aurora_ledger_log_seconds_total",
        C,
        "process",
        "ledger",
        "seconds the Ledger spent appending to its log",
    ),
)
"""Every metric (see the module docstring). ``process_*`` series (RSS, CPU, open files) come
with every role too, from prometheus_client's process collector."""

BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}
STEP_FIELDS: tuple[str, ...] = tuple(m.step for m in METRICS if m.step is not None)
"""The step record's fields (:mod:`aurora.observe.steps`)."""


def tags(mode: str) -> set[str]:
    """The TensorBoard/W&B tags a run of ``mode`` (``sim`` or ``real``) writes each step."""
    return {m.tag for m in METRICS if m.tag is not None and mode in m.modes}


def markdown() -> str:
    """The table as Markdown (docs/OBSERVABILITY.md)."""
    lines = [
        "| metric | type | labels | served by | what | step tag (TensorBoard, W&B) |",
        "|---|---|---|---|---|---|",
    ]
    for group in GROUPS:
        for m in (x for x in METRICS if x.group == group):
            tag = "" if m.tag is None else f"`{m.tag}`" + ("" if "sim" in m.modes else " (real)")
            labels = ", ".join(m.labels)
            lines.append(f"| `{m.name}` | {m.kind} | {labels} | {m.role} | {m.help} | {tag} |")
    return "\n".join(lines)
