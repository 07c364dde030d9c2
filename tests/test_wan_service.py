"""The WAN proxy as a process (``python -m nebula_fl.wan``), its control socket, and a real Flower pair through it."""

from __future__ import annotations

import os
import re
import signal
import socket
import socketserver
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from nebula_fl.wan import ControlError, query_proxy
from nebula_fl.wan.service import main, parse_target

HOST = "127.0.0.1"
VENV_BIN = Path(sys.executable).parent
READY = re.compile(r"^wan proxy listening on 127\.0\.0\.1:(\d+) -> (\S+) \((\S+)\)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def kill_tree(popen: subprocess.Popen) -> None:
    """Stop a process and every descendant (collected first: Flower's SuperExec runs in its own session)."""
    try:
        root = psutil.Process(popen.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    popen.wait(timeout=5)


class EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    while data := self.request.recv(65536):
                        self.request.sendall(data)
                except OSError:
                    pass

        super().__init__((HOST, 0), Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(5)


@pytest.fixture
def echo():
    server = EchoServer()
    yield server.server_address[1]
    server.close()


@pytest.fixture
def short_dir():
    """A short folder for Unix sockets (their paths are limited to 107 bytes)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="wan-") as folder:
        yield Path(folder)


def start_proxy(target: str, control: Path, profile: str = "50mbit:10ms") -> tuple[subprocess.Popen, int]:
    popen = subprocess.Popen(
        [sys.executable, "-m", "nebula_fl.wan", "--listen-port", "0", "--target", target, "--profile", profile,
         "--control", str(control)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(popen.stdout.readline()), daemon=True)
    reader.start()
    reader.join(15)
    if not lines or not READY.match(lines[0].strip()):
        kill_tree(popen)
        raise AssertionError(f"no ready line from the proxy: {lines!r}; stderr: {popen.stderr.read()[-2000:]}")
    return popen, int(READY.match(lines[0].strip()).group(1))


def test_proxy_process_answers_control_requests_and_stops_cleanly_on_sigterm(echo, short_dir):
    control = short_dir / "c.sock"
    popen, port = start_proxy(f"{HOST}:{echo}", control)
    try:
        assert stat.S_ISSOCK(control.stat().st_mode) and stat.S_IMODE(control.stat().st_mode) == 0o600
        with socket.create_connection((HOST, port), timeout=5) as conn:
            conn.sendall(b"h" * 1000)
            got = b""
            while len(got) < 1000:
                got += conn.recv(65536)
            stats = query_proxy(control, "stats")
            assert (stats["bytes_up"], stats["bytes_down"], stats["connections"]) == (1000, 1000, 1)
            assert stats["target"] == f"{HOST}:{echo}" and stats["profile"]["spec"] == "50mbit:10ms"
            assert query_proxy(control, "set_profile", profile="2mbit:100ms")["profile"]["spec"] == "2mbit:100ms"
            assert query_proxy(control, "stats")["profile"]["rtt_s"] == 0.1
            with pytest.raises(ControlError, match=r"refused 'set_profile'.*RATE:RTT"):
                query_proxy(control, "set_profile", profile="fast")
            with pytest.raises(ControlError, match="unknown op 'frobnicate'; use one of stats, drop"):
                query_proxy(control, "frobnicate")
            assert query_proxy(control, "drop") == {"dropped": 1}
            conn.settimeout(5)
            try:
                assert conn.recv(10) == b""
            except ConnectionResetError:
                pass
        assert query_proxy(control, "stats")["dropped"] == 1
        keep = socket.create_connection((HOST, port), timeout=5)  # open at SIGTERM: it must not hold the exit up
        popen.send_signal(signal.SIGTERM)
        assert popen.wait(timeout=10) == 0
        keep.close()
        assert not control.exists()
        with pytest.raises(ControlError, match="no WAN proxy control socket"):
            query_proxy(control, "stats")
    finally:
        if popen.poll() is None:
            kill_tree(popen)


def test_stop_request_and_a_refused_second_proxy_on_the_same_socket(echo, short_dir, capsys):
    control = short_dir / "c.sock"
    popen, _ = start_proxy(f"{HOST}:{echo}", control)
    try:
        code = main(["--target", f"{HOST}:{echo}", "--profile", "1mbit:1ms", "--control", str(control)])
        assert code == 2 and "another process is listening on the control socket" in capsys.readouterr().err
        assert query_proxy(control, "stop") == {}
        assert popen.wait(timeout=10) == 0
        assert not control.exists()
    finally:
        if popen.poll() is None:
            kill_tree(popen)


def test_a_stale_socket_file_is_reported_and_then_replaced(echo, short_dir):
    control = short_dir / "stale.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(control))  # left behind, as by a proxy that was SIGKILLed
    with pytest.raises(ControlError, match="nothing answers"):
        query_proxy(control, "stats", timeout=2)
    popen, _ = start_proxy(f"{HOST}:{echo}", control)
    try:
        assert query_proxy(control, "stats")["connections"] == 0
    finally:
        kill_tree(popen)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "127.0.0.1:8000", "--profile", "fast"], "WAN profile 'fast'"),
        (["--target", "localhost", "--profile", "1mbit:1ms"], "not HOST:PORT"),
        (["--target", "127.0.0.1:99999", "--profile", "1mbit:1ms"], "not HOST:PORT"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, message, short_dir, capsys):
    assert main([*argv, "--control", str(short_dir / "x.sock")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nebula-fl wan: error: ") and message in err and err.count("\n") == 1
    assert not (short_dir / "x.sock").exists()


def test_a_non_socket_control_path_or_an_overlong_one_is_refused(short_dir, capsys):
    plain = short_dir / "file"
    plain.write_text("not a socket")
    assert main(["--target", "127.0.0.1:8000", "--profile", "1mbit:1ms", "--control", str(plain)]) == 2
    assert "exists and is not a socket" in capsys.readouterr().err
    assert plain.read_text() == "not a socket"
    long = short_dir / ("s" * 120)
    assert main(["--target", "127.0.0.1:8000", "--profile", "1mbit:1ms", "--control", str(long)]) == 2
    assert "choose a shorter --control path" in capsys.readouterr().err


def test_parse_target():
    assert parse_target("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_target("[::1]:9") == ("::1", 9)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_target(":80")


def test_a_real_supernode_registers_and_polls_through_the_proxy(tmp_path, short_dir):
    """flower-superlink <- proxy <- flower-supernode, all on 127.0.0.1: the proxy sees the Fleet API calls."""
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "flwr"), FLWR_TELEMETRY_ENABLED="0",
               FLWR_DISABLE_UPDATE_CHECK="1", PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    superlink_port, node_port = free_port(), free_port()
    started: list[subprocess.Popen] = []

    def start(name: str, argv: list[str]) -> subprocess.Popen:
        log = (tmp_path / f"{name}.log").open("wb")
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 cwd=tmp_path, start_new_session=True)
        log.close()
        started.append(popen)
        return popen

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in tmp_path.glob("*.log"))

    control = short_dir / "fl.sock"
    try:
        superlink = start("superlink", [str(VENV_BIN / "flower-superlink"), "--insecure",
                                        "--disable-runtime-dependency-installation", "--port", str(superlink_port)])
        proxy, proxy_port = start_proxy(f"{HOST}:{superlink_port}", control, "20mbit:20ms")
        started.append(proxy)
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as probe:
                if probe.connect_ex((HOST, superlink_port)) == 0:
                    break
            assert superlink.poll() is None and time.monotonic() < deadline, f"no SuperLink:\n{logs()}"
            time.sleep(0.1)
        start("supernode", [str(VENV_BIN / "flower-supernode"), "--insecure", "--superlink",
                            f"{HOST}:{proxy_port}", "--port", str(node_port)])
        deadline = time.monotonic() + 20
        while True:
            stats = query_proxy(control, "stats")
            paths = stats["requests_by_path"]
            if stats["bytes_down"] > 0 and "/v1/fleet/pull-messages" in paths:
                break
            assert time.monotonic() < deadline, f"no Fleet traffic through the proxy: {stats}\n{logs()}"
            time.sleep(0.2)
        assert "/v1/fleet/register-node" in paths and stats["unparsed_connections"] == 0
        assert stats["bytes_up"] > 500 * stats["requests"] > 0  # every call is a POST with ~0.8 kB of headers
        assert stats["upstream_failures"] == 0
    finally:
        for popen in reversed(started):
            kill_tree(popen)
    assert not control.exists()
