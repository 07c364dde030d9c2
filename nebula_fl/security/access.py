"""What another user of a cluster host can open: the check of a deployment that runs the trainer as its own user.

The trainer is the cluster's trust boundary: its data, state folder (identity and secure-aggregation keys, the
privacy ledger, snapshots, cached replies) and policy must be unreadable by the SuperNode's user, whose
processes talk to the server, and its socket the one way in. Modes and owners say so only indirectly (a group,
an ACL, a parent folder); this asks the kernel: as root, it lists every path under the folders given, then a
child process running as the other user tries to open each one (read a file, list a folder, connect to a
socket) and reports what worked.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from nebula_fl.errors import NebulaError

# Run as the other user: for each path, whether it opens (a socket: whether it accepts a connection).
_PROBE = r"""
import json, os, socket, stat, sys
out = {}
for path in json.loads(sys.stdin.read()):
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            os.listdir(path)
        elif stat.S_ISSOCK(mode):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(2.0)
            try:
                s.connect(path)
            finally:
                s.close()
        else:
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        out[path] = True
    except OSError:
        out[path] = False
print(json.dumps(out))
"""


@dataclass(frozen=True, kw_only=True)
class Access:
    path: str
    kind: str  # "folder", "file" or "socket"
    owner: str  # "uid:gid"
    mode: str  # e.g. "0700"
    opens: bool  # whether the other user could open it


def _kind(mode: int) -> str:
    return "folder" if stat.S_ISDIR(mode) else "socket" if stat.S_ISSOCK(mode) else "file"


def _every_path(roots: Iterable[Path]) -> list[Path]:
    found: list[Path] = []
    for root in roots:
        if not root.exists():
            raise NebulaError(f"'{root}' does not exist; give the cluster's state folder, data, policy and socket")
        found.append(root)
        if root.is_dir() and not root.is_symlink():
            for folder, dirs, files in os.walk(root):
                found += [Path(folder) / name for name in sorted(dirs) + sorted(files)]
    return found


def check_access(paths: Iterable[str | Path], *, uid: int, gid: int, groups: Iterable[int] = ()) -> list[Access]:
    """What the user `uid` (primary group `gid`, supplementary `groups`) can open of every path under `paths`.
    Needs root (to list what that user may not, and to become it)."""
    if os.geteuid() != 0:
        raise NebulaError("checking another user's access needs root (it lists folders that user may not and runs "
                          "a probe as that user); run it with sudo")
    every = _every_path(Path(p).expanduser().resolve() for p in paths)
    try:
        probe = subprocess.run([sys.executable, "-I", "-c", _PROBE], input=json.dumps([str(p) for p in every]),
                               capture_output=True, text=True, user=uid, group=gid, extra_groups=list(groups),
                               cwd="/", timeout=120)
    except OSError as err:
        raise NebulaError(f"uid {uid} cannot run this Python ({sys.executable}: {err.strerror}); install nebula-fl "
                          "where the cluster's service users can run it") from None
    if probe.returncode != 0:
        raise NebulaError(f"the probe running as uid {uid} failed: {probe.stderr.strip().splitlines()[-1:]}; can that "
                          "user run this Python?")
    opens = json.loads(probe.stdout)
    out = []
    for path in every:
        st = path.lstat()
        out.append(Access(path=str(path), kind=_kind(st.st_mode), owner=f"{st.st_uid}:{st.st_gid}",
                          mode=f"{stat.S_IMODE(st.st_mode):04o}", opens=bool(opens[str(path)])))
    return out


def user_ids(user: str) -> tuple[int, int, list[int]]:
    """A user name or uid as (uid, primary gid, supplementary gids), as a login of that user would have them."""
    import grp
    import pwd

    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        raise NebulaError(f"no such user {user!r}; give the SuperNode's user (name or uid)") from None
    groups = [g.gr_gid for g in grp.getgrall() if entry.pw_name in g.gr_mem]
    return entry.pw_uid, entry.pw_gid, groups


def beyond_the_socket(found: list[Access]) -> list[Access]:
    """What the other user opens besides the way in: a trainer's socket, its key file and the folder holding them."""
    sockets = {a.path for a in found if a.kind == "socket"}
    way_in = sockets | {f"{s}.key" for s in sockets} | {str(Path(s).parent) for s in sockets}
    return [a for a in found if a.opens and a.path not in way_in]
