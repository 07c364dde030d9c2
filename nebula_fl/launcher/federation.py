"""Run a whole federation on this machine with the real Flower commands.

One SuperLink on loopback, and per cluster a persistent trainer plus a ``flower-supernode`` that
points its ClientApp at it, then ``flwr run`` of a generated app folder holding the resolved config.
Everything lives under the run folder (``logs/``, ``.flwr/`` as FLWR_HOME, ``clusters/<i>/state``),
is offline (no telemetry, no update check, no runtime dependency install), and is stopped — every
process and every child — on success, failure and Ctrl-C alike.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import tomli_w
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from nebula_fl.clients.protocol import request
from nebula_fl.errors import NebulaError
from nebula_fl.launcher.plan import LaunchPlan, free_port, port_free
from nebula_fl.launcher.processes import Managed, ProcessSet
from nebula_fl.launcher.report import print_summary, round_line
from nebula_fl.server.run_folder import RunFolder

APP_LICENSE = "Apache-2.0: generated nebula-fl app bundle (configuration only; the code is the installed nebula-fl)\n"


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
            "components": {"serverapp": "nebula_fl.server.app:app", "clientapp": "nebula_fl.clients.app:app"},
            "config": flat_config,
        }}},
    }
    (app / "pyproject.toml").write_text(tomli_w.dumps(doc))
    (app / "LICENSE").write_text(APP_LICENSE)
    return app


def _raise_interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


def _bin(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else (shutil.which(name) or name)


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

    def run(self) -> int:
        """Launch, follow and stop the federation; returns the process exit status."""
        plan = self.plan
        self.folder.path.mkdir(parents=True, exist_ok=True)
        stored = self.folder.read_config() if plan.resume else {}
        self.folder.write_config({**stored, "run_config": plan.config.to_flat(), "launcher": plan.launcher_record()})
        socket_dir = Path(tempfile.mkdtemp(prefix="nebula-"))
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
            signal.signal(signal.SIGTERM, previous)
            shutil.rmtree(socket_dir, ignore_errors=True)
        summary = self.folder.read_summary()
        if summary.get("status") != "completed":
            if outcome == "failed" and error:  # the launcher saw the cause (a process died, a start failed)
                summary = self.folder.update_summary(status="failed", error=error)
            elif summary.get("status") in (None, "running"):
                status = "interrupted" if outcome == "interrupted" else "failed"
                summary = self.folder.update_summary(
                    status=status, error=error or summary.get("error") or "the ServerApp stopped before the end"
                )
        print_summary(self.console, self.folder.rounds(), summary, str(self.folder.path))
        if summary.get("status") == "completed":
            return 0
        if summary.get("error") and not error:
            self.console.print(f"[red]error:[/red] {summary['error']}")
        return 130 if summary.get("status") == "interrupted" else 1

    # -- start-up --------------------------------------------------------------------------------
    def _launch(self, socket_dir: Path) -> None:
        plan, cfg = self.plan, self.plan.config
        flwr_home = self.folder.path / ".flwr"
        shutil.rmtree(flwr_home, ignore_errors=True)
        flwr_home.mkdir(parents=True)
        port = plan.port or free_port()
        if not port_free(port):
            raise NebulaError(f"port {port} on 127.0.0.1 is in use; pass --port N (or --port 0 to pick a free one)")
        (flwr_home / "config.toml").write_text(tomli_w.dumps(
            {"superlink": {"default": "local", "local": {"address": f"127.0.0.1:{port}", "insecure": True}}}
        ))
        env = child_env(flwr_home)
        superlink = self.procs.start(
            "superlink",
            [_bin("flower-superlink"), "--insecure", "--disable-runtime-dependency-installation", "--port", str(port)],
            log_path=self.logs / "superlink.log", env=env, cwd=self.folder.path,
        )
        # Trainers load torch and the model while the SuperLink and then the ServerApp start up.
        trainers = []
        for i in range(plan.clusters):
            sock = socket_dir / f"cluster-{i}.sock"
            argv = [
                sys.executable, "-m", "nebula_fl", "trainer", "--socket", str(sock), "--cluster-id", str(i),
                "--workers", str(plan.workers[i]), "--device", plan.devices[i], "--threads", str(plan.threads[i]),
                "--model", cfg.model.model, "--state-dir", str(self.folder.path / "clusters" / str(i) / "state"),
                "--dataset", cfg.data.dataset, "--num-clusters", str(plan.clusters), "--partition", cfg.data.partition,
                "--seed", str(cfg.federation.seed), "--test-fraction", str(cfg.data.test_fraction),
                "--max-examples", str(cfg.data.max_examples),
            ]
            proc = self.procs.start(f"trainer-{i}", argv, log_path=self.logs / f"trainer-{i}.log", env=env)
            trainers.append((i, sock, proc))
        self._wait(lambda: not port_free(port), superlink, "the SuperLink", timeout=60)
        self.console.print(f"superlink listening on 127.0.0.1:{port}")
        links = self._start_wan(socket_dir, port, env) if plan.wan else [port] * plan.clusters
        flat = cfg.to_flat()
        if plan.wan:
            flat["comm.wan-control"] = ",".join(str(socket_dir / f"wan-{i}.sock") for i in range(plan.clusters))
        app = write_app(self.folder.path, flat)
        self.procs.start(
            "flwr-run", [_bin("flwr"), "run", str(app), "local", "--stream"],
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
            self.console.print(
                f"cluster {i}: trainer ready, {info['num_examples']} examples, {info['workers']} worker(s) on "
                f"{info['device']}, labels {info['label_counts']}"
            )
            self.procs.start(
                f"supernode-{i}",
                [_bin("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{links[i]}", "--port",
                 str(free_port()), "--node-config", f'trainer="{sock}" cluster-id={i}'],
                log_path=self.logs / f"supernode-{i}.log", env=env,
            )
        self.console.print(f"federation started: {plan.clusters} cluster(s), logs in {self.logs}")

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
        shown = {line["round"] for line in self.folder.rounds()} if self.plan.resume else set()
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
                if (dead := self.procs.first_dead_service()) is not None:
                    raise _fail(f"{dead.name} exited with status {dead.popen.returncode} during the run", dead)
                time.sleep(0.5)
        status = self.folder.read_summary().get("status")
        if status != "completed" and flwr_run.popen.returncode not in (0, None):
            raise _fail(f"flwr run exited with status {flwr_run.popen.returncode}", flwr_run)
        return status or "failed"
