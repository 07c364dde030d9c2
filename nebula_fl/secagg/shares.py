"""Key agreement, secret sharing and sealed shares, on Flower's vetted primitives and `cryptography`.

Each cluster holds two EC key pairs per epoch (as in SecAgg): `c` seals the shares it sends to a
neighbour (ECDH + HKDF → Fernet: AES-CBC with HMAC-SHA256, so a tampered share is detected), `s`
agrees the pairwise mask secret. Only an `s` private key is ever reconstructed (a cluster that
dropped out), so shares sealed to that cluster stay sealed.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from functools import lru_cache

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.fernet import InvalidToken
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)


class ShareError(ValueError):
    """A share that cannot be used: tampered, sealed with another key, or for another purpose."""


@dataclass(frozen=True)
class KeyPair:
    private_pem: bytes
    public: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        sk, pk = generate_key_pairs()
        return cls(private_key_to_bytes(sk), public_key_to_bytes(pk))

    @property
    def private(self) -> ec.EllipticCurvePrivateKey:
        return bytes_to_private_key(self.private_pem)


def check_public(data: bytes) -> bytes:
    """A peer's public key, or ShareError if it is not a valid EC public key."""
    try:
        key = bytes_to_public_key(bytes(data))
    except (ValueError, TypeError) as err:
        raise ShareError(f"not an EC public key: {err}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP384R1):
        raise ShareError("not a P-384 EC public key (the curve every cluster's keys are on)")
    return bytes(data)


@lru_cache(maxsize=1024)
def fernet_key(private_pem: bytes, peer_public: bytes) -> bytes:
    """The Fernet key two clusters agree on (ECDH + HKDF-SHA256, Flower's `generate_shared_key`); kept for the
    process's life, as the private key it comes from is: a round unseals one share per neighbour, each time."""
    return generate_shared_key(bytes_to_private_key(private_pem), bytes_to_public_key(peer_public))


def matches_public(private_pem: bytes, public: bytes) -> bool:
    """Whether a rebuilt private key is the one behind `public` (False for anything that is not a key)."""
    try:
        return public_key_to_bytes(bytes_to_private_key(bytes(private_pem)).public_key()) == bytes(public)
    except (ValueError, TypeError, AttributeError, UnsupportedAlgorithm):
        return False


def pair_secret(private_pem: bytes, peer_public: bytes) -> bytes:
    """The 32-byte secret behind a pair's masks (the same derivation, raw bytes)."""
    return base64.urlsafe_b64decode(fernet_key(private_pem, peer_public))


def split(secret: bytes, *, threshold: int, holders: int) -> list[bytes]:
    """`holders` Shamir shares of `secret`, any `threshold` of which rebuild it."""
    if not 1 <= threshold <= holders:
        raise ValueError(f"threshold {threshold} must be in 1..{holders}")
    return create_shares(secret, threshold, holders)


def combine(shares: list[bytes]) -> bytes:
    try:
        return combine_shares(shares)
    except (ValueError, IndexError) as err:
        raise ShareError(f"the shares do not rebuild a secret: {err}") from None


def seal(key: bytes, *, header: dict, share: bytes) -> bytes:
    """Encrypt and authenticate `share` with the header that says what it is (who, to whom, which round)."""
    body = json.dumps({"h": header, "s": base64.b64encode(share).decode()}, sort_keys=True).encode()
    return encrypt(key, body)


def unseal(key: bytes, token: bytes, *, expect: dict) -> bytes:
    """The share inside `token`, if it authenticates under `key` and its header is exactly `expect`."""
    try:
        body = json.loads(decrypt(key, bytes(token)))
    except (InvalidToken, ValueError, TypeError) as err:
        raise ShareError(f"a sealed share does not authenticate ({type(err).__name__}): tampered or another key") from None
    if not isinstance(body, dict) or body.get("h") != expect:
        raise ShareError(f"a sealed share is for {body.get('h') if isinstance(body, dict) else '?'}, not {expect}")
    return base64.b64decode(body["s"])
