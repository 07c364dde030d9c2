"""The cluster's own privacy ledger: every release of its data, on disk, append-only, for its whole life.

It belongs to the data, not to one federation or one process: it lives in the trainer's state
folder (``privacy-ledger.jsonl``), survives restarts and new federation ids, and is only ever
appended to (one JSON line per release, flushed and fsynced before the release leaves the
cluster). Restoring a training snapshot never touches it, so nothing a server does — resuming,
replaying a round, starting a new federation — can lower what it records as spent.

Releases are kept per mode, because the two protect different units: ``sample`` releases (DP-SGD
steps, per example) and ``client`` releases (one noised update, for the cluster's data as a whole)
are composed separately; ε is Opacus's accountant over each mode's history (``privacy/ledger.py``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from nebula_fl.errors import NebulaError
from nebula_fl.privacy.ledger import Entry, check_mechanism, epsilon_of, merge_entry

LEDGER_FILE = "privacy-ledger.jsonl"
FORMAT = 1


class LedgerError(NebulaError):
    """The ledger file cannot be trusted; the trainer refuses to release anything until it is fixed."""


class ClusterLedger:
    """Append-only record of this cluster's releases; ε per mode by an Opacus accountant."""

    def __init__(self, *, path: str | Path, accountant: str = "prv") -> None:
        self.path = Path(path)
        self.accountant = accountant
        self._entries: list[dict[str, Any]] = self._read()

    def _read(self) -> list[dict[str, Any]]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        lines = raw.split(b"\n")
        entries = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                check_mechanism(noise_multiplier=entry["noise_multiplier"], sample_rate=entry["sample_rate"],
                                steps=entry["steps"])
                if entry.get("mode") not in ("sample", "client"):
                    raise ValueError(f"mode {entry.get('mode')!r}")
            except (ValueError, KeyError, TypeError) as err:
                if number == len(lines) and not raw.endswith(b"\n"):
                    break  # a line torn by a crash while it was written: that release never left
                raise LedgerError(
                    f"privacy ledger '{self.path}' is damaged at line {number} ({err}); it is this cluster's record "
                    "of spent privacy: restore it from a backup before the trainer releases anything again"
                ) from None
            entries.append(entry)
        return entries

    # -- recording -------------------------------------------------------------------------------
    def record(self, *, federation: str, round: int, mode: str, noise_multiplier: float, sample_rate: float,
               steps: int, delta: float) -> dict[str, Any]:
        """Append one release and make it durable before returning (call before the release leaves)."""
        if mode not in ("sample", "client"):
            raise ValueError(f"ledger mode must be 'sample' or 'client', got {mode!r}")
        sigma, q, k = check_mechanism(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps)
        entry = {"v": FORMAT, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "federation": str(federation),
                 "round": int(round), "mode": mode, "noise_multiplier": sigma, "sample_rate": q, "steps": k,
                 "delta": float(delta), "accountant": self.accountant}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(entry) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            written = os.write(fd, line)
            if written != len(line):
                raise LedgerError(f"could not append to the privacy ledger '{self.path}' (disk full?)")
            os.fsync(fd)
        finally:
            os.close(fd)
        self._entries.append(entry)
        return entry

    # -- queries ---------------------------------------------------------------------------------
    def entries(self, *, mode: str | None = None, federation: str | None = None) -> list[dict[str, Any]]:
        return [dict(e) for e in self._entries
                if (mode is None or e["mode"] == mode) and (federation is None or e["federation"] == federation)]

    def history(self, *, mode: str, federation: str | None = None) -> list[Entry]:
        history: list[Entry] = []
        for e in self.entries(mode=mode, federation=federation):
            merge_entry(history, (float(e["noise_multiplier"]), float(e["sample_rate"]), int(e["steps"])))
        return history

    def epsilon(self, *, mode: str, delta: float, federation: str | None = None) -> float:
        return epsilon_of(self.history(mode=mode, federation=federation), accountant=self.accountant, delta=delta)

    def epsilon_after(self, *, mode: str, delta: float, noise_multiplier: float, sample_rate: float, steps: int) -> float:
        history = self.history(mode=mode)
        merge_entry(history, check_mechanism(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps))
        return epsilon_of(history, accountant=self.accountant, delta=delta)

    def steps(self, *, mode: str, federation: str | None = None) -> int:
        return sum(int(e["steps"]) for e in self.entries(mode=mode, federation=federation))

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "accountant": self.accountant, "entries": self.entries()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Append-only: a state may only confirm what the file holds; one that would lower it is refused."""
        theirs = state.get("entries") if isinstance(state, dict) else None
        if not isinstance(theirs, list) or len(theirs) > len(self._entries) or theirs != self._entries[: len(theirs)]:
            raise LedgerError(
                f"refusing to load a privacy ledger state that is not a prefix of '{self.path}': "
                "the ledger is append-only and is never rolled back"
            )
