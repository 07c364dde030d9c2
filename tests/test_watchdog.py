"""The launcher's watchdog, on real process trees of `sleep`: a SIGKILLed launcher leaves nothing behind,
a launcher that says "done" keeps what it did not ask to stop, and a reused pid is never signalled."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from nebula_fl.launcher.watchdog import Remembered, Watchdog
from tests.conftest import same_start

# A process tree like Flower's: a root with a child, a grandchild in a new session (SuperExec-like),
# and a middle process that exits after 1.5 s, orphaning its child (reparented out of the tree).
TREE = "sleep 300 & setsid bash -c 'sleep 300 & wait' & bash -c 'setsid sleep 300 & sleep 1.5' & wait"

# Started as if it were `nebula-fl run`: the watchdog first, then a tree it does not tie to its own life.
FAKE_LAUNCHER = textwrap.dedent("""
    import json, subprocess, sys, time
    from pathlib import Path
    from nebula_fl.launcher.watchdog import Watchdog

    dog = Watchdog(log_path=Path(sys.argv[1]), interval=0.2, grace=2.0)
    tree = subprocess.Popen(["bash", "-c", sys.argv[2]], start_new_session=True)
    dog.watch(tree.pid)
    print(json.dumps({"watchdog": dog.popen.pid, "tree": tree.pid}), flush=True)
    time.sleep(600)
""")


def _same(pid: int, created: float) -> psutil.Process | None:
    try:
        proc = psutil.Process(pid)
        if same_start(proc.create_time(), created) and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.Error:
        pass
    return None


def _kill_all(seen: dict[int, tuple[float, str]]) -> None:
    for pid, (created, _) in seen.items():
        if (proc := _same(pid, created)) is not None:
            proc.kill()


def test_a_sigkilled_launcher_leaves_no_process_of_its_tree(tmp_path):
    log = tmp_path / "watchdog.log"
    launcher = subprocess.Popen([sys.executable, "-c", FAKE_LAUNCHER, str(log), TREE], stdout=subprocess.PIPE, text=True)
    seen: dict[int, tuple[float, str]] = {}
    try:
        pids = json.loads(launcher.stdout.readline())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # record the tree while the orphan still hangs from it
            for proc in psutil.Process(launcher.pid).children(recursive=True):
                try:
                    # the latest command line: a child caught between its fork and its exec shows its parent's
                    seen[proc.pid] = (proc.create_time(), " ".join(proc.cmdline()))
                except psutil.Error:
                    pass
            if sum(cmd == "sleep 300" for _, cmd in seen.values()) == 3:
                break
            time.sleep(0.05)
        sleeps = [pid for pid, (_, cmd) in seen.items() if cmd == "sleep 300"]
        assert len(sleeps) == 3, seen
        time.sleep(2.0)  # the middle process has exited: its sleep now hangs from no process of the tree
        orphan = [pid for pid in sleeps if pid not in {p.pid for p in psutil.Process(pids["tree"]).children(True)}]
        assert len(orphan) == 1 and _same(orphan[0], seen[orphan[0]][0]) is not None
        assert all(_same(pid, seen[pid][0]) for pid in [*sleeps, pids["tree"], pids["watchdog"]])

        launcher.kill()  # SIGKILL: the launcher cannot stop anything itself
        launcher.wait()
        started = time.monotonic()
        deadline = started + 8
        while time.monotonic() < deadline and any(_same(pid, c) for pid, (c, _) in seen.items()):
            time.sleep(0.1)
        survivors = [f"{pid}: {cmd}" for pid, (c, cmd) in seen.items() if _same(pid, c)]
        assert survivors == [], survivors
        assert time.monotonic() - started < 6  # grace 2 s, then SIGKILL (bash ignores nothing here: sooner)
        assert "the launcher is gone" in log.read_text() and "exiting" in log.read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        _kill_all(seen)


def test_done_lets_the_watchdog_exit_without_touching_anything(tmp_path):
    sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        dog = Watchdog(log_path=tmp_path / "watchdog.log", interval=0.1)
        dog.watch(sleeper.pid)
        time.sleep(0.5)
        started = time.monotonic()
        dog.release()
        assert dog.popen.returncode == 0 and time.monotonic() - started < 2
        time.sleep(0.3)
        assert sleeper.poll() is None  # the launcher said it stopped everything: the watchdog must not act
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_watchdog_whose_pipe_closes_stops_a_term_ignoring_process_with_sigkill(tmp_path):
    stubborn = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 300 & wait; wait"], start_new_session=True)
    dog = Watchdog(log_path=tmp_path / "watchdog.log", interval=0.1, grace=1.0)
    try:
        dog.watch(stubborn.pid)
        time.sleep(0.5)
        children = psutil.Process(stubborn.pid).children(recursive=True)
        assert children, "the tree has a child"
        dog.popen.stdin.close()  # as when the launcher dies: EOF without "done"
        assert dog.popen.wait(10) == 1
        assert stubborn.wait(5) == -signal.SIGKILL  # it ignored SIGTERM: the grace ran out
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    finally:
        for proc in (stubborn, dog.popen):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_reused_pid_is_never_signalled():
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        created = psutil.Process(bystander.pid).create_time()
        remembered = Remembered()
        remembered.add(bystander.pid, created - 5.0)  # the pid once belonged to another, older process
        assert remembered.alive() == []
        assert remembered.stop(grace=0.2) == 0
        assert bystander.poll() is None
        same = Remembered()
        same.add(bystander.pid, created)
        assert [p.pid for p in same.alive()] == [bystander.pid]
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.parametrize("line", [b"watch notapid\n", b"bogus words\n", b"\n"])
def test_malformed_lines_do_not_kill_the_watchdog(tmp_path, line):
    """A garbled line must not end the watchdog early (it would then protect nothing)."""
    dog = Watchdog(log_path=tmp_path / "watchdog.log", interval=0.1)
    try:
        dog.popen.stdin.write(line)
        dog.popen.stdin.flush()
        time.sleep(0.5)
        assert dog.popen.poll() is None, (tmp_path / "watchdog.log").read_text()
    finally:
        dog.release()
    assert dog.popen.returncode == 0


# A process tied to one that is not its parent, as a trainer's ranks (forked by a fork server) are to their supervisor.
TIED = "import sys, time; from nebula_fl.lifetime import die_with_process; die_with_process(int(sys.argv[1])); time.sleep(60)"


def test_a_process_tied_to_another_dies_when_that_one_is_killed_or_already_gone():
    other = subprocess.Popen(["sleep", "300"])
    tied = subprocess.Popen([sys.executable, "-c", TIED, str(other.pid)])
    try:
        time.sleep(1.0)  # tied, and waiting
        assert tied.poll() is None
        other.kill()
        other.wait()
        assert tied.wait(timeout=5) == -signal.SIGKILL
        late = subprocess.run([sys.executable, "-c", TIED, str(other.pid)], timeout=30)  # gone before it was tied
        assert late.returncode == -signal.SIGKILL
    finally:
        for proc in (other, tied):
            proc.kill()
            proc.wait()
