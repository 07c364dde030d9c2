"""One checkpoint folder: nested state as safetensors + JSON, sealed by a manifest so damage is never loaded.

Strategies and outer optimizers return plain nested dicts from ``state_dict()``; ``split_state`` puts
the arrays in safetensors (no pickle) and the rest in JSON, ``join_state`` joins them back on resume.

A checkpoint folder holds ``adapter.safetensors``, ``state.safetensors``, ``state.json`` and, written
last, ``manifest.json`` (size and SHA-256 of each of the three, and the round). The run's ``latest``
pointer names the folder *and* the SHA-256 of its manifest, so every byte a resume reads is covered by
a checksum: a truncated file, a flipped byte, a missing file or a pointer to the wrong folder is
reported as :class:`CheckpointDamage` naming the file, never parsed into a wrong state.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from nebula_fl.errors import NebulaError
from nebula_fl.storage.durable import fsync_dir, write_durably

_ARRAY = "__array__"
FORMAT = 2  # 1: the folders written before manifests (no manifest.json, no "format" in state.json)
ADAPTER = "adapter.safetensors"
STATE_ARRAYS = "state.safetensors"
STATE_JSON = "state.json"
MANIFEST = "manifest.json"
FILES = (ADAPTER, STATE_ARRAYS, STATE_JSON)
NAME = re.compile(r"round-(\d{5,})")


class CheckpointError(NebulaError):
    """A checkpoint that a resume would read is damaged; the message says which file and how to go on."""


class CheckpointDamage(Exception):
    """Where a checkpoint is damaged (internal: RunFolder turns it into a CheckpointError with advice)."""

    def __init__(self, file: str, what: str) -> None:
        super().__init__(f"{file} {what}")
        self.file = file  # the damaged file, relative to the checkpoint folder (or "latest")
        self.what = what  # what is wrong with it, e.g. "is truncated (812 bytes, the manifest says 1,640)"


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    round: int
    adapter: dict[str, np.ndarray]
    state: dict[str, Any]


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


def round_of(name: str) -> int | None:
    """The round a checkpoint folder name stands for (``round-00003`` -> 3), or None for any other name."""
    match = NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def folder_name(round: int) -> str:
    return f"round-{round:05d}"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_checkpoint(folder: Path, *, round: int, adapter: dict[str, np.ndarray], state: dict[str, Any]) -> str:
    """Fill the empty `folder` with a sealed checkpoint; returns the SHA-256 of its manifest.

    The manifest is written last, from the very bytes written before it, so a folder with a valid
    manifest holds exactly what was meant to be saved.
    """
    skeleton, arrays = split_state(state)
    blobs = {
        ADAPTER: save_safetensors({k: np.ascontiguousarray(v) for k, v in adapter.items()}),
        STATE_ARRAYS: save_safetensors(arrays),
        STATE_JSON: (json.dumps({"format": FORMAT, "round": round, "state": skeleton}, indent=1) + "\n").encode(),
    }
    for name, data in blobs.items():
        write_durably(folder / name, data)
    manifest = {"format": FORMAT, "round": round,
                "files": {name: {"size": len(data), "sha256": sha256(data)} for name, data in blobs.items()}}
    data = (json.dumps(manifest, indent=1) + "\n").encode()
    write_durably(folder / MANIFEST, data)
    fsync_dir(folder)
    return sha256(data)


def _read(folder: Path, name: str) -> bytes:
    try:
        return (folder / name).read_bytes()
    except FileNotFoundError:
        raise CheckpointDamage(name, "is missing") from None
    except OSError as err:
        raise CheckpointDamage(name, f"cannot be read ({err.strerror or err})") from None


def _json(data: bytes, name: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CheckpointDamage(name, "is not valid JSON") from None


def read_manifest(folder: Path) -> tuple[dict[str, Any], bytes]:
    """The checkpoint's manifest, checked for shape (not yet against the files), and its raw bytes."""
    raw = _read(folder, MANIFEST)
    manifest = _json(raw, MANIFEST)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(files, dict) or set(files) != set(FILES) or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("round"), int) or isinstance(manifest.get("round"), bool)
        or not all(isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
                   for e in files.values())
    ):
        raise CheckpointDamage(MANIFEST, "does not have the layout of a checkpoint manifest")
    return manifest, raw


def _verified_files(folder: Path, manifest: dict[str, Any]) -> dict[str, bytes]:
    blobs = {}
    for name in FILES:
        entry = manifest["files"][name]
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            raise CheckpointDamage(name, "is missing") from None
        except OSError as err:
            raise CheckpointDamage(name, f"cannot be read ({err.strerror or err})") from None
        if size != entry["size"]:
            what = "is truncated" if size < entry["size"] else "is longer than written"
            raise CheckpointDamage(name, f"{what} ({size:,} bytes, {MANIFEST} says {entry['size']:,})")
        data = _read(folder, name)
        if sha256(data) != entry["sha256"]:
            raise CheckpointDamage(name, "does not match its SHA-256 in manifest.json (its bytes changed)")
        blobs[name] = data
    return blobs


def _parse(blobs: dict[str, bytes], *, expected_round: int, legacy: bool) -> Checkpoint:
    """Parse verified (or, for a legacy folder, unverified) bytes into a checkpoint."""
    tensors = {}
    for name in (ADAPTER, STATE_ARRAYS):
        try:
            tensors[name] = {k: np.array(v) for k, v in load_safetensors(blobs[name]).items()}
        except Exception:  # safetensors raises its own error types for every malformed header or length
            raise CheckpointDamage(name, "is not a readable safetensors file") from None
    meta = _json(blobs[STATE_JSON], STATE_JSON)
    if not isinstance(meta, dict) or not isinstance(meta.get("round"), int) or "state" not in meta:
        raise CheckpointDamage(STATE_JSON, "does not hold a round and a state")
    if meta["round"] != expected_round:
        raise CheckpointDamage(STATE_JSON, f"is for round {meta['round']}, not {expected_round}")
    if not legacy and meta.get("format") != FORMAT:
        raise CheckpointDamage(STATE_JSON, f"is not of checkpoint format {FORMAT}")
    try:
        state = join_state(meta["state"], tensors[STATE_ARRAYS])
    except Exception:  # a reference to an array that is not there, or a malformed reference
        raise CheckpointDamage(STATE_JSON, f"refers to arrays missing from {STATE_ARRAYS}") from None
    if not isinstance(state, dict):
        raise CheckpointDamage(STATE_JSON, "does not hold a state dictionary")
    return Checkpoint(round=meta["round"], adapter=tensors[ADAPTER], state=state)


def read_checkpoint(folder: Path, *, manifest_sha256: str | None = None) -> Checkpoint:
    """Verify and parse one checkpoint folder; raises CheckpointDamage naming the first damaged file.

    `manifest_sha256` is what the ``latest`` pointer says the manifest hashes to (None: not checked).
    A folder written before manifests existed (no manifest.json, no format in state.json) is accepted
    after parsing, as long as nothing asks for a manifest digest.
    """
    expected_round = round_of(folder.name)
    if expected_round is None:
        raise CheckpointDamage(folder.name, "is not a checkpoint folder name (round-NNNNN)")
    if not (folder / MANIFEST).exists() and manifest_sha256 is None:
        legacy = {name: _read(folder, name) for name in FILES}
        meta = _json(legacy[STATE_JSON], STATE_JSON)
        if not isinstance(meta, dict) or "format" in meta:
            raise CheckpointDamage(MANIFEST, "is missing")
        return _parse(legacy, expected_round=expected_round, legacy=True)
    # The folder is checked on its own first: a damaged manifest also explains a digest mismatch.
    manifest, raw = read_manifest(folder)
    if manifest["round"] != expected_round:
        raise CheckpointDamage(MANIFEST, f"is for round {manifest['round']}, not {expected_round}")
    blobs = _verified_files(folder, manifest)
    if manifest_sha256 is not None and sha256(raw) != manifest_sha256:
        raise CheckpointDamage("latest", f"does not match {folder.name}/{MANIFEST} (one of the two changed)")
    return _parse(blobs, expected_round=expected_round, legacy=False)


def pointer_text(name: str, manifest_sha256: str) -> str:
    return f"{name} sha256={manifest_sha256}\n"


POINTER = re.compile(r"(round-\d{5,}) sha256=([0-9a-f]{64})\n")


def parse_pointer(data: bytes) -> tuple[str, str | None]:
    """(folder name, manifest digest, or None for a pointer written before manifests) from ``latest``.

    A pointer with a digest must be exactly what ``pointer_text`` writes, so that no truncation of it
    reads as another valid pointer.
    """
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise CheckpointDamage("latest", "is not text") from None
    if " sha256=" not in text and round_of(text.strip()) is not None:
        return text.strip(), None
    if match := POINTER.fullmatch(text):
        return match.group(1), match.group(2)
    raise CheckpointDamage("latest", "does not name a checkpoint (expected 'round-NNNNN sha256=...')")
