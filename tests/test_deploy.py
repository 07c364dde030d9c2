"""A site's and a server's config files, the supervisor that keeps their services running, the health endpoint, and
the systemd units in examples/sites (checked by systemd's own `systemd-analyze verify`).

The supervisor runs real processes (small Python commands); time is driven through `step(now)`, so a backoff of a
minute is checked without waiting for it. A federation under `nebula-fl server` and `nebula-fl site`, each host on
its own network stack, is tests/test_multihost.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from nebula_fl.cli import main
from nebula_fl.deploy.health import HealthServer
from nebula_fl.deploy.site import REFUSED_WHY, SUPERNODE_REFUSED, site_services
from nebula_fl.deploy.site_config import SiteConfig
from nebula_fl.deploy.supervisor import BACKOFF_S, STABLE_S, Service, Supervisor
from nebula_fl.errors import NebulaError
from nebula_fl.launcher.plan import free_port
from tests.conftest import REPO, still_running


def service(name: str, code: str, **kwargs) -> Service:
    return Service(name=name, argv=[sys.executable, "-c", code], env=dict(os.environ), **kwargs)


def settle(sup: Supervisor, name: str) -> int:
    """Wait for `name`'s process to exit; its status."""
    state = next(s for s in sup.states if s.service.name == name)
    return state.managed.popen.wait(30)


def test_a_dying_service_is_restarted_after_growing_delays_that_start_over_once_it_stayed_up(tmp_path):
    said: list[str] = []
    sup = Supervisor([service("flaky", "print('up'); raise SystemExit(3)")], log_dir=tmp_path, say=said.append)
    try:
        sup.start_all()
        (state,) = sup.states
        for death, delay in enumerate(BACKOFF_S[:3], start=1):
            assert settle(sup, "flaky") == 3
            now = time.monotonic()
            sup.step(now)
            assert state.deaths == death and state.due == pytest.approx(now + delay)
            ok, report = sup.health()
            assert not ok and report["services"]["flaky"]["state"] == "restarting"
            assert report["services"]["flaky"]["last_exit"] == 3
            sup.step(now + delay - 0.01)
            assert state.restarts == death - 1  # not before its time
            sup.step(now + delay)
            assert state.restarts == death
        assert f"flaky: exited 3 after 0 s; restarting in {BACKOFF_S[2]:g} s (death 3 in a row" in said[-2]
        # up long enough: its next death counts as the first again
        settle(sup, "flaky")
        state.started_at -= STABLE_S
        now = time.monotonic()
        sup.step(now)
        assert state.deaths == 1 and state.due == pytest.approx(now + BACKOFF_S[0])
        assert (tmp_path / "flaky.log").read_text().count("up") == 4  # one log, appended across restarts
    finally:
        sup.stop(grace=2)


def test_a_service_that_refuses_its_input_ends_the_supervisor_with_its_line(tmp_path):
    code = "import sys; print('nebula-fl: error: --workers 0: a trainer needs 1 or more', file=sys.stderr); sys.exit(2)"
    sup = Supervisor([service("trainer", code), service("after", "import time; time.sleep(60)")], log_dir=tmp_path,
                     say=lambda _: None)
    try:
        sup.start_all()
        settle(sup, "trainer")
        sup.step(time.monotonic())
        assert sup.failure == "trainer refused its input (exit 2): nebula-fl: error: --workers 0: a trainer needs 1 or more"
        assert sup.states[0].due is None  # not restarted: it would fail the same way
    finally:
        sup.stop(grace=2)


def test_flowers_refusal_is_retried_at_a_steady_pace_and_said_once(tmp_path):
    said: list[str] = []
    # as flwr 1.42's SuperNode does: the code in its log, exit status 1
    node = service("supernode", "print('ERROR :     Exit Code: 305'); raise SystemExit(1)",
                   retry={SUPERNODE_REFUSED: (10.0, REFUSED_WHY)})
    sup = Supervisor([node], log_dir=tmp_path, say=said.append)
    try:
        sup.start_all()
        for _ in range(3):
            settle(sup, "supernode")
            now = time.monotonic()
            sup.step(now)
            assert sup.states[0].due == pytest.approx(now + 10.0) and sup.states[0].deaths == 0
            sup.step(now + 10.0)
        assert sum(REFUSED_WHY in line for line in said) == 1
        assert sup.health()[1]["services"]["supernode"]["restarts"] == 3
    finally:
        sup.stop(grace=2)


def test_a_refusal_earlier_in_the_log_does_not_make_a_later_crash_a_retry(tmp_path):
    (tmp_path / "supernode.log").write_text("ERROR :     Exit Code: 305\n" * 3)  # an earlier start's refusals
    said: list[str] = []
    sup = Supervisor([service("supernode", "raise SystemExit(1)", retry={SUPERNODE_REFUSED: (10.0, REFUSED_WHY)})],
                     log_dir=tmp_path, say=said.append)
    try:
        sup.start_all()
        settle(sup, "supernode")
        now = time.monotonic()
        sup.step(now)
        assert sup.states[0].deaths == 1 and sup.states[0].due == pytest.approx(now + BACKOFF_S[0])
        assert not any(REFUSED_WHY in line for line in said)
    finally:
        sup.stop(grace=2)


def test_sigterm_stops_the_services_in_reverse_order_and_leaves_nothing(tmp_path):
    order = tmp_path / "order"
    code = ("import signal, sys, time\n"
            "def bye(*_):\n"
            f"    open({str(order)!r}, 'a').write(sys.argv[1] + '\\n'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            "while True: time.sleep(0.05)\n")
    services = [Service(name=n, argv=[sys.executable, "-c", code, n], env=dict(os.environ))
                for n in ("trainer", "supernode", "clientapp")]
    script = tmp_path / "supervise.py"
    script.write_text(
        "import os, sys\nfrom pathlib import Path\n"
        "from nebula_fl.deploy.supervisor import Service, Supervisor, main_loop\n"
        f"services = [Service(name=n, argv=[sys.executable, '-c', {code!r}, n], env=dict(os.environ)) "
        "for n in ('trainer', 'supernode', 'clientapp')]\n"
        f"port = {free_port()}\n"
        f"sys.exit(main_loop(Supervisor(services, log_dir=Path({str(tmp_path)!r})), health=f'127.0.0.1:{{port}}'))\n")
    assert len(services) == 3
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while len(psutil.Process(proc.pid).children()) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.1)
        children = psutil.Process(proc.pid).children(recursive=True)
        time.sleep(0.5)  # each has set its handler
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert order.read_text().split() == ["clientapp", "supernode", "trainer"]
        assert "stopped (SIGTERM)" in out
        assert not still_running(children, timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_health_endpoint_answers_200_only_when_every_service_runs():
    state = {"ok": True}
    port = free_port()
    server = HealthServer(f"127.0.0.1:{port}", lambda: (state["ok"], {"status": "ok" if state["ok"] else "degraded"}))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as answer:
            assert answer.status == 200 and json.loads(answer.read()) == {"status": "ok"}
        state["ok"] = False
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
        assert err.value.code == 503 and json.loads(err.value.read()) == {"status": "degraded"}
        with pytest.raises(NebulaError, match="cannot listen"):
            HealthServer(f"127.0.0.1:{port}", lambda: (True, {}))
    finally:
        server.close()


# -- config files ------------------------------------------------------------------------------------------
def write(tmp_path: Path, text: str, name: str = "site.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


SITE = 'cluster-id = 1\nsuperlink = "10.0.0.1:8000"\nstate-dir = "state"\ninsecure = true\n'


def test_a_site_file_becomes_its_three_services_in_order(tmp_path):
    cfg = SiteConfig.load(write(tmp_path, SITE + '[trainer]\ndataset = "bbcnews"\nworkers = 2\n'
                                                  'require-secure-aggregation = false\n'))
    assert cfg.state_dir == tmp_path / "state" and cfg.log_dir == tmp_path / "state" / "logs"
    trainer, node, runner = site_services(cfg)
    assert [trainer.name, node.name, runner.name] == ["trainer", "supernode", "clientapp"]
    assert trainer.argv[-4:] == ["--dataset", "bbcnews", "--workers", "2"]  # false leaves the flag out
    assert "--cluster-id" in trainer.argv and trainer.argv[trainer.argv.index("--cluster-id") + 1] == "1"
    assert node.argv[node.argv.index("--superlink") + 1] == "10.0.0.1:8000" and "--insecure" in node.argv
    assert "--isolation" in node.argv and SUPERNODE_REFUSED in node.retry
    secret = Path(runner.argv[runner.argv.index("--superexec-auth-secret-file") + 1])
    assert secret.stat().st_mode & 0o077 == 0 and (tmp_path / "state" / "run").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(("text", "fragment"), [
    (SITE + "workers = 2\n", "unknown key 'workers' (a trainer flag goes under [trainer])"),
    ('superlink = "a:1"\nstate-dir = "s"\ninsecure = true\n', "'cluster-id' is missing"),
    ('cluster-id = 0\nsuperlink = "nowhere"\nstate-dir = "s"\ninsecure = true\n', "'nowhere' is not HOST:PORT"),
    ('cluster-id = 0\nsuperlink = "a:1"\nstate-dir = "s"\n', "ca is missing; TLS needs"),
    ('cluster-id = 0\nsuperlink = "a:1"\nstate-dir = "s"\nca = "ca.crt"\nnode-key = "k"\n', "ca = '"),
    (SITE + "[trainer]\nsocket = \"/tmp/x\"\n", "[trainer] socket is set by the site itself"),
    (SITE + "[trainer]\nworker = 2\n", "unrecognized arguments: --worker 2"),
    (SITE + "[trainer]\nprivacy-mode = \"loose\"\n", "argument --privacy-mode: invalid choice: 'loose'"),
    (SITE + "[trainer]\nworkers = \"two\"\n", "argument --workers: invalid int value: 'two'"),
    ("cluster-id = [\n", "is not valid TOML"),
])
def test_a_bad_site_file_is_one_line_naming_the_key_and_nothing_starts(tmp_path, capsys, text, fragment):
    path = write(tmp_path, text)
    assert main(["site", "--config", str(path), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"nebula-fl: error: {path}") and fragment in err and "\n" not in err, err
    assert not (tmp_path / "s").exists() and not (tmp_path / "state").exists()


def test_a_server_file_is_checked_the_same_way(tmp_path, capsys):
    good = write(tmp_path, 'work-dir = "srv"\ninsecure = true\nhealth = "127.0.0.1:9101"\n', "server.toml")
    assert main(["server", "--config", str(good), "--check"]) == 0
    out = capsys.readouterr().out
    assert f"run folders in {tmp_path / 'srv' / 'runs'}" in out and "registrations in memory" in out
    for text, fragment in [('work-dir = "srv"\n', "certs is missing"),
                           ('work-dir = "srv"\ncerts = "nope"\n', "lacks ca.crt"),
                           ('work-dir = "srv"\ninsecure = true\nregister = ["k.pub"]\n', "insecure = true with certs"),
                           ('insecure = true\n', "'work-dir' is missing"),
                           ('work-dir = "srv"\ninsecure = true\nport = 0\n', "port = 0 is not a port")]:
        assert main(["server", "--config", str(write(tmp_path, text, "bad.toml")), "--check"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("nebula-fl: error: ") and fragment in err and "\n" not in err, (text, err)


@pytest.mark.parametrize("unit", ["nebula-site@.service", "nebula-server.service"])
def test_the_systemd_units_pass_systemds_own_check(tmp_path, unit):
    """`systemd-analyze verify` with ExecStart pointed at this install; any line it prints is a finding (a
    misspelt key or value is only warned about), and a control with a misspelt value shows it does print."""
    text = (REPO / "examples" / "sites" / unit).read_text().replace("/opt/nebula-fl/.venv/bin/nebula-fl",
                                                                     str(Path(sys.executable).with_name("nebula-fl")))
    name = unit.replace("@", "@0") if "@" in unit else unit
    for body, clean in ((text, True), (text.replace("Type=exec", "Type=exce"), False)):
        (tmp_path / name).write_text(body)
        done = subprocess.run(["systemd-analyze", "verify", str(tmp_path / name)], capture_output=True, text=True,
                              timeout=60)
        findings = [x for x in (done.stdout + done.stderr).splitlines() if name.split(".")[0] in x or "exce" in x]
        assert (done.returncode == 0 and not findings) == clean, done.stdout + done.stderr
