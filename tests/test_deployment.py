"""The documented cluster deployment, as root: `cluster_users.sh` then `cluster.sh` run the trainer as its own user
and the SuperNode and its ClientApp runner as another; the kernel, asked as the SuperNode's user, opens nothing of
the trainer's (data, state folder, policy) but its socket, through which `hello` says nothing of the data."""

import contextlib
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from nebula_fl.launcher.federation import _bin, child_env
from nebula_fl.launcher.plan import free_port, port_free
from nebula_fl.launcher.processes import ProcessSet
from nebula_fl.model.tiny import build_tiny_model
from nebula_fl.security.access import beyond_the_socket, check_access

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "examples" / "across_machines"
TRAINER, NODE, SOCKET_GROUP, OUTSIDER = 61001, 61002, 61003, 61004  # numeric: no account is made on the host
TOPICS = ("business", "entertainment", "politics", "sport", "tech")

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0, reason="the deployment's users need root to set up (CI is root)")]


@contextmanager
def _python_reachable():
    """The deployment's users run this Python. Where it lives under a folder they cannot search (this sandbox's
    interpreter is under /root, mode 0700), the folder is made searchable by others (o+x: not listable) for the
    test and restored after: an installed deployment puts nebula-fl where its service users can run it. Tests on
    other workers take turns under one lock: one restoring /root while another's users still run would refuse it
    (`env: 'nebula-fl': Permission denied`, seen in CI)."""
    with open("/tmp/nebula-fl-python-reachable.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        changed = []
        for folder in [*Path(os.path.realpath(sys.executable)).parents, *REPO.parents, REPO]:
            mode = folder.stat().st_mode
            if not mode & stat.S_IXOTH:
                folder.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
                changed.append((folder, stat.S_IMODE(mode)))
        try:
            yield
        finally:
            for folder, mode in changed:
                folder.chmod(mode)


def _as(uid: int, gid: int, groups: list[int], code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], user=uid, group=gid, extra_groups=groups, capture_output=True,
                          text=True, timeout=60, cwd="/")


def _uids(root_pid: int) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
            uid = proc.uids().effective
        except psutil.Error:
            continue
        for name in ("nebula-fl trainer", "flower-supernode", "nebula-fl clientapp"):
            if name in cmd and "setpriv" not in cmd:
                found.setdefault(name, set()).add(uid)
    return found


def test_the_supernodes_user_opens_nothing_of_the_trainer_but_its_socket():
    base = Path(tempfile.mkdtemp(prefix="nebula-deploy-", dir="/tmp"))
    base.chmod(0o755)  # the deployment's users reach the model and scripts, not what the setup hides
    procs = ProcessSet()
    with _python_reachable():
        _deploy_and_check(base, procs)


def _deploy_and_check(base: Path, procs: ProcessSet) -> None:
    try:
        model = build_tiny_model(base / "model")
        data = base / "data.csv"
        data.write_text("text,label\n" + "".join(f"a {t} story number {i},{t}\n" for i in range(8) for t in TOPICS))
        policy = base / "policy.json"
        policy.write_text(json.dumps({"mode": "client", "min_noise_multiplier": 1.0, "max_epsilon": 8}))
        env = {**child_env(base / ".flwr"), "TRAINER_USER": str(TRAINER), "NODE_USER": str(NODE),
               "SOCKET_GROUP": str(SOCKET_GROUP), "NEBULA_ROOT": str(base / "srv"), "SOCKET_DIR": str(base / "run"),
               "DATA": str(data), "PRIVACY_POLICY": str(policy)}
        setup = subprocess.run(["bash", str(SCRIPTS / "cluster_users.sh")], env=env, capture_output=True, text=True,
                               timeout=60)
        assert setup.returncode == 0, setup.stderr
        trainer_dir, sock = base / "srv" / "trainer", base / "run" / "trainer-0.sock"

        port = free_port()
        procs.start("superlink", [_bin("flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
                                  "--port", str(port)], log_path=base / "superlink.log", env=env, cwd=base)
        del env["PRIVACY_POLICY"]  # cluster.sh finds the copy the setup made in the trainer's folder
        cluster = procs.start("cluster", ["bash", str(SCRIPTS / "cluster.sh")], log_path=base / "cluster.log", env={
            **env, "INSECURE": "1", "CLUSTER_ID": "0", "SUPERLINK": f"127.0.0.1:{port}", "MODEL": str(model),
            "NODE_PORT": str(free_port())})
        deadline = time.monotonic() + 180
        while not (sock.exists() and "nebula-fl clientapp" in _uids(cluster.popen.pid) and not port_free(port)):
            assert cluster.alive() and time.monotonic() < deadline, cluster.log_tail(30)
            time.sleep(0.5)
        time.sleep(2.0)  # the SuperNode's first pull; the runner's first task poll

        # who runs what: the trainer as its user; the SuperNode and the runner as the node's
        uids = _uids(cluster.popen.pid)
        assert uids == {"nebula-fl trainer": {TRAINER}, "flower-supernode": {NODE}, "nebula-fl clientapp": {NODE}}, uids

        # what the SuperNode's user can open: the socket, its key, their folder; nothing else of the trainer's
        paths = [trainer_dir, base / "run", data]
        found = check_access(paths, uid=NODE, gid=NODE, groups=[SOCKET_GROUP])
        opened = {a.path for a in found if a.opens}
        assert opened == {str(base / "run"), str(sock), f"{sock}.key"}, opened
        assert beyond_the_socket(found) == []
        state = {Path(a.path).name for a in found if a.path.startswith(str(trainer_dir / "state"))}
        assert {"state", "trainer.lock", "shard.json", "privacy-policy.json"} <= state, state
        assert all(a.mode in ("0700", "0600") for a in found if a.path.startswith(str(trainer_dir)))
        # ... and through the socket, hello says nothing of the data
        hello = _as(NODE, NODE, [SOCKET_GROUP], f"from nebula_fl.clients.protocol import request; import json; "
                                                f"print(json.dumps(request({str(sock)!r}, {{'op': 'hello'}})[0]))")
        assert hello.returncode == 0, hello.stderr
        assert json.loads(hello.stdout) == {"ok": True, "cluster_id": 0, "workers": 1, "nodes": 1, "device": "cpu",
                                            "precision": "auto", "parallel": "ddp", "privacy_mode": "client"}
        # controls: a user outside the socket's group cannot even connect; and a file the trainer's user leaves
        # readable is found by the same check, so an empty list above means something
        outsider = check_access([base / "run"], uid=OUTSIDER, gid=OUTSIDER)
        assert not any(a.opens for a in outsider if a.kind == "socket")
        leak = trainer_dir / "state" / "left-open.txt"
        leak.write_text("x")
        leak.chmod(0o644)
        os.chmod(trainer_dir, 0o755)
        os.chmod(trainer_dir / "state", 0o755)
        assert [a.path for a in beyond_the_socket(check_access(paths, uid=NODE, gid=NODE, groups=[SOCKET_GROUP]))] \
            == [str(trainer_dir), str(trainer_dir / "state"), str(leak)]
    finally:
        procs.stop_all()
        shutil.rmtree(base, ignore_errors=True)


def test_check_access_names_what_another_user_opens_and_exits_one_for_anything_beyond_a_socket(tmp_path):
    base = Path(tempfile.mkdtemp(prefix="nebula-access-", dir="/tmp"))
    try:
        with _python_reachable():
            _check_access_cli(base, tmp_path / "out.json")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _check_access_cli(base: Path, out: Path) -> None:
    from nebula_fl.cli import main

    def check() -> tuple[int, dict]:
        with out.open("w") as handle, contextlib.redirect_stdout(handle):
            status = main(["check-access", "--user", "nobody", "--json", str(base)])
        return status, json.loads(out.read_text())

    base.chmod(0o755)
    for name, mode in (("private", 0o600), ("open", 0o644)):
        (base / name).write_text("x")
        (base / name).chmod(mode)
    status, report = check()
    assert status == 1 and report["beyond_the_socket"] == [str(base), str(base / "open")]
    assert {Path(p["path"]).name: p["opens"] for p in report["paths"]} == {base.name: True, "open": True,
                                                                          "private": False}
    (base / "open").chmod(0o600)
    base.chmod(0o700)
    status, report = check()
    assert status == 0 and report["beyond_the_socket"] == [] and not any(p["opens"] for p in report["paths"])
