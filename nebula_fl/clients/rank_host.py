"""One preloaded fork server for the ranks of every trainer one user starts on one machine.

A rank needs torch, transformers and peft: about 9 s of CPU to import, which each trainer's own fork server pays
(``trainer_service.run_trainer``). When one launcher starts every cluster of a federation on one machine
(``nebula-fl run``), its trainers ask this host for their ranks instead, and the imports are paid once per launch
rather than once per cluster (and per restarted trainer). Across machines, or with a trainer per user, each trainer
keeps its own fork server: the host forks as the user who started it, so only that user's trainers may use it
(its socket and key file are that user's alone, and every connection passes multiprocessing's HMAC handshake).

A hosted rank is the trainer's as much as one from its own fork server: it runs `rank.rank_main` with the trainer's
environment, working folder, umask, stdout and stderr, and dies with the trainer (``lifetime.die_with_process``);
the trainer is told its exit status. If the host is gone, a trainer starts its ranks from its own fork server.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from multiprocessing import reduction
from multiprocessing.connection import Client, Connection, wait
from pathlib import Path
from typing import Any

import psutil

from nebula_fl.clients.protocol import TrainerListener, key_path
from nebula_fl.lifetime import reap_multiprocessing_helpers

# What every rank imports (about 9 s of CPU): a fork server imports it once for all the ranks it forks. Opacus
# (1.2 s more) is not among them: only a round under sample-level DP needs it, and then each rank imports it once.
RANK_PRELOAD = ("torch", "torch.distributed", "transformers", "peft", "nebula_fl.clients.trainer",
                "nebula_fl.clients.rank", "nebula_fl.clients.trainer_service", "nebula_fl.clients.rank_host")
HANDSHAKE_S = 10.0  # a trainer connecting completes the handshake at once; a stalled client holds the host no longer
CONNECT_S = 30.0  # how long a trainer waits for a host still starting (the launcher starts it just before)


class _Fd:
    """A descriptor the host passes on to the rank it forks (multiprocessing duplicates it into the child)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _import_path(pythonpath: str) -> None:
    """The trainer's PYTHONPATH before the host's own path, as a process started with it has: a plug-in (a task,
    a strategy) installed there after the host started is found, its entry points included (read from sys.path)."""
    import importlib

    entries = [p for p in pythonpath.split(os.pathsep) if p]
    sys.path[:0] = [p for p in entries if p not in sys.path]
    importlib.invalidate_caches()


def _detach(dup) -> int:
    return dup.detach()


def hosted_rank(env: dict[str, str], cwd: str, umask: int, stdout: int, stderr: int, *rank_args: Any) -> None:
    """A rank forked by the host, made the trainer's: its environment, import path, folder, umask and log, then
    `rank_main`."""
    os.environ.clear()
    os.environ.update(env)
    _import_path(env.get("PYTHONPATH", ""))
    os.chdir(cwd)
    os.umask(umask)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    from nebula_fl.clients.rank import rank_main

    rank_main(*rank_args)


def serve(socket_path: Path, *, preload: list[str]) -> int:
    """Fork ranks for the trainers that connect until SIGTERM or SIGINT; then kill the ranks still running."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    forkserver.ensure_running()  # the imports start now, while the launcher starts the SuperLink and the trainers
    listener = TrainerListener(socket_path, io_timeout=HANDSHAKE_S)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: stopping.append(signum))
    clients: dict[Connection, list[Any]] = {}  # a trainer's connection -> the ranks started for it, by index
    print(f"rank host: serving {socket_path} (preloaded: {', '.join(preload)})", flush=True)
    try:
        while not stopping:
            sentinels = {p.sentinel: (conn, i, p) for conn, ranks in clients.items()
                         for i, p in enumerate(ranks) if p is not None}
            for ready in wait([listener.sock, *clients, *sentinels], timeout=1.0):
                if ready is listener.sock:
                    try:
                        clients[listener.accept()] = []
                    except (OSError, EOFError, mp.AuthenticationError) as err:
                        print(f"rank host: refused a connection ({type(err).__name__})", flush=True)
                elif ready in sentinels:
                    conn, i, p = sentinels[ready]
                    if conn in clients:  # (not if its trainer's connection closed earlier in this pass)
                        p.join()
                        clients[conn][i] = None
                        _tell(conn, ("exited", i, p.exitcode))
                elif ready in clients:
                    _handle(ctx, ready, clients)
    finally:
        for ranks in clients.values():
            _kill(ranks)
        listener.close()
        Path(socket_path).unlink(missing_ok=True)
        key_path(socket_path).unlink(missing_ok=True)
        reap_multiprocessing_helpers()
    return 0


def _handle(ctx, conn: Connection, clients: dict[Connection, list[Any]]) -> None:
    """One request of a trainer: start a rank (its stdout and stderr follow as descriptors); a closed connection
    (the trainer stopped or died) takes its ranks still running with it."""
    try:
        op, name, args = conn.recv()
        if op != "start":
            raise ValueError(f"unknown request {op!r}")
        stdout, stderr = reduction.recv_handle(conn), reduction.recv_handle(conn)
    except Exception:  # closed, or not a request this host makes sense of: that trainer is done with
        _kill(clients.pop(conn))
        conn.close()
        return
    try:
        process = ctx.Process(target=hosted_rank, args=(*args[:3], _Fd(stdout), _Fd(stderr), *args[3:]), name=name)
        process.start()
    except Exception as err:  # that trainer's start fails (it sees the connection close); the host serves on
        print(f"rank host: could not start {name!r} ({type(err).__name__}: {err})", flush=True)
        _kill(clients.pop(conn))
        conn.close()
        return
    finally:
        os.close(stdout)
        os.close(stderr)
    clients[conn].append(process)
    _tell(conn, ("started", len(clients[conn]) - 1, process.pid))


def _tell(conn: Connection, message: tuple) -> None:
    try:
        conn.send(message)
    except OSError:
        pass  # the trainer is gone: its connection is closed at its next read


def _kill(ranks: list[Any]) -> None:
    for p in ranks:
        if p is not None and p.is_alive():
            p.kill()
    for p in ranks:
        if p is not None:
            p.join(5.0)


class HostedRank:
    """One rank started by a rank host, as the trainer's supervisor sees a multiprocessing.Process: `start`,
    `exitcode`, `is_alive`, `terminate`, `kill`, `join`. Signals go to its pid; its exit status comes from the host."""

    def __init__(self, host: RankHostClient, *, name: str, args: tuple) -> None:
        self.host, self.name, self.args = host, name, args
        self.pid: int | None = None
        self._exitcode: int | None = None

    def start(self) -> None:
        self.pid = self.host.start(self)

    @property
    def exitcode(self) -> int | None:
        self.host.pump()
        return self._exitcode

    def is_alive(self) -> bool:
        if self.pid is None:
            return False
        return self.exitcode is None or (self.host.lost and psutil.pid_exists(self.pid))

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.is_alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def join(self, timeout: float | None = None) -> None:
        """Until the host reports the exit, or the process is gone (whatever the host says), or `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and psutil.pid_exists(self.pid) and (deadline is None or time.monotonic() < deadline):
            if not self.host.pump(0.1):
                time.sleep(0.1)


class RankHostClient:
    """A trainer's connection to a rank host: its ranks' starts out, their exit statuses back."""

    def __init__(self, socket_path: Path, *, wait_s: float = CONNECT_S) -> None:
        """Connect, waiting up to `wait_s` for a host still starting (no socket yet); a socket nobody serves (a host
        that died) or a key that does not match fails at once."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.conn = Client(str(socket_path), family="AF_UNIX", authkey=key_path(socket_path).read_bytes())
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
        self.ranks: list[HostedRank] = []
        self.lost = False

    def start(self, rank: HostedRank) -> int:
        env = dict(os.environ)
        umask = os.umask(0)
        os.umask(umask)
        self.conn.send(("start", rank.name, (env, os.getcwd(), umask, *rank.args)))
        for fd in (sys.stdout.fileno(), sys.stderr.fileno()):
            reduction.send_handle(self.conn, fd, 0)
        self.ranks.append(rank)
        while rank.pid is None:
            if not self.pump(None):
                raise OSError("the rank host closed the connection before starting the rank")
        return rank.pid

    def pump(self, timeout: float | None = 0.0) -> bool:
        """Read what the host said (starts, exits); False once it is gone: every rank not known to have exited then
        counts as failed (exit status 1), so the supervisor stops the trainer, and is signalled by its pid."""
        if self.lost:
            return False
        try:
            while self.conn.poll(timeout):
                kind, index, value = self.conn.recv()
                if kind == "started":
                    self.ranks[index].pid = value
                    return True
                self.ranks[index]._exitcode = value
                timeout = 0.0
        except (OSError, EOFError):
            self.lost = True
            for rank in self.ranks:
                if rank._exitcode is None:
                    rank._exitcode = 1
            return False
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nebula_fl.clients.rank_host", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="the Unix socket trainers give as --rank-host")
    args = parser.parse_args(argv)
    return serve(Path(args.socket).resolve(), preload=list(RANK_PRELOAD))


if __name__ == "__main__":
    sys.exit(main())
