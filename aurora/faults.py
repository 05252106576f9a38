"""Fault schedules: one spelling of a membership or network event for every mode.

A :class:`Fault` says *what* happens (``kind``, one of :data:`FAULT_KINDS`), *to whom*
(``target``) and *when* (``at_step``: right after batch ``at_step`` is handed out, so a lost Actor
loses the leases it just got; or ``at_s``: seconds after the run starts, simulated or wall
clock). The simulator (``sim/``) and the real-process injector (``emulation/injector.py``) read
the same :class:`Fault` objects, so a schedule written once, on the command line (``--fault``) or
in code, runs in both modes.

:func:`parse_fault` reads the command-line spelling; :func:`check_faults` checks a schedule
against the deployment before anything runs (an unknown Actor, region, relay or link, a step past
the end of the run) and names the offending spec, so a typo never silently does nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from aurora.topology import Topology

FAULT_KINDS = (
    "preempt",
    "preempt_notice",
    "leave",
    "join",
    "region_loss",
    "relay_fail",
    "trainer_crash",
    "link_cut",
    "ledger_crash",
)
"""Every fault kind, in this order:

========================  ================================  ======================================
kind                      target                            meaning
========================  ================================  ======================================
``preempt``               Actor id                          lost without notice (SIGKILL)
``preempt_notice``        Actor id                          notice, ``notice_s`` to drain, then
                                                            lost (SIGTERM, then SIGKILL)
``leave``                 Actor id                          graceful departure
``join``                  new Actor id                      a fresh Actor in ``region`` on
                                                            ``gpu``; catches up from a snapshot
``region_loss``           region                            every Actor and relay of the region
``relay_fail``            relay id (or seed Actor id)       the relay is lost (SIGKILL)
``trainer_crash``         (none)                            the Trainer is lost and restarts from
                                                            its checkpoint
``link_cut``              link ``A-B`` (regions)            the link drops everything for
                                                            ``duration_s``, then is restored
``ledger_crash``          (none)                            the Job Ledger process is lost and
                                                            restarts from its log (real mode only:
                                                            the simulator has no Ledger process)
========================  ================================  ======================================
"""

SYNTAX = (
    "KIND:TARGET@step=N or KIND:TARGET@t=SECONDS, with ,notice=S (preempt_notice) or "
    ",for=S (link_cut) appended; join:ID:REGION:GPU@step=N for a join; trainer_crash@t=S"
)
"""How ``--fault`` is spelled (printed in errors and help)."""

EXAMPLES = (
    "preempt:ca-a100-1@step=6",
    "preempt_notice:ca-a100-2@t=120,notice=30",
    "leave:ca-a100-3@step=4",
    "join:ca-new-0:ca:A100@step=14",
    "region_loss:ca@step=3",
    "relay_fail:relay-ca@t=200",
    "trainer_crash@t=500",
    "link_cut:us-ca@t=60,for=20",
    "ledger_crash@t=90",
)
"""One example per kind (help text and docs)."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One scheduled membership or network event."""

    kind: str
    """One of :data:`FAULT_KINDS`."""
    target: str = ""
    """Actor id (preempt, preempt_notice, leave), new Actor id (join), region (region_loss),
    relay id or seed Actor id (relay_fail), ``A-B`` region pair (link_cut); empty for
    trainer_crash."""
    at_s: float | None = None
    """Seconds after the start of the run (simulated or wall clock); exactly one of ``at_s``
    and ``at_step`` is set."""
    at_step: int | None = None
    """The event happens right after batch ``at_step`` (1-based) is handed out (a lost Actor
    loses the leases it just got, as a preempted Actor's rollouts abort in the paper's
    Fig. 13)."""
    notice_s: float = 30.0
    """Warning before a ``preempt_notice`` takes the machine (s)."""
    duration_s: float = 10.0
    """How long a ``link_cut`` lasts before the link is restored (s)."""
    region: str = ""
    """Region of a joining Actor."""
    gpu: str = ""
    """GPU type of a joining Actor."""

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {list(FAULT_KINDS)}, got {self.kind!r}")
        if (self.at_s is None) == (self.at_step is None):
            raise ValueError(f"fault {self.kind}: set exactly one of at_s and at_step")
        if self.at_s is not None and not self.at_s >= 0:
            raise ValueError(f"fault {self.kind}: t must be >= 0 seconds, got {self.at_s}")
        if self.at_step is not None and self.at_step < 1:
            raise ValueError(f"fault {self.kind}: step must be >= 1, got {self.at_step}")
        if self.kind in ("trainer_crash", "ledger_crash"):
            if self.target:
                raise ValueError(f"fault {self.kind} takes no target, got {self.target!r}")
        elif not self.target:
            raise ValueError(f"fault {self.kind}: target is required")
        if self.kind == "join" and not (self.region and self.gpu):
            raise ValueError(f"fault join {self.target!r}: region and gpu are required")
        if not self.notice_s >= 0:
            raise ValueError(f"fault {self.kind}: notice must be >= 0 s, got {self.notice_s}")
        if not self.duration_s > 0:
            raise ValueError(f"fault {self.kind}: duration must be > 0 s, got {self.duration_s}")
        if self.kind == "link_cut" and "-" not in self.target.strip("-"):
            raise ValueError(f"fault link_cut: target must be REGION-REGION, got {self.target!r}")

    @property
    def when(self) -> str:
        """``step=N`` or ``t=S``, as written on the command line."""
        return f"step={self.at_step}" if self.at_step is not None else f"t={_num(self.at_s)}"

    def spec(self) -> str:
        """The command-line spelling of this fault (``parse_fault(f.spec()) == f``)."""
        what = self.kind
        if self.kind == "join":
            what += f":{self.target}:{self.region}:{self.gpu}"
        elif self.target:
            what += f":{self.target}"
        extra = ""
        if self.kind == "preempt_notice":
            extra = f",notice={_num(self.notice_s)}"
        elif self.kind == "link_cut":
            extra = f",for={_num(self.duration_s)}"
        return f"{what}@{self.when}{extra}"


def _num(x: float | None) -> str:
    """Shortest spelling of ``x`` that reads back as the same float: ``4`` for 4.0, but every
    digit of a recorded time such as 4.229145050048828 (``:g`` alone keeps six and would move a
    replayed fault by microseconds)."""
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


def parse_fault(text: str) -> Fault:
    """Read one ``--fault`` spec (see :data:`SYNTAX`); a malformed spec raises ``ValueError``
    naming it and the expected form."""

    def bad(why: str = "") -> ValueError:
        return ValueError(f"--fault {text!r}: {why + '; ' if why else ''}expected {SYNTAX}")

    def wrong(why: str) -> ValueError:
        return ValueError(f"--fault {text!r}: {why}")

    if text.count("@") != 1:
        raise bad()
    what, when = text.split("@")
    parts = what.split(":")
    kind = parts[0]
    if kind not in FAULT_KINDS:
        raise bad(f"unknown kind {kind!r} (one of {', '.join(FAULT_KINDS)})")
    kwargs: dict[str, Any] = {"kind": kind}  # Fault's fields, checked by its __post_init__
    want = {"join": 4, "trainer_crash": 1, "ledger_crash": 1}.get(kind, 2)
    if len(parts) != want:
        raise bad()
    if kind == "join":
        kwargs.update(target=parts[1], region=parts[2], gpu=parts[3])
    elif kind not in ("trainer_crash", "ledger_crash"):
        kwargs["target"] = parts[1]
    for i, item in enumerate(when.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise bad()
        try:
            if i == 0 and key == "step":
                kwargs["at_step"] = int(value)
            elif i == 0 and key == "t":
                kwargs["at_s"] = float(value)
            elif i > 0 and key == "notice" and kind == "preempt_notice":
                kwargs["notice_s"] = float(value)
            elif i > 0 and key == "for" and kind == "link_cut":
                kwargs["duration_s"] = float(value)
            else:
                raise bad(f"unexpected {key!r}")
        except ValueError as exc:
            if str(exc).startswith("--fault"):
                raise
            raise bad(f"{key}={value!r} is not a number") from None
    try:
        return Fault(**kwargs)
    except ValueError as exc:
        raise wrong(str(exc)) from None


def check_faults(faults: Iterable[Fault], topology: Topology, *, steps: int) -> None:
    """Check a schedule against a deployment before a run starts.

    Raises ``ValueError`` naming the fault (in its command-line spelling) when it targets an
    Actor, region, relay or link the topology does not have (joined Actors count from their
    join on), when it comes after the last step, or when a joining id is taken by an Actor that
    no earlier fault took away (a preempted Actor may come back under its own id). Faults
    given by time and by step are ordered time first, then step, for this check.
    """
    actors = {aid for aid, _ in topology.actor_ids()}
    relays = {r.id for r in topology.relays}
    regions = {r.name for r in topology.regions}
    region_of = {aid: g.region for aid, g in topology.actor_ids()}
    gone: set[str] = set()
    """Actors an earlier fault (in time order) took away: they may join again (a return)."""
    order = sorted(faults, key=lambda f: (f.at_s is None, f.at_s or 0.0, f.at_step or 0))
    for f in order:

        def bad(why: str, f: Fault = f) -> ValueError:
            return ValueError(f"--fault {f.spec()!r}: {why}")

        if f.at_step is not None and f.at_step > steps:
            raise bad(f"step {f.at_step} is after the last step of the run ({steps})")
        if f.kind in ("preempt", "preempt_notice", "leave") and f.target not in actors:
            raise bad(f"unknown Actor {f.target!r} (known: {', '.join(sorted(actors))})")
        if f.kind == "relay_fail" and f.target not in relays | actors:
            known = ", ".join(sorted(relays | actors))
            raise bad(f"unknown relay or Actor {f.target!r} (known: {known})")
        if f.kind == "region_loss" and f.target not in regions:
            raise bad(f"unknown region {f.target!r} (known: {', '.join(sorted(regions))})")
        if f.kind == "region_loss" and f.target == topology.trainer.region:
            raise bad("the Trainer's region cannot be lost (use trainer_crash)")
        if f.kind in ("preempt", "preempt_notice", "leave"):
            gone.add(f.target)
        if f.kind == "region_loss":
            gone |= {a for a in actors if region_of.get(a) == f.target}
        if f.kind == "join":
            if (f.target in actors and f.target not in gone) or f.target in relays:
                raise bad(f"id {f.target!r} is already in use (a return needs an earlier loss)")
            if f.region not in regions:
                raise bad(f"unknown region {f.region!r} (known: {', '.join(sorted(regions))})")
            actors.add(f.target)
            region_of[f.target] = f.region
            gone.discard(f.target)
        if f.kind == "link_cut" and link_ends(f.target, topology) is None:
            names = ", ".join(f"{lk.a}-{lk.b}" for lk in topology.links) or "none"
            raise bad(f"no link {f.target!r} (links: {names})")


def link_ends(target: str, topology: Topology) -> tuple[str, str] | None:
    """The two regions of a ``link_cut`` target ``A-B`` (region names may hold ``-``
    themselves, so every split point is tried against the topology's links), or None."""
    for i, ch in enumerate(target):
        if ch == "-":
            a, b = target[:i], target[i + 1 :]
            if topology.link(a, b) is not None:
                return a, b
    return None
