"""A job's keys: the Trainer's signing key, the job's public key and the job secret, as files.

Theory of operation
-------------------
Three things, made once per job by ``aurora keys new --out DIR``:

* ``trainer.key`` - the Trainer's Ed25519 private key (PEM, PKCS#8), mode 0600. The only thing
  the data plane trusts: it signs every version and snapshot announcement
  (:mod:`aurora.delta.announce`). Only the Trainer holds it.
* ``job.pub`` - the matching public key (PEM, SubjectPublicKeyInfo). Every node gets it (a
  file, an environment variable, or its fingerprint pinned in the topology) and verifies
  announcements against it. It is not secret.
* ``job.secret`` - 32 random bytes as hex, mode 0600: admission control (who may connect to the
  data plane at all; :mod:`aurora.transport.wire`). Every admitted node holds it; integrity never
  depends on it.

And one *identity* per Actor, relay and observer, made by ``aurora keys issue --role ROLE --id
NAME`` with the Trainer's key (``aurora real`` issues them itself for what it launches): a file
(mode 0600) holding the role's own Ed25519 private key and a *certificate*, the job key's
signature over ``(role, id, public key)`` (:func:`certificate_body`). On the control plane a
peer proves its role and id with it (:mod:`aurora.runtime.channel`): the id is bound to that key,
not to what a HELLO says. The Trainer's identity is the job key itself (no certificate).

Loaders take a file path or, when none is given, an environment variable holding the key
itself (PEM text, or hex of the raw bytes) - never a command-line argument, which any user of
the host can read in the process table. Every failure is a :class:`KeyFileError` whose message
names the file or variable and says what is wrong, in one line.

Ed25519 comes from ``cryptography`` (OpenSSL), the same library that verifies.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
    load_pem_private_key,
    load_pem_public_key,
)

from aurora.delta.announce import public_key_of, sign_bytes, verify_bytes
from aurora.delta.hashing import H

log = logging.getLogger("aurora.keys")

SIGNING_KEY_FILE = "trainer.key"
PUBLIC_KEY_FILE = "job.pub"
SECRET_FILE = "job.secret"
ENV_SIGNING_KEY = "AURORA_TRAINER_KEY"
"""Environment variable that may hold the Trainer's private key (PEM text or 64 hex chars)."""
ENV_PUBLIC_KEY = "AURORA_JOB_PUBLIC_KEY"
"""Environment variable that may hold the job's public key (PEM text or 64 hex chars)."""
ENV_SECRET = "AURORA_JOB_SECRET"
"""Environment variable that may hold the job secret (hex, at least 32 characters)."""
ENV_IDENTITY = "AURORA_IDENTITY"
"""Environment variable that may hold a role's identity (the JSON of an identity file)."""
SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
ROLES = ("trainer", "actor", "relay", "observer")
"""Control-plane roles (``docs/TRANSPORT.md``, "The control plane": what each is trusted for)."""
CERT_LABEL = b"aurora role certificate v1"
"""Domain separation of a certificate's signed bytes (never an announcement's or a handshake's)."""


class KeyFileError(ValueError):
    """A key that cannot be used; the message names the file or variable and the reason."""


@dataclass(frozen=True)
class JobKeyFiles:
    """Where ``new_job_keys`` wrote the job's keys."""

    signing_key: Path
    public_key: Path
    secret: Path
    fingerprint: str


def fingerprint(public_key: bytes) -> str:
    """A short, printable name of a public key (``ed25519:`` and 16 hex characters) to pin in a
    topology file or compare by eye."""
    return "ed25519:" + H(b"aurora-job-key", public_key).hex()[:16]


def _write_new(path: Path, data: bytes, mode: int, force: bool) -> None:
    # O_NOFOLLOW: with --force, a symbolic link planted where a key goes would otherwise be
    # followed and the private key written (and the target truncated) wherever it points.
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:
        raise KeyFileError(
            f"{path}: exists already (keys are never overwritten; --force)"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise KeyFileError(
                f"{path}: is a symbolic link; refused (a key is never written through a link)"
            ) from None
        raise KeyFileError(f"{path}: cannot write ({exc.strerror})") from None
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # also when the file existed (force) with a wider mode
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def new_job_keys(out: str | os.PathLike[str], *, force: bool = False) -> JobKeyFiles:
    """Generate a signing key pair and a job secret and write them under ``out`` (the private
    files with mode 0600). Refuses to overwrite existing files unless ``force``."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KeyFileError(f"{out}: cannot create the directory ({exc.strerror})") from None
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    public = private.public_key()
    pub_pem = public.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    files = JobKeyFiles(
        out / SIGNING_KEY_FILE,
        out / PUBLIC_KEY_FILE,
        out / SECRET_FILE,
        fingerprint(public.public_bytes(Encoding.Raw, PublicFormat.Raw)),
    )
    if not force:
        taken = [str(p) for p in (files.signing_key, files.public_key, files.secret) if p.exists()]
        if taken:
            raise KeyFileError(f"{taken[0]}: exists already (keys are never overwritten; --force)")
    _write_new(files.signing_key, pem, 0o600, force)
    _write_new(files.public_key, pub_pem, 0o644, force)
    _write_new(files.secret, secrets.token_hex(SECRET_BYTES).encode() + b"\n", 0o600, force)
    return files


def _read(path: str | os.PathLike[str] | None, env: str, what: str) -> tuple[bytes, str]:
    """(content, where) of a key given as a file path or, without one, in ``env``."""
    if path is not None:
        p = Path(path)
        try:
            data = p.read_bytes()
            mode = p.stat().st_mode
        except FileNotFoundError:
            raise KeyFileError(f"{p}: no such file ({what})") from None
        except IsADirectoryError:
            raise KeyFileError(f"{p}: is a directory, not a {what} file") from None
        except OSError as exc:
            raise KeyFileError(f"{p}: cannot read the {what} ({exc.strerror})") from None
        if what != "public key" and mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("%s: the %s is readable by others (mode %o); chmod 600", p, what, mode)
        return data, str(p)
    value = os.environ.get(env)
    if value is None or not value.strip():
        raise KeyFileError(f"no {what}: give its file, or set the environment variable {env}")
    return value.encode(), f"${env}"


def _raw_or_pem(data: bytes, where: str, what: str) -> bytes | None:
    text = data.strip()
    if text.startswith(b"-----BEGIN"):
        return None
    try:
        raw = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise KeyFileError(f"{where}: not a {what} (PEM, or 64 hex characters)") from None
    if len(raw) != 32:
        raise KeyFileError(f"{where}: a raw {what} is 32 bytes (64 hex characters), not {len(raw)}")
    return raw


def load_signing_key(
    path: str | os.PathLike[str] | None = None, *, env: str = ENV_SIGNING_KEY
) -> bytes:
    """The Trainer's raw 32-byte Ed25519 private key, from ``path`` or ``$env``."""
    data, where = _read(path, env, "Trainer signing key")
    raw = _raw_or_pem(data, where, "Ed25519 private key")
    if raw is not None:
        return raw
    try:
        key = load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        reason = str(exc).split("\n")[0] or type(exc).__name__
        raise KeyFileError(
            f"{where}: not a readable unencrypted PEM private key ({reason})"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{where}: a {type(key).__name__}, not an Ed25519 private key")
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def load_public_key(
    path: str | os.PathLike[str] | None = None, *, env: str = ENV_PUBLIC_KEY
) -> bytes:
    """The job's raw 32-byte Ed25519 public key, from ``path`` or ``$env``."""
    data, where = _read(path, env, "public key")
    raw = _raw_or_pem(data, where, "Ed25519 public key")
    if raw is not None:
        return raw
    try:
        key = load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        reason = str(exc).split("\n")[0] or type(exc).__name__
        raise KeyFileError(f"{where}: not a readable PEM public key ({reason})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{where}: a {type(key).__name__}, not an Ed25519 public key")
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def load_job_secret(path: str | os.PathLike[str] | None = None, *, env: str = ENV_SECRET) -> bytes:
    """The job secret (admission control), from ``path`` or ``$env``: hex text."""
    data, where = _read(path, env, "job secret")
    try:
        secret = bytes.fromhex(data.strip().decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise KeyFileError(f"{where}: the job secret must be hex text") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise KeyFileError(
            f"{where}: the job secret is {len(secret)} bytes, at least {MIN_SECRET_BYTES} needed"
        )
    return secret


# -- role identities ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """Who a control-plane peer is: its ``role``, its ``id``, its raw Ed25519 private key and
    the job key's ``cert`` over them (None for the Trainer, whose key is the job key)."""

    role: str
    id: str
    private_key: bytes
    cert: bytes | None

    @property
    def public_key(self) -> bytes:
        return public_key_of(self.private_key)


def certificate_body(role: str, peer: str, public_key: bytes) -> bytes:
    """The bytes the job key signs to certify that ``public_key`` speaks as ``peer`` in
    ``role`` (length-prefixed fields, so no two triples give the same bytes)."""
    parts = (CERT_LABEL, role.encode(), peer.encode(), public_key)
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


def issue_identity(role: str, peer: str, signing_key: bytes) -> Identity:
    """A fresh key pair for ``peer`` in ``role``, certified with the job's ``signing_key``."""
    if role not in ROLES or role == "trainer":
        raise KeyFileError(f"cannot issue an identity for role {role!r} (actor, relay, observer)")
    if not peer or len(peer) > 128 or not peer.isprintable() or peer == "trainer":
        raise KeyFileError(f"bad id {peer[:40]!r}: 1-128 printable characters, not 'trainer'")
    private = Ed25519PrivateKey.generate().private_bytes(
        Encoding.Raw, PrivateFormat.Raw, NoEncryption()
    )
    cert = sign_bytes(certificate_body(role, peer, public_key_of(private)), signing_key)
    return Identity(role=role, id=peer, private_key=private, cert=cert)


def trainer_identity(signing_key: bytes) -> Identity:
    """The Trainer speaks with the job key itself."""
    return Identity(role="trainer", id="trainer", private_key=signing_key, cert=None)


def check_identity(
    role: str, peer: str, public_key: bytes, cert: bytes | None, job_key: bytes
) -> str | None:
    """Why ``public_key`` may not speak as ``peer`` in ``role`` under the job key ``job_key``
    (one line), or None when it may: the Trainer's key is the job key, any other role's key
    carries the job key's certificate for exactly that role and id."""
    if role not in ROLES:
        return f"unknown role {role[:40]!r}"
    if role == "trainer":
        return None if public_key == job_key else "the trainer role needs the job's key"
    if peer == "trainer":
        return "the id 'trainer' is the Trainer's"
    if cert is None or not verify_bytes(certificate_body(role, peer, public_key), cert, job_key):
        return f"no certificate of the job key for {role} {peer[:40]!r} and this key"
    return None


def write_identity(path: str | os.PathLike[str], ident: Identity, *, force: bool = False) -> None:
    """Write ``ident`` as an identity file (JSON, mode 0600, never through a link)."""
    body = {"role": ident.role, "id": ident.id, "key": ident.private_key.hex()}
    if ident.cert is not None:
        body["cert"] = ident.cert.hex()
    _write_new(Path(path), json.dumps(body).encode() + b"\n", 0o600, force)


def load_identity(
    path: str | os.PathLike[str] | None = None, *, env: str = ENV_IDENTITY
) -> Identity:
    """A role's identity from its file (``aurora keys issue``) or ``$env``."""
    data, where = _read(path, env, "identity")
    try:
        body = json.loads(data)
        ident = Identity(
            role=str(body["role"]),
            id=str(body["id"]),
            private_key=bytes.fromhex(body["key"]),
            cert=bytes.fromhex(body["cert"]) if body.get("cert") else None,
        )
        if len(ident.private_key) != 32:
            raise ValueError("the key is not 32 bytes")
    except (ValueError, KeyError, TypeError) as exc:
        raise KeyFileError(f"{where}: not an identity file of aurora keys issue ({exc})") from None
    return ident


# -- `aurora keys` -------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``aurora keys new --out DIR`` to the ``aurora`` command."""
    keys = subparsers.add_parser(
        "keys",
        help="the job's signing key, public key and secret; role identities",
        description="Make a job's keys (the Trainer's signing key, the job's public key and "
        "secret) and the identities relays, Actors and observers join with.",
    )
    sub = keys.add_subparsers(dest="keys_cmd", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "new",
        help=f"write {SIGNING_KEY_FILE} (0600), {PUBLIC_KEY_FILE} and {SECRET_FILE} (0600)",
        description=f"Write a new job's keys into a directory: {SIGNING_KEY_FILE} (the "
        f"Trainer's Ed25519 signing key, mode 0600), {PUBLIC_KEY_FILE} (every node) and "
        f"{SECRET_FILE} (every admitted node, mode 0600).",
    )
    p.add_argument("--out", required=True, help="directory for the three files")
    p.add_argument("--force", action="store_true", help="overwrite existing key files")
    p.set_defaults(func=run)
    p = sub.add_parser(
        "issue",
        help="an Actor's, relay's or observer's identity, certified by the job key",
        description="Write an identity for one relay, Actor or observer: a key pair of its own "
        "and the job key's certificate over its role and id. The Ledger admits that id only "
        "from the holder of this file.",
    )
    p.add_argument(
        "--role", required=True, choices=["actor", "relay", "observer"], help="the role it joins as"
    )
    p.add_argument("--id", required=True, help="the id it joins under")
    p.add_argument("--out", required=True, help="identity file to write (mode 0600)")
    p.add_argument(
        "--signing-key", default=None, help=f"the Trainer's key (default: ${ENV_SIGNING_KEY})"
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.set_defaults(func=run_issue)


def run_issue(args: argparse.Namespace) -> int:
    try:
        ident = issue_identity(args.role, args.id, load_signing_key(args.signing_key))
        write_identity(args.out, ident, force=args.force)
    except KeyFileError as exc:
        raise SystemExit(f"aurora keys issue: {exc}") from None
    print(f"identity     {args.out}  ({args.role} {args.id}; mode 0600; --identity of that role)")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        files = new_job_keys(args.out, force=args.force)
    except KeyFileError as exc:
        raise SystemExit(f"aurora keys new: {exc}") from None
    print(f"signing key  {files.signing_key}  (the Trainer only; mode 0600)")
    print(f"public key   {files.public_key}  (every node; fingerprint {files.fingerprint})")
    print(f"job secret   {files.secret}  (every admitted node; mode 0600)")
    return 0


if __name__ == "__main__":
    import sys

    parser = argparse.ArgumentParser(prog="python -m aurora.keys")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args()
    sys.exit(ns.func(ns))
