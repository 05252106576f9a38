"""``--log tensorboard|wandb``: each step's record as scalars, under the table's tags.

Theory of operation
-------------------
:class:`StepLog` writes a step record (:mod:`aurora.observe.steps`) as one scalar per field
under its tag (:attr:`aurora.observe.table.Metric.tag`), at the step's number, so every run,
simulated or real, draws the same series and runs of one topology overlay: ``tensorboard
--logdir results/`` shows ``aurora sim`` and ``aurora real`` side by side. Only the table's
step fields are written; a field the run does not have (a simulator has no reward) is not.

Backends: ``tensorboard`` writes event files with tensorboardX (its writer alone: protobuf and
numpy, no TensorFlow, no torch; ``pip install 'aurorarl[tensorboard]'``); ``wandb`` logs to
Weights & Biases in offline mode (``WANDB_MODE`` may say otherwise; ``wandb sync`` uploads a
finished run), where wandb is installed (``'aurorarl[wandb]'``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aurora.observe.table import METRICS

KINDS = ("tensorboard", "wandb")
"""The ``--log`` choices."""

SUBFOLDER = {"tensorboard": "tb", "wandb": "wandb"}
"""Where in a run's folder each kind writes."""

TAG_OF: dict[str, str] = {m.step: m.tag for m in METRICS if m.step is not None and m.tag}
"""Step record field -> tag."""

EXTRA_TAGS = {"heldout_reward": "training/heldout_reward"}
"""Scalars written once or twice a run, outside the step record: held-out exact match before
training (at step 0) and after it (at the last step); real runs only."""


def check(kind: str) -> None:
    """ValueError (one line) unless ``--log kind`` can be written here."""
    if kind not in KINDS:
        raise ValueError(f"--log {kind!r}: expected one of {', '.join(KINDS)}")
    package, extra = ("tensorboardX", "tensorboard") if kind == "tensorboard" else ("wandb",) * 2
    try:
        __import__(package)
    except ImportError:
        raise ValueError(f"--log {kind} needs {package}: pip install 'aurorarl[{extra}]'") from None


class StepLog:
    """One run's scalars, to TensorBoard or W&B (module docstring)."""

    def __init__(
        self, kind: str, run: str | Path, *, name: str, config: Mapping[str, Any] | None = None
    ) -> None:
        check(kind)
        self.kind = kind
        self.folder = Path(run) / SUBFOLDER[kind]
        """Where the files go: ``RUN/tb`` (event files) or ``RUN/wandb`` (W&B's offline run)."""
        self.written: set[int] = set()
        if kind == "tensorboard":
            from tensorboardX import SummaryWriter

            self.folder.mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(logdir=str(self.folder), flush_secs=5)
        else:
            import wandb

            self.folder.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "aurorarl"),
                name=name,
                dir=str(run),  # W&B adds wandb/
                mode=os.environ.get("WANDB_MODE", "offline"),
                config=dict(config or {}),
                reinit="create_new",
            )

    def step(self, step: int, record: Mapping[str, float]) -> None:
        """Write step ``step``'s record (the table's step fields in it; others are ignored)."""
        values = {
            TAG_OF[k]: float(v)
            for k, v in record.items()
            if k in TAG_OF and isinstance(v, int | float) and math.isfinite(v)
        }
        self.scalars(step, values)
        self.written.add(step)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if not values:
            return
        if self.kind == "tensorboard":
            for tag, value in values.items():
                self._tb.add_scalar(tag, value, global_step=step)
        else:
            self._wandb.log(dict(values), step=step)

    def heldout(self, first: Any, last: Any, last_step: int) -> None:
        """Held-out reward before (step 0) and after training (``last_step``), where known."""
        for step, value in ((0, first), (last_step, last)):
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.scalars(step, {EXTRA_TAGS["heldout_reward"]: float(value)})

    def close(self) -> None:
        if self.kind == "tensorboard":
            self._tb.close()
        else:
            self._wandb.finish()


def write_rows(
    kind: str,
    run: str | Path,
    rows: list[dict[str, Any]],
    *,
    name: str,
    config: Mapping[str, Any] | None = None,
) -> Path:
    """A simulated run's step rows through :class:`StepLog` into its folder ``run``; returns
    where the files went."""
    from aurora.observe.steps import from_sim_row

    log = StepLog(kind, run, name=name, config=config)
    try:
        for row in rows:
            log.step(int(row["step"]), from_sim_row(row))
    finally:
        log.close()
    return log.folder
