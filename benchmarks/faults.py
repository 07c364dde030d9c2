"""Fault scenarios on real processes: what each fault costs a `nebula-fl run`, and whether the run recovers.

Every scenario is a real federation (`nebula-fl run --preset smoke --port 0`, the shipped MiniLM): a
flower-superlink, a trainer and a flower-supernode per cluster, `flwr run`. A fault is injected from outside at a
chosen moment: SIGKILL of a trainer, a SuperNode or the launcher while a round trains (a cluster's trainer is
"training" once it holds an accepted connection on its socket, i.e. the round's request is in its hands), a
damaged checkpoint, a trainer frozen with SIGSTOP past the round timeout, a port reused at once. Each scenario
records `name`, `passed`, `rounds_completed`, `recovery_seconds` (from the fault to the metrics line of the round
it hit; from the resume command to that line after a launcher kill; null where nothing recovers), `lost`,
`seconds` (wall), `detail` (what failed) and `facts` (what was measured on the way).

    .venv/bin/python benchmarks/faults.py                  # all 8 scenarios (~10 min on 2 cores)
    .venv/bin/python benchmarks/faults.py --quick          # trainer-sigkill, corrupt-checkpoint, slow-cluster,
                                                           # port-time-wait (~4.5 min)
    .venv/bin/python benchmarks/faults.py --only supernode-sigkill,slow-cluster --out /tmp/faults

Writes results.json (default benchmarks/results/faults/) with every run folder beside it (runs/<scenario>/, logs
included), prints a table, and exits 1 if a scenario failed. Every process a scenario starts is stopped when it
ends, whatever happened (Ctrl-C to the launcher, then SIGKILL to each descendant it was seen to have).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from harness import Tracked, free_port, fresh_out, write_results  # beside this script, first on sys.path
from rich.console import Console
from rich.table import Table
from safetensors.numpy import load_file

from nebula_fl.storage.checkpoint import parse_pointer, read_checkpoint
from nebula_fl.storage.run_folder import RunFolder

REPO = Path(__file__).resolve().parents[1]

DEFAULT_OUT = REPO / "benchmarks" / "results" / "faults"
RUN_TIMEOUT_S = 900  # a whole federation of a scenario; a hang past it is a failure, and stopped
FAULT_TIMEOUT_S = 300  # from the launch to the moment the fault is injected (start-up plus round 1)
RECOVERY_LIMIT_S = 30.0  # a round hit by a killed trainer or SuperNode must close within this
SUPERVISION_DEADLINE_S = 10.0  # every process of a SIGKILLed launcher is gone within this
STALL_S = 30.0  # how long a trainer is frozen by SIGSTOP
ROUND_TIMEOUT_S = 20
RESUME_TOLERANCE = 1e-6  # max abs difference of the resumed run's final adapter from the uninterrupted one
DP_BUDGET = 50.0
DP_CONFIG = f'privacy.mode="sample" privacy.noise-multiplier=1.0 privacy.max-epsilon={DP_BUDGET:g}'
QUICK = ("trainer-sigkill", "corrupt-checkpoint", "slow-cluster", "port-time-wait")


class Abort(Exception):
    """The scenario cannot go on (a run ended or hung where it should not have); the message says how."""


class Scenario:
    """One scenario: the launches it makes (all stopped at the end), its checks, its record."""

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.dir = root / "runs" / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.launches: list[Tracked] = []
        self.frozen: list[psutil.Process] = []
        self.failures: list[str] = []
        self.facts: dict[str, Any] = {}
        self.rounds_completed: int | None = None
        self.recovery_seconds: float | None = None
        self.lost = "unknown (the scenario did not get that far)"

    # -- launches --------------------------------------------------------------------------------
    def run_folder(self, label: str) -> Path:
        return self.dir / label

    def launch(self, label: str, *args: str) -> Tracked:
        """`nebula-fl ARGS`, its output in <scenario>/<label>.log, its descendants recorded."""
        tracked = Tracked(list(args), cwd=REPO, log=self.dir / f"{label}.log")
        self.launches.append(tracked)
        return tracked

    def start_run(self, label: str, *extra: str) -> tuple[Tracked, Path]:
        folder = self.run_folder(label)
        return self.launch(label, "run", "--preset", "smoke", "--port", "0", "--out", str(folder), *extra), folder

    def wait(self, tracked: Tracked, *, timeout: float = RUN_TIMEOUT_S, until: Callable[[], bool] | None = None,
             what: str = "the run") -> int:
        """Tracked.wait without its AssertionError: a hang becomes a short Abort (the log is on disk)."""
        try:
            return tracked.wait(timeout, until=until)
        except AssertionError:
            raise Abort(f"{what} did not get there within {timeout:.0f} s (stopped); see {tracked.log}") from None

    def until_round(self, tracked: Tracked, folder: Path, rnd: int, *, timeout: float = FAULT_TIMEOUT_S) -> None:
        """Wait until round `rnd`'s metrics line is written; the run ending first aborts the scenario."""
        code = self.wait(tracked, timeout=timeout, until=lambda: rounds_done(folder) >= rnd, what=f"round {rnd}")
        if code != -1:
            raise Abort(f"the run exited with status {code} before round {rnd} was recorded; see {tracked.log}")

    def freeze(self, proc: psutil.Process) -> None:
        """SIGSTOP a process and its descendants (thawed at the end of the scenario if not before)."""
        for member in [proc, *proc.children(recursive=True)]:
            member.send_signal(signal.SIGSTOP)
            self.frozen.append(member)

    def thaw(self) -> None:
        for member in self.frozen:
            try:
                member.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
        self.frozen.clear()

    def close(self) -> None:
        """Stop every launch (Ctrl-C, then SIGKILL to its recorded descendants); one left alive fails the scenario."""
        self.thaw()
        for tracked in self.launches:
            tracked.stop()
        left = [proc for tracked in self.launches for proc in tracked.survivors(settle=5.0)]
        self.check(not left, f"{len(left)} process(es) still alive after the scenario was stopped: {left[:3]}")

    # -- checks ----------------------------------------------------------------------------------
    def check(self, ok: bool, failure: str) -> bool:
        if not ok:
            self.failures.append(failure)
        return bool(ok)

    def record(self, seconds: float) -> dict[str, Any]:
        return {"name": self.name, "passed": not self.failures, "rounds_completed": self.rounds_completed,
                "recovery_seconds": None if self.recovery_seconds is None else round(self.recovery_seconds, 1),
                "lost": self.lost, "seconds": round(seconds, 1), "detail": "; ".join(self.failures),
                "facts": self.facts}


# -- reading a run ---------------------------------------------------------------------------------
def rounds_of(folder: Path) -> list[dict[str, Any]]:
    return RunFolder(folder).rounds()


def rounds_done(folder: Path) -> int:
    return len(rounds_of(folder))


def summary_of(folder: Path) -> dict[str, Any]:
    return RunFolder(folder).read_summary()


def node_clusters(lines: list[dict[str, Any]]) -> dict[str, str]:
    """"node-N" -> cluster id, from the rounds where node N's cluster was known (metrics name a node whose
    cluster the server no longer knows, e.g. a replaced SuperNode, by its node id)."""
    return {f"node-{info['node_id']}": cid for line in lines for cid, info in line.get("clusters", {}).items()
            if cid.isdigit() and "node_id" in info}


def lost_updates(lines: list[dict[str, Any]]) -> list[str]:
    """What the metrics say was lost: each dropped cluster update and each skipped round."""
    names = node_clusters(lines)
    lost = []
    for line in lines:
        for key in sorted(line.get("rejected") or {}):
            lost.append(f"cluster {names.get(key, key)}'s round-{line['round']} update")
        if line.get("skipped"):
            lost.append(f"round {line['round']} (skipped, adapter kept)")
    return lost


def trained(line: dict[str, Any], cluster: str) -> bool:
    """Whether `cluster`'s update of this round was aggregated."""
    info = line.get("clusters", {}).get(cluster) or {}
    return cluster not in (line.get("rejected") or {}) and "train_loss" in info


def completed(sc: Scenario, tracked: Tracked, folder: Path, *, rounds: int, what: str = "the run") -> dict[str, Any]:
    """Wait for the run to end; check exit 0, status completed and every round recorded once, in order."""
    code = sc.wait(tracked, what=what)
    summary = summary_of(folder)
    sc.rounds_completed = summary.get("rounds_completed")
    sc.check(code == 0, f"{what} exited with status {code} (see {tracked.log})")
    sc.check(summary.get("status") == "completed", f"{what}: status {summary.get('status')!r}, error "
             f"{summary.get('error')!r}")
    recorded = [line["round"] for line in rounds_of(folder)]
    sc.check(recorded == list(range(1, rounds + 1)), f"{what}: rounds recorded {recorded}, not 1..{rounds}")
    left = tracked.survivors()
    sc.check(not left, f"{what}: {len(left)} process(es) outlived the launcher: {left[:3]}")
    return summary


def log_lines(path: Path, *words: str, last: int = 6) -> list[str]:
    """The last lines of a log holding any of `words` (all of them when none given), ANSI colours removed."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    lines = [line.replace("\x1b[92m", "").replace("\x1b[93m", "").replace("\x1b[91m", "").replace("\x1b[0m", "")
             for line in text.splitlines() if line.strip()]
    if words:
        lines = [line for line in lines if any(w in line for w in words)]
    return [line.strip()[:300] for line in lines[-last:]]


def diagnosis(folder: Path, cluster: int, launcher_log: Path) -> dict[str, list[str]]:
    """What the logs of a run say about one cluster's fault: the launcher's and the ServerApp's lines about it,
    the last lines of the cluster's SuperNode and trainer."""
    logs = folder / "logs"
    return {
        "launcher": log_lines(launcher_log, f"cluster {cluster}", "error", "dropped", "SKIPPED", last=8),
        "server.log": log_lines(logs / "server.log", "WARNING", "ERROR", "replaced", "skipped", "serves cluster",
                                last=12),
        f"supernode-{cluster}.log": log_lines(logs / f"supernode-{cluster}.log", last=8),
        f"trainer-{cluster}.log": log_lines(logs / f"trainer-{cluster}.log", last=8),
    }


# -- finding processes and moments -----------------------------------------------------------------
def find(tracked: Tracked, *words: str) -> psutil.Process | None:
    """The launcher's live descendant whose whole command line holds every one of `words`."""
    tracked.poll_tree()
    for pid, (created, _) in sorted(tracked.seen.items()):
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) < 1e-3 and proc.status() != psutil.STATUS_ZOMBIE and all(
                    w in " ".join(proc.cmdline()) for w in words):
                return proc
        except psutil.Error:
            pass
    return None


def trainer_of(tracked: Tracked, cluster: int) -> psutil.Process | None:
    return find(tracked, "nebula_fl trainer", f"--cluster-id {cluster} ")


def socket_ends(trainer: psutil.Process) -> int:
    """How many sockets of the trainer's tree are bound to its socket path: the listening one, then one per
    accepted connection."""
    try:
        argv = trainer.cmdline()
        sock = argv[argv.index("--socket") + 1]
    except (psutil.Error, ValueError, IndexError):
        return 0
    count = 0
    for proc in [trainer, *trainer.children(recursive=True)]:
        try:
            count += sum(1 for c in proc.net_connections(kind="unix") if c.laddr == sock)
        except psutil.Error:
            pass
    return count


def listens(trainer: psutil.Process) -> bool:
    return socket_ends(trainer) >= 1


def holds_a_request(trainer: psutil.Process) -> bool:
    """Whether the trainer holds an accepted connection on its socket (a round's request is in its hands)."""
    return socket_ends(trainer) >= 2


def wait_training(sc: Scenario, tracked: Tracked, cluster: int, *, into: float = 1.0,
                  timeout: float = 120.0) -> psutil.Process:
    """Cluster `cluster`'s trainer, `into` seconds after a round's request reached it (it is training then)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tracked.popen.poll() is not None:
            raise Abort(f"the run exited with status {tracked.popen.returncode} before cluster {cluster} trained")
        trainer = trainer_of(tracked, cluster)
        if trainer is not None and holds_a_request(trainer):
            time.sleep(into)
            tracked.poll_tree()
            return trainer
        time.sleep(0.1)
    raise Abort(f"cluster {cluster}'s trainer was not sent a round within {timeout:.0f} s")


def max_abs_diff(a: Path, b: Path) -> float:
    first, second = load_file(str(a)), load_file(str(b))
    if set(first) != set(second):
        return float("inf")
    return max(float(np.max(np.abs(first[k].astype(np.float64) - second[k].astype(np.float64)))) for k in first)


def tree_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


# -- scenarios --------------------------------------------------------------------------------------
def killed_cluster_service(sc: Scenario, *, service: str) -> None:
    """3 clusters, 4 rounds; SIGKILL cluster 1's trainer or SuperNode while round 2 trains."""
    tracked, folder = sc.start_run("run", "--clusters", "3", "--rounds", "4")
    sc.until_round(tracked, folder, 1)
    trainer = wait_training(sc, tracked, 1)
    victim = trainer if service == "trainer" else find(tracked, "flower-supernode", "cluster-id=1")
    if victim is None:
        raise Abort("cluster 1's flower-supernode is not among the launcher's descendants")
    sc.facts["killed"] = " ".join(victim.cmdline())[:120]
    victim.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    closed_at: float | None = None

    def progress() -> bool:  # round 2 closed, and the restarted trainer (if it was killed) listens again
        nonlocal closed_at
        if closed_at is None and rounds_done(folder) >= 2:
            closed_at = time.monotonic()
        if service == "trainer" and "trainer_listening_again_after_s" not in sc.facts:
            again = trainer_of(tracked, 1)
            if again is not None and again.pid != victim.pid and listens(again):
                sc.facts["trainer_listening_again_after_s"] = round(time.monotonic() - killed, 1)
        return closed_at is not None and (service != "trainer" or "trainer_listening_again_after_s" in sc.facts)

    closed = sc.wait(tracked, timeout=240, until=progress, what="round 2 after the kill")
    if closed_at is not None:
        sc.recovery_seconds = closed_at - killed
        closed = -1
    sc.check(closed == -1 and sc.recovery_seconds <= RECOVERY_LIMIT_S,
             f"round 2 closed {sc.recovery_seconds:.1f} s after the kill (limit {RECOVERY_LIMIT_S:.0f} s)"
             if closed == -1 else f"the run exited with status {closed} before round 2 closed")
    summary = completed(sc, tracked, folder, rounds=4)
    lines = rounds_of(folder)
    if len(lines) >= 2:
        second = lines[1]
        sc.facts["round_2"] = {"seconds": round(second["seconds"], 1), "aggregated": second["clusters_aggregated"],
                               "rejected": second["rejected"]}
        sc.check(all(trained(second, c) for c in ("0", "2")), f"round 2 did not aggregate clusters 0 and 2: {second}")
        names = node_clusters(lines)
        dropped = [key for key in second.get("rejected") or {} if names.get(key, key) == "1"]
        sc.facts["drop_recorded_as"] = dropped
        sc.check(bool(dropped), f"round 2's metrics line records no drop of cluster 1: {second.get('rejected')}")
        sc.check(any(d["round"] == 2 for d in summary.get("drops") or []), "summary.json `drops` lacks round 2")
        again = [line["round"] for line in lines[2:] if trained(line, "1")]
        sc.facts["cluster_1_trained_again_in"] = again
        sc.check(bool(again), "cluster 1 never trained again after the kill")
        sc.lost = ", ".join(lost_updates(lines)) or "nothing"
    restarts = [r for r in summary.get("restarts") or [] if r.get("service") == service and r.get("cluster") == 1]
    sc.facts["restarts"] = summary.get("restarts")
    sc.check(bool(restarts) and all(r.get("restarted") for r in restarts),
             f"summary.json `restarts` has no restarted {service} of cluster 1: {summary.get('restarts')}")
    if sc.failures:
        sc.facts["logs"] = diagnosis(folder, 1, tracked.log)


def trainer_sigkill(sc: Scenario) -> None:
    killed_cluster_service(sc, service="trainer")


def supernode_sigkill(sc: Scenario) -> None:
    killed_cluster_service(sc, service="supernode")


def launcher_killed_then_resumed(sc: Scenario, extra: list[str]) -> tuple[Path, int]:
    """2 clusters, 4 rounds; SIGKILL the launcher while round 2 trains, check nothing outlives it 10 s, resume.

    Returns the run folder and the rounds it had completed at the kill."""
    tracked, folder = sc.start_run("run", "--clusters", "2", "--rounds", "4", *extra)
    sc.until_round(tracked, folder, 1)
    wait_training(sc, tracked, 0, into=0.3)  # a smoke round trains for 1.5-4 s: kill it before the update leaves
    for _ in range(3):  # every descendant recorded, ClientApps included
        tracked.poll_tree()
        time.sleep(0.1)
    done = rounds_done(folder)
    sc.facts["processes_at_kill"] = sum(1 for pid in tracked.seen if psutil.pid_exists(pid))
    tracked.popen.kill()
    killed = time.monotonic()
    tracked.popen.wait()
    left = tracked.survivors(settle=SUPERVISION_DEADLINE_S)
    gone_after = time.monotonic() - killed
    sc.facts["all_gone_after_s"] = round(gone_after, 1) if not left else None
    sc.check(not left, f"{len(left)} process(es) alive {SUPERVISION_DEADLINE_S:.0f} s after the launcher's SIGKILL: "
             f"{left[:3]}")
    return folder, done


def resume(sc: Scenario, folder: Path, *, rounds: int, done: int) -> dict[str, Any]:
    """`--resume` the run; recovery = from the command to the metrics line of the round the kill interrupted."""
    started = time.monotonic()
    resumed = sc.launch("resume", "run", "--resume", str(folder), "--port", "0")
    if sc.wait(resumed, until=lambda: rounds_done(folder) > done, what="the resume") == -1:
        sc.recovery_seconds = time.monotonic() - started
    summary = completed(sc, resumed, folder, rounds=rounds, what="the resume")
    sc.lost = f"round {done + 1}'s work in flight at the kill (trained again after --resume)"
    return summary


def launcher_sigkill_resume(sc: Scenario) -> None:
    codec = ["--codec", "topk:0.25+int4"]
    folder, done = launcher_killed_then_resumed(sc, codec)
    resume(sc, folder, rounds=4, done=done)
    reference, ref_folder = sc.start_run("reference", "--clusters", "2", "--rounds", "4", *codec)
    completed(sc, reference, ref_folder, rounds=4, what="the uninterrupted reference run")
    a, b = folder / "adapter.safetensors", ref_folder / "adapter.safetensors"
    if sc.check(a.exists() and b.exists(), "a final adapter.safetensors is missing"):
        diff = max_abs_diff(a, b)
        sc.facts["max_abs_diff_vs_uninterrupted"] = diff
        sc.facts["final_accuracy"] = {"resumed": summary_of(folder).get("final_accuracy"),
                                      "uninterrupted": summary_of(ref_folder).get("final_accuracy")}
        sc.check(diff <= RESUME_TOLERANCE, f"the resumed final adapter differs from the uninterrupted one by {diff:.3g} "
                 f"(max abs; tolerance {RESUME_TOLERANCE:g})")


def launcher_sigkill_resume_dp(sc: Scenario) -> None:
    folder, done = launcher_killed_then_resumed(sc, ["--run-config", DP_CONFIG])
    ledgers = {c: folder / "clusters" / str(c) / "state" / "privacy-ledger.jsonl" for c in (0, 1)}
    before = {c: path.read_bytes().splitlines() if path.exists() else [] for c, path in ledgers.items()}
    at_kill = rounds_of(folder)
    eps_before = {c: (at_kill[-1]["clusters"].get(str(c)) or {}).get("epsilon") if at_kill else None for c in (0, 1)}
    sc.facts["ledger_lines_at_kill"] = {str(c): len(lines) for c, lines in before.items()}
    sc.facts["epsilon_before_kill"] = {str(c): e for c, e in eps_before.items()}
    resume(sc, folder, rounds=4, done=done)
    lines = rounds_of(folder)
    final = lines[-1]["clusters"] if lines else {}
    sc.facts["answered_from_the_reply_cache"] = log_lines(folder / "logs" / "trainer-0.log", "asked again") + log_lines(
        folder / "logs" / "trainer-1.log", "asked again")
    sc.facts["epsilon_final"] = {str(c): (final.get(str(c)) or {}).get("epsilon") for c in (0, 1)}
    sc.facts["ledger_lines_after"] = {}
    for c, path in ledgers.items():
        after = path.read_bytes().splitlines() if path.exists() else []
        sc.facts["ledger_lines_after"][str(c)] = len(after)
        sc.check(after[: len(before[c])] == before[c] and len(after) >= len(before[c]),
                 f"cluster {c}'s ledger did not only grow across the resume ({len(before[c])} lines before, "
                 f"{len(after)} after, prefix {'kept' if after[: len(before[c])] == before[c] else 'changed'})")
        rounds = [json.loads(line).get("round") for line in after if line.strip()]
        twice = sorted({r for r in rounds if rounds.count(r) > 1})
        sc.check(not twice, f"cluster {c}'s ledger charges round(s) {twice} twice")
        eps, was = (final.get(str(c)) or {}).get("epsilon"), eps_before[c]
        ok = isinstance(eps, float | int) and isinstance(was, float | int) and was <= eps <= DP_BUDGET
        sc.check(ok, f"cluster {c}: final ε {eps} is not within [ε before the kill {was}, budget {DP_BUDGET:g}]")


def corrupt_checkpoint(sc: Scenario) -> None:
    tracked, folder = sc.start_run("run", "--clusters", "2", "--rounds", "2")
    completed(sc, tracked, folder, rounds=2, what="the 2-round run")
    root = folder / "checkpoint"
    latest, _ = parse_pointer((root / "latest").read_bytes())
    previous = [p for p in sorted(root.glob("round-*")) if p.name != latest]
    if not previous:
        raise Abort(f"no checkpoint before {latest} is kept in {root}")
    kept = tree_digest(previous[-1])
    adapter = root / latest / "adapter.safetensors"
    size = adapter.stat().st_size
    with adapter.open("r+b") as handle:
        handle.truncate(size // 2)
    sc.facts["damaged"] = f"{latest}/adapter.safetensors truncated from {size} to {size // 2} bytes"
    refused = subprocess.run([sys.executable, "-m", "nebula_fl", "run", "--resume", str(folder), "--rounds", "3",
                              "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=300)
    stderr = [line for line in refused.stderr.splitlines() if line.strip()]
    sc.facts["refusal"] = {"exit": refused.returncode, "stderr": stderr[:3]}
    sc.check(refused.returncode == 2, f"--resume on the damaged checkpoint exited {refused.returncode}, not 2")
    sc.check(len(stderr) == 1, f"--resume on the damaged checkpoint printed {len(stderr)} stderr lines, not 1")
    sc.check(tree_digest(previous[-1]) == kept, f"the previous checkpoint {previous[-1].name} changed")
    rewound = sc.launch("rewind", "run", "--resume", str(folder), "--rounds", "3", "--rewind", "--port", "0")
    started = time.monotonic()
    completed(sc, rewound, folder, rounds=3, what="--rewind")
    sc.facts["rewind_seconds"] = round(time.monotonic() - started, 1)
    output = rewound.output()
    sc.check("moved the damaged checkpoint aside" in output, "--rewind did not say it moved the damaged checkpoint")
    sc.lost = f"{latest} (damaged; its round trained again after --rewind)"


def stalled_trainer(sc: Scenario, *, min_clusters: int) -> tuple[Tracked, Path]:
    """2 clusters, 3 rounds, round-timeout 20 s: freeze cluster 1's trainer while round 2 trains, 30 s."""
    tracked, folder = sc.start_run("run", "--clusters", "2", "--rounds", "3", "--run-config",
                                   f"min-clusters={min_clusters} round-timeout={ROUND_TIMEOUT_S}")
    sc.until_round(tracked, folder, 1)
    first = rounds_of(folder)[0]
    sc.facts["round_1"] = {"seconds": round(first["seconds"], 1), "aggregated": first["clusters_aggregated"]}
    sc.freeze(wait_training(sc, tracked, 1, into=0.2))
    stopped = time.monotonic()
    closed_at = None

    def progress() -> bool:
        nonlocal closed_at
        if closed_at is None and rounds_done(folder) >= 2:
            closed_at = time.monotonic()
        if sc.frozen and time.monotonic() - stopped >= STALL_S:
            sc.thaw()
        return closed_at is not None and not sc.frozen

    if sc.wait(tracked, timeout=300, until=progress, what="round 2 with a frozen trainer") != -1:
        raise Abort(f"the run exited with status {tracked.popen.returncode} before round 2 was recorded")
    sc.facts["thawed_after_s"] = round(time.monotonic() - stopped, 1)
    sc.recovery_seconds = closed_at - stopped
    return tracked, folder


def slow_cluster(sc: Scenario) -> None:
    tracked, folder = stalled_trainer(sc, min_clusters=1)
    completed(sc, tracked, folder, rounds=3)
    lines = rounds_of(folder)
    if len(lines) < 2:
        return
    second = lines[1]
    sc.facts["round_2"] = {"seconds": round(second["seconds"], 1), "aggregated": second["clusters_aggregated"],
                           "rejected": second["rejected"]}
    sc.facts["cluster_1_trained_again_in"] = [line["round"] for line in lines[2:] if trained(line, "1")]
    sc.check(trained(second, "0") and not trained(second, "1") and second["clusters_aggregated"] == 1,
             f"round 2 did not close with cluster 0 only: aggregated {second['clusters_aggregated']}, "
             f"rejected {second['rejected']}")
    sc.check(ROUND_TIMEOUT_S - 1 <= second["seconds"] <= ROUND_TIMEOUT_S + 15,
             f"round 2 took {second['seconds']:.1f} s, not ~{ROUND_TIMEOUT_S} s (the round timeout)")
    sc.lost = ", ".join(lost_updates(lines)) or "nothing"
    if sc.failures:
        sc.facts["logs"] = diagnosis(folder, 1, tracked.log)


def below_min_clusters(sc: Scenario) -> None:
    tracked, folder = stalled_trainer(sc, min_clusters=2)
    checkpoints = folder / "checkpoint"
    one, two = checkpoints / "round-00001", checkpoints / "round-00002"
    if one.is_dir() and two.is_dir():  # both kept until round 3's checkpoint is written
        diff = max(float(np.max(np.abs(a - read_checkpoint(two).adapter[k])))
                   for k, a in read_checkpoint(one).adapter.items())
        sc.facts["adapter_change_in_round_2"] = diff
        sc.check(diff == 0.0, f"the global adapter changed in round 2 by {diff:.3g} (max abs)")
    completed(sc, tracked, folder, rounds=3)
    lines = rounds_of(folder)
    if len(lines) < 2:
        return
    second = lines[1]
    sc.facts["round_2"] = {"seconds": round(second["seconds"], 1), "skipped": second.get("skipped"),
                           "accuracy": second.get("accuracy")}
    sc.check(bool(second.get("skipped")), "round 2's metrics line is not `skipped`")
    sc.check(second.get("accuracy") is None, f"round 2's accuracy is {second.get('accuracy')}, not null")
    said = log_lines(folder / "logs" / "server.log", "round 2 skipped", last=1)
    sc.facts["log_line"] = said[0] if said else None
    sc.check(bool(said), "server.log has no 'round 2 skipped' line")
    sc.facts["skipped_rounds"] = summary_of(folder).get("skipped_rounds")
    sc.lost = ", ".join(lost_updates(lines)) or "nothing"
    if sc.failures:
        sc.facts["logs"] = diagnosis(folder, 1, tracked.log)


def time_wait_on(port: int) -> int:
    return sum(1 for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_TIME_WAIT
               and port in (c.laddr.port if c.laddr else None, c.raddr.port if c.raddr else None))


def port_time_wait(sc: Scenario) -> None:
    port = free_port()
    sc.facts["port"] = port
    for label in ("first", "second"):
        folder = sc.run_folder(label)
        if label == "second":
            sc.facts["time_wait_connections_before_second"] = time_wait_on(port)
        tracked = sc.launch(label, "run", "--preset", "smoke", "--clusters", "2", "--rounds", "1", "--port", str(port),
                            "--out", str(folder))
        completed(sc, tracked, folder, rounds=1, what=f"the {label} run on port {port}")
    sc.lost = "nothing"


SCENARIOS: dict[str, Callable[[Scenario], None]] = {
    "trainer-sigkill": trainer_sigkill,
    "supernode-sigkill": supernode_sigkill,
    "launcher-sigkill-resume": launcher_sigkill_resume,
    "launcher-sigkill-resume-dp": launcher_sigkill_resume_dp,
    "corrupt-checkpoint": corrupt_checkpoint,
    "slow-cluster": slow_cluster,
    "below-min-clusters": below_min_clusters,
    "port-time-wait": port_time_wait,
}


def run_scenario(name: str, root: Path, console: Console) -> dict[str, Any]:
    """Run one scenario; an exception in it fails the scenario (not the benchmark), and everything it started stops."""
    sc = Scenario(name, root)
    console.print(f"[bold]{name}[/bold] … (runs in {sc.dir})")
    started = time.monotonic()
    try:
        SCENARIOS[name](sc)
    except Abort as err:
        sc.failures.append(str(err))
    except Exception as err:
        sc.failures.append(f"{type(err).__name__}: {err}")
    finally:
        sc.close()
    record = sc.record(time.monotonic() - started)
    verdict = "[green]passed[/green]" if record["passed"] else f"[red]FAILED[/red]: {record['detail']}"
    console.print(f"  {verdict} ({record['seconds']:.0f} s)")
    return record


def table(records: list[dict[str, Any]]) -> Table:
    out = Table(title="nebula-fl: fault scenarios on real processes (MiniLM, --preset smoke)")
    for column in ("scenario", "passed", "rounds", "recovery s", "lost", "wall s", "detail"):
        out.add_column(column, justify="right" if column in ("rounds", "recovery s", "wall s") else "left")
    for r in records:
        out.add_row(r["name"], "yes" if r["passed"] else "[red]no[/red]", str(r["rounds_completed"] or "-"),
                    "-" if r["recovery_seconds"] is None else f"{r['recovery_seconds']:.1f}", r["lost"],
                    f"{r['seconds']:.0f}", r["detail"][:160] or "-")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help=f"comma-separated scenarios of: {', '.join(SCENARIOS)}")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)} (under ~10 min on 2 cores)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="results folder (must be new or empty)")
    args = parser.parse_args(argv)
    names = list(QUICK) if args.quick else list(SCENARIOS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in SCENARIOS]
        if unknown:
            parser.error(f"--only: unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    root = fresh_out(args.out)
    console = Console(width=None if sys.stdout.isatty() else 200)  # a log file gets the whole table
    started = time.monotonic()
    records = [run_scenario(name, root, console) for name in names]
    wall = time.monotonic() - started
    result = {"scenarios": records, "all_passed": all(r["passed"] for r in records), "wall_seconds": round(wall, 1),
              "command": " ".join(sys.argv), "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    write_results(root, result)
    console.print(table(records))
    console.print(f"all passed: {'yes' if result['all_passed'] else 'no'} | wall {wall / 60:.1f} min | "
                  f"{root / 'results.json'}")
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
