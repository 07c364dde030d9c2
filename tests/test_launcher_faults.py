"""Faults, end to end with the real Flower commands on the tiny model: a SIGKILLed launcher leaves no process
behind; a damaged newest checkpoint then stops its resume with one line, and --rewind resumes it from the one
before; a SIGKILLed trainer is restarted while the other clusters go on."""

import json
import os
import signal
import time

import psutil

from tests.conftest import same_start
from tests.test_e2e import TINY, rounds_of, smoke_args


def _lines(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _find(cli, *words: str) -> psutil.Process:
    """The launcher's live descendant whose command line holds every one of `words`."""
    cli.poll_tree()
    for pid, (created, _) in cli.seen.items():
        try:
            proc = psutil.Process(pid)
            cmd = " ".join(proc.cmdline())
            if same_start(proc.create_time(), created) and all(w in cmd for w in words):
                return proc
        except psutil.Error:
            pass
    raise AssertionError(f"no live process with {words} among the launcher's descendants")


def _latest_round(out) -> int:
    try:
        return int((out / "checkpoint" / "latest").read_text().split()[0].removeprefix("round-"))
    except (OSError, ValueError, IndexError):
        return 0


def test_a_sigkilled_launcher_leaves_no_process_and_its_run_rewinds_past_damage(tiny_model, run_cli, tmp_path):
    out = tmp_path / "run"
    cli = run_cli(*smoke_args(tiny_model, out, "--rounds", "4"), name="killed", own_rank_host=True)
    assert cli.wait(300, until=lambda: _latest_round(out) >= 2) == -1, cli.output()[-3000:]
    for _ in range(10):  # record every descendant (a ClientApp may be starting right now)
        cli.poll_tree()
        time.sleep(0.1)
    seen = " ".join(cli.commands)
    for program in ("flower-superlink", "flower-supernode", "nebula_fl clientapp", "flower-superexec", "flwr-serverapp",
                    "nebula_fl trainer", "nebula_fl.launcher.watchdog"):
        assert program in seen, program
    alive_before = [pid for pid, (created, _) in cli.seen.items() if psutil.pid_exists(pid)]
    assert len(alive_before) >= 8  # superlink + its superexec + serverapp, 2 supernodes + their runners, 2 trainers...

    cli.popen.kill()  # SIGKILL: the launcher stops nothing itself
    killed_at = time.monotonic()
    cli.popen.wait()
    cli.handle.close()
    assert cli.survivors(settle=10.0) == [], "processes outlived the SIGKILLed launcher"
    assert time.monotonic() - killed_at < 10.5
    assert "the launcher is gone" in (out / "logs" / "watchdog.log").read_text()

    # The newest checkpoint damaged as well: a resume stops with one line and touches nothing; --rewind resumes
    # from the one before, that round is trained again, and the run ends.
    newest = _latest_round(out)
    assert 2 <= newest < 4
    adapter = out / "checkpoint" / f"round-{newest:05d}" / "adapter.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:-10])
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    refused = run_cli("run", "--resume", str(out), "--port", "0", name="refused", own_rank_host=True)
    assert refused.wait(120) == 2, refused.output()[-3000:]
    assert f"round-{newest:05d} is damaged: adapter.safetensors is truncated" in refused.output()
    assert f"the previous checkpoint round-{newest - 1:05d} is intact" in refused.output()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before

    # resumed on other hardware settings (here bf16 autocast): the run's config stays, the trainers change
    rewound = run_cli("run", "--resume", str(out), "--rewind", "--port", "0", "--precision", "bf16", name="rewind", own_rank_host=True)
    assert rewound.wait(300) == 0, rewound.output()[-3000:]
    assert rewound.survivors() == []
    assert f"moved the damaged checkpoint aside: checkpoint/damaged-round-{newest:05d}" in rewound.output()
    assert f"rewound to the checkpoint of round {newest - 1}" in rewound.output()
    assert f"round {newest}/4" in rewound.output()
    assert (out / "checkpoint" / f"damaged-round-{newest:05d}" / "adapter.safetensors").exists()
    assert rounds_of(out) == [1, 2, 3, 4]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 4
    assert summary["restarts"] == []
    records = _lines(out)
    assert records[0]["clusters"]["0"]["precision"] == "fp32" and records[-1]["clusters"]["0"]["precision"] == "bf16"
    assert json.loads((out / "config.json").read_text())["launcher"]["precisions"] == ["bf16", "bf16"]


def test_a_killed_trainer_is_restarted_while_the_other_clusters_go_on(tiny_model, run_cli, tmp_path):
    out = tmp_path / "run"
    started = time.monotonic()
    # overlapped rounds: the killed trainer loses what it trained ahead, and its restart resumes from its snapshot
    # rounds enough for the restarted trainer to come back on a loaded machine (a trainer's start is ~8 s of CPU)
    cli = run_cli("run", "--preset", "smoke", "--clusters", "3", "--rounds", "6", "--port", "0", "--out", str(out),
                  "--round-overlap", "--run-config", f'model="{tiny_model}" {TINY}', name="restart", own_rank_host=True)
    assert cli.wait(400, until=lambda: len(rounds_of(out)) >= 1) == -1, cli.output()[-3000:]
    trainer = _find(cli, "nebula_fl trainer", "--cluster-id 1 ")
    runner_log = out / "logs" / "clientapp-1.log"
    # Round 2 is on its way: kill cluster 1's trainer as soon as cluster 1's ClientApp runner takes round 2's train
    # message, so that the ClientApp finds it dead (the restarted one takes longer to load than the relay to call).
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        cli.poll_tree()
        if "train message, round 2" in runner_log.read_text():
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"no ClientApp started for cluster 1 in round 2; log:\n{cli.output()[-3000:]}")
    os.kill(trainer.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert cli.wait(600) == 0, cli.output()[-5000:]
    assert cli.survivors() == [], "processes outlived the launcher"

    output = cli.output()
    assert "cluster 1: trainer exited with status -9; restarted (1 of 3)" in output
    # by default the launch starts its own rank host, and every trainer (the restarted one too) forks from it
    assert "rank host: serving" in (out / "logs" / "rank-host.log").read_text()
    assert not any("cannot be reached" in (out / "logs" / f"trainer-{i}.log").read_text() for i in range(3))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 6
    (restart,) = summary["restarts"]
    assert restart["service"] == "trainer" and restart["cluster"] == 1 and restart["exit_code"] == -signal.SIGKILL
    assert restart["restarted"] is True
    assert killed_at - started - 30 < restart["seconds_into_run"] < killed_at - started + 3  # the launcher's clock

    lines = _lines(out)
    assert [x["round"] for x in lines] == [1, 2, 3, 4, 5, 6]
    node_1 = lines[0]["clusters"]["1"]["node_id"]
    died = lines[1]
    assert {"0", "2"} <= set(died["clusters"]) and "0" not in died["rejected"] and "2" not in died["rejected"]
    if "1" in died["rejected"]:  # the drop is recorded under its cluster, and the others were aggregated
        assert died["clusters_aggregated"] == 2
    else:  # or the ClientApp waited (TRAINER_WAIT_S) for the restarted trainer, which trained round 2
        assert died["clusters_aggregated"] == 3 and "train_loss" in died["clusters"]["1"], died
    later = [x for x in lines[2:] if "1" in x["clusters"] and "1" not in x["rejected"]]
    assert later, "cluster 1 never trained again after its trainer was restarted"
    assert later[-1]["clusters"]["1"]["node_id"] == node_1  # the same SuperNode, a new trainer behind it
    # overlapped: after round 1 every cluster's cycle is timed, and it trained through part of it
    busy = [c["busy_fraction"] for x in lines[2:] for c in x["timeline"]["clusters"].values() if "busy_fraction" in c]
    assert busy and all(0 < b <= 1 for b in busy)
