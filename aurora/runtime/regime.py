"""How much to scale an emulated WAN so a small model sees the paper's transfer regime.

Theory of operation
-------------------
What decides whether weight transfer is on the critical path is the ratio of the time a dense
copy takes to cross the link to the generation window it must hide behind:

    R = (dense bytes x 8 / link rate) / generation window.

The paper's default deployment (Qwen3-8B, 15.6 GB, a 0.5-1 Gbit/s link, a ~45 s window) has
R ~ 3.7: PrimeRL-Full waits on a dense broadcast every step and AuroraRL's delta hides. A model a
CPU trains in minutes is ~10^4 times smaller and its steps ~10^2 times shorter, so on the same
link every transfer would be instantaneous. :func:`regime_scale` multiplies every link rate so
the small model's R equals the topology's (both from the inputs the simulator reads,
``aurora/traces/paper.yaml``); RTT and loss are not scaled.
"""

from __future__ import annotations

from aurora.jobspec import JobSpec
from aurora.topology import Topology


def paper_ratio(topology: Topology, *, workload: str = "gsm8k") -> float:
    """R of the topology as the paper runs it (its model, its Actors' GPU, its first remote
    link): dense transfer time over the generation window."""
    from aurora.traces import load_traces

    traces = load_traces()
    model = topology.trainer.model
    dense_bytes = traces.model(model, where="trainer.model").dense_bytes.value
    gbps = remote_link_gbps(topology)
    gpu = topology.actors[0].gpu
    rate = traces.gpu(gpu, model, where="actors[0].gpu").tokens_per_s[model].value
    tokens = traces.workload(workload).tokens_per_rollout.value
    window = tokens * traces.constants.rollouts_per_actor.value / rate
    return dense_bytes * 8 / (gbps * 1e9) / window


def remote_link_gbps(topology: Topology) -> float:
    """Nominal rate of the Trainer's link to the first region with Actors elsewhere (the mean
    of a fluctuating link's bounds)."""
    home = topology.trainer.region
    for group in topology.actors:
        if group.region != home:
            link = topology.link(home, group.region)
            assert link is not None  # the topology checked every Actor has a path
            if link.fluctuation is not None:
                return (link.fluctuation.low_gbps + link.fluctuation.high_gbps) / 2
            return link.gbps
    raise ValueError("the topology has no Actors outside the Trainer's region: no WAN to scale")


def regime_scale(topology: Topology, spec: JobSpec) -> float:
    """Factor on every link rate that gives this run's model the topology's ratio R.

    Needs ``spec.dense_bytes`` (bf16 bytes of the run's model) and ``spec.window_s`` (its
    generation window per step on this machine, measured; the ``real:`` section's
    ``window_s``). RTT and loss are not scaled: they are what the TCP stack sees, and scaling
    them below the delay line's resolution would remove them."""
    r = paper_ratio(topology)
    dense = float(spec.dense_bytes)
    window = float(spec.window_s)
    gbps = remote_link_gbps(topology)
    return dense * 8 / (r * window * gbps * 1e9)
