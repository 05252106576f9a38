"""aurora status: a live view of a job from its Ledger, as an observer that can only read.

Theory of operation
-------------------
The command connects to the Ledger as an *observer*: the role its identity certifies
(``aurora keys issue --role observer``), not what its hello says. An observer's session takes
two messages, a heartbeat and ``status`` (:mod:`aurora.runtime.messages`); anything else is
dropped, and nothing it sends is logged or decided. Like every role, it first checks the
Ledger's own certificate under the job's public key, for the job its identity names, so a
Ledger that cannot prove it is this job's is never asked. The Ledger answers ``status`` with
:func:`aurora.observe.status.snapshot`. Given a run's folder whose Ledger no longer answers, the
same snapshot is rebuilt from the folder's Ledger log (:func:`run`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aurora.observe.status import render

OBSERVER_ID = "status"
"""The id of the observer identity ``aurora real`` issues in a run's folder."""


def from_folder(run: Path) -> dict[str, Any]:
    """The snapshot of a run from its folder's Ledger log (replayed on a copy)."""
    from aurora.jobspec import JobSpec
    from aurora.observe.status import snapshot
    from aurora.runtime.ledger.service import LedgerService
    from aurora.runtime.trainer import ledger_config
    from aurora.store.ledgerlog import LedgerLog

    db = run / "ledger.db"
    if not db.exists() or not (run / "job.json").exists():
        raise ValueError(f"{run}: not a run folder of aurora real (no ledger.db and job.json)")
    spec = JobSpec.decode(json.loads((run / "job.json").read_text())["spec"])
    with tempfile.TemporaryDirectory(prefix="aurora-status-") as tmp:
        for suffix in ("", "-wal", "-shm"):
            if Path(f"{db}{suffix}").exists():
                shutil.copyfile(f"{db}{suffix}", f"{tmp}/ledger.db{suffix}")
        copy = f"{tmp}/ledger.db"
        log = LedgerLog(copy)
        try:
            end = max((row.now for row in log.events()), default=0.0)
        finally:
            log.close()
        service = LedgerService(
            ledger_config(spec, copy, stats_path=f"{tmp}/stats.json"), clock=lambda: end
        )
        try:
            service.replay()
            summary = run / "summary.json"
            if summary.exists():
                service.metrics.finished(json.loads(summary.read_text()))
            return snapshot(service)
        finally:
            service.log.close()


async def _live(args: argparse.Namespace, show: Any) -> int:
    from aurora.keys import load_identity, load_job_secret, load_public_key
    from aurora.runtime.channel import connect
    from aurora.runtime.messages import Direction

    secret = load_job_secret(args.secret_file)
    job_key = load_public_key(args.public_key)
    host, _, port = args.join.rpartition(":")
    while True:
        # Read at every connection: whoever issued it renews it while the job runs, and the
        # Ledger closes a session whose certificate has expired.
        identity = load_identity(args.identity)
        if identity.role != "observer":
            raise ValueError(
                f"the identity is a {identity.role}'s; aurora status needs an observer's "
                "(aurora keys issue --role observer --id NAME)"
            )
        ch = await connect(
            host or "127.0.0.1",
            int(port) if port.isdigit() else 0,
            secret=secret,
            hello={"id": identity.id, "role": "observer"},
            identity=identity,
            job_key=job_key,
            job=args.job_id,
            unix_path=args.unix_path,
        )
        answered = False
        try:
            while True:
                await ch.send({"op": "status"})
                finished = False
                deadline = time.monotonic() + 10.0
                while True:
                    try:
                        msg = await asyncio.wait_for(
                            ch.recv_checked(Direction.LEDGER_TO_OBSERVER),
                            max(0.0, deadline - time.monotonic()),
                        )
                    except TimeoutError:
                        raise ConnectionError("the Ledger did not answer within 10 s") from None
                    if msg["op"] == "finished":
                        finished = True
                    elif msg["op"] == "status":
                        show(msg["snapshot"])
                        answered = True
                        finished = finished or bool(msg["snapshot"].get("finished"))
                        break
                if not args.watch or finished:
                    return 0
                await asyncio.sleep(args.watch)
        except ConnectionError:
            # A watch whose session had answered connects again (a renewed certificate, a
            # restarted Ledger); one that never got an answer, or a Ledger gone, ends here.
            if not (args.watch and answered):
                raise
        finally:
            ch.close()


def _printer(args: argparse.Namespace) -> Any:
    clear = bool(args.watch) and not args.json and sys.stdout.isatty()

    def show(snap: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(snap, sort_keys=True), flush=True)
            return
        if clear:
            print("\x1b[H\x1b[2J", end="")
        print(render(snap), flush=True)
        if args.watch:
            print()

    return show


def run(args: argparse.Namespace) -> int:
    """``aurora status``. Given a run's folder (``aurora status RUN``) it connects with the
    folder's job secret, public key and the observer identity ``aurora real`` issued there
    (``keys/observer-status.identity``); when no Ledger answers (the run has finished or was
    stopped), the same snapshot is rebuilt from the folder's Ledger log, replayed on a copy.
    ``--watch`` asks again every few seconds until the job finishes; ``--json`` prints the
    snapshot itself, one object per line."""
    from aurora.jobspec import JobSpec
    from aurora.keys import PUBLIC_KEY_FILE, SECRET_FILE
    from aurora.runtime.channel import IdentityRefused

    show = _printer(args)
    try:
        if args.run is not None:
            folder = Path(args.run)
            if not folder.is_dir():
                raise ValueError(f"{folder}: no such run folder")
            ident = folder / "keys" / f"observer-{OBSERVER_ID}.identity"
            job = folder / "job.json"
            sock = folder / "ledger.sock"
            live = ident.exists() and job.exists() and not args.offline
            if live:
                described = json.loads(job.read_text())
                ports = described.get("ports", {})
                args.join = f"127.0.0.1:{ports.get('ledger', 0)}"
                args.secret_file = str(folder / "keys" / SECRET_FILE)
                args.public_key = str(folder / "keys" / PUBLIC_KEY_FILE)
                args.identity = str(ident)
                args.job_id = JobSpec.decode(described["spec"]).job_id
                args.unix_path = str(sock) if sock.exists() else None
                try:
                    return asyncio.run(_live(args, show))
                except IdentityRefused as exc:
                    # Another job's Ledger on the run's old port, or this observer refused.
                    print(f"aurora status: {exc}; reading the run's log", file=sys.stderr)
                except ConnectionError:
                    pass  # no Ledger answers: the run is over, read its log
            show(from_folder(folder))
            return 0
        if not args.join:
            raise ValueError("give a run folder, or --join HOST:PORT with --identity")
        args.unix_path = None
        args.job_id = None  # the job the identity's certificate names
        return asyncio.run(_live(args, show))
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"aurora status: {exc}", file=sys.stderr)
        return 2
    except (ConnectionError, OSError, TimeoutError) as exc:
        print(f"aurora status: {exc}", file=sys.stderr)
        return 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="a live view of a job from its Ledger (read-only), or of a finished run's folder",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "run",
        nargs="?",
        default=None,
        help="a run folder of aurora real (live if its Ledger answers, else from its log)",
    )
    p.add_argument("--join", default=None, help="HOST:PORT of a running job's Ledger")
    p.add_argument(
        "--secret-file",
        default=None,
        help="with --join: file holding the job secret (default: $AURORA_JOB_SECRET)",
    )
    p.add_argument(
        "--public-key",
        default=None,
        help="with --join: the job's public key, which the Ledger's certificate is checked "
        "under (default: $AURORA_JOB_PUBLIC_KEY)",
    )
    p.add_argument(
        "--identity",
        default=None,
        help="with --join: an observer identity from aurora keys issue --role observer "
        "(default: $AURORA_IDENTITY)",
    )
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="S",
        help="ask again every S seconds (default 2) until the job finishes",
    )
    p.add_argument("--json", action="store_true", help="print the snapshot as JSON (one a line)")
    p.add_argument(
        "--offline",
        action="store_true",
        help="with a run folder: read its log even if its Ledger is running",
    )
    p.set_defaults(func=run)
