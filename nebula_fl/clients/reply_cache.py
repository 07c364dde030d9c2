"""Each (federation, round) is released at most once: the exact reply bytes, kept for replays.

A server that sends a round again — after its own resume, or to collect a second noised release
of the same round and average the noise away — gets the very bytes it got the first time. The
frame is written (atomically, fsynced) before it is sent. The newest `keep` frames of a federation
are kept whole; older ones shrink to an empty marker, so a replay of an old round is refused
instead of retrained. Rounds older than the newest released one are never trained again either.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

FEDERATION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
FRAME = "round-{:06d}.frame"


class ReplyCache:
    def __init__(self, *, root: str | Path, keep: int = 16) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep

    def _folder(self, federation: str) -> Path:
        if not FEDERATION_ID.fullmatch(federation):  # it names a folder: never let the server pick a path
            raise ValueError(f"federation id {federation!r} is not a plain name of letters, digits, '-' and '_'")
        return self.root / federation

    def released(self, federation: str) -> list[int]:
        """Rounds of `federation` this cluster has released (whole frame or marker), ascending."""
        folder = self._folder(federation)
        if not folder.is_dir():
            return []
        rounds = []
        for path in folder.glob("round-*.frame"):
            match = re.fullmatch(r"round-(\d+)\.frame", path.name)  # 6 digits at least, more past round 999,999
            if match and path.name == FRAME.format(int(match.group(1))):  # one name per round: the one put() writes
                rounds.append(int(match.group(1)))
        return sorted(rounds)

    def get(self, federation: str, server_round: int) -> bytes | None:
        """The frame sent for this round; b"" if it was released but is no longer kept; None if never."""
        path = self._folder(federation) / FRAME.format(server_round)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def put(self, federation: str, server_round: int, frame: bytes) -> None:
        if not frame:
            raise ValueError("an empty frame cannot be cached (empty marks an evicted round)")
        folder = self._folder(federation)
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / FRAME.format(server_round)
        tmp = target.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(frame)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        for old in self.released(federation)[: -self.keep]:
            marker = folder / FRAME.format(old)
            if marker.stat().st_size:
                marker.write_bytes(b"")
