"""A real run and the simulator's replay of it, overlaid from their TensorBoard event files.

Theory of operation
-------------------
``python -m experiments.sim_vs_real --log tensorboard`` makes real runs (``aurora real``) and
replays each in the simulator with the run's own deployment and measured inputs
(:mod:`sim.runtrace`); both write their step series under the same tags (``RUN/tb`` and
``RUN/sim/tb``, :mod:`aurora.observe.steplog`). This reads both back with TensorBoard's own
reader (EventAccumulator) and draws the series both have, the real run solid and the simulated
dashed: what ``tensorboard --logdir RUN`` shows, as a figure for ``docs/OBSERVABILITY.md``. The
scalars it drew go to ``<evidence>/<run>.csv`` (tag, step, real, sim).

    python -m experiments.observe_overlay RUN [RUN ...] --out docs/img/observe_overlay.png \\
        --evidence evidence/observe
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from pathlib import Path

TAGS = (
    ("training/step_time_s", "step time (s)"),
    ("training/tokens_per_s", "tokens/s"),
    ("delta/delta_bytes", "delta bytes per version"),
    ("scheduling/staleness", "staleness (versions)"),
)


def scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar series in ``folder``'s event files: tag -> step -> value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def main(argv: Sequence[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run folders with tb/ and sim/tb/")
    p.add_argument("--out", required=True, help="the figure (PNG)")
    p.add_argument("--evidence", default=None, help="folder for the scalars drawn (CSV)")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TAGS), figsize=(4.2 * len(TAGS), 3.6))
    for i, run in enumerate(Path(r) for r in args.runs):
        real, sim = scalars(run / "tb"), scalars(run / "sim" / "tb")
        color = f"C{i}"
        label = run.name.split("-n")[-1].split("-", 1)[-1]  # the strategy and seed
        for ax, (tag, title) in zip(axes, TAGS, strict=True):
            for series, style, mark, who in ((real, "-", "o", "real"), (sim, "--", "x", "sim")):
                got = series.get(tag, {})
                steps = sorted(got)
                values = [got[s] for s in steps]
                ax.plot(
                    steps,
                    values,
                    style,
                    color=color,
                    marker=mark,
                    ms=4,
                    mfc="none",
                    label=f"{label}: {who}",
                )
            ax.set(title=title, xlabel="step")
            if tag == "training/step_time_s":
                ax.set_yscale("log")  # the first step waits for every Actor to load its model
            ax.grid(True, alpha=0.3)
        if args.evidence:
            out = Path(args.evidence)
            out.mkdir(parents=True, exist_ok=True)
            with open(out / f"{run.name}.csv", "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["tag", "step", "real", "sim"])
                for tag in sorted(set(real) | set(sim)):
                    for step in sorted(set(real.get(tag, {})) | set(sim.get(tag, {}))):
                        w.writerow(
                            [
                                tag,
                                step,
                                real.get(tag, {}).get(step, ""),
                                sim.get(tag, {}).get(step, ""),
                            ]
                        )
    axes[0].legend(fontsize=7)
    fig.suptitle(
        "the same deployment, real (solid) and simulated (dashed): one set of tags", fontsize=9
    )
    fig.tight_layout()
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    print(path)
    return path


if __name__ == "__main__":
    main()
