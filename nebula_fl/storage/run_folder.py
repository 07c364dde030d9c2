"""The run folder: config, per-round metrics, summary, checkpoints, final adapter and plot.

Config, summary, checkpoints and the final adapter are written whole or not at all, and survive a power loss
once written (temp file, fsync, rename, fsync of the folder: ``write_durably`` and ``fsync_dir``; JSON files each
through a temp file of its own, since two processes write ``summary.json``: the ServerApp and the launcher, which
also hold a lock while they read, change and write it, so neither loses the other's fields); metrics lines
are appended and fsynced one by one, and a line cut short by a crash ends the usable history. ``summary.json`` says ``running``
from the first moment and ``completed`` only after the last round's checkpoint and the final
adapter are on disk, so a run that did not finish never claims to have. A round is complete once its
checkpoint is; metrics lines of rounds past the last checkpoint are dropped on resume, so no round is
counted twice. The two newest checkpoints are kept, each sealed by a manifest (storage/checkpoint.py),
so a damaged newest one is reported, never loaded, and the run can rewind to the one before.

Every JSON file here is strict JSON: a metric that has no value (NaN, e.g. the causal-lm task's exact match on
plain text) is written as null, as a metric a task does not report is, never as the bare ``NaN`` that other
readers (jq, JavaScript, pandas' strict mode) refuse.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save

from nebula_fl.errors import NebulaError
from nebula_fl.storage.checkpoint import (
    MANIFEST,
    CheckpointDamage,
    CheckpointError,
    folder_name,
    fsync_dir,
    parse_pointer,
    pointer_text,
    read_checkpoint,
    round_of,
    sha256,
    write_checkpoint,
    write_durably,
)
from nebula_fl.storage.durable import write_folder_durably

CONFIG = "config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
ADAPTER = "adapter.safetensors"
MODEL = "model.safetensors"  # a task that exchanges every weight (pre-training) ends with the whole model
PEFT_ADAPTER = "peft-adapter"  # the final adapter as PEFT saves it: what PeftModel.from_pretrained and servers load


def plot_name(metric: str) -> str:
    return f"{metric}_vs_bytes.png"
CHECKPOINTS = "checkpoint"
LATEST = "latest"
STATUSES = ("running", "completed", "failed", "interrupted")


def finite(obj: Any) -> Any:
    """`obj` with every NaN or infinite float (at any depth of dicts, lists and tuples) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **options: Any) -> str:
    """Strict JSON of `obj`, a value-less metric (NaN) as null."""
    return json.dumps(finite(obj), allow_nan=False, **options)


def write_json(path: Path, obj: Any) -> None:
    """Write `obj` as `path` the way checkpoints are: a crash leaves the old file or the new one, never a torn one,
    and the rename itself survives a power loss (summary.json's status is what says whether the run finished).
    Each write has a temp file of its own: two writers at once never rename or remove each other's."""
    write_durably(path, (dumps(obj, indent=2, sort_keys=False) + "\n").encode())
    fsync_dir(path.parent)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) across processes and threads: one read-change-write
    at a time."""
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


class RunFolder:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().resolve()

    # -- config and summary ----------------------------------------------------------------------
    def read_config(self) -> dict[str, Any]:
        try:
            return read_json(self.path / CONFIG)
        except (OSError, ValueError):
            raise NebulaError(f"'{self.path}' is not a nebula-fl run folder (no readable {CONFIG})") from None

    def write_config(self, config: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_json(self.path / CONFIG, config)

    def read_summary(self) -> dict[str, Any]:
        try:
            return read_json(self.path / SUMMARY)
        except (OSError, ValueError):
            return {}

    def update_summary(self, **fields: Any) -> dict[str, Any]:
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"unknown status {fields['status']!r}")
        with _locked(self.path / f".{SUMMARY}.lock"):  # the launcher writes it too
            summary = self.read_summary()
            summary.update(fields)
            summary["updated_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            write_json(self.path / SUMMARY, summary)
        return summary

    # -- metrics ---------------------------------------------------------------------------------
    def rounds(self) -> list[dict[str, Any]]:
        path = self.path / METRICS
        if not path.exists():
            return []
        lines = []
        for raw in path.read_text().splitlines():
            try:
                lines.append(json.loads(raw))
            except ValueError:
                break  # a line cut short by a crash ends the usable history
        return lines

    def append_round(self, line: dict[str, Any]) -> None:
        with (self.path / METRICS).open("a") as handle:
            handle.write(dumps(line) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def truncate_rounds(self, last_round: int) -> None:
        """Keep the metrics of rounds 1..last_round, each once (the last line written for it)."""
        by_round = {line["round"]: line for line in self.rounds() if line.get("round", 0) <= last_round}
        write_durably(self.path / METRICS, "".join(dumps(by_round[r]) + "\n" for r in sorted(by_round)).encode())
        fsync_dir(self.path)

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint_names(self) -> list[str]:
        """The checkpoint folders (``round-NNNNN``), oldest first; damaged ones moved aside are not among them."""
        try:
            found = [p.name for p in (self.path / CHECKPOINTS).iterdir() if round_of(p.name) is not None and p.is_dir()]
        except OSError:
            return []
        return sorted(found, key=lambda name: round_of(name) or 0)

    def has_checkpoint(self) -> bool:
        """Whether any checkpoint is here, intact or not (a new run must not write over it)."""
        return (self.path / CHECKPOINTS / LATEST).exists() or bool(self.checkpoint_names())

    def save_checkpoint(self, *, round: int, adapter: dict[str, np.ndarray], state: dict[str, Any]) -> None:
        """Write round `round`'s checkpoint, point ``latest`` at it, then keep it and the one before it.

        The new folder is complete (manifest included) before it gets its name and before anything
        older is deleted, so a crash at any moment leaves at least one intact checkpoint.
        """
        root = self.path / CHECKPOINTS
        root.mkdir(parents=True, exist_ok=True)
        for stale in [*root.glob(".round-*.tmp"), *root.glob(".round-*.old")]:  # left by a crash mid-write
            shutil.rmtree(stale, ignore_errors=True)
        # a crash before the last pruning, or after a rename but before `latest` moved, left folders it does not keep
        if (committed := self._latest_name()) and (root / committed).is_dir():
            self._prune(keep=committed)
        name = folder_name(round)
        tmp = root / f".{name}.tmp"
        tmp.mkdir()
        digest = write_checkpoint(tmp, round=round, adapter=adapter, state=state)
        target = root / name
        if target.exists():  # the same round saved again: a round repeated after a resume
            old = root / f".{name}.old"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        fsync_dir(root)
        write_durably(root / LATEST, pointer_text(name, digest).encode())
        fsync_dir(root)
        self._prune(keep=name)

    def _latest_name(self) -> str | None:
        """The folder ``latest`` names, or None when it is missing or unreadable (then nothing is pruned)."""
        try:
            return parse_pointer((self.path / CHECKPOINTS / LATEST).read_bytes())[0]
        except (OSError, CheckpointDamage):
            return None

    def _prune(self, *, keep: str) -> None:
        """Delete every checkpoint but `keep` and the newest one before it."""
        root = self.path / CHECKPOINTS
        names = self.checkpoint_names()
        kept = {keep, *[n for n in names if (round_of(n) or 0) < (round_of(keep) or 0)][-1:]}
        for stale_name in names:
            if stale_name not in kept:  # renamed first, so a crash mid-delete leaves no half checkpoint behind
                os.replace(root / stale_name, root / f".{stale_name}.old")
                shutil.rmtree(root / f".{stale_name}.old", ignore_errors=True)

    def load_checkpoint(self) -> tuple[int, dict[str, np.ndarray], dict[str, Any]] | None:
        """(round, global adapter, state) of the last complete round, or None if there is none.

        Every byte is checked against the manifest before it is parsed; any damage raises
        CheckpointError saying which file is damaged and what to do, and nothing else is raised.
        """
        root = self.path / CHECKPOINTS
        name: str | None = None
        try:
            try:
                raw = (root / LATEST).read_bytes()
            except FileNotFoundError:
                if not self.checkpoint_names():
                    return None
                raise CheckpointDamage(LATEST, "is missing") from None
            except OSError as err:
                raise CheckpointDamage(LATEST, f"cannot be read ({err.strerror or err})") from None
            name, digest = parse_pointer(raw)
            if not (root / name).is_dir():
                raise CheckpointDamage(LATEST, f"points to {name}, which does not exist")
            if digest is None and (root / name / MANIFEST).exists():
                raise CheckpointDamage(LATEST, f"lacks the SHA-256 of {name}/{MANIFEST}")
            ckpt = read_checkpoint(root / name, manifest_sha256=digest)
        except CheckpointDamage as damage:
            raise CheckpointError(self._damage_advice(name, damage)) from None
        return ckpt.round, ckpt.adapter, ckpt.state

    def _intact(self, name: str) -> bool:
        try:
            read_checkpoint(self.path / CHECKPOINTS / name)
        except CheckpointDamage:
            return False
        return True

    def _damage_advice(self, name: str | None, damage: CheckpointDamage) -> str:
        root = self.path / CHECKPOINTS
        rewind = f"`nebula-fl run --resume {self.path} --rewind`"
        if damage.file == LATEST:
            what = f"the checkpoint pointer {root / LATEST} is damaged: it {damage.what}"
            candidates = self.checkpoint_names()
        else:
            what = f"checkpoint {root / str(name)} is damaged: {damage}"
            candidates = [n for n in self.checkpoint_names() if (round_of(n) or 0) < (round_of(str(name)) or 0)]
        intact = next((n for n in reversed(candidates) if self._intact(n)), None)
        if intact is None:
            return (f"{what}; no earlier checkpoint is intact: restart this run from round 1 with {rewind} "
                    "(it moves the damaged checkpoints aside), or start a new run with another --out")
        which = f"checkpoint {intact}" if damage.file == LATEST else f"the previous checkpoint {intact}"
        return f"{what}; {which} is intact; resume from it with {rewind} (it moves the damaged ones aside)"

    def rewind_plan(self) -> tuple[int | None, list[str]]:
        """(round of the newest intact checkpoint or None, damaged newer ones) — what rewind would do."""
        damaged = []
        for name in reversed(self.checkpoint_names()):
            if self._intact(name):
                return round_of(name), damaged
            damaged.append(name)
        return None, damaged

    def rewind_checkpoints(self) -> tuple[int | None, list[str]]:
        """Move damaged checkpoints newer than the newest intact one aside (``damaged-round-NNNNN``) and
        point ``latest`` at that one (or remove it: the run restarts from round 1).

        Returns (round resumed from or None, the new names of the folders moved aside).
        """
        root = self.path / CHECKPOINTS
        kept, damaged = self.rewind_plan()
        moved = []
        for name in damaged:
            aside, n = root / f"damaged-{name}", 1
            while aside.exists():
                n += 1
                aside = root / f"damaged-{name}-{n}"
            os.replace(root / name, aside)
            moved.append(aside.name)
        if kept is None:
            (root / LATEST).unlink(missing_ok=True)
        else:
            name = folder_name(kept)
            manifest = root / name / MANIFEST
            text = pointer_text(name, sha256(manifest.read_bytes())) if manifest.exists() else name + "\n"
            write_durably(root / LATEST, text.encode())
        if root.exists():
            fsync_dir(root)
        return kept, moved

    # -- results ---------------------------------------------------------------------------------
    def save_peft_adapter(self, write: Callable[[Path], bool]) -> Path | None:
        """`write(folder)` fills a new folder (PEFT's `save_pretrained`), which then replaces PEFT_ADAPTER whole: a
        run folder never holds a half-written adapter folder under that name. None if `write` declined."""
        final = self.path / PEFT_ADAPTER
        return final if write_folder_durably(final, write) else None

    def save_adapter(self, adapter: dict[str, np.ndarray], *, name: str = ADAPTER) -> None:
        """The final global exchanged tensors: the adapter, or (`name` = MODEL) every weight of a full-exchange task."""
        write_durably(self.path / name, save({k: np.ascontiguousarray(v) for k, v in adapter.items()}))
        fsync_dir(self.path)
