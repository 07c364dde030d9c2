"""Only nebula-fl's own ClientApp runs on a cluster: the bundle check (pure), and a foreign app bundle submitted to a
running federation (over TLS) by someone holding nothing but the SuperLink's address, whose code never runs
on any cluster while the federation goes on (that federation is test_secure_federation's; the control here: a
stock SuperNode does run it)."""

import io
import json
import re
import subprocess
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
import tomli_w
from flwr.cli.build import build_fab_from_disk

from nebula_fl import __version__
from nebula_fl.clients.bundle_check import COMPONENTS, MAX_BUNDLE_BYTES, BundleRefused, check_bundle
from nebula_fl.clients.runner import RunnerOptions
from nebula_fl.errors import ConfigError
from nebula_fl.launcher.federation import _bin, child_env, write_app
from nebula_fl.launcher.plan import free_port
from nebula_fl.launcher.processes import ProcessSet
from tests.conftest import start_plain_superlink

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 8  # a federation that meets the foreign bundle runs this many rounds: still running when it comes back


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buf.getvalue()


def _pyproject(**tool) -> bytes:
    doc = {"project": {"name": "x", "version": "1.0.0"},
           "tool": {"flwr": {"app": {"components": dict(COMPONENTS), "config": {"num-server-rounds": 2}}},
                    "nebula-fl": {"version": __version__}}}
    for dotted, value in tool.items():
        node = doc
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return tomli_w.dumps(doc).encode()


# -- unit: which bundles a cluster accepts ---------------------------------------------------------------------------
def test_the_bundles_nebula_fl_builds_pass_as_flower_builds_them(tmp_path):
    launched = build_fab_from_disk(write_app(tmp_path, {"num-server-rounds": 3}))  # what `nebula-fl run` submits
    doc = check_bundle(launched, own_version=__version__)
    assert doc["tool"]["flwr"]["app"]["config"] == {"num-server-rounds": 3}
    root = build_fab_from_disk(REPO)  # `flwr run .` from a checkout
    assert check_bundle(root, own_version=__version__)["tool"]["nebula-fl"]["version"] == __version__
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"] == __version__
    base = {"pyproject.toml": _pyproject(), "LICENSE": b"Apache-2.0", ".info/CONTENT": b""}
    check_bundle(_zip(base), own_version=__version__)


@pytest.mark.parametrize(("files", "fragment"), [
    ({"evilapp.py": b"import os"}, "carries 'evilapp.py'"),
    ({"pkg/__init__.py": b""}, "never code"),
    ({"sitecustomize.pth": b""}, "configuration only"),
    ({"pyproject.toml": _pyproject(tool__flwr__app__components={"serverapp": "nebula_fl.server.app:app",
                                                                 "clientapp": "evilapp:client"})},
     "names the components"),
    ({"pyproject.toml": _pyproject(tool__flwr__app__components={**COMPONENTS, "agentapp": "x:y"})}, "names the components"),
    ({"pyproject.toml": _pyproject(tool__flwr__app__components=None)}, "names the components None"),
    ({"pyproject.toml": _pyproject(**{"tool__nebula-fl": None})}, "does not say which nebula-fl"),
    ({"pyproject.toml": _pyproject(**{"tool__nebula-fl__version": "0.0.1"})}, "made for nebula-fl 0.0.1"),
    ({"pyproject.toml": b"[tool.flwr\nbroken"}, "not readable TOML"),
    ({"LICENSE": b"x" * (MAX_BUNDLE_BYTES + 1)}, "more than"),
])
def test_a_bundle_with_code_other_components_or_another_version_is_refused_in_one_line(files, fragment):
    base = {"pyproject.toml": _pyproject(), "LICENSE": b"Apache-2.0", ".info/CONTENT": b""}
    with pytest.raises(BundleRefused, match=re.escape(fragment)) as err:
        check_bundle(_zip({**base, **files}), own_version=__version__)
    assert "\n" not in str(err.value)


def test_what_is_not_a_bundle_is_refused():
    with pytest.raises(BundleRefused, match="not a zip"):
        check_bundle(b"#!/bin/sh\nrm -rf /\n", own_version=__version__)
    with pytest.raises(BundleRefused, match=r"no pyproject\.toml"):
        check_bundle(_zip({"LICENSE": b"x"}), own_version=__version__)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive, pytest.warns(UserWarning, match="Duplicate"):
        archive.writestr("pyproject.toml", _pyproject())
        archive.writestr("pyproject.toml", b"[tool]")
    with pytest.raises(BundleRefused, match="twice"):
        check_bundle(buf.getvalue(), own_version=__version__)


def test_runner_options_are_checked(monkeypatch):
    RunnerOptions(runtime_api_address="127.0.0.1:9094", auth_secret=b"s")
    for bad in ("9094", "127.0.0.1:", "127.0.0.1:99999", ":9094"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            RunnerOptions(runtime_api_address=bad)
    with pytest.raises(ConfigError, match="empty"):
        RunnerOptions(runtime_api_address="127.0.0.1:9094", auth_secret=b"")
    for poll in ("0", "nan", "61", "soon"):  # the runner honours Flower's SuperExec poll variable, checked alike
        monkeypatch.setenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", poll)
        with pytest.raises(ConfigError, match="FLWR_SUPEREXEC_TASK_POLL_INTERVAL"):
            RunnerOptions(runtime_api_address="127.0.0.1:9094")
    monkeypatch.setenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.5")
    assert RunnerOptions(runtime_api_address="127.0.0.1:9094").poll_s == 0.5


# -- e2e: a foreign bundle submitted to a running federation ---------------------------------------------------------
EVIL_APP = '''
import json, os, sys, time
from pathlib import Path
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

MARKS = Path("@MARKS@")  # where this bundle's code, wherever it runs, leaves its traces


def mark(name, text=""):
    (MARKS / f"{name}-{os.getpid()}").write_text(text)


mark("evil-imported", " ".join(sys.argv))  # an import side effect: any process that loads this code says so

client = ClientApp()

@client.query()
def steal(msg: Message, context: Context) -> Message:
    mark("clientapp-ran", json.dumps(dict(os.environ)))
    return Message(RecordDict({"loot": ConfigRecord({"uid": os.getuid()})}), reply_to=msg)

server = ServerApp()

@server.main()
def main(grid: Grid, context: Context) -> None:
    nodes, deadline = [], time.time() + 60
    while not nodes and time.time() < deadline:
        nodes = list(grid.get_node_ids())
        time.sleep(0.5)
    asked = [Message(RecordDict({"ask": ConfigRecord({"x": 1})}), dst_node_id=n, message_type="query") for n in nodes]
    replies = list(grid.send_and_receive(asked, timeout=90))
    seen = [{"node": r.metadata.src_node_id, "error": r.error.reason if r.has_error() else None,
             "content": None if r.has_error() else str(r.content)} for r in replies]
    (MARKS / "server-saw.json").write_text(json.dumps({"nodes": nodes, "replies": seen}))
'''


def _evil_app(folder: Path, marks: Path) -> Path:
    app = folder / "evilapp-src"
    (app / "evilapp").mkdir(parents=True)
    (app / "evilapp" / "__init__.py").write_text("")
    (app / "evilapp" / "apps.py").write_text(EVIL_APP.replace("@MARKS@", str(marks)))
    doc = {"build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
           "project": {"name": "evilapp", "version": "1.0.0", "license": "Apache-2.0", "dependencies": []},
           "tool": {"flwr": {"app": {"publisher": "someone",
                                     "components": {"serverapp": "evilapp.apps:server", "clientapp": "evilapp.apps:client"},
                                     "config": {"rounds": 1}}}}}
    (app / "pyproject.toml").write_text(tomli_w.dumps(doc))
    return app


def submit_foreign_bundle(out: Path, tmp_path: Path, marks: Path) -> None:
    """Submit the foreign bundle to the federation running in `out`, as someone holding nothing but the SuperLink's
    address (and, with TLS, the public CA) would, and wait until its ServerApp heard back from the clusters.
    The federation that meets it: test_secure_federation's, over TLS as across sites."""
    connection = tomllib.loads((out / ".flwr" / "config.toml").read_text())["superlink"]["local"]
    assert set(connection) <= {"address", "insecure", "root-certificates"}
    home = tmp_path / "submitter"
    home.mkdir()
    (home / "config.toml").write_text(tomli_w.dumps({"superlink": {"default": "target", "target": connection}}))
    _submit(_evil_app(tmp_path, marks), home=home, cwd=tmp_path)
    _wait_for_file(marks / "server-saw.json", 180, "the foreign ServerApp never heard back from the clusters")


def check_foreign_bundle_refused(out: Path, marks: Path, *, rounds: int) -> None:
    """No code of the bundle ran on a cluster, each cluster said why, and the federation went on undisturbed."""
    saw = json.loads((marks / "server-saw.json").read_text())
    assert len(saw["nodes"]) == 2 and len(saw["replies"]) == 2
    for reply in saw["replies"]:  # an error reply from each cluster, saying why; no content
        assert reply["content"] is None and "refused by the nebula-fl cluster" in reply["error"]
        assert "carries 'evilapp/__init__.py'" in reply["error"]
    # its ClientApp never ran, and only the SuperLink's ServerApp runner (the server's side, which the threat model
    # does not trust anyway) ever imported it
    assert not list(marks.glob("clientapp-ran-*"))
    importers = [p.read_text() for p in marks.glob("evil-imported-*")]
    assert importers and all("flwr-serverapp" in cmd for cmd in importers), importers
    for i in (0, 1):
        runner_log = (out / "logs" / f"clientapp-{i}.log").read_text()
        assert runner_log.count("refused run") == 1 and "evilapp" in runner_log
        assert "evilapp" not in (out / "logs" / f"trainer-{i}.log").read_text()  # the trainer never heard of it
    summary = json.loads((out / "summary.json").read_text())  # every round aggregated both clusters
    assert summary["status"] == "completed" and summary["rounds_completed"] == rounds
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == list(range(1, rounds + 1))
    assert all(set(x["clusters"]) == {"0", "1"} and not x["rejected"] for x in lines)


def _submit(app: Path, *, home: Path, cwd: Path) -> None:
    done = subprocess.run([_bin("flwr"), "run", str(app), "target"], env=child_env(home), capture_output=True,
                          text=True, timeout=120, cwd=cwd)
    assert done.returncode == 0 and "Successfully started run" in done.stdout + done.stderr, done.stdout + done.stderr


def _wait_for_file(path: Path, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


@pytest.mark.e2e
def test_control_a_stock_supernode_runs_the_foreign_clientapp_and_the_traces_show_it(tmp_path):
    """The control for test_secure_federation's federation: the same bundle against a stock SuperNode (Flower's
    default isolation) runs its ClientApp on the node, and the traces looked for there appear; so their absence there
    means something."""
    marks, home, port = tmp_path / "marks", tmp_path / ".flwr", free_port()
    marks.mkdir()
    home.mkdir()
    target = {"address": f"127.0.0.1:{port}", "insecure": True}
    (home / "config.toml").write_text(tomli_w.dumps({"superlink": {"default": "target", "target": target}}))
    procs = ProcessSet()
    try:
        start_plain_superlink(procs, port=port, home=home, folder=tmp_path)
        procs.start("supernode", [_bin("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}", "--port",
                                  str(free_port())], log_path=tmp_path / "supernode.log", env=child_env(home))
        _submit(_evil_app(tmp_path, marks), home=home, cwd=tmp_path)
        _wait_for_file(marks / "server-saw.json", 180, "the foreign ServerApp never heard back from the stock node")
    finally:
        procs.stop_all()
    saw = json.loads((marks / "server-saw.json").read_text())
    assert len(saw["replies"]) == 1 and saw["replies"][0]["error"] is None and "uid" in saw["replies"][0]["content"]
    assert len(list(marks.glob("clientapp-ran-*"))) == 1
    assert any("flwr-clientapp" in p.read_text() for p in marks.glob("evil-imported-*"))
