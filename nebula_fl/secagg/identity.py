"""A cluster's long-term identity key, its signatures, and the federation's roster of them.

Secure aggregation is only as strong as the list of who takes part: a server that can add members it holds
the keys of ("Sybils") can surround one cluster with clusters of its own and read that cluster's update off
any sum. So every cluster signs what it says in the protocol (its epoch keys, its uploads, the survivor set
it agrees to) with an Ed25519 key that never leaves its state folder, and checks what others signed against
the *roster*: the other clusters' public identity keys, which the operators exchange out of band (like SSH's
known_hosts; `nebula-fl identity` prints a cluster's line). Without a roster a cluster can only check
signatures against keys the server delivered, which stops a server that lies about a real member's words
but not one that invents members; the trainer says so when it starts.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from nebula_fl.errors import ConfigError

IDENTITY_FILE = "identity.key"
PUBLIC_BYTES = 32
SIGNATURE_BYTES = 64
DOMAIN = "nebula-fl secagg v2"


def message(kind: str, *fields: object) -> bytes:
    """The exact bytes a signature covers: a domain tag, what is signed, and its fields, unambiguously."""
    return json.dumps([DOMAIN, kind, *fields], separators=(",", ":"), sort_keys=True).encode()


class Identity:
    """This cluster's signing key (Ed25519, deterministic signatures: a replayed request gets the same bytes)."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public = base64.b64encode(raw).decode()

    @classmethod
    def load_or_create(cls, folder: Path) -> Identity:
        """The key in `folder` (made on first use, 0600): the same identity for the cluster's whole life."""
        path = folder / IDENTITY_FILE
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            pem = Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(pem)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"the identity key '{path}' is unreadable ({err}); restore it from a backup — a new key "
                              "would need every other cluster's roster updated") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"the identity key '{path}' is not an Ed25519 key; restore the cluster's own key file")
        return cls(key)

    def sign(self, kind: str, *fields: object) -> str:
        return base64.b64encode(self._key.sign(message(kind, *fields))).decode()


def verify(public: str, signature: object, kind: str, *fields: object) -> bool:
    """Whether `signature` (base64) is `public`'s signature of (kind, fields); False for anything malformed."""
    try:
        key = Ed25519PublicKey.from_public_bytes(_b64(public, PUBLIC_BYTES))
        key.verify(_b64(signature, SIGNATURE_BYTES), message(kind, *fields))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def check_public(public: object) -> str:
    """`public` if it is a base64 Ed25519 public key, else ValueError."""
    if not isinstance(public, str):
        raise ValueError("an identity key must be a base64 string")
    Ed25519PublicKey.from_public_bytes(_b64(public, PUBLIC_BYTES))
    return public


def _b64(text: object, size: int) -> bytes:
    if not isinstance(text, str):
        raise TypeError("not a base64 string")
    try:
        raw = base64.b64decode(text.encode(), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError("not base64") from None
    if len(raw) != size:
        raise ValueError(f"{len(raw)} bytes, not {size}")
    return raw


# -- the roster ------------------------------------------------------------------------------------
def roster_line(cluster_id: int | str, identity: Identity) -> str:
    return f"{cluster_id} {identity.public}"


def load_roster(path: str | Path) -> dict[str, str]:
    """Cluster id -> identity public key, from lines '<cluster-id> <key>' ('#' starts a comment)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read the secure-aggregation roster '{path}' ({err.strerror}); pass the file of the "
                          "clusters' identity lines ('nebula-fl identity' prints one)") from None
    roster: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"roster '{path}' line {number}"
        if len(parts) != 2 or not parts[0].isdigit():
            raise ConfigError(f"{where} is not '<cluster-id> <identity key>'; copy the line 'nebula-fl identity' printed")
        cid, key = str(int(parts[0])), parts[1]
        try:
            check_public(key)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{where}: the key of cluster {cid} is not an Ed25519 identity key ({err})") from None
        if roster.get(cid, key) != key:
            raise ConfigError(f"{where}: cluster {cid} is listed twice with different keys; keep the one its operator gave")
        if key in roster.values() and roster.get(cid) != key:
            raise ConfigError(f"{where}: two clusters share one identity key; each cluster has its own")
        roster[cid] = key
    if not roster:
        raise ConfigError(f"the secure-aggregation roster '{path}' lists no cluster; add one line per cluster")
    return roster
