"""Nested state (dicts of scalars and NumPy arrays) as one safetensors file plus one JSON file.

Strategies and outer optimizers return plain nested dicts from ``state_dict()``; this splits them so
the arrays go to safetensors (no pickle) and the rest to JSON, and joins them back on resume.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_ARRAY = "__array__"


def split_state(state: Any, prefix: str = "") -> tuple[Any, dict[str, np.ndarray]]:
    """Replace every array in `state` by a reference; return (json-able skeleton, arrays)."""
    arrays: dict[str, np.ndarray] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, np.ndarray):
            arrays[path] = np.ascontiguousarray(node)
            return {_ARRAY: path}
        if isinstance(node, dict):
            return {str(k): walk(v, f"{path}/{k}" if path else str(k)) for k, v in node.items()}
        if isinstance(node, list | tuple):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(node)]
        if isinstance(node, np.generic):
            return node.item()
        return node

    return walk(state, prefix), arrays


def join_state(skeleton: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(skeleton, dict):
        if set(skeleton) == {_ARRAY}:
            return arrays[skeleton[_ARRAY]]
        return {k: join_state(v, arrays) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_state(v, arrays) for v in skeleton]
    return skeleton
