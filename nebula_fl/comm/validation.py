"""Checks on tensors that arrive over the WAN, before anything touches model or aggregate."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def check_arrays(*, expected: Mapping[str, tuple[int, ...]], arrays: Mapping[str, np.ndarray], what: str) -> None:
    """Raise ValueError unless `arrays` has exactly the expected keys and shapes, float dtypes, finite values."""
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        raise ValueError(
            f"{what} keys do not match: {len(missing)} missing (e.g. {missing[:1]}), "
            f"{len(extra)} unexpected (e.g. {extra[:1]}); both sides must use the same model and LoRA config"
        )
    for key, shape in expected.items():
        value = arrays[key]
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{what} tensor '{key}' has shape {tuple(value.shape)}, expected {tuple(shape)}")
        if not np.issubdtype(value.dtype, np.floating):
            raise ValueError(f"{what} tensor '{key}' has dtype {value.dtype}, expected a float type")
        if not np.isfinite(value).all():
            raise ValueError(f"{what} tensor '{key}' holds NaN or Inf")
