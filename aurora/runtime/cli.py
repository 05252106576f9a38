"""The role subcommands: ``aurora trainer``, ``ledger``, ``relay``, ``actor``, ``real``.

Each role is its own process so that a deployment starts them on different hosts; ``aurora
real`` starts them all on one. Keys come from files (``--secret-file``, ``--public-key``,
``--signing-key``, made by ``aurora keys new``) or environment variables (``AURORA_JOB_SECRET``,
``AURORA_JOB_PUBLIC_KEY``, ``AURORA_TRAINER_KEY``), never from the command line. A role that
cannot start prints one line naming what is wrong and exits with 2 (bad input) or 1 (a failure
at run time); one the job's Ledger refuses because the job excluded or revoked its id exits with
4 (:class:`aurora.runtime.channel.Dismissed`): the job working, not a failure of the role.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aurora.faults import EXAMPLES as FAULT_EXAMPLES

if TYPE_CHECKING:  # pragma: no cover - typing only
    from aurora.jobspec import JobSpec


def _addr(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{flag} {text!r}: expected HOST:PORT")
    return host, int(port)


def _logging(role: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _run_role(role: str, make: Any) -> int:
    """Run a role's coroutine; one line and an exit code for whatever stops it."""
    from aurora.runtime.channel import Dismissed

    _logging(role)
    try:
        return int(asyncio.run(make()))
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:  # KeyFileError is a ValueError
        print(f"aurora {role}: {exc}", file=sys.stderr)
        return 2
    except Dismissed as exc:
        print(f"aurora {role}: {exc}", file=sys.stderr)
        return Dismissed.EXIT_CODE
    except (ConnectionError, OSError, RuntimeError) as exc:
        print(f"aurora {role}: {exc}", file=sys.stderr)
        return 1


def _secret(args: argparse.Namespace) -> bytes:
    from aurora.keys import load_job_secret

    return load_job_secret(args.secret_file)


def _public_key(args: argparse.Namespace) -> bytes:
    from aurora.keys import load_public_key

    return load_public_key(args.public_key)


def _identity(args: argparse.Namespace, role: str) -> Any:
    """The role's identity (``--identity`` or ``$AURORA_IDENTITY``), checked to be this role's
    and this id's, so a wrong file is one line here rather than a refusal at the Ledger. It is
    an :class:`~aurora.keys.IdentityFile`: read again at each connection once the file changes
    (a renewal needs no restart)."""
    import time

    from aurora.keys import CLOCK_SKEW_S, IdentityFile

    source = IdentityFile(args.identity)
    ident = source.identity
    if ident.role != role or ident.id != args.id:
        raise ValueError(
            f"the identity is for {ident.role} {ident.id!r}, not {role} {args.id!r} "
            f"(aurora keys issue --role {role} --id {args.id})"
        )
    if ident.expires is not None and ident.expires + CLOCK_SKEW_S < time.time():
        raise ValueError(
            f"the identity of {role} {args.id!r} has expired "
            f"({time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(ident.expires))}): renew it "
            "with aurora keys issue"
        )
    return source


def _load_job(args: argparse.Namespace, *, keep: bool = False) -> JobSpec:
    """The job spec from ``--job``, or made from ``--topology``. With ``keep`` (the Trainer) a
    spec made from the topology is written to ``RUN_DIR/job.json`` and read back on a restart:
    the job id carries a random nonce, so deriving it again would name another job."""
    from aurora.jobspec import JobSpec
    from aurora.runtime.job import make_spec

    kept = Path(args.run_dir) / "job.json" if keep and not args.job else None
    if kept is not None and kept.exists():
        args.job = str(kept)
    if args.job:
        try:
            return JobSpec.decode(json.loads(Path(args.job).read_text())["spec"])
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"--job {args.job}: cannot read a job spec ({exc})") from None
    if not args.topology:
        raise ValueError("give --job FILE (written by aurora real) or --topology FILE")
    from aurora.topology import load_topology

    topo = load_topology(args.topology)
    store = args.store or str(Path(args.run_dir) / "store")
    # Where the job's Actors come from follows from where its Trainer and Ledger listen and
    # are advertised (aurora.runtime.job.resolve_actors), unless --actors says.
    listen = [
        h for h in (getattr(args, "host", None), getattr(args, "advertise", None)) if h is not None
    ]
    if getattr(args, "ledger", None):
        listen.append(args.ledger.rpartition(":")[0])
    actors = getattr(args, "actors", None)
    spec = make_spec(
        topo,
        strategy=args.strategy,
        seed=args.seed,
        steps=args.steps,
        store=store,
        backend=backend_for(topo, args.backend),
        extra={"actors": actors} if actors else None,
        listen=listen or None,
    )
    if kept is not None:
        from aurora.store.files import write_atomic

        kept.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(str(kept), [json.dumps({"spec": spec.encode()}).encode()])
    return spec


def backend_for(topology: Any, asked: str) -> str:
    """``shapes`` when the topology's ``real.model`` is one of its models, else ``asked``."""
    from aurora.runtime.shapes import MODELS

    return "shapes" if topology.real.model in MODELS else asked


# -- trainer ------------------------------------------------------------------------------------


def _trainer(args: argparse.Namespace) -> int:
    async def main() -> int:
        from aurora.keys import load_signing_key
        from aurora.runtime.trainer import TrainerProcess, TrainerRun

        run = TrainerRun(
            spec=_load_job(args, keep=True),
            run_dir=args.run_dir,
            secret=_secret(args),
            signing_key=load_signing_key(args.signing_key),
            public_key=_public_key(args),
            host=args.host,
            advertise=args.advertise,
            data_port=args.data_port,
            ledger=_addr(args.ledger, "--ledger") if args.ledger else None,
            ledger_port=args.ledger_port,
            ports_file=args.ports_file,
            revocations=args.revocations,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
        )
        return await TrainerProcess(run).main()

    return _run_role("trainer", main)


def _job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", help="job spec JSON written by aurora real (instead of --topology)")
    p.add_argument("--topology", help="topology YAML (its real: section)")
    p.add_argument("--strategy", default="aurora", help="transfer strategy (default aurora)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the job: prompts, sampling (default 0)"
    )
    p.add_argument("--steps", type=int, default=None, help="training steps (default real.steps)")
    p.add_argument(
        "--actors",
        choices=["local", "remote"],
        default=None,
        help="where the job's Actors come from (default: remote when --host, --advertise or "
        "--ledger is an address other hosts reach); remote turns verification on unless the "
        "topology's real.verify is false",
    )
    p.add_argument("--store", default=None, help="Checkpoint Store URL (default RUN_DIR/store)")
    p.add_argument(
        "--backend",
        default="rl",
        choices=["rl", "standin", "shapes"],
        help="compute: rl (real models, default), standin (load and fault tests) or shapes "
        "(a published model's tensors, synthetic steps)",
    )


def _metrics_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off; "
        "docs/OBSERVABILITY.md)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address /metrics listens on (default 127.0.0.1: this host only)",
    )


def _identity_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--identity",
        default=None,
        help="its identity file from aurora keys issue (default: $AURORA_IDENTITY)",
    )


def _secret_arg(p: argparse.ArgumentParser, *, public_key: bool = True) -> None:
    p.add_argument(
        "--secret-file",
        default=None,
        help="file holding the job secret (default: the value of $AURORA_JOB_SECRET)",
    )
    if public_key:
        p.add_argument(
            "--public-key",
            default=None,
            help="file holding the job's public key (default: $AURORA_JOB_PUBLIC_KEY)",
        )


# -- ledger -------------------------------------------------------------------------------------


def _ledger(args: argparse.Namespace) -> int:
    async def main() -> int:
        from aurora.keys import IdentityFile
        from aurora.runtime.job import unverified_warning
        from aurora.runtime.ledger.config import channel_limits
        from aurora.runtime.ledger.service import LedgerService
        from aurora.runtime.trainer import ledger_config

        spec = _load_job(args)
        identity = IdentityFile(args.identity)
        mine = identity.identity
        if mine.role != "ledger":
            raise ValueError(
                f"the identity is for {mine.role} {mine.id!r}, not a Ledger's "
                "(aurora keys issue --role ledger --id ledger)"
            )
        if args.job and mine.job != spec.job_id:
            raise ValueError(
                f"the identity is for job {mine.job!r}, --job {args.job} is {spec.job_id!r}"
            )
        warning = unverified_warning(spec)
        if warning is not None:
            logging.getLogger("aurora.runtime.ledger").warning("ledger: %s", warning)
        service = LedgerService(ledger_config(spec, args.db), public_key=_public_key(args))
        service.replay()
        port = await service.start(
            args.host,
            args.port,
            secret=_secret(args),
            identity=identity,
            unix_path=str(Path(args.db).with_suffix(".sock")),
            limits=channel_limits(spec),
        )
        logging.getLogger("aurora.runtime.ledger").info(
            "ledger: serving on %s:%d (log %s)", args.host, port, args.db
        )
        if args.metrics_port is not None:  # docs/OBSERVABILITY.md
            from aurora.observe.exporter import serve as observe_serve

            await observe_serve([service.metrics], args.metrics_host, args.metrics_port)
        try:
            await service.done.wait()
            await asyncio.sleep(0.5)
        finally:
            await service.close()
        return 0

    return _run_role("ledger", main)


# -- relay --------------------------------------------------------------------------------------


def _relay(args: argparse.Namespace) -> int:
    async def main() -> int:
        from aurora.runtime.relay import RelayProcess, RelayRun

        run = RelayRun(
            id=args.id,
            region=args.region,
            ledger=_addr(args.join, "--join"),
            secret=_secret(args),
            public_key=_public_key(args),
            identity=_identity(args, "relay"),
            host=args.host,
            advertise=args.advertise,
            port=args.port,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
        )
        return await RelayProcess(run).main()

    return _run_role("relay", main)


# -- actor --------------------------------------------------------------------------------------


def _actor(args: argparse.Namespace) -> int:
    async def main() -> int:
        from aurora.runtime.actor import ActorProcess, ActorRun

        run = ActorRun(
            id=args.id,
            region=args.region,
            ledger=_addr(args.join, "--join"),
            secret=_secret(args),
            public_key=_public_key(args),
            identity=_identity(args, "actor"),
            host=args.host,
            advertise=args.advertise,
            engine=args.engine,
            engine_url=args.engine_url,
            notice_s=args.notice_s,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
        )
        return await ActorProcess(run).main()

    return _run_role("actor", main)


# -- real ---------------------------------------------------------------------------------------


def _real(args: argparse.Namespace) -> int:
    if not args.topology and not args.cleanup:
        print("aurora real: --topology is required (or --emulate --cleanup)", file=sys.stderr)
        return 2
    from aurora.faults import parse_fault
    from aurora.runtime.launcher import Launcher, RealRun
    from aurora.topology import load_topology

    if args.cleanup:
        from emulation.cleanup import cleanup_leftovers

        try:
            removed = cleanup_leftovers()
        except PermissionError as exc:
            print(f"aurora real: --cleanup: {exc}", file=sys.stderr)
            return 1
        print(f"removed {len(removed)} emulated network(s) left by killed runs")
        return 0
    try:
        topology = load_topology(args.topology)
        faults = tuple(parse_fault(f) for f in args.fault)
        extra = json.loads(args.extra) if args.extra else {}
        run = RealRun(
            topology=topology,
            topology_path=args.topology,
            strategy=args.strategy,
            steps=args.steps,
            seed=args.seed,
            out=args.out,
            faults=faults,
            spot_hazard=args.spot_hazard,
            spot_notice_s=args.spot_notice,
            spot_return_s=args.spot_return,
            actors=args.actors,
            backend=backend_for(topology, args.backend),
            extra=extra,
            progress=not args.quiet,
            emulate=args.emulate,
            scale=args.scale,
            metrics=args.metrics,
            metrics_host=args.metrics_host,
            log=args.log,
        )
        from aurora.runtime.job import strategy_spec

        strategy_spec(args.strategy)
    except ValueError as exc:
        print(f"aurora real: {exc}", file=sys.stderr)
        return 2
    return Launcher(run).main()


def add_parsers(sub: Any) -> None:
    """Add every role subcommand to ``aurora``'s subparsers."""
    add_export_parser(sub)
    p = sub.add_parser(
        "real",
        help="run a topology on real processes on this host",
        description="Run a topology's deployment as real processes on this host: a Trainer "
        "with its Job Ledger, a relay per remote region and the Actors, over loopback (or an "
        "emulated WAN with --emulate), with real models. Needs the torch extra: "
        "pip install -e '.[torch]'. Writes results/real/NAME-STRATEGY-sSEED/.",
    )
    p.add_argument("--topology", help="topology YAML (examples/geo.yaml)")
    p.add_argument(
        "--strategy",
        default="aurora",
        help="aurora, prime-full, prime-async2, prime-async4, ideal-singledc or aurora-norelay",
    )
    p.add_argument("--steps", type=int, default=None, help="training steps (default real.steps)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the job: prompts, sampling (default 0)"
    )
    p.add_argument("--out", default="results/real", help="output folder (default results/real)")
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        help="membership or network event, repeatable: " + ", ".join(FAULT_EXAMPLES),
    )
    p.add_argument("--spot-hazard", type=float, default=0.0, help="preemptions/hour/spot Actor")
    p.add_argument(
        "--spot-notice",
        type=float,
        default=30.0,
        help="notice of each hazard preemption (s; 0: none, SIGKILL at once)",
    )
    p.add_argument(
        "--spot-return", type=float, default=None, help="a preempted spot Actor returns after S s"
    )
    p.add_argument("--actors", type=int, default=None, help="Actors to start (default real.actors)")
    p.add_argument(
        "--backend",
        default="rl",
        choices=["rl", "standin", "shapes"],
        help="compute: rl (real models), standin (labelled stand-in for load/fault tests) or "
        "shapes (a published model's tensors, synthetic steps; implied by real.model "
        "qwen3-*-shapes)",
    )
    p.add_argument(
        "--emulate",
        nargs="?",
        const="auto",
        default=None,
        choices=["auto", "netns", "mininet"],
        help="run over an emulated WAN (root): regions as network namespaces behind a shaping "
        "router (docs/EMULATION.md)",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=None,
        help="multiply every emulated link rate (default: the paper's transfer regime for this "
        "model, printed)",
    )
    p.add_argument(
        "--cleanup",
        action="store_true",
        help="with --emulate: remove the namespaces, rules and processes a killed run left, exit",
    )
    p.add_argument(
        "--extra",
        default=None,
        metavar="JSON",
        help="job spec fields to override, as JSON (e.g. '{\"verify\": true}')",
    )
    p.add_argument("--quiet", action="store_true", help="no live line")
    p.add_argument(
        "--metrics",
        action="store_true",
        help="every role serves Prometheus /metrics on a free port; the targets are written to "
        "RUN/prometheus/targets.json for Prometheus's file_sd (docs/OBSERVABILITY.md)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="with --metrics: the address every /metrics listens on (default 127.0.0.1)",
    )
    p.add_argument(
        "--log",
        choices=["tensorboard", "wandb"],
        default=None,
        help="write each step's series to TensorBoard event files (RUN/tb) or to W&B in offline "
        "mode, under the same tags as aurora sim --log (docs/OBSERVABILITY.md)",
    )
    p.set_defaults(func=_real)
    from aurora.runtime.status import add_parser as add_status_parser

    add_status_parser(sub)

    p = sub.add_parser(
        "trainer",
        help="run the Trainer (and by default the Ledger)",
        description="Run the Trainer of a job on this host: GRPO on each admitted batch, "
        "publishing each version as a signed delta checkpoint; by default it hosts the Job "
        "Ledger too. Relays and Actors on other hosts join it with --join. Needs the torch "
        "extra for real models.",
    )
    _job_args(p)
    p.add_argument("--run-dir", required=True, help="folder for the Trainer's state and logs")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--advertise", default=None, help="address others reach it at (default --host)")
    p.add_argument("--data-port", type=int, default=0, help="data-plane port (0: any)")
    p.add_argument("--ledger-port", type=int, default=0, help="in-process Ledger port (0: any)")
    p.add_argument("--ledger", default=None, help="HOST:PORT of a standalone aurora ledger")
    p.add_argument("--ports-file", default=None, help="write the bound ports here (JSON)")
    _secret_arg(p)
    p.add_argument(
        "--signing-key",
        default=None,
        help="file holding the Trainer's signing key (default: $AURORA_TRAINER_KEY)",
    )
    p.add_argument(
        "--revocations",
        default=None,
        help="the job's revocation list (aurora keys revoke), watched while the job runs "
        "(default: RUN_DIR/revoked.json)",
    )
    _metrics_args(p)
    p.set_defaults(func=_trainer)

    p = sub.add_parser(
        "ledger",
        help="run a standalone Job Ledger (durable, SQLite)",
        description="Run the Job Ledger as its own process: it leases prompts, commits versions "
        "and admits results through the policy core, logging every event to SQLite and "
        "replaying the log on restart. Point the Trainer at it with --ledger HOST:PORT.",
    )
    _job_args(p)
    p.add_argument("--run-dir", default=".", help="folder for the default store")
    p.add_argument("--db", required=True, help="SQLite log (replayed if it exists)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="control port to listen on (0: any)")
    _secret_arg(p)
    p.add_argument(
        "--identity",
        default=None,
        help="the Ledger's identity (aurora keys issue --role ledger --id ledger: every role "
        "checks it; default: $AURORA_IDENTITY)",
    )
    _metrics_args(p)
    p.set_defaults(func=_ledger)

    p = sub.add_parser(
        "relay",
        help="run a region's relay",
        description="Run a region's relay: it receives each delta checkpoint once over the WAN "
        "and forwards its segments cut-through to the region's Actors. Joins a running job "
        "through its Ledger.",
    )
    p.add_argument("--join", required=True, help="HOST:PORT of the Ledger")
    p.add_argument("--id", required=True, help="relay id")
    p.add_argument("--region", required=True, help="region it serves")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="data-plane port (0: any)")
    p.add_argument("--advertise", default=None, help="address others reach it at (default --host)")
    _secret_arg(p)
    _identity_arg(p)
    _metrics_args(p)
    p.set_defaults(func=_relay)

    p = sub.add_parser(
        "actor",
        help="run an Actor that joins a running job",
        description="Run an Actor that joins a running job through its Ledger: it generates "
        "rollouts for its leases, stages the next delta while it generates, and activates it "
        "at the end of a batch. Needs the torch extra (or a vLLM server: --engine-url).",
    )
    p.add_argument("--join", required=True, help="HOST:PORT of the Ledger")
    p.add_argument("--id", required=True, help="Actor id (a returning Actor reuses its id)")
    p.add_argument("--region", required=True, help="region it runs in")
    p.add_argument("--host", default="127.0.0.1", help="address its data-plane node listens on")
    p.add_argument("--engine", default=None, help="engine override (transformers, vllm, standin)")
    p.add_argument(
        "--engine-url",
        default=None,
        help="drive a running `vllm serve` at this URL as the engine (docs/VLLM.md)",
    )
    p.add_argument("--advertise", default=None, help="address others reach it at (default --host)")
    p.add_argument("--notice-s", type=float, default=30.0, help="drain time on SIGTERM (s)")
    _secret_arg(p)
    _identity_arg(p)
    _metrics_args(p)
    p.set_defaults(func=_actor)


# -- export -------------------------------------------------------------------------------------


def _export(args: argparse.Namespace) -> int:
    """Rebuild version V from the store's snapshot + delta chain, every piece verified against
    the Trainer's signature, and write it as a Hugging Face model directory whose config,
    tokenizer and chat template are the job model's files the Trainer signed with that
    snapshot (refused, naming the file, otherwise)."""
    from aurora.delta import apply_chain
    from aurora.keys import load_public_key
    from aurora.policy.versions import plan_catch_up
    from aurora.store import CheckpointStore

    _logging("export")
    try:
        spec = _load_job(args)
        key = load_public_key(args.public_key)
        store = CheckpointStore(args.store or spec.store, job=spec.job_id, public_key=key)
        deltas, snaps = store.sizes()
        if args.version not in deltas and args.version not in snaps:
            raise ValueError(f"--version {args.version}: not in the store {store.url}")
        plan = plan_catch_up(None, args.version, deltas, snaps)
        assert plan.snapshot is not None
        state, snap = store.verified_snapshot(plan.snapshot)
        chain = [store.verified_delta(v)[0] for v in plan.deltas]
        h = apply_chain(chain, state, active_version=plan.snapshot, active_hash=snap.chain_hash)
        want = store.verified_delta(args.version)[1].weights_hash if plan.deltas else h
        if h != want:
            raise ValueError(f"v{args.version} rebuilt to h={h[:16]}.., signed h={want[:16]}..")
        signed = store.verified_manifest(plan.snapshot)
        from aurora.runtime.rlbackend import export_state

        export_state(spec, state, args.out, signed=signed)
    except (ValueError, KeyError, OSError) as exc:
        print(f"aurora export: {exc}", file=sys.stderr)
        return 2
    print(
        f"v{args.version}: snapshot v{plan.snapshot} + {len(plan.deltas)} deltas, h(v) {h[:16]}.. "
        f"and {len(signed)} model files (signed), written to {args.out}"
    )
    return 0


def _check_model(args: argparse.Namespace) -> int:
    """Check a model directory the Trainer wrote and signed (a run's ``model/``) against the
    job's key: every file as signed, or one line naming the first that is not."""
    from aurora.keys import load_public_key
    from aurora.models import verify_model_dir

    _logging("check-model")
    try:
        spec = _load_job(args)
        ann = verify_model_dir(
            args.dir, public_key=load_public_key(args.public_key), job=spec.job_id
        )
    except (ValueError, KeyError, OSError) as exc:
        print(f"aurora check-model: {exc}", file=sys.stderr)
        return 2
    print(
        f"{args.dir}: v{ann.version} of job {ann.job}, h(v) {ann.chain_hash[:16]}.., weights "
        f"{ann.weights_hash[:16]}.. and every other file (signed)"
    )
    return 0


def add_export_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="rebuild a version from the store (verified) as a Hugging Face model",
        description="Rebuild policy version V from the Checkpoint Store (a snapshot plus the "
        "delta chain, every piece verified against the Trainer's signature) and write it as a "
        "Hugging Face model directory. Needs the torch extra.",
    )
    p.add_argument("--job", required=True, help="the run's job.json (model, store, job id)")
    p.add_argument("--store", default=None, help="Checkpoint Store URL (default: the job's)")
    p.add_argument("--version", type=int, required=True, help="version to rebuild")
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    p.add_argument(
        "--public-key", default=None, help="the job's public key (default: $AURORA_JOB_PUBLIC_KEY)"
    )
    p.set_defaults(func=_export, topology=None)

    p = sub.add_parser(
        "check-model",
        help="check a run's model/ directory against the Trainer's signature",
        description="Check every file of a run's model/ directory (weights, config, tokenizer "
        "files, chat template) against the record the Trainer signed; one line names the first "
        "file that differs.",
    )
    p.add_argument("dir", help="the model directory (a run's model/)")
    p.add_argument("--job", required=True, help="the run's job.json (its job id)")
    p.add_argument(
        "--public-key", default=None, help="the job's public key (default: $AURORA_JOB_PUBLIC_KEY)"
    )
    p.set_defaults(func=_check_model, topology=None)
