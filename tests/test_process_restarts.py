"""The launcher's process handling on real processes: children die with a SIGKILLed launcher (parent-death
signal), a dead cluster service is started again with the same argv and its log appended, at most 3 times,
and the SuperLink's death is never retried."""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from rich.console import Console

from nebula_fl.config import RunConfig
from nebula_fl.errors import NebulaError
from nebula_fl.launcher.federation import MAX_RESTARTS, Federation
from nebula_fl.launcher.plan import LaunchPlan
from nebula_fl.launcher.processes import ProcessSet

SERVICE = "echo started $$; setsid sleep 300 & wait"  # a service that leaves a child in another session


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_child_gets_sigterm_when_the_process_that_started_it_is_sigkilled(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from nebula_fl.launcher.processes import ProcessSet
        item = ProcessSet().start("svc", ["sleep", "300"], log_path=Path({str(tmp_path / "svc.log")!r}), env=dict(os.environ))
        print(item.popen.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    try:
        assert psutil.Process(child).status() != psutil.STATUS_ZOMBIE
        assert psutil.Process(child).ppid() == launcher.pid
        assert os.getsid(child) == child  # its own session, as before
        launcher.kill()
        launcher.wait()
        assert _gone(child, 3), "the child outlived its SIGKILLed parent"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_restart_stops_what_the_dead_one_left_and_starts_the_same_argv_appending_its_log(tmp_path):
    procs = ProcessSet()
    log = tmp_path / "trainer-0.log"
    first = procs.start("trainer-0", ["bash", "-c", SERVICE], log_path=log, env=dict(os.environ))
    procs.start("supernode-0", ["sleep", "300"], log_path=tmp_path / "supernode-0.log", env=dict(os.environ))
    try:
        time.sleep(0.5)
        procs.remember_descendants()
        (left,) = [pid for pid in first.known if pid != first.popen.pid]
        first.popen.send_signal(signal.SIGKILL)
        first.popen.wait()
        assert procs.dead_services() == [first] and not _gone(left, 0.2)  # its child lives on, orphaned
        again = procs.restart(first)
        assert _gone(left, 5), "restart left the dead service's child running"
        assert again.argv == first.argv and again.restarts == 1 and again.alive()
        assert procs.items[0] is again and procs.dead_services() == []  # same place in the stop order
        time.sleep(0.5)
        assert log.read_text().count("started") == 2  # one log, appended
    finally:
        procs.stop_all(grace=2)
    assert all(not item.alive() for item in procs.items)


def _federation(tmp_path) -> Federation:
    plan = LaunchPlan(config=RunConfig(), out=tmp_path / "run", clusters=2, workers=[1, 1], devices=["cpu", "cpu"],
                      port=0, resume=False)
    return Federation(plan, console=Console(file=io.StringIO(), width=200))


def test_a_cluster_service_is_restarted_three_times_then_the_run_stops(tmp_path):
    fed = _federation(tmp_path)
    fed.procs.start("wan-1", ["sleep", "300"], log_path=fed.logs / "wan-1.log", env=dict(os.environ))
    try:
        for n in range(1, MAX_RESTARTS + 2):
            (item,) = fed.procs.items
            item.popen.send_signal(signal.SIGKILL)
            item.popen.wait()
            if n <= MAX_RESTARTS:
                fed._restart(item, fed.console)
                assert f"cluster 1: WAN proxy exited with status -9; restarted ({n} of 3)" in fed.console.file.getvalue()
            else:
                with pytest.raises(NebulaError, match="cluster 1: WAN proxy exited with status -9 after 3 restarts"):
                    fed._restart(item, fed.console)
    finally:
        fed.procs.stop_all(grace=2)
    assert [r["restarted"] for r in fed.restarts] == [True, True, True, False]
    assert all(r["service"] == "wan" and r["cluster"] == 1 and r["exit_code"] == -9 for r in fed.restarts)
    json.dumps(fed.restarts)  # what goes into summary.json


def test_the_superlinks_death_is_never_retried(tmp_path):
    fed = _federation(tmp_path)
    item = fed.procs.start("superlink", ["bash", "-c", "exit 3"], log_path=fed.logs / "superlink.log",
                           env=dict(os.environ))
    item.popen.wait()
    with pytest.raises(NebulaError, match="superlink exited with status 3 during the run"):
        fed._restart(item, fed.console)
    assert fed.restarts == [] and fed.procs.items == [item]
