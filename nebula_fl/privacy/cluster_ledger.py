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

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from nebula_fl.errors import NebulaError
from nebula_fl.privacy.ledger import Entry, check_mechanism, epsilon_of, merge_entry
from nebula_fl.storage.durable import fsync_dir

LEDGER_FILE = "privacy-ledger.jsonl"
FORMAT = 1
TAIL_BYTES = 1 << 16  # a ledger line is well under this: a longer unterminated tail is not one torn line


class LedgerError(NebulaError):
    """The ledger file cannot be trusted; the trainer refuses to release anything until it is fixed."""


def _parse(line: bytes) -> dict[str, Any]:
    """One ledger line as an entry; ValueError, KeyError or TypeError if it is not one."""
    entry = json.loads(line)
    check_mechanism(noise_multiplier=entry["noise_multiplier"], sample_rate=entry["sample_rate"], steps=entry["steps"])
    if entry.get("mode") not in ("sample", "client"):
        raise ValueError(f"mode {entry.get('mode')!r}")
    return entry


def _cut_torn_tail(fd: int, path: Path) -> int:
    """The file's size once it ends with a line end: a line torn by a crash mid-append (it never left the
    cluster) is cut off, a whole entry that lacks only its line end (a hand-restored file) is ended. Appended
    after either, the next release would be glued to it and the file read as damaged."""
    size = os.fstat(fd).st_size
    tail = os.pread(fd, min(size, TAIL_BYTES), size - min(size, TAIL_BYTES))
    if not tail or tail.endswith(b"\n"):
        return size
    cut = tail.rfind(b"\n")
    if cut < 0 and len(tail) < size:
        raise LedgerError(f"privacy ledger '{path}' ends in over {TAIL_BYTES} bytes without a line end; restore it "
                          "from a backup before the trainer releases anything again")
    try:
        whole = bool(_parse(tail[cut + 1:]))  # `_read` counts it as an entry: keep it
    except (ValueError, KeyError, TypeError):
        whole = False
    if whole:
        os.write(fd, b"\n")
    else:
        os.ftruncate(fd, size - len(tail) + cut + 1)
    os.fsync(fd)
    return os.fstat(fd).st_size


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
                entry = _parse(line)
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
               steps: int, delta: float, no_budget: bool = False) -> dict[str, Any]:
        """Append one release and make it durable before returning (call before the release leaves). `no_budget`:
        the cluster's policy set no budget (mode 'off'), so it ran what the server asked with no cap of its own."""
        if mode not in ("sample", "client"):
            raise ValueError(f"ledger mode must be 'sample' or 'client', got {mode!r}")
        sigma, q, k = check_mechanism(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps)
        entry = {"v": FORMAT, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "federation": str(federation),
                 "round": int(round), "mode": mode, "noise_multiplier": sigma, "sample_rate": q, "steps": k,
                 "delta": float(delta), "accountant": self.accountant, **({"no_budget": True} if no_budget else {})}
        try:
            self._append((json.dumps(entry) + "\n").encode())
        except OSError as err:
            raise LedgerError(f"could not append to the privacy ledger '{self.path}' ({err.strerror or err}); nothing "
                              "was recorded: free disk space or fix the state folder's permissions") from None
        self._entries.append(entry)
        return entry

    def _append(self, line: bytes) -> None:
        """Write one whole line and make it durable (file and, when new, its folder entry), or leave the file as it
        was: a failed append is cut off again, so no torn line ever sits before a later one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            start = _cut_torn_tail(fd, self.path)
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError:
                with contextlib.suppress(OSError):  # if this fails too, the next append cuts the torn tail
                    os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)
        if created:
            fsync_dir(self.path.parent)

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
