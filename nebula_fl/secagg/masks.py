"""Mask expansion: a 32-byte key into a field vector, with ChaCha20 as the stream (OpenSSL, vectorised).

Pairwise masks use a key per (pair, epoch, round, the two mask keys' numbers), derived with HKDF-SHA256
from the ECDH secret of the two mask keys the pair used that round (each cluster's mask key serves one
round: clients/secagg_stage.py): a neighbour can reveal the key of one round (when its pair-mate dropped
out of that round) without revealing any other round's. Self masks use a fresh random 32-byte seed per round.
Keys are used once each, so ChaCha20 runs with an all-zero nonce (counter starting at 0).
"""

from __future__ import annotations

import json

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from nebula_fl.secagg.field import FieldCode

KEY_BYTES = 32
_ZERO_NONCE = bytes(16)


def expand(key: bytes, *, count: int, code: FieldCode) -> np.ndarray:
    """`count` uniform elements of Z_{2^b} (uint64) from `key`'s ChaCha20 keystream."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a mask key is {KEY_BYTES} bytes, got {len(key)}")
    width = 4 if code.bits <= 32 else 8
    encryptor = Cipher(algorithms.ChaCha20(key, _ZERO_NONCE), mode=None).encryptor()
    stream = encryptor.update(bytes(count * width))
    words = np.frombuffer(stream, dtype="<u4" if width == 4 else "<u8")
    return words.astype(np.uint64) & code.mask


def round_key(pair_secret: bytes, *, epoch: str, server_round: int, seqs: tuple[int, int],
              purpose: str = "pair-mask") -> bytes:
    """The key of one round's mask between a pair, from the ECDH secret of the mask keys they used in it
    (HKDF-SHA256). `seqs`: the numbers of those keys, the lower cluster id's first (pair_order), so both
    sides derive the same key and a key pair used in another round or order derives another."""
    info = json.dumps(["nebula-fl secagg", purpose, epoch, int(server_round), [int(seqs[0]), int(seqs[1])]]).encode()
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(pair_secret)


def pair_sign(me: str, other: str) -> int:
    """+1 for the lower cluster id of a pair, -1 for the higher: the two masks cancel in the sum."""
    return 1 if _order(me) < _order(other) else -1


def pair_order(me: str, other: str, mine: int, theirs: int) -> tuple[int, int]:
    """(the lower cluster id's key number, the higher's): the `seqs` both sides of a pair pass to round_key."""
    return (mine, theirs) if pair_sign(me, other) > 0 else (theirs, mine)


def _order(cid: str) -> tuple[int, str]:
    return (int(cid), cid) if cid.isascii() and cid.isdigit() else (1 << 62, cid)
