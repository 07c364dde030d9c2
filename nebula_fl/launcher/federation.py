"""Run a whole federation on this machine with the real Flower commands.

One SuperLink on loopback, and per cluster a persistent trainer plus a ``flower-supernode`` that
points its ClientApp at it, then ``flwr run`` of a generated app folder holding the resolved config.
Everything lives under the run folder (``logs/``, ``.flwr/`` as FLWR_HOME, ``clusters/<i>/state``),
is offline (no telemetry, no update check, no runtime dependency install), and is stopped — every
process and every child — on success, failure and Ctrl-C alike, and by the watchdog (watchdog.py)
if the launcher itself is killed. A cluster's trainer, SuperNode, ClientApp runner or WAN proxy that dies mid-run is
started again (MAX_RESTARTS times at most) while the other clusters go on; the SuperLink's death ends
the run.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import tomli_w
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from nebula_fl import __version__
from nebula_fl.clients.bundle_check import COMPONENTS
from nebula_fl.clients.protocol import request
from nebula_fl.clients.trainer_service import SHARD_FILE
from nebula_fl.components import resolve
from nebula_fl.errors import NebulaError
from nebula_fl.launcher.plan import LaunchPlan, free_port, port_free
from nebula_fl.launcher.processes import Managed, ProcessSet
from nebula_fl.launcher.report import print_summary, round_line
from nebula_fl.launcher.secure import transport_for
from nebula_fl.launcher.watchdog import Watchdog
from nebula_fl.storage.run_folder import RunFolder

APP_LICENSE = "Apache-2.0: generated nebula-fl app bundle (configuration only; the code is the installed nebula-fl)\n"


SUPEREXEC_POLL_S = "0.1"


def child_env(flwr_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env.update(
        PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}",
        FLWR_HOME=str(flwr_home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        GLOO_SOCKET_IFNAME=env.get("GLOO_SOCKET_IFNAME", "lo"),
        # Flower's SuperExec looks for a message to start an app for once a second by default: up to a second
        # on every hop of every round. A local poll is cheap.
        FLWR_SUPEREXEC_TASK_POLL_INTERVAL=env.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", SUPEREXEC_POLL_S),
    )
    return env


def write_app(folder: Path, flat_config: dict) -> Path:
    """A minimal Flower app folder: the components live in the installed package, the config is resolved."""
    app = folder / "app"
    app.mkdir(parents=True, exist_ok=True)
    doc = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {"name": "nebula-fl-run", "version": "1.0.0", "description": "A nebula-fl federation",
                    "license": "Apache-2.0", "dependencies": []},
        "tool": {"flwr": {"app": {
            "publisher": "nebula-fl",
            "fab-include": ["LICENSE"],
            "components": dict(COMPONENTS),
            "config": flat_config,
        }}, "nebula-fl": {"version": __version__}},  # clusters refuse a bundle made for another version
    }
    (app / "pyproject.toml").write_text(tomli_w.dumps(doc))
    (app / "LICENSE").write_text(APP_LICENSE)
    return app


def superexec_secret(path: Path) -> Path:
    """A fresh random secret (mode 0600) shared by one SuperNode and its ClientApp runner: the SuperNode hands its
    tasks only to a holder of it, so no other local process can take a cluster's messages."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(secrets.token_bytes(32))
    return path


def _raise_interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


def _bin(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else (shutil.which(name) or name)


MAX_RESTARTS = 3  # per service per launch; one more death is fatal
# Seconds a dead service waits before its 1st, 2nd, 3rd restart: a trainer is back at once; a SuperNode
# SIGKILLed under node authentication is refused until the SuperLink's heartbeat for its key lapses
# (2 x 30 s), so the later attempts reach past that.
RESTART_DELAYS_S = (1.0, 15.0, 60.0)
SERVICE_LABELS = {"trainer": "trainer", "supernode": "SuperNode", "clientapp": "ClientApp runner", "wan": "WAN proxy"}  # restartable, per cluster


def _fail(what: str, proc: Managed) -> NebulaError:
    tail = proc.log_tail(8).replace("\n", "\n    ")
    return NebulaError(f"{what} (log: {proc.log_path})\n    {tail}") if tail else NebulaError(f"{what} (log: {proc.log_path})")


class Federation:
    def __init__(self, plan: LaunchPlan, *, console: Console) -> None:
        self.plan = plan
        self.console = console
        self.folder = RunFolder(plan.out)
        self.procs = ProcessSet()
        self.logs = self.folder.path / "logs"
        self.started = time.monotonic()
        self.restarts: list[dict] = []  # each death of a cluster's service during the run, restarted or not
        self.restart_due: dict[str, float] = {}  # dead service -> when it is started again
        self.resumed_after = 0  # the round of the checkpoint a resumed run continues from

    def _headline(self, summary: dict) -> dict:
        """The task's headline metric and its last value, for a summary the ServerApp stopped before writing (so
        a stopped causal-lm run reports its loss, not a classifier's missing accuracy)."""
        if "metric" in summary:
            return {}
        metric = resolve(self.plan.config).task.metric
        rounds = self.folder.rounds()
        return {"task": self.plan.config.task.name, "metric": metric,
                "final_metric": rounds[-1].get(metric) if rounds else None}

    def run(self) -> int:
        """Launch, follow and stop the federation; returns the process exit status."""
        plan = self.plan
        self.folder.path.mkdir(parents=True, exist_ok=True)
        stored = self.folder.read_config() if plan.resume else {}
        if plan.rewind:
            self._rewind()
        # Rounds past the checkpoint (after a crash or a rewind) are run again: show them again too.
        ckpt = self.folder.load_checkpoint() if plan.resume else None
        self.resumed_after = ckpt[0] if ckpt else 0
        self.folder.write_config({**stored, "run_config": resolve(plan.config).flat(plan.config),
                                  "launcher": plan.launcher_record()})
        # First, so that nothing started below can outlive this process, however it ends.
        watchdog = self.procs.watchdog = Watchdog(log_path=self.logs / "watchdog.log")
        socket_dir = Path(tempfile.mkdtemp(prefix="nebula-"))
        watchdog.remove_if_killed(socket_dir)
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        outcome = "failed"
        error: str | None = None
        try:
            self._launch(socket_dir)
            outcome = self._follow()
        except KeyboardInterrupt:
            outcome, error = "interrupted", "stopped by the user (Ctrl-C or SIGTERM)"
            self.console.print("[yellow]interrupted: stopping every process[/yellow]")
        except NebulaError as err:
            error = str(err)
            self.console.print(f"[red]error:[/red] {err}")
        finally:
            self.procs.stop_all()
            watchdog.release()
            signal.signal(signal.SIGTERM, previous)
            shutil.rmtree(socket_dir, ignore_errors=True)
        earlier = self.folder.read_summary().get("restarts") or []  # those of earlier launches of this run
        self.folder.update_summary(restarts=[*earlier, *self.restarts])
        self._note_membership()
        summary = self.folder.read_summary()
        if summary.get("status") != "completed":
            if outcome == "failed" and error:  # the launcher saw the cause (a process died, a start failed)
                summary = self.folder.update_summary(status="failed", error=error)
            elif summary.get("status") in (None, "running"):
                status = "interrupted" if outcome == "interrupted" else "failed"
                summary = self.folder.update_summary(
                    status=status, error=error or summary.get("error") or "the ServerApp stopped before the end",
                    **self._headline(summary),
                )
        print_summary(self.console, self.folder.rounds(), summary, str(self.folder.path))
        if summary.get("status") == "completed":
            return 0
        if summary.get("error") and not error:
            self.console.print(f"[red]error:[/red] {summary['error']}")
        return 130 if summary.get("status") == "interrupted" else 1

    def _note_membership(self) -> None:
        """summary.json's privacy.clusters names each cluster whose operator took the server's word for the
        secure-aggregation members (its --cluster-policy opts out of this launcher's roster): a weaker guarantee
        than the roster every other cluster checks, said where the run's privacy is read."""
        trusting = sorted(str(i) for i, fields in (self.plan.cluster_policies or {}).items()
                          if fields.get("secagg_trust_server_membership"))
        if not trusting:
            return
        privacy = dict(self.folder.read_summary().get("privacy") or {})
        clusters = dict(privacy.get("clusters") or {})
        for cid in trusting:
            clusters[cid] = {**clusters.get(cid, {}), "membership": "the server's word"}
        self.folder.update_summary(privacy={**privacy, "clusters": clusters})

    def _rewind(self) -> None:
        kept, moved = self.folder.rewind_checkpoints()
        for name in moved:
            self.console.print(f"[yellow]moved the damaged checkpoint aside: checkpoint/{name}[/yellow]")
        self.console.print(f"rewound to the checkpoint of round {kept}" if kept else
                           "no intact checkpoint: the run restarts from round 1")

    # -- start-up --------------------------------------------------------------------------------
    def _launch(self, socket_dir: Path) -> None:
        plan, cfg = self.plan, self.plan.config
        flwr_home = self.folder.path / ".flwr"
        shutil.rmtree(flwr_home, ignore_errors=True)
        flwr_home.mkdir(parents=True)
        self.transport = transport = transport_for(self.folder.path, secure=plan.secure, clusters=plan.clusters)
        port = plan.port or free_port()
        if not port_free(port):
            raise NebulaError(f"port {port} on 127.0.0.1 is in use; pass --port N (or --port 0 to pick a free one)")
        (flwr_home / "config.toml").write_text(tomli_w.dumps(
            {"superlink": {"default": "local", "local": transport.connection(f"127.0.0.1:{port}")}}
        ))
        env = child_env(flwr_home)
        superlink = self.procs.start(
            "superlink",
            [_bin("flower-superlink"), *transport.superlink_args(), "--disable-runtime-dependency-installation",
             "--port", str(port)],
            log_path=self.logs / "superlink.log", env=env, cwd=self.folder.path,
        )
        # Trainers load torch and the model while the SuperLink and then the ServerApp start up; their ranks fork
        # from one rank host, which imports torch, transformers and peft once for every cluster (--rank-host: one
        # the user keeps running across launches).
        rank_host = plan.rank_host or socket_dir / "rank-host.sock"
        if plan.rank_host is None:
            self.procs.start("rank-host", [sys.executable, "-m", "nebula_fl.clients.rank_host", "--socket",
                                           str(rank_host)], log_path=self.logs / "rank-host.log", env=env)
        trainers = []
        roster = self._write_roster()
        for i in range(plan.clusters):
            sock = socket_dir / f"cluster-{i}.sock"
            argv = [
                sys.executable, "-m", "nebula_fl", "trainer", "--socket", str(sock), "--cluster-id", str(i),
                "--workers", str(plan.workers[i]), "--device", plan.devices[i], "--threads", str(plan.threads[i]),
                "--model", cfg.model.model, "--state-dir", str(self._state_dir(i)),
                "--dataset", cfg.data.dataset, "--num-clusters", str(plan.clusters), "--partition", cfg.data.partition,
                "--seed", str(cfg.federation.seed), "--test-fraction", str(cfg.data.test_fraction),
                "--max-examples", str(cfg.data.max_examples), "--targets", resolve(cfg).task.targets,
                *(["--slowdown", f"{plan.slowdown_per_cluster[i]:g}"] if plan.slowdown_per_cluster else []),
                *(["--precision", plan.precisions[i]] if plan.precisions else []),
                *(["--parallel", plan.parallel[i]] if plan.parallel else []),
                "--privacy-policy", str(self._write_policy(i, roster)), "--rank-host", str(rank_host),
            ]
            proc = self.procs.start(f"trainer-{i}", argv, log_path=self.logs / f"trainer-{i}.log", env=env)
            trainers.append((i, sock, proc))
        self._wait(lambda: not port_free(port), superlink, "the SuperLink", timeout=60)
        self.console.print(f"superlink listening on 127.0.0.1:{port}" + (" (TLS, SuperNode auth)" if transport.secure else ""))
        for i in range(plan.clusters if transport.secure else 0):  # a SuperNode is refused until its key is registered
            node = transport.register(i, flwr=_bin("flwr"), connection="local", env=env)
            self.console.print(f"cluster {i}: SuperNode key registered as node {node}")
        links = self._start_wan(socket_dir, port, env) if plan.wan else [port] * plan.clusters
        flat = cfg.to_flat()
        if plan.wan:
            flat["comm.wan-control"] = ",".join(str(socket_dir / f"wan-{i}.sock") for i in range(plan.clusters))
        app = write_app(self.folder.path, flat)
        self.procs.start(
            "flwr-run", [sys.executable, "-m", "nebula_fl", "submit", str(app), "local"],  # flwr run --stream
            log_path=self.logs / "server.log", env=env, cwd=self.folder.path, expect_exit=True,
        )
        for i, sock, proc in trainers:
            info: dict = {}

            def ready(sock=sock, info=info) -> bool:
                try:
                    info.update(request(sock, {"op": "hello"})[0])
                    return True
                except NebulaError:
                    return False

            self._wait(ready, proc, f"trainer {i}", timeout=300)
            shard = json.loads((self._state_dir(i) / SHARD_FILE).read_text())  # the operator's view, not the socket's
            self.console.print(
                f"cluster {i}: trainer ready, {shard['num_examples']} examples, {info['workers']} worker(s) on "
                f"{info['device']} ({info.get('parallel', 'ddp')}), labels {shard['label_counts']}"
            )
            runtime_port, secret = free_port(), superexec_secret(socket_dir / f"superexec-{i}.secret")
            self.procs.start(
                f"supernode-{i}",
                [_bin("flower-supernode"), *transport.supernode_args(i), "--superlink", f"127.0.0.1:{links[i]}",
                 "--isolation", "process", "--superexec-auth-secret-file", str(secret), "--port", str(runtime_port),
                 "--node-config", f'trainer="{sock}" cluster-id={i}'],
                log_path=self.logs / f"supernode-{i}.log", env=env,
            )
            self.procs.start(
                f"clientapp-{i}",
                [sys.executable, "-m", "nebula_fl", "clientapp", "--runtime-api-address", f"127.0.0.1:{runtime_port}",
                 "--superexec-auth-secret-file", str(secret)],
                log_path=self.logs / f"clientapp-{i}.log", env=env,
            )
        self.console.print(f"federation started: {plan.clusters} cluster(s), logs in {self.logs}; each cluster runs "
                           "only nebula-fl's own ClientApp (app bundles are read as configuration)")
        self.console.print("one user runs every process here (a demo); across machines, run each cluster's trainer as "
                           "its own user (docs: Across machines, Deploying a cluster)")

    def _write_policy(self, cluster: int, roster: Path | None) -> Path:
        """Each cluster's own privacy policy, as its operator would write it for this run (never weaker), with
        the fields of its --cluster-policy over it and the federation's roster (this launcher made every key)."""
        from nebula_fl.privacy.policy import PrivacyPolicy, policy_for_run

        path = self.folder.path / "clusters" / str(cluster) / "privacy-policy.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        cfg = self.plan.config
        fields = policy_for_run(cfg.privacy, rounds=cfg.federation.num_server_rounds,
                                local_steps=cfg.train.steps_cap).to_dict()
        fields.update((self.plan.cluster_policies or {}).get(cluster, {}))
        if roster is not None and not fields.get("secagg_trust_server_membership"):  # unless its operator opts out
            fields.setdefault("secagg_peers", str(roster))
        PrivacyPolicy.from_dict(fields, where=f"cluster {cluster}'s privacy policy").save(path)
        return path

    def _write_roster(self) -> Path | None:
        """The clusters' identity keys (made here, in each cluster's state folder), when anything masks: what
        operators across machines exchange by hand (`nebula-fl identity`)."""
        from nebula_fl.secagg.identity import Identity, roster_line

        own = self.plan.cluster_policies or {}
        if not (self.plan.config.secagg.enabled or any(p.get("require_secure_aggregation") for p in own.values())):
            return None
        lines = [roster_line(i, Identity.load_or_create(self._state_dir(i) / "secagg")) for i in range(self.plan.clusters)]
        path = self.folder.path / "clusters" / "peers.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# the federation's secure-aggregation roster: <cluster-id> <identity key>\n" + "\n".join(lines)
                        + "\n")
        return path

    def _state_dir(self, cluster: int) -> Path:
        return self.folder.path / "clusters" / str(cluster) / "state"

    def _start_wan(self, socket_dir: Path, port: int, env: dict[str, str]) -> list[int]:
        """One emulated WAN link (a counting, shaping proxy) per cluster; returns the ports to connect to."""
        from nebula_fl.wan.service import query_proxy

        ports = []
        for i, profile in enumerate(self.plan.wan or []):
            listen = free_port()
            control = socket_dir / f"wan-{i}.sock"
            proc = self.procs.start(
                f"wan-{i}",
                [sys.executable, "-m", "nebula_fl.wan", "--listen-port", str(listen), "--target", f"127.0.0.1:{port}",
                 "--profile", profile, "--control", str(control)],
                log_path=self.logs / f"wan-{i}.log", env=env,
            )

            def ready(control=control) -> bool:
                try:
                    query_proxy(str(control), "stats")
                    return True
                except Exception:
                    return False

            self._wait(ready, proc, f"the WAN proxy of cluster {i}", timeout=60)
            self.console.print(f"cluster {i}: emulated WAN {profile} on 127.0.0.1:{listen}")
            ports.append(listen)
        return ports

    def _wait(self, condition, proc: Managed, what: str, *, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if not proc.alive():
                raise _fail(f"{what} exited with status {proc.popen.returncode} while starting", proc)
            if time.monotonic() > deadline:
                raise _fail(f"{what} did not come up within {timeout:.0f} s", proc)
            time.sleep(0.2)

    # -- following the run -----------------------------------------------------------------------
    def _follow(self) -> str:
        total = self.plan.config.federation.num_server_rounds
        flwr_run = next(p for p in self.procs.items if p.name == "flwr-run")
        shown = {line["round"] for line in self.folder.rounds() if line["round"] <= self.resumed_after}
        with Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} rounds"),
            TimeElapsedColumn(), console=self.console, transient=True,
        ) as progress:
            task = progress.add_task("federating", total=total, completed=len(shown))
            while True:
                self.procs.remember_descendants()
                for line in self.folder.rounds():
                    if line["round"] not in shown:
                        shown.add(line["round"])
                        progress.console.print(round_line(line, total))
                        progress.update(task, completed=len(shown))
                if not flwr_run.alive():
                    break
                now = time.monotonic()
                for dead in self.procs.dead_services():
                    delay = RESTART_DELAYS_S[min(dead.restarts, len(RESTART_DELAYS_S) - 1)]
                    if now >= self.restart_due.setdefault(dead.name, now + delay):
                        del self.restart_due[dead.name]
                        self._restart(dead, progress.console)
                time.sleep(0.5)
        status = self.folder.read_summary().get("status")
        if status in (None, "running") and flwr_run.popen.returncode not in (0, None):  # the ServerApp said nothing
            raise _fail(f"nebula-fl submit exited with status {flwr_run.popen.returncode}", flwr_run)
        return status or "failed"

    def _restart(self, dead: Managed, console: Console) -> None:
        """Start a cluster's dead trainer, SuperNode or WAN proxy again; the SuperLink's death, or a service
        that died more than MAX_RESTARTS times, ends the run. The other clusters go on meanwhile: the
        ServerApp gets an error reply for this one and aggregates the rest."""
        kind, _, index = dead.name.rpartition("-")
        code = dead.popen.returncode
        if kind not in SERVICE_LABELS or not index.isdigit():
            raise _fail(f"{dead.name} exited with status {code} during the run", dead)
        record = {"service": kind, "cluster": int(index), "exit_code": code,
                  "seconds_into_run": round(time.monotonic() - self.started, 1), "restarted": False}
        self.restarts.append(record)
        what = f"cluster {index}: {SERVICE_LABELS[kind]} exited with status {code}"
        if dead.restarts >= MAX_RESTARTS:
            raise _fail(f"{what} after {MAX_RESTARTS} restarts; stopping the run", dead)
        again = self.procs.restart(dead)
        record["restarted"] = True
        console.print(f"[yellow]{what}; restarted ({again.restarts} of {MAX_RESTARTS})[/yellow]")
