"""Files written whole or not at all, and renames that survive a power loss: the one way the server's run folder
and a cluster's ledger put bytes on disk (no project imports: every layer may use it)."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path


def write_durably(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (temp file, fsync, rename); the caller fsyncs the folder (fsync_dir) once
    it has renamed all it writes there. A write that fails removes its temp file and leaves `path` as it was.
    Each write has a temp file of its own: two writers at once never rename or remove each other's."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        with tmp.open("xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_dir(path: Path) -> None:
    """Make the entries renamed or created in folder `path` durable (file contents are fsynced on their own)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_folder_durably(path: Path, fill: Callable[[Path], bool]) -> bool:
    """Make folder `path` whole or not at all: `fill(folder)` writes a fresh sibling folder, whose files are then
    fsynced and which replaces `path` (an older one removed). False, and `path` untouched, when `fill` declines; a
    `fill` that fails leaves nothing behind either."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    old = path.with_name(f".{path.name}.{secrets.token_hex(8)}.old")
    tmp.mkdir()
    try:
        if not fill(tmp):
            return False
        for item in (f for f in tmp.rglob("*") if f.is_file()):
            with item.open("rb") as handle:
                os.fsync(handle.fileno())
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        fsync_dir(path.parent)
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
