"""The run folder: config, per-round metrics, summary, checkpoints, final adapter and plot.

Every file is written whole or not at all (temp file + rename). ``summary.json`` says ``running``
from the first moment and ``completed`` only after the last round's checkpoint and the final
adapter are on disk, so a run that did not finish never claims to have. A round is complete once its
checkpoint is; metrics lines of rounds past the last checkpoint are dropped on resume, so no round is
counted twice.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from nebula_fl.errors import NebulaError
from nebula_fl.server.checkpoint import join_state, split_state

CONFIG = "config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
ADAPTER = "adapter.safetensors"
PLOT = "accuracy_vs_bytes.png"
CHECKPOINTS = "checkpoint"
STATUSES = ("running", "completed", "failed", "interrupted")


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


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
            handle.write(json.dumps(line) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def truncate_rounds(self, last_round: int) -> None:
        """Keep the metrics of rounds 1..last_round, each once (the last line written for it)."""
        by_round = {line["round"]: line for line in self.rounds() if line.get("round", 0) <= last_round}
        tmp = self.path / f".{METRICS}.tmp"
        tmp.write_text("".join(json.dumps(by_round[r]) + "\n" for r in sorted(by_round)))
        os.replace(tmp, self.path / METRICS)

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, *, round: int, adapter: dict[str, np.ndarray], state: dict[str, Any]) -> None:
        root = self.path / CHECKPOINTS
        root.mkdir(parents=True, exist_ok=True)
        name = f"round-{round:05d}"
        tmp = root / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        skeleton, arrays = split_state(state)
        save_file({k: np.ascontiguousarray(v) for k, v in adapter.items()}, str(tmp / ADAPTER))
        save_file(arrays, str(tmp / "state.safetensors"))
        write_json(tmp / "state.json", {"round": round, "state": skeleton})
        shutil.rmtree(root / name, ignore_errors=True)
        os.replace(tmp, root / name)
        latest = root / ".latest.tmp"
        latest.write_text(name)
        os.replace(latest, root / "latest")
        for old in sorted(p for p in root.glob("round-*") if p.name != name):
            shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self) -> tuple[int, dict[str, np.ndarray], dict[str, Any]] | None:
        """(round, global adapter, state) of the last complete round, or None if there is none."""
        root = self.path / CHECKPOINTS
        try:
            name = (root / "latest").read_text().strip()
        except OSError:
            return None
        folder = root / name
        meta = read_json(folder / "state.json")
        state = join_state(meta["state"], load_file(str(folder / "state.safetensors")))
        return int(meta["round"]), load_file(str(folder / ADAPTER)), state

    # -- results ---------------------------------------------------------------------------------
    def save_adapter(self, adapter: dict[str, np.ndarray]) -> None:
        tmp = self.path / f".{ADAPTER}.tmp"
        save_file({k: np.ascontiguousarray(v) for k, v in adapter.items()}, str(tmp))
        os.replace(tmp, self.path / ADAPTER)
