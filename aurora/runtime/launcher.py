"""``aurora real``: every role of a topology as its own process on one host.

Theory of operation
-------------------
The launcher is a convenience around the role subcommands, nothing more: it resolves the job
(:mod:`aurora.runtime.job`), writes a fresh job secret (mode 0600) into the run's folder, starts
the Trainer (with the Ledger in its process) on fixed ports, then one process per relay and per
Actor, exactly the commands a user would run on separate hosts (``docs/RUNTIME.md``). It
watches the run through the Ledger as an *observer* (one live line per step), carries out the
fault schedule (:mod:`aurora.runtime.injector`), and stops everything when the Trainer
finishes, on Ctrl-C or on an error, with no orphan left (:mod:`aurora.runtime.procs`). Results
are then rebuilt from the Ledger's log (:mod:`aurora.runtime.outputs`).

Exit codes: 0 the run completed; 1 a role failed (its one-line reason is printed); 2 bad input;
3 the run stalled (no step for ``stall_s``); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aurora.faults import Fault, check_faults
from aurora.jobspec import JobSpec
from aurora.keys import REAL_LIFETIME_S
from aurora.provenance import git_sha
from aurora.runtime.channel import Dismissed, connect
from aurora.runtime.injector import Injector, SpotHazard
from aurora.runtime.job import make_spec, plan_processes, strategy_spec
from aurora.runtime.messages import Direction
from aurora.runtime.procs import Proc, Procs
from aurora.topology import Topology

EXIT_OK, EXIT_ROLE_FAILED, EXIT_BAD_INPUT, EXIT_STALLED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class LaunchError(Exception):
    """The run cannot go on; the message is one line for the user."""

    def __init__(self, message: str, code: int = EXIT_ROLE_FAILED) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, kw_only=True)
class RealRun:
    """One ``aurora real`` invocation."""

    topology: Topology
    """The deployment."""
    topology_path: str
    """Where it was read from (printed and recorded)."""
    strategy: str = "aurora"
    """Transfer strategy (``aurora``, ``prime-full``, ``prime-async2``, ``prime-async4``,
    ``ideal-singledc``)."""
    steps: int | None = None
    """Training steps; None takes ``real.steps``."""
    seed: int = 0
    """Seed of the model, the task, sampling and the fault draws."""
    out: str = "results/real"
    """Parent folder of the run's folder ``<name>-<strategy>-s<seed>``."""
    faults: tuple[Fault, ...] = ()
    """Scheduled faults (``--fault``)."""
    spot_hazard: float = 0.0
    """Preemptions per hour per spot Actor."""
    spot_notice_s: float = 30.0
    """Notice of each hazard preemption (s)."""
    spot_return_s: float | None = None
    """A preempted spot Actor returns after this many seconds (None: never)."""
    actors: int | None = None
    """Actors to start; None takes ``real.actors``."""
    backend: str = "rl"
    """Compute backend: ``rl`` (real models) or ``standin`` (labelled stand-in)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """More job-spec settings (backend options)."""
    progress: bool = True
    """Show the live line."""
    stall_s: float = 300.0
    """Stop with exit code 3 when no step completes for this long (s)."""
    trainer_restart_s: float = 1.0
    """A crashed Trainer (or Ledger) is restarted after this many seconds (s)."""
    ledger_process: bool = False
    """Run the Ledger as its own process (``aurora ledger``) instead of inside the Trainer's;
    implied by a ``ledger_crash`` fault."""
    emulate: str | None = None
    """Run over an emulated WAN (``auto``, ``netns`` or ``mininet``; needs root): every region a
    network namespace behind a shaping router (:mod:`emulation.network`). None: loopback."""
    scale: float | None = None
    """Multiplier of every link rate under ``emulate``; None: :func:`aurora.runtime.regime.
    regime_scale` (the paper's ratio of dense transfer to generation window, for this model)."""
    hooks: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Fault-injection hooks per process id (:mod:`aurora.runtime.hooks`; the reliability
    matrix's tests only)."""
    identity_lifetime_s: float = REAL_LIFETIME_S
    """How long the identities the launcher issues are certified for (s); each is renewed
    (certified again, same key) once half of that is left, for as long as the run lasts."""
    metrics: bool = False
    """Every role serves ``/metrics`` on a free port; targets in ``RUN/prometheus/``."""
    metrics_host: str = "127.0.0.1"
    """Where each ``/metrics`` listens (this host only by default)."""
    log: str | None = None
    """``tensorboard`` or ``wandb``: each step's series (:mod:`aurora.observe.steplog`)."""


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run_folder(run: RealRun) -> Path:
    return Path(run.out) / f"{run.topology.name}-{run.strategy}-s{run.seed}"


class Launcher:
    """One run (see the module docstring)."""

    def __init__(self, run: RealRun) -> None:
        self.run = run
        self.topo = run.topology
        self.real = run.topology.real
        self.plan = plan_processes(
            run.topology, actors=run.actors, relays=strategy_spec(run.strategy).relays
        )
        self.dir = run_folder(run)
        self.host = self.real.host
        self.spec: JobSpec | None = None
        """Made by :meth:`prepare`."""
        self.procs = Procs(self.dir)
        self.ports: dict[str, int] = {}
        self.region_of: dict[str, str] = {}
        self.step = 0
        self.last_step_at = time.monotonic()
        self.finished = asyncio.Event()
        self.failure: LaunchError | None = None
        self.live_line: Any = None
        self.stats: dict[int, dict[str, Any]] = {}
        self.actors_live: list[str] = []
        self.injector: Injector | None = None
        self.net: Any = None
        """The emulated network (``emulation.network.Network``) under ``emulate``."""
        self.scale: float | None = None
        self.metrics_ports: dict[str, int] = {}
        """Role id -> its ``/metrics`` port (``--metrics``)."""
        self.steplog: Any = None
        """The run's :class:`aurora.observe.steplog.StepLog` (``--log``)."""

    @property
    def job(self) -> JobSpec:
        """The job spec (after :meth:`prepare`)."""
        if self.spec is None:
            raise RuntimeError("the job spec is made by prepare()")
        return self.spec

    # -- set-up ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        run = self.run
        if run.log is not None:
            from aurora.observe.steplog import check

            check(run.log)
        check_faults(run.faults, self.topo, steps=run.steps or self.real.steps)
        if run.spot_hazard > 0 and not any(g.spot for g in self.topo.actors):
            raise LaunchError(
                f"--spot-hazard {run.spot_hazard}: the topology has no spot Actors "
                "(set spot: true on an actor group)",
                EXIT_BAD_INPUT,
            )
        # Everything that can refuse the job first (the model, the device, every Actor's
        # engine), so a refused run leaves no folder behind and an earlier run's is kept.
        store = self.real.store or str(self.dir / "store")
        try:
            self.spec = make_spec(
                self.topo,
                strategy=run.strategy,
                seed=run.seed,
                steps=run.steps,
                store=store,
                backend=run.backend,
                extra={"start_actors": len(self.plan.actors), **run.extra},
            )
            if run.backend == "rl":
                from aurora.runtime.rlbackend import check_compute

                check_compute(
                    device=self.job.device,
                    engine=self.job.engine,
                    engines=[a.engine for a in self.plan.actors if a.engine],
                )
        except ValueError as exc:
            # The model, the device and the engines are the topology's (its real: section).
            raise ValueError(f"{run.topology_path}: {exc}") from None
        if self.dir.exists():
            if not (self.dir / "job.json").exists():
                raise LaunchError(
                    f"{self.dir} exists and is not a run folder of aurora real; not overwriting",
                    EXIT_BAD_INPUT,
                )
            shutil.rmtree(self.dir)
        from aurora.keys import new_job_keys

        try:
            self.dir.mkdir(parents=True)
            self.keys = new_job_keys(self.dir / "keys")
        except OSError as exc:
            raise LaunchError(f"cannot write {self.dir}: {exc.strerror}", EXIT_BAD_INPUT) from None
        self.secret_file = str(self.keys.secret)
        self.ports = {"ledger": free_port(self.host), "data": free_port(self.host)}
        (self.dir / "job.json").write_text(
            json.dumps(
                {
                    "spec": self.job.encode(),
                    "topology": self.run.topology_path,
                    "actors": [asdict(a) for a in self.plan.actors],
                    "relays": [list(r) for r in self.plan.relays],
                    "ports": self.ports,
                },
                indent=2,
            )
        )
        for a in self.plan.actors:
            self.region_of[a.id] = a.region
        for rid, region in self.plan.relays:
            self.region_of[rid] = region
        # An identity that can only read, for aurora status RUN (docs/OBSERVABILITY.md).
        self._identity("observer", "status")
        if run.metrics:
            from aurora.observe.targets import write_targets

            self.metrics_ports = write_targets(self, faults=run.faults)

    def describe(self) -> str:
        """The first line: what runs, and what was scaled from the topology."""
        regions: dict[str, int] = {}
        for a in self.plan.actors:
            regions[a.region] = regions.get(a.region, 0) + 1
        where = ", ".join(f"{n} in {r}" for r, n in sorted(regions.items()))
        relays = ", ".join(f"{rid} ({r})" for rid, r in self.plan.relays) or "seed Actors"
        scaled = (
            f"scaled from {self.plan.scaled_from} Actors"
            if self.plan.scaled_from != len(self.plan.actors)
            else "as in the topology"
        )
        model = {
            "rl": self.real.model,
            "shapes": f"{self.real.model} (real tensor shapes, synthetic AdamW-like steps, "
            f"stand-in generation at {self.job.standin_tokens_per_s} tokens/s)",
        }.get(self.run.backend, "stand-in compute (standin)")
        return (
            f"{self.topo.name}: {len(self.plan.actors)} Actors ({where}; {scaled}), relays: "
            f"{relays}; Trainer in {self.topo.trainer.region}; model {model} on "
            f"{self.real.device} instead of {self.topo.trainer.model}; strategy "
            f"{self.run.strategy}, {self.job.steps} steps, seed {self.run.seed}, "
            f"regime {self.real.regime}; {self.dir}"
        )

    def _common(self, *, public_key: bool = True) -> list[str]:
        out = ["--secret-file", self.secret_file]
        if public_key:
            out += ["--public-key", str(self.keys.public_key)]
        return out

    def _trainer_args(self) -> list[str]:
        return [
            "--job",
            str(self.dir / "job.json"),
            "--run-dir",
            str(self.dir),
            "--host",
            self._listen(),
            "--advertise",
            self._reach(self.topo.trainer.region),
            "--ledger-port",
            str(self.ports["ledger"]),
            "--data-port",
            str(self.ports["data"]),
            "--ports-file",
            str(self.dir / "ports.json"),
            "--signing-key",
            str(self.keys.signing_key),
            *self._common(),
            *self._metrics("trainer"),
        ]

    def _actor_args(self, aid: str, region: str, engine: str | None) -> list[str]:
        args = [
            "--join",
            self._ledger_addr(),
            "--id",
            aid,
            "--region",
            region,
            "--host",
            self._listen(),
            "--advertise",
            self._reach(region),
            *self._common(),
            *self._identity("actor", aid),
            *self._metrics(aid),
        ]
        if engine is not None:
            args += ["--engine", engine]
        return args

    def _metrics(self, pid: str) -> list[str]:
        """``--metrics-port``/``--metrics-host`` of ``pid`` under ``--metrics``, else nothing."""
        if pid not in self.metrics_ports:
            return []
        host = "0.0.0.0" if self.net is not None else self.run.metrics_host
        return ["--metrics-port", str(self.metrics_ports[pid]), "--metrics-host", host]

    def _identity(self, role: str, pid: str) -> list[str]:
        """``--identity FILE``: ``pid``'s identity in ``role`` for this job, issued with the job
        key once (a restarted process keeps its key, so the Ledger sees the same machine come
        back) and renewed while the run lasts (:meth:`renew_identities`)."""
        from aurora.keys import issue_identity, load_signing_key, write_identity

        path = self.dir / "keys" / f"{role}-{pid}.identity"
        if not path.exists():
            ident = issue_identity(
                role,
                pid,
                load_signing_key(self.keys.signing_key),
                job=self.job.job_id,
                lifetime_s=self.run.identity_lifetime_s,
            )
            write_identity(path, ident)
        return ["--identity", str(path)]

    def renew_identities(self, now: float | None = None) -> list[str]:
        """Certify again (same key, same job) every identity this run issued that has less
        than half its lifetime left; returns the files renewed. A role reads its file again at
        its next connection: the Ledger closes a session whose certificate expires, and the
        role reconnects with the renewed one within the Ledger's grace, losing nothing."""
        from aurora.keys import (
            KeyFileError,
            load_identity,
            load_signing_key,
            renew_identity,
            replace_identity,
        )

        now = time.time() if now is None else now
        lifetime = self.run.identity_lifetime_s
        renewed = []
        key = None
        for path in sorted((self.dir / "keys").glob("*.identity")):
            try:
                ident = load_identity(path)
            except KeyFileError:
                continue
            if ident.expires is None or ident.expires - now > lifetime / 2:
                continue
            key = key or load_signing_key(self.keys.signing_key)
            replace_identity(path, renew_identity(ident, key, lifetime_s=lifetime, now=now))
            renewed.append(str(path))
        return renewed

    async def _renew(self) -> None:
        while not self.finished.is_set():
            await asyncio.sleep(min(60.0, self.run.identity_lifetime_s / 20))
            self.renew_identities()

    @property
    def standalone_ledger(self) -> bool:
        return self.run.ledger_process or any(f.kind == "ledger_crash" for f in self.run.faults)

    def start_ledger(self) -> None:
        args = [
            "--job",
            str(self.dir / "job.json"),
            "--db",
            str(self.dir / "ledger.db"),
            "--host",
            self._listen(),
            "--port",
            str(self.ports["ledger"]),
            *self._common(),
            *self._identity("ledger", "ledger"),
            *self._metrics("ledger"),
        ]
        p = self.procs.procs.get("ledger") or self._add("ledger", "ledger", args)
        p.start()

    # -- where a role listens and how others reach it (loopback, or an emulated region) ------

    def _listen(self) -> str:
        return "0.0.0.0" if self.net is not None else self.host

    def _reach(self, region: str) -> str:
        return self.net.address(region) if self.net is not None else self.host

    def _ledger_addr(self) -> str:
        return f"{self._reach(self.topo.trainer.region)}:{self.ports['ledger']}"

    def _add(self, pid: str, role: str, args: list[str]) -> Proc:
        region = self.region_of.get(pid, self.topo.trainer.region)
        wrap = (lambda argv: self.net.wrap(region, argv)) if self.net is not None else None
        proc = self.procs.add(pid, role, args, wrap=wrap)
        if pid in self.run.hooks:
            proc.env["AURORA_FAULT_HOOKS"] = json.dumps(self.run.hooks[pid])
        return proc

    def start_trainer(self) -> None:
        args = self._trainer_args()
        if self.standalone_ledger:
            args += ["--ledger", self._ledger_addr()]
        p = self.procs.procs.get("trainer") or self._add("trainer", "trainer", args)
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "ports.json").unlink()
        p.start()

    def start_actor(self, aid: str, region: str, engine: str | None = None) -> None:
        self.region_of[aid] = region
        p = self.procs.procs.get(aid) or self._add(
            aid, "actor", self._actor_args(aid, region, engine)
        )
        if p.starts:
            p.env.pop("AURORA_FAULT_HOOKS", None)  # a machine that comes back is a fresh one
        p.start()

    def start_relay(self, rid: str, region: str) -> None:
        args = [
            "--join",
            self._ledger_addr(),
            "--id",
            rid,
            "--region",
            region,
            "--host",
            self._listen(),
            "--advertise",
            self._reach(region),
            *self._common(),
            *self._identity("relay", rid),
            *self._metrics(rid),
        ]
        p = self.procs.procs.get(rid) or self._add(rid, "relay", args)
        p.start()

    async def _wait_ports(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        trainer = self.procs.procs["trainer"]
        while not (self.dir / "ports.json").exists():
            if not trainer.alive:
                raise LaunchError(f"the Trainer failed: {trainer.last_error()}")
            if time.monotonic() > deadline:
                raise LaunchError(f"the Trainer did not start within {timeout_s:.0f} s")
            await asyncio.sleep(0.1)

    # -- the Cluster the injector drives ---------------------------------------------------------

    def kill(self, pid: str) -> None:
        p = self.procs.procs.get(pid)
        if p is not None:
            p.kill()

    def notice(self, pid: str, notice_s: float) -> None:
        p = self.procs.procs.get(pid)
        if p is None or not p.alive:
            return
        p.expected_exit = True
        p.signal(signal.SIGTERM)
        asyncio.get_running_loop().call_later(notice_s, p.kill)

    def leave(self, pid: str) -> None:
        p = self.procs.procs.get(pid)
        if p is not None and p.alive:
            p.expected_exit = True
            p.signal(signal.SIGUSR1)

    def join(self, pid: str, region: str, gpu: str) -> None:
        region = region or self.region_of.get(pid, "")
        existing = self.procs.procs.get(pid)
        if existing is not None and existing.alive:
            return
        self.start_actor(pid, region)

    def region_loss(self, region: str) -> None:
        for pid, p in self.procs.procs.items():
            if self.region_of.get(pid) == region and p.alive:
                p.kill()

    def relay_fail(self, pid: str) -> None:
        self.kill(pid)

    def trainer_crash(self) -> None:
        self.kill("trainer")

        def restart() -> None:
            if not self.finished.is_set():
                self.start_trainer()

        asyncio.get_running_loop().call_later(self.run.trainer_restart_s, restart)

    def ledger_crash(self) -> None:
        if not self.standalone_ledger:
            self.trainer_crash()  # the Ledger lives in the Trainer's process
            return
        self.kill("ledger")

        def restart() -> None:
            if not self.finished.is_set():
                self.start_ledger()

        asyncio.get_running_loop().call_later(self.run.trainer_restart_s, restart)

    def link_cut(self, target: str, duration_s: float) -> None:
        from aurora.faults import link_ends

        ends = link_ends(target, self.topo)
        assert ends is not None
        if self.net is not None:
            a, b = ends
            self.net.cut(a, b)  # the router drops everything on the link, both ways
            asyncio.get_running_loop().call_later(duration_s, self.net.restore, a, b)
            return
        cut = {r for r in ends if r != self.topo.trainer.region} or set(ends)
        frozen = [
            p for pid, p in self.procs.procs.items() if self.region_of.get(pid) in cut and p.alive
        ]
        for p in frozen:
            p.signal(signal.SIGSTOP)

        def restore() -> None:
            for p in frozen:
                p.signal(signal.SIGCONT)

        asyncio.get_running_loop().call_later(duration_s, restore)

    def record(self, spec: str) -> None:
        """Write the fault, with its wall time, to the run's own fault log (merged into
        events.csv): the Ledger may be the very thing the fault takes down."""
        with open(self.dir / "faults.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "spec": spec}) + "\n")

    def _dismissed(self, p: Proc) -> bool:
        """Whether ``p`` stopped because the job's Ledger refused it for good (the job excluded
        or revoked it: :class:`Dismissed`): the job working, so the run goes on without it.
        Said once, and kept in the run's own log (``dismissed.jsonl``: events.csv and
        summary.json)."""
        if p.alive or p.expected_exit or p.returncode != Dismissed.EXIT_CODE:
            return False
        p.expected_exit = True
        why = p.last_error()
        print(
            f"aurora real: {p.id} dismissed by the job; going on without it: {why}", file=sys.stderr
        )
        with open(self.dir / "dismissed.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), p.role: p.id, "why": why}) + "\n")
        return True

    # -- running -----------------------------------------------------------------------------

    async def _observe(self) -> None:
        """Follow the run through the Ledger (reconnecting across Trainer restarts)."""
        from aurora.keys import SelfIssued, load_job_secret, load_public_key, load_signing_key

        secret = load_job_secret(self.secret_file)
        identity = SelfIssued(
            "observer",
            "launcher",
            load_signing_key(self.keys.signing_key),
            job=self.job.job_id,
            lifetime_s=self.run.identity_lifetime_s,
        )
        job_key = load_public_key(self.keys.public_key)
        while not self.finished.is_set():
            try:
                ch = await connect(
                    self.host,
                    self.ports["ledger"],
                    secret=secret,
                    hello={"id": "launcher", "role": "observer"},
                    identity=identity(),
                    job_key=job_key,
                    unix_path=str(sock) if (sock := self.dir / "ledger.sock").exists() else None,
                )
            except ConnectionError:
                await asyncio.sleep(0.3)
                continue
            try:
                while not self.finished.is_set():
                    try:
                        msg = await asyncio.wait_for(
                            ch.recv_checked(Direction.LEDGER_TO_OBSERVER), 0.2
                        )
                    except TimeoutError:
                        continue
                    self._on_observed(msg)
            except ConnectionError:
                await asyncio.sleep(0.3)
            finally:
                ch.close()

    def _on_observed(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "batch_requested":
            if self.injector is not None:
                self.injector.batch_requested(int(msg["batch"]))
        elif op == "progress":
            self.actors_live = list(msg.get("actors", []))
        elif op == "stats":
            v = int(msg["version"])
            self.stats[v] = msg
            self.step = max(self.step, v)
            self.last_step_at = time.monotonic()
            self._show(v, msg)
            if self.steplog is not None:
                self.steplog.step(v, msg)  # the Ledger's step record rides on the stats
        elif op == "finished":
            self.finished.set()

    def _show(self, v: int, stats: dict[str, Any]) -> None:
        prev = self.stats.get(v - 1, {}).get("time")
        dt = (float(stats["time"]) - float(prev)) if prev else None
        tps = f"{stats.get('tokens', 0) / dt:,.0f}" if dt else "-"
        alive = sum(1 for p in self.procs.procs.values() if p.role == "actor" and p.alive)
        reward = stats.get("reward")
        parts = [f"step {v}/{self.job.steps}", f"v{v}", f"tokens/s {tps}"]
        if isinstance(reward, float):
            parts.append(f"reward {reward:.3f}")
        parts.append(f"Actors live {alive}")
        line = "  ".join(parts)
        if self.live_line is not None:
            self.live_line.set_postfix_str(line, refresh=False)
            self.live_line.update(v - self.live_line.n)
        elif self.run.progress:
            print(line, flush=True)

    async def _watch(self) -> None:
        """Fail fast when a role dies unexpectedly, or nothing progresses."""
        while not self.finished.is_set():
            await asyncio.sleep(0.2)
            trainer = self.procs.procs.get("trainer")
            if trainer is not None and not trainer.alive and not trainer.expected_exit:
                if trainer.returncode == 0:
                    self.finished.set()
                    return
                raise LaunchError(f"the Trainer failed: {trainer.last_error()}")
            for p in self.procs.procs.values():
                if self._dismissed(p):
                    continue
                if p.role != "trainer" and not p.alive and not p.expected_exit:
                    code = p.returncode
                    p.expected_exit = True  # report once
                    if code not in (0, None) and self.step == 0:
                        # Before the first step no fault has struck: a role that cannot start
                        # (a missing engine, a bad model) is the job's error, not a preemption,
                        # and the run would wait for it until the stall limit.
                        raise LaunchError(f"{p.id} failed at start: {p.last_error()}")
                    if code not in (0, None):
                        print(f"warning: {p.id} exited ({code}): {p.last_error()}", file=sys.stderr)
            if time.monotonic() - self.last_step_at > self.run.stall_s:
                raise LaunchError(
                    f"no step completed for {self.run.stall_s:.0f} s (stalled at step "
                    f"{self.step}); see {self.dir}/logs",
                    EXIT_STALLED,
                )

    async def _run(self) -> None:
        if self.standalone_ledger:
            self.start_ledger()
        self.start_trainer()
        await self._wait_ports()
        for rid, region in self.plan.relays:
            self.start_relay(rid, region)
        for a in self.plan.actors:
            self.start_actor(a.id, a.region, a.engine if a.engine != self.real.engine else None)
        spot = None
        if self.run.spot_hazard > 0:
            spot_ids = {
                f"{g.prefix}-{i}" for g in self.topo.actors if g.spot for i in range(g.count)
            }
            spot = SpotHazard(
                per_hour=self.run.spot_hazard,
                actors=tuple(a.id for a in self.plan.actors if a.id in spot_ids),
                notice_s=self.run.spot_notice_s,
                return_s=self.run.spot_return_s,
                seed=self.run.seed,
            )
        self.injector = Injector(self.run.faults, self, spot=spot)
        self.injector.start()
        self.last_step_at = time.monotonic()
        observer = asyncio.create_task(self._observe())
        renew = asyncio.create_task(self._renew())
        watch = asyncio.create_task(self._watch())
        done, _ = await asyncio.wait(
            [watch, asyncio.create_task(self.finished.wait())],
            return_when=asyncio.FIRST_COMPLETED,
        )
        self.injector.stop()
        self.finished.set()
        for t in (observer, renew, watch):
            t.cancel()
        for p in self.procs.procs.values():  # dismissed in the last moments, before the watch saw
            self._dismissed(p)
        for task in done:
            exc = task.exception()
            if exc is not None:
                raise exc
        trainer = self.procs.procs["trainer"]
        if trainer.popen is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(trainer.popen.wait, 120)

    def main(self) -> int:
        try:
            self.prepare()
        except (LaunchError, ValueError) as exc:
            code = exc.code if isinstance(exc, LaunchError) else EXIT_BAD_INPUT
            print(f"aurora real: {exc}", file=sys.stderr)
            return code
        print(self.describe(), flush=True)
        if self.run.emulate is not None:
            try:
                self._build_network()
            except Exception as exc:  # EmulationError/EmulationUnavailable: one line, no run
                print(f"aurora real: --emulate: {exc}", file=sys.stderr)
                return EXIT_BAD_INPUT
            if self.metrics_ports and self.net is not None:
                from aurora.observe.targets import write_targets

                write_targets(  # each role's /metrics is in its region's namespace now
                    self, faults=self.run.faults, ports=self.metrics_ports, reach=self._reach
                )
        if self.run.log is not None:
            from aurora.observe.steplog import StepLog

            try:
                self.steplog = StepLog(
                    self.run.log,
                    self.dir,
                    name=self.dir.name,
                    config={"mode": "real", "strategy": self.run.strategy, "seed": self.run.seed},
                )
            except ValueError as exc:
                print(f"aurora real: {exc}", file=sys.stderr)
                return EXIT_BAD_INPUT
        if self.run.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.live_line = tqdm(total=self.job.steps, unit="step", leave=True)
        code = EXIT_OK
        try:
            asyncio.run(self._run())
        except LaunchError as exc:
            print(f"\naurora real: {exc}", file=sys.stderr)
            code = exc.code
        except KeyboardInterrupt:
            print("\naurora real: interrupted; stopping every process", file=sys.stderr)
            code = EXIT_INTERRUPTED
        finally:
            if self.live_line is not None:
                self.live_line.close()
            self.procs.stop_all()
            if self.net is not None:
                # Closed first: the delay lines' own statistics (their lateness) and the
                # kernel's drop and retransmission counters at the end exist only after it.
                self.net.close()
                with contextlib.suppress(Exception):
                    (self.dir / "emulation.json").write_text(
                        json.dumps(self.net.describe(), indent=2, default=str)
                    )
        return self._finish(code)

    def _build_network(self) -> None:
        from aurora.runtime.regime import regime_scale
        from emulation.network import build_network

        assert self.run.emulate is not None  # called under --emulate only

        if not self.job.strategy.shaped:
            print(f"{self.run.strategy}: no WAN to shape (RDMA in the paper); running on loopback")
            return
        self.scale = (
            self.run.scale if self.run.scale is not None else regime_scale(self.topo, self.job)
        )
        print(f"emulated WAN: every link rate x {self.scale:.4g} (RTT and loss as configured)")
        self.net = build_network(
            self.topo, scale=self.scale, backend=self.run.emulate, seed=self.run.seed
        )
        (self.dir / "emulation.json").write_text(
            json.dumps(self.net.describe(), indent=2, default=str)
        )

    def _finish(self, code: int) -> int:
        from aurora.runtime.outputs import write_outputs
        from aurora.runtime.trainer import ledger_config

        if not (self.dir / "ledger.db").exists():
            if self.steplog is not None:
                self.steplog.close()
            return code
        config = {
            "topology": self.topo.name,
            "topology_file": self.run.topology_path,
            "mode": "real",
            "backend": self.run.backend,
            "model": self.job.model if self.run.backend in ("rl", "shapes") else "standin",
            "strategy": self.run.strategy,
            "regime": self.job.regime,
            "actors": len(self.plan.actors),
            "seed": self.run.seed,
            "git_sha": git_sha(),
            "emulated": self.net is not None,
            "link_scale": self.scale,
            "spec": self.job.encode(),
        }
        policy = ledger_config(self.job, str(self.dir / "ledger.db")).policy
        summary = write_outputs(self.dir, config=config, name=self.topo.name, policy=policy)
        summary["exit_code"] = code
        if self.steplog is not None:
            self.steplog.heldout(
                summary["reward_first"], summary["reward_last"], summary["steps_completed"]
            )
            self.steplog.close()
        (self.dir / "summary.json").write_text(
            json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n"
        )
        print(
            f"{summary['steps_completed']} steps, {summary['tokens_per_s']:,.0f} tokens/s, "
            f"prompts lost {summary['prompts_lost']}, hash mismatches "
            f"{summary['actor_hash_mismatches']}, refused {summary['results_refused'] or 0}, "
            f"held-out reward {_fmt(summary['reward_first'])} -> {_fmt(summary['reward_last'])}"
        )
        print(f"results: {self.dir}")
        return code


def _fmt(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)
