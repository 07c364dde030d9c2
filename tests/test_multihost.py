"""A federation across separate hosts, run as real sites run it.

Five network namespaces on one bridge (tests/netns.py), each link capped at 20 Mbit/s by tc's token bucket and
delayed 100 ms round trip by the project's WAN proxy inside each site: the server host runs `nebula-fl server
--config` (TLS, SuperNode authentication with the clusters' keys registered, a persistent database), three sites
run `nebula-fl site --config` each (trainer, SuperNode, ClientApp runner; a roster of the clusters' identity keys;
a policy that trains only securely aggregated rounds), and a fifth host submits with `nebula-fl submit`. Mid-run
one site's SuperNode is SIGKILLed: its supervisor restarts it, waits out Flower's "still online" refusal, and the
cluster trains again. The run completes and submit exits 0; a second run without secure aggregation, which every
cluster's policy refuses, makes submit exit 1; a site stopped with SIGTERM and started again is not refused. The figures (wall time, rounds, bytes per round, kill-to-rejoin
seconds) go to the test's output and `multihost-figures.json` in its folder.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nebula_fl.config import PRESETS, RunConfig
from nebula_fl.launcher.federation import child_env, write_app
from nebula_fl.security import make_certificates
from tests.conftest import docs_block, nebula_cmd, still_running
from tests.netns import Hosts

ROUNDS = 6  # a SIGKILLed SuperNode is refused for ~60 s (Flower's heartbeat patience): the run outlasts that
PORT = 8000  # each host has its own ports
RATE, PROFILE = "20mbit", "20mbit:100ms"


def wait_for(what: str, check, timeout: float, *procs: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for proc in procs:
            assert proc.poll() is None, f"{' '.join(map(str, proc.args[-3:]))} exited {proc.returncode} waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def metrics(runs: Path) -> list[dict]:
    found = sorted(runs.glob("*/metrics.jsonl"))
    return [json.loads(x) for x in found[-1].read_text().splitlines()] if found else []


@pytest.mark.e2e
@pytest.mark.longest
def test_three_sites_on_their_own_hosts_under_tls_auth_and_secure_aggregation_survive_a_killed_supernode(
        tiny_model, tmp_path):
    hosts = Hosts(["server", "site0", "site0b", "site1", "site2", "submitter"], rate=RATE)
    server = hosts["server"]
    procs: list[subprocess.Popen] = []
    seen: list[psutil.Process] = []

    def start(host, args, name, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(host.argv(*nebula_cmd(*args)), stdout=(tmp_path / f"{name}.out").open("w"),
                                stderr=subprocess.STDOUT, cwd=tmp_path, **kwargs)
        procs.append(proc)
        return proc

    # the commands the across-machines page gives, with this test's files in place of /etc/nebula/...
    server_cmd, site_cmd, submit_cmd = docs_block("how-to/across-machines.md", "nebula-fl server")
    assert server_cmd[:3] == ["nebula-fl", "server", "--config"] and site_cmd[:3] == ["nebula-fl", "site", "--config"]
    assert submit_cmd[:2] == ["nebula-fl", "submit"] and len(server_cmd) == len(site_cmd) == 4
    started = time.monotonic()
    try:
        certs = make_certificates(folder=tmp_path / "certs", hosts=["127.0.0.1", server.address], clusters=3)
        (tmp_path / "server.toml").write_text(
            f'work-dir = "server"\nhost = "0.0.0.0"\nport = {PORT}\ncerts = "certs"\ndatabase = "superlink.db"\n'
            f'register = [{", ".join(json.dumps(str(p)) for p in certs.cluster_public_keys)}]\n')
        link = start(server, [*server_cmd[1:3], str(tmp_path / "server.toml")], "server")
        roster = []
        for i in range(3):
            state = tmp_path / f"site-{i}"
            line = subprocess.run(nebula_cmd("identity", "--state-dir", str(state / "trainer"), "--cluster-id",
                                             str(i)), capture_output=True, text=True, check=True, timeout=60)
            roster.append(line.stdout.strip())
        (tmp_path / "roster.txt").write_text("\n".join(roster) + "\n")
        wait_for("the server's registrations", lambda: "3 SuperNode key(s) registered" in
                 (tmp_path / "server.out").read_text(), 90, link)
        sites = []
        for i in range(3):
            host = hosts[f"site{i}"]
            # the site's WAN: 100 ms round trip to the SuperLink, inside its host (the tbf caps the rate)
            procs.append(subprocess.Popen(host.argv(sys.executable, "-m", "nebula_fl.wan", "--listen-port", "18000",
                                                    "--target", f"{server.address}:{PORT}", "--profile", PROFILE,
                                                    "--control", str(tmp_path / f"wan-{i}.sock")),
                                          stdout=(tmp_path / f"wan-{i}.out").open("w"), stderr=subprocess.STDOUT))
            trainer = (f'[trainer]\ndataset = "bbcnews"\nnum-clusters = 3\nmax-examples = 300\nmodel = "{tiny_model}"\n'
                       f'secagg-peers = "{tmp_path / "roster.txt"}"\nrequire-secure-aggregation = true\n')
            nodes = f'nnodes = 2\nrendezvous = "{host.address}:29500"\n'  # cluster 0 spans two machines
            (tmp_path / f"site-{i}.toml").write_text(
                f'cluster-id = {i}\nsuperlink = "127.0.0.1:18000"\nstate-dir = "site-{i}"\nca = "certs/ca.crt"\n'
                f'node-key = "certs/cluster-{i}"\n' + trainer + (nodes + "node-rank = 0\n" if i == 0 else ""))
            sites.append(start(host, [*site_cmd[1:3], str(tmp_path / f"site-{i}.toml")], f"site-{i}"))
            if i == 0:  # its second machine: the trainer only, its ranks joining node 0's at the rendezvous
                (tmp_path / "site-0b.toml").write_text('cluster-id = 0\nstate-dir = "site-0b"\n' + trainer + nodes
                                                       + "node-rank = 1\n")
                sites.append(start(hosts["site0b"], ["site", "--config", str(tmp_path / "site-0b.toml")], "site-0b"))
        for name, count in (("0", 3), ("0b", 1), ("1", 3), ("2", 3)):
            wait_for(f"site {name}'s services", lambda name=name, count=count: (tmp_path / f"site-{name}.out")
                     .read_text().count("started (pid") >= count, 120, *sites)

        # the submitter: its own host, its own connection (TLS with the federation's CA)
        home = tmp_path / "submitter"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "fed"\n[superlink.fed]\naddress = "{server.address}:{PORT}"\n'
            f'root-certificates = "{certs.ca_cert}"\n')
        flat = RunConfig().replace({**PRESETS["smoke"], "model": str(tiny_model), "num-server-rounds": ROUNDS,
                                    "min-clusters": 2, "wait-for-clusters": 3, "lr": 0.1, "secagg.enabled": True,
                                    "secagg.threshold": 2}).to_flat()
        app = write_app(tmp_path / "submit", flat)
        submit = start(hosts["submitter"], [submit_cmd[1], str(app), "fed"], "submit", env=child_env(home))
        runs = tmp_path / "server" / "runs"
        wait_for("round 1", lambda: len(metrics(runs)) >= 1, 400, submit, link, *sites)
        node = next(p for p in psutil.Process(sites[2].pid).children(recursive=True)
                    if "flower-supernode" in " ".join(p.cmdline()))
        node.kill()
        killed, after = time.monotonic(), len(metrics(runs))
        back = None
        while submit.poll() is None:
            lines = metrics(runs)
            if back is None and any("1" in x["clusters"] and not (x.get("rejected") or {}).get("1")
                                    for x in lines[after + 1:]):
                back = time.monotonic() - killed
            time.sleep(0.5)
        out = (tmp_path / "submit.out").read_text()
        assert submit.returncode == 0, out[-4000:]
        wall = time.monotonic() - started
        (folder,) = runs.iterdir()
        assert re.fullmatch(rf"run \d+: completed, \d+ round\(s\) aggregated; run folder on the server host: "
                            rf"{re.escape(str(folder))}", out.strip().splitlines()[-1])
        lines = metrics(runs)
        assert [x["round"] for x in lines] == list(range(1, ROUNDS + 1))
        site_log = (tmp_path / "site-1.out").read_text()
        assert "supernode: exited -9" in site_log
        assert "the SuperLink refused this SuperNode" in site_log  # Flower's "still online" window, waited out
        if back is None:  # it rejoined in the round that was running when the run's last line was written
            back = time.monotonic() - killed
        assert any("1" in x["clusters"] for x in lines[after + 1:]), "cluster 1 never trained again"
        secured = [x for x in lines if x.get("secagg")]
        assert secured and all(not x.get("skipped") for x in lines[-3:])
        assert "node 0 of 2" in (tmp_path / "site-0" / "logs" / "trainer.log").read_text()
        assert "node 1 of 2" in (tmp_path / "site-0b" / "logs" / "trainer.log").read_text()
        figures = {"wall_s": round(wall, 1), "rounds": len(lines),
                   "round_train_s": {name: _median_round_s(tmp_path / name / "logs" / "trainer.log")
                                     for name in ("site-0", "site-1", "site-2")},
                   "bytes_per_round": round(sum(x["bytes_up"] + x["bytes_down"] for x in lines) / len(lines)),
                   "kill_to_rejoin_s": round(back, 1), "link": f"{RATE} tbf, {PROFILE} proxy"}

        # a run without secure aggregation: every cluster's policy refuses it, and submit says so with exit 1
        flat["secagg.enabled"] = False
        flat["num-server-rounds"] = 1
        refused = subprocess.run(hosts["submitter"].argv(*nebula_cmd("submit", str(write_app(tmp_path / "plain", flat)),
                                                                     "fed")),
                                 env=child_env(home), capture_output=True, text=True, timeout=400, cwd=tmp_path)
        last = refused.stdout.strip().splitlines()[-1]
        assert refused.returncode == 1 and ": failed: " in last and "requires secure aggregation" in last, last

        # a clean stop, what a service manager sends, deactivates the site's SuperNode at the SuperLink (Flower does
        # on SIGTERM): the site started again joins at once, with no "still online" refusal to wait out
        sites[3].send_signal(signal.SIGTERM)
        assert sites[3].wait(60) == 0
        again = start(hosts["site2"], ["site", "--config", str(tmp_path / "site-2.toml")], "site-2-again")
        wait_for("site 2's services, started again", lambda: (tmp_path / "site-2-again.out").read_text()
                 .count("started (pid") >= 3, 120, again)
        time.sleep(10)  # a refusal comes within a second or two of the SuperNode's start
        log = (tmp_path / "site-2-again.out").read_text()
        assert "refused" not in log and "exited" not in log and again.poll() is None, log
        (tmp_path / "multihost-figures.json").write_text(json.dumps(figures))
        print("multihost figures:", figures)
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    seen.extend(psutil.Process(proc.pid).children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {" ".join(map(str, p.args[-3:])): p.wait(60) for p in procs}
        hosts.close()
    assert not still_running(seen, timeout=10)
    assert not hosts.left()
    assert all(code == 0 for args, code in codes.items() if "site" in args or "server" in args), codes


def _median_round_s(log: Path) -> float:
    """The median of a trainer's "round N: ..., T s" lines: its ranks' training time in a round."""
    times = sorted(float(m.group(1)) for m in re.finditer(r"round \d+: loss [\d.]+, \d+ step\(s\), ([\d.]+) s",
                                                          log.read_text()))
    return times[len(times) // 2] if times else float("nan")
