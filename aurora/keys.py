"""A job's keys: the Trainer's signing key, the job's public key and the job secret, as files.

``aurora keys new --out DIR`` makes three things once per job (:func:`new_job_keys`):
``trainer.key``, the Trainer's Ed25519 private key, the only thing the data plane trusts (it
signs every announcement, :mod:`aurora.delta.announce`); ``job.pub``, the matching public key
every node verifies against (not secret); ``job.secret``, 32 random bytes for admission control
only (:mod:`aurora.transport.wire`): integrity never depends on it. Every Actor, relay, observer
and standalone Ledger also gets an *identity* (:class:`Identity`): its own Ed25519 key and a
:class:`Certificate` the job key signs, with which it proves its role and id on the control
plane (:mod:`aurora.runtime.channel`); the job key can revoke ids (:class:`Revocations`).
Loaders take a file path or an environment variable holding the key itself, never a
command-line argument (which any user of the host can read in the process table); every failure
is a :class:`KeyFileError` naming the file or variable in one line. Ed25519 comes from
``cryptography`` (OpenSSL), the same library that verifies.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
ROLES = ("trainer", "actor", "relay", "observer", "ledger")
"""Control-plane roles (``docs/TRANSPORT.md``, "The control plane": what each is trusted for)."""
CLIENT_ROLES = ("trainer", "actor", "relay", "observer")
"""The roles that connect to the Ledger (the Ledger's own certificate only serves)."""
LEDGER_ID = "ledger"
"""The id a job's Ledger is certified under."""
CERT_LABEL = b"aurora role certificate v2"
"""Domain separation of a certificate's signed bytes (never an announcement's or a handshake's;
v2: the job and the validity period are signed too)."""
REVOKE_LABEL = b"aurora revocation list v1"
"""Domain separation of a revocation list's signed bytes."""
DEFAULT_LIFETIME_S = 7 * 86400
"""How long a certificate of ``aurora keys issue`` is valid by default (s): a week, so that a
forgotten or leaked identity ends on its own within one, and a job longer than that renews its
identities (issues them again) once a week."""
REAL_LIFETIME_S = 86400
"""How long ``aurora real`` certifies the identities it issues (s); it renews them at half of
it while the run lasts (:class:`SelfIssued`, the launcher's renewal)."""
MAX_LIFETIME_S = 10 * 365 * 86400
"""Longest lifetime a certificate may be issued for (s)."""
CLOCK_SKEW_S = 300.0
"""How far apart the issuer's and a checker's clocks may be (s): a certificate is taken from
``issued - CLOCK_SKEW_S`` to ``expires + CLOCK_SKEW_S`` (Kerberos' default tolerance)."""


class KeyFileError(ValueError):
    """A key that cannot be used; the message names the file or variable and the reason."""


@dataclass(frozen=True)
class JobKeyFiles:
    """Where ``new_job_keys`` wrote the job's keys.

    * ``trainer.key`` - the Trainer's Ed25519 private key (PEM, PKCS#8), mode 0600. The only
      thing the data plane trusts: it signs every version and snapshot announcement
      (:mod:`aurora.delta.announce`), and keys the coin of verified rollouts
      (:func:`verification_key`). Only the Trainer holds it.
    * ``job.pub`` - the matching public key (PEM, SubjectPublicKeyInfo). Every node gets it (a
      file, an environment variable, or its fingerprint pinned in the topology) and verifies
      announcements against it. It is not secret.
    * ``job.secret`` - 32 random bytes as hex, mode 0600: admission control (who may connect to
      the data plane at all; :mod:`aurora.transport.wire`). Every admitted node holds it;
      integrity never depends on it.
    """

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
    """(content, where) of a key given as a file path or, without one, in ``env`` (PEM text, or
    hex of the raw bytes) - never a command-line argument, which any user of the host can read
    in the process table."""
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
class Certificate:
    """The job key's word that ``public_key`` speaks as ``id`` in ``role`` for job ``job`` from
    ``issued`` to ``expires`` (wall-clock seconds since the epoch), with its ``signature``."""

    role: str
    id: str
    public_key: bytes
    job: str
    issued: int
    expires: int
    signature: bytes

    def body(self) -> bytes:
        return certificate_body(
            self.role,
            self.id,
            self.public_key,
            job=self.job,
            issued=self.issued,
            expires=self.expires,
        )

    def to_wire(self) -> dict[str, Any]:
        """The fields a control-plane message carries it in (``identify``, ``kx``)."""
        return {
            "role": self.role,
            "id": self.id,
            "key": self.public_key,
            "job": self.job,
            "issued": self.issued,
            "expires": self.expires,
            "cert": self.signature,
        }

    @classmethod
    def from_wire(cls, msg: dict[str, Any]) -> Certificate:
        """The certificate in a message's fields; ValueError (one line) when a field is missing
        or of the wrong type or size (nothing is verified here: :func:`check_identity`)."""
        role, peer, key, job = msg.get("role"), msg.get("id"), msg.get("key"), msg.get("job")
        issued, expires, sig = msg.get("issued"), msg.get("expires"), msg.get("cert")
        if not all(isinstance(x, str) for x in (role, peer, job)):
            raise ValueError("a certificate without a role, id and job")
        if not (isinstance(key, bytes) and len(key) == 32 and isinstance(sig, bytes)):
            raise ValueError("a certificate without a 32-byte key and a signature")
        for t in (issued, expires):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**53:
                raise ValueError("a certificate without its issue and expiry times")
        return cls(role, peer, key, job, issued, expires, sig)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Identity:
    """Who a control-plane peer is: its ``role``, its ``id``, its raw Ed25519 private key and
    the job key's ``cert`` over them (None for the Trainer, whose key is the job key).

    One per Actor, relay, observer and standalone Ledger, made by ``aurora keys issue --role
    ROLE --id NAME --job JOB`` with the Trainer's key (``aurora real`` issues them itself): a
    file (mode 0600) holding the role's own Ed25519 private key and a *certificate*, the job
    key's signature over (role, id, public key, job id, issued, expires)
    (:func:`certificate_body`). On the control plane each end proves its role and id with it
    (:mod:`aurora.runtime.channel`): the peers to the Ledger and the Ledger to them, so an id is
    bound to a key, a certificate holds in one job only and for a limited time
    (:data:`DEFAULT_LIFETIME_S`, give or take :data:`CLOCK_SKEW_S`). The Trainer's identity is
    the job key itself (no certificate, no expiry).
    """

    role: str
    id: str
    private_key: bytes
    cert: Certificate | None

    @property
    def public_key(self) -> bytes:
        return public_key_of(self.private_key)

    @property
    def job(self) -> str | None:
        """The job its certificate names (None for the Trainer)."""
        return None if self.cert is None else self.cert.job

    @property
    def expires(self) -> int | None:
        """When its certificate ends (s since the epoch; None for the Trainer)."""
        return None if self.cert is None else self.cert.expires


def certificate_body(
    role: str, peer: str, public_key: bytes, *, job: str, issued: int, expires: int
) -> bytes:
    """The bytes the job key signs to certify that ``public_key`` speaks as ``peer`` in
    ``role`` for ``job`` from ``issued`` to ``expires`` (length-prefixed fields, so no two
    certificates give the same bytes)."""
    parts = (
        CERT_LABEL,
        role.encode(),
        peer.encode(),
        public_key,
        job.encode(),
        issued.to_bytes(8, "little"),
        expires.to_bytes(8, "little"),
    )
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


def _check_name(role: str, peer: str, job: str) -> None:
    if role not in ROLES or role == "trainer":
        raise KeyFileError(
            f"cannot issue an identity for role {role!r} (actor, relay, observer, ledger)"
        )
    if not peer or len(peer) > 128 or not peer.isprintable() or peer == "trainer":
        raise KeyFileError(f"bad id {peer[:40]!r}: 1-128 printable characters, not 'trainer'")
    if not job or len(job) > 255 or not job.isprintable():
        raise KeyFileError(f"bad job id {job[:40]!r}: 1-255 printable characters")


def issue_identity(
    role: str,
    peer: str,
    signing_key: bytes,
    *,
    job: str,
    lifetime_s: float = DEFAULT_LIFETIME_S,
    now: float | None = None,
    private_key: bytes | None = None,
) -> Identity:
    """An identity for ``peer`` in ``role`` in job ``job``, valid from ``now`` (the wall clock)
    for ``lifetime_s``, certified with the job's ``signing_key``: a fresh key pair, or
    ``private_key`` certified again (a renewal)."""
    _check_name(role, peer, job)
    if not 0 < lifetime_s <= MAX_LIFETIME_S:
        raise KeyFileError(f"a lifetime of {lifetime_s} s: more than 0, at most 10 years")
    issued = int(time.time() if now is None else now)
    expires = issued + max(1, int(lifetime_s))
    if private_key is None:
        private_key = Ed25519PrivateKey.generate().private_bytes(
            Encoding.Raw, PrivateFormat.Raw, NoEncryption()
        )
    key = public_key_of(private_key)
    body = certificate_body(role, peer, key, job=job, issued=issued, expires=expires)
    cert = Certificate(role, peer, key, job, issued, expires, sign_bytes(body, signing_key))
    return Identity(role=role, id=peer, private_key=private_key, cert=cert)


def renew_identity(
    ident: Identity, signing_key: bytes, *, lifetime_s: float, now: float | None = None
) -> Identity:
    """``ident``'s key certified again, for the same role, id and job, from ``now``."""
    if ident.cert is None:
        raise KeyFileError("the Trainer's identity is the job key: nothing to renew")
    return issue_identity(
        ident.role,
        ident.id,
        signing_key,
        job=ident.cert.job,
        lifetime_s=lifetime_s,
        now=now,
        private_key=ident.private_key,
    )


def trainer_identity(signing_key: bytes) -> Identity:
    """The Trainer speaks with the job key itself."""
    return Identity(role="trainer", id="trainer", private_key=signing_key, cert=None)


VERIFY_LABEL = b"aurora verification key v1"
"""Domain separation of the verification key (never a signature's or another hash's)."""


def verification_key(signing_key: bytes) -> bytes:
    """The job's verification key: keyed BLAKE2b-256 of :data:`VERIFY_LABEL` under the
    Trainer's raw Ed25519 private key. It keys the coin that picks which admitted results and
    completions the Trainer recomputes (:func:`aurora.policy.verification.plan`), so it is
    known only where the signing key is (the Trainer), never sent, logged or printed; derived,
    not stored, it is the same after every restart. BLAKE2b keyed with a secret is a
    pseudo-random function: the key says nothing of the signing key, and nothing an Actor is
    sent says anything of the key."""
    if len(signing_key) != 32:
        raise ValueError("a raw Ed25519 private key is 32 bytes")
    return hashlib.blake2b(VERIFY_LABEL, key=signing_key, digest_size=32).digest()


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def check_identity(
    role: str,
    peer: str,
    public_key: bytes,
    cert: Certificate | None,
    job_key: bytes,
    *,
    job: str | None,
    now: float,
    revoked: Collection[str] = (),
) -> str | None:
    """Why ``public_key`` may not speak as ``peer`` in ``role`` in job ``job`` at ``now`` (the
    wall clock) under the job key ``job_key`` (one line), or None when it may: the Trainer's
    key is the job key; any other role's key carries the job key's certificate for exactly that
    role, id and job, valid at ``now`` within :data:`CLOCK_SKEW_S`, and its id is not in
    ``revoked``. ``job`` None: the certificate's job is not checked (the caller has none to
    compare with)."""
    if role not in ROLES:
        return f"unknown role {role[:40]!r}"
    if role == "trainer":
        return None if public_key == job_key else "the trainer role needs the job's key"
    if peer == "trainer":
        return "the id 'trainer' is the Trainer's"
    if (
        cert is None
        or (cert.role, cert.id, cert.public_key) != (role, peer, public_key)
        or not verify_bytes(cert.body(), cert.signature, job_key)
    ):
        return f"no certificate of the job key for {role} {peer[:40]!r} and this key"
    if job is not None and cert.job != job:
        return f"its certificate is for job {cert.job[:80]!r}, not {job[:80]!r}"
    if now < cert.issued - CLOCK_SKEW_S:
        return (
            f"its certificate is valid only from {_when(cert.issued)} (it is {_when(now)} "
            "here: check both clocks)"
        )
    if now > cert.expires + CLOCK_SKEW_S:
        return f"its certificate expired at {_when(cert.expires)} (renew it: aurora keys issue)"
    if peer in revoked:
        return f"{role} {peer[:40]!r} is revoked (aurora keys revoke)"
    return None


def write_identity(path: str | os.PathLike[str], ident: Identity, *, force: bool = False) -> None:
    """Write ``ident`` as an identity file (JSON, mode 0600, never through a link)."""
    body: dict[str, Any] = {"role": ident.role, "id": ident.id, "key": ident.private_key.hex()}
    if ident.cert is not None:
        body.update(
            job=ident.cert.job,
            issued=ident.cert.issued,
            expires=ident.cert.expires,
            cert=ident.cert.signature.hex(),
        )
    _write_new(Path(path), json.dumps(body).encode() + b"\n", 0o600, force)


def replace_identity(path: str | os.PathLike[str], ident: Identity) -> None:
    """Write ``ident`` over the identity file at ``path`` atomically (a renewal: a role that
    reads the file at that moment sees the old identity or the new one, never half of each)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    write_identity(tmp, ident)
    os.replace(tmp, path)


def load_identity(
    path: str | os.PathLike[str] | None = None, *, env: str = ENV_IDENTITY
) -> Identity:
    """A role's identity from its file (``aurora keys issue``) or ``$env``."""
    data, where = _read(path, env, "identity")
    try:
        body = json.loads(data)
        key = bytes.fromhex(body["key"])
        if len(key) != 32:
            raise ValueError("the key is not 32 bytes")
        cert = None
        if body.get("cert"):
            if "job" not in body or "expires" not in body:
                raise ValueError(
                    "its certificate names no job and no expiry (issued by an older aurora: "
                    "issue it again)"
                )
            cert = Certificate.from_wire(
                {
                    "role": body["role"],
                    "id": body["id"],
                    "key": public_key_of(key),
                    "job": body["job"],
                    "issued": body["issued"],
                    "expires": body["expires"],
                    "cert": bytes.fromhex(body["cert"]),
                }
            )
        ident = Identity(role=str(body["role"]), id=str(body["id"]), private_key=key, cert=cert)
    except (ValueError, KeyError, TypeError) as exc:
        raise KeyFileError(f"{where}: not an identity file of aurora keys issue ({exc})") from None
    return ident


class IdentityFile:
    """A role's identity, read again from its file whenever the file changes: a role that calls
    it at every connection picks up a renewed identity (``aurora keys issue --force`` over the
    same file) without a restart. From ``$AURORA_IDENTITY`` (no path) it is read once. A file
    that no longer reads keeps the last good identity, with one warning per change."""

    def __init__(self, path: str | os.PathLike[str] | None, *, env: str = ENV_IDENTITY) -> None:
        self.path = None if path is None else Path(path)
        self._stamp = self._stat()
        self.identity = load_identity(path, env=env)

    def _stat(self) -> tuple[int, int] | None:
        if self.path is None:
            return None
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def __call__(self) -> Identity:
        stamp = self._stat()
        if stamp is not None and stamp != self._stamp:
            self._stamp = stamp
            try:
                ident = load_identity(self.path)
            except KeyFileError as exc:
                log.warning("%s; keeping the identity read before", exc)
                return self.identity
            if (ident.role, ident.id) != (self.identity.role, self.identity.id):
                log.warning(
                    "%s: now names %s %r, not %s %r; keeping the identity read before",
                    self.path,
                    ident.role,
                    ident.id,
                    self.identity.role,
                    self.identity.id,
                )
                return self.identity
            self.identity = ident
        return self.identity


class SelfIssued:
    """An identity that the holder of the job key issues to itself (the Ledger inside the
    Trainer's process, the launcher's observer), certified again once less than half of its
    ``lifetime_s`` is left, so it never expires while its issuer runs."""

    def __init__(
        self,
        role: str,
        peer: str,
        signing_key: bytes,
        *,
        job: str,
        lifetime_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._args = (role, peer, signing_key)
        self.job, self.lifetime_s, self.clock = job, lifetime_s, clock
        self.identity = issue_identity(
            role, peer, signing_key, job=job, lifetime_s=lifetime_s, now=clock()
        )

    def __call__(self) -> Identity:
        cert = self.identity.cert
        assert cert is not None
        now = self.clock()
        if now > cert.expires - self.lifetime_s / 2:
            self.identity = renew_identity(
                self.identity, self._args[2], lifetime_s=self.lifetime_s, now=now
            )
        return self.identity


# -- revocation ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Revocations:
    """The job key's list of ids revoked in job ``job`` (signed; :func:`revoke`). Revocation
    is for good: whoever enforces lists keeps the union of every list it verified.

    ``aurora keys revoke ID`` adds ids to the job's revocation list, a file the job key signs:
    signed, so that whoever carries it (the Trainer sends it to the Ledger, the Ledger logs it)
    can be checked and no one but the job key holder can revoke; kept as a union, so no later
    list undoes a revocation.
    """

    job: str
    ids: tuple[str, ...]
    issued: int
    signature: bytes

    def body(self) -> bytes:
        return revocations_body(self.job, self.ids, self.issued)

    def encode(self) -> bytes:
        """The list as a file's (and a message's) bytes: JSON with the signature in hex."""
        body = {
            "job": self.job,
            "ids": list(self.ids),
            "issued": self.issued,
            "sig": self.signature.hex(),
        }
        return json.dumps(body, indent=1).encode() + b"\n"

    @classmethod
    def decode(
        cls, data: bytes, job_key: bytes, *, job: str | None, where: str = "revocation list"
    ) -> Revocations:
        """The list in ``data``, verified: signed by ``job_key``, for ``job`` (None: any);
        :class:`KeyFileError` (one line naming ``where``) otherwise."""
        try:
            body = json.loads(data)
            ids = body["ids"]
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise ValueError("ids is not a list of strings")
            issued = body["issued"]
            if isinstance(issued, bool) or not isinstance(issued, int):
                raise ValueError("issued is not an integer")
            out = cls(str(body["job"]), tuple(sorted(set(ids))), issued, bytes.fromhex(body["sig"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise KeyFileError(
                f"{where}: not a revocation list of aurora keys revoke ({exc})"
            ) from None
        if not verify_bytes(out.body(), out.signature, job_key):
            raise KeyFileError(f"{where}: not signed by this job's key")
        if job is not None and out.job != job:
            raise KeyFileError(f"{where}: a list for job {out.job[:80]!r}, not {job[:80]!r}")
        return out


def revocations_body(job: str, ids: Collection[str], issued: int) -> bytes:
    """The bytes the job key signs for a revocation list (length-prefixed fields)."""
    parts = (REVOKE_LABEL, job.encode(), issued.to_bytes(8, "little"), *(i.encode() for i in ids))
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


def revoke(
    path: str | os.PathLike[str],
    ids: Collection[str],
    signing_key: bytes,
    *,
    job: str | None,
    now: float | None = None,
) -> Revocations:
    """Add ``ids`` to the revocation list at ``path`` (made for ``job`` when it does not
    exist; checked to be ``job``'s when it does), signed again with ``signing_key``, and
    written atomically (mode 0644: it is not secret)."""
    path = Path(path)
    job_key = public_key_of(signing_key)
    old: tuple[str, ...] = ()
    if path.exists():
        prev = Revocations.decode(path.read_bytes(), job_key, job=job, where=str(path))
        job, old = prev.job, prev.ids
    if job is None:
        raise KeyFileError(f"{path}: no such list yet; name its job (--job or --job-id)")
    for i in ids:
        if not i or len(i) > 128 or not i.isprintable() or i == "trainer":
            raise KeyFileError(
                f"cannot revoke {i[:40]!r}: an id of 1-128 printable characters, not 'trainer'"
            )
    merged = tuple(sorted(set(old) | set(ids)))
    issued = int(time.time() if now is None else now)
    rev = Revocations(
        job, merged, issued, sign_bytes(revocations_body(job, merged, issued), signing_key)
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    _write_new(tmp, rev.encode(), 0o644, False)
    os.replace(tmp, path)
    return rev


class RevocationFile:
    """A revocation list file, read again whenever it changes (the Trainer watches it and sends
    each new list to the Ledger). :meth:`current` is the union of every list read that
    verified for ``job``; a file that does not verify is reported once and changes nothing."""

    def __init__(self, path: str | os.PathLike[str], job_key: bytes, *, job: str) -> None:
        self.path = Path(path)
        self.job_key, self.job = job_key, job
        self.ids: frozenset[str] = frozenset()
        self.latest: Revocations | None = None
        """The newest list read that verified (what is sent on)."""
        self._stamp: tuple[int, int] | None = None

    def poll(self, *, strict: bool = False) -> bool:
        """Read the file if it changed; True when it added ids. ``strict``: a list that does
        not verify raises :class:`KeyFileError` (at start) instead of a warning."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return False
        except OSError as exc:
            if strict:
                raise KeyFileError(
                    f"{self.path}: cannot read the revocation list ({exc.strerror})"
                ) from None
            return False
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            rev = Revocations.decode(
                self.path.read_bytes(), self.job_key, job=self.job, where=str(self.path)
            )
        except (KeyFileError, OSError) as exc:
            if strict:
                raise KeyFileError(str(exc)) from None
            log.error("%s; the revocations read before still hold", exc)
            return False
        self.latest = rev
        grew = not set(rev.ids) <= self.ids
        self.ids = self.ids | set(rev.ids)
        return grew


# -- `aurora keys` -------------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """Seconds of ``text``: a number with an optional unit ``s``, ``m``, ``h`` or ``d``
    (``7d``, ``12h``, ``3600``); ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([smhd]?)\s*", text)
    if match is None:
        raise ValueError(f"{text!r}: a duration is a number and a unit, e.g. 7d, 12h, 30m, 90s")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def job_of(args: argparse.Namespace) -> str | None:
    """The job id of ``--job-id ID`` or of ``--job FILE`` (a ``job.json`` of ``aurora real``
    or ``aurora trainer``), or None when neither is given."""
    if getattr(args, "job_id", None):
        return str(args.job_id)
    if getattr(args, "job", None):
        try:
            return str(json.loads(Path(args.job).read_text())["spec"]["job_id"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise KeyFileError(
                f"{args.job}: cannot read the job id of a job.json ({exc})"
            ) from None
    return None


def _job_args(p: argparse.ArgumentParser, *, required: bool) -> None:
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument(
        "--job", default=None, help="the job's job.json (written by aurora trainer or aurora real)"
    )
    g.add_argument("--job-id", default=None, help="the job id itself")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``aurora keys new|issue|revoke`` to the ``aurora`` command."""
    keys = subparsers.add_parser(
        "keys",
        help="the job's signing key, public key and secret; role identities; revocations",
        description="Make a job's keys (the Trainer's signing key, the job's public key and "
        "secret), the identities the Ledger, relays, Actors and observers join with, and "
        "revocation lists.",
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
        help="an Actor's, relay's, observer's or standalone Ledger's identity, certified by the "
        "job key for one job and a limited time",
        description="Write an identity: a fresh key pair and the job key's certificate over its "
        "role, id, job and validity period. Renew one before it expires by issuing it again "
        "(--force over the same file): a running role reads its file again at its next "
        "connection, and the Ledger closes a connection when its certificate expires.",
    )
    p.add_argument(
        "--role",
        required=True,
        choices=["actor", "relay", "observer", "ledger"],
        help="the role it joins as",
    )
    p.add_argument("--id", required=True, help=f"the id it joins under (the Ledger: {LEDGER_ID})")
    p.add_argument("--out", required=True, help="identity file to write (mode 0600)")
    _job_args(p, required=True)
    p.add_argument(
        "--valid-for",
        default="7d",
        help="how long the certificate holds from now, e.g. 12h, 7d, 30d (default 7d); "
        f"clocks may differ by up to {CLOCK_SKEW_S:.0f} s",
    )
    p.add_argument(
        "--signing-key", default=None, help=f"the Trainer's key (default: ${ENV_SIGNING_KEY})"
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing file (a renewal)")
    p.set_defaults(func=run_issue)
    p = sub.add_parser(
        "revoke",
        help="revoke ids for good: add them to the job's signed revocation list",
        description="Add ids to the job's revocation list (a file signed by the job key; made "
        "if missing). The Trainer reads the list at RUN_DIR/revoked.json (its --revocations) "
        "when it changes and sends it to the Ledger, which logs it (it survives restarts), "
        "closes the revoked ids' connections and refuses every certificate for them from then "
        "on; the Trainer refuses their results too. Revocation cannot be undone: issue a new id.",
    )
    p.add_argument("ids", nargs="+", metavar="ID", help="the ids to revoke (any role but trainer)")
    p.add_argument(
        "--list",
        required=True,
        help="the revocation list to update (for aurora real and aurora trainer: "
        "RUN_DIR/revoked.json)",
    )
    _job_args(p, required=False)
    p.add_argument(
        "--signing-key", default=None, help=f"the Trainer's key (default: ${ENV_SIGNING_KEY})"
    )
    p.set_defaults(func=run_revoke)


def run_issue(args: argparse.Namespace) -> int:
    try:
        job = job_of(args)
        assert job is not None  # argparse requires one of them
        lifetime = parse_duration(args.valid_for)
        ident = issue_identity(
            args.role, args.id, load_signing_key(args.signing_key), job=job, lifetime_s=lifetime
        )
        write_identity(args.out, ident, force=args.force)
    except (KeyFileError, ValueError) as exc:
        raise SystemExit(f"aurora keys issue: {exc}") from None
    assert ident.cert is not None
    print(
        f"identity     {args.out}  ({args.role} {args.id}; job {job}; valid until "
        f"{_when(ident.cert.expires)}; mode 0600; --identity of that role)"
    )
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    try:
        rev = revoke(args.list, args.ids, load_signing_key(args.signing_key), job=job_of(args))
    except (KeyFileError, ValueError) as exc:
        raise SystemExit(f"aurora keys revoke: {exc}") from None
    print(
        f"revoked      {', '.join(args.ids)}  ({args.list}: {len(rev.ids)} ids of job {rev.job}; "
        "the Trainer sends it to the Ledger within a second)"
    )
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
