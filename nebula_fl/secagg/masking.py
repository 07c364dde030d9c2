"""Adding and removing masks: what a cluster uploads, and what the server subtracts once it may.

A cluster i uploads y_i = enc_i + PRG(b_i) + Σ_j s_ij · PRG(k_ij,r) over its neighbours j in the
round, with s_ij = +1 for the lower id of the pair and -1 for the higher. Summed over survivors, the
pairwise masks between two survivors cancel; what remains is every survivor's self mask and the
masks survivors share with clusters that dropped before uploading.
"""

from __future__ import annotations

import numpy as np

from nebula_fl.secagg import field
from nebula_fl.secagg.field import FieldCode
from nebula_fl.secagg.masks import expand


def mask_input(encoded: np.ndarray, *, code: FieldCode, self_seed: bytes, pair_keys: dict[int, list[bytes]]) -> np.ndarray:
    """`encoded` plus its self mask plus the pairwise masks, keyed by sign (+1 / -1)."""
    out = field.add(encoded, expand(self_seed, count=encoded.size, code=code), code=code)
    for sign, keys in pair_keys.items():
        for key in keys:
            m = expand(key, count=encoded.size, code=code)
            out = field.add(out, m, code=code) if sign > 0 else field.subtract(out, m, code=code)
    return out


def remove_masks(total: np.ndarray, *, code: FieldCode, self_seeds: list[bytes],
                 orphan_pairs: list[tuple[int, bytes]]) -> np.ndarray:
    """The sum of the survivors' encodings, from the sum of their uploads.

    `self_seeds`: every survivor's rebuilt self-mask seed. `orphan_pairs`: (sign the survivor used,
    round key) of each pairwise mask a survivor shares with a cluster that dropped before uploading.
    """
    out = total
    for seed in self_seeds:
        out = field.subtract(out, expand(seed, count=total.size, code=code), code=code)
    for sign, key in orphan_pairs:
        m = expand(key, count=total.size, code=code)
        out = field.subtract(out, m, code=code) if sign > 0 else field.add(out, m, code=code)
    return out
