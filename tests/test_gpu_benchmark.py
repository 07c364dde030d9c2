"""benchmarks/gpu.py without a GPU: the dry run lists the six cases in order, through nebula-fl's own CLI with a
free port and a fresh run folder each; without CUDA it refuses in one line with a non-zero exit; a run folder's
round seconds and busy fractions are read as the timeline writes them; a clean refusal passes only where allowed."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO, load_script

gpu = load_script("nebula_benchmarks_gpu", REPO / "benchmarks" / "gpu.py")

NAMES = ["demo-cuda", "two-workers", "mixed", "fsdp", "mlm", "bf16"]


def test_the_dry_run_lists_the_six_cases_in_order(capsys, tmp_path):
    assert gpu.main(["--dry-run", "--out", str(tmp_path / "gpu")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("6 cases")
    assert [line.split(" ")[0] for line in lines[1:]] == NAMES
    for line in lines[1:]:
        assert " -m nebula_fl run " in line and "--port 0" in line
    assert [f"--out {tmp_path / 'gpu' / name / 'run'}" in line for name, line in zip(NAMES, lines[1:])] == [True] * 6
    assert "--workers-per-cluster 2" in lines[2] and "--device cuda,cpu" in lines[3]
    assert "--parallel fsdp" in lines[4] and "--task mlm" in lines[5] and "--precision bf16" in lines[6]
    assert not (tmp_path / "gpu").exists()  # a dry run writes nothing


def test_fsdp_spans_two_gpus_only_where_two_are_visible():
    one = {c.name: c for c in gpu.cases(1)}["fsdp"].args
    two = {c.name: c for c in gpu.cases(2)}["fsdp"].args
    assert "cuda:0+cuda:1" in two and two[two.index("--workers-per-cluster") + 1] == "2"
    assert "cuda" in one and one[one.index("--workers-per-cluster") + 1] == "1"


def test_without_cuda_it_refuses_in_one_line():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py")], capture_output=True, text=True,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}, cwd=REPO, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip() == gpu.NO_GPU and proc.stdout == ""


def test_a_run_folder_is_read_as_the_timeline_writes_it(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed", "rounds_completed": 2}))
    lines = [{"round": 1, "seconds": 9.5, "timeline": {"clusters": {"0": {"train_s": 0.2}, "1": {"train_s": 0.3}}}},
             {"round": 2, "seconds": 8.0, "timeline": {"clusters": {"0": {"busy_fraction": 0.25},
                                                                    "1": {"busy_fraction": 0.5}}}}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"round\": 3, \"sec")
    run = gpu.read_run(tmp_path)
    assert run == {"status": "completed", "rounds_completed": 2, "round_s": [9.5, 8.0],
                   "busy_fraction": {"1": {"0": None, "1": None}, "2": {"0": 0.25, "1": 0.5}}}
    assert gpu.read_run(tmp_path / "missing") == {"status": None, "rounds_completed": None, "round_s": [],
                                                  "busy_fraction": {}}


def test_a_clean_refusal_passes_only_where_allowed():
    line = "nebula-fl: error: --workers-per-cluster 2 on cuda needs 2 GPUs; 1 is visible"
    assert gpu.refusal_line(f"starting\n{line}\n") == line
    refusable, plain = gpu.cases(1)[1], gpu.cases(1)[0]
    assert gpu.judge(refusable, exit_code=2, timed_out=False, status=None, refusal=line)
    assert not gpu.judge(plain, exit_code=2, timed_out=False, status=None, refusal=line)
    assert not gpu.judge(refusable, exit_code=None, timed_out=True, status="running", refusal=None)
    assert not gpu.judge(refusable, exit_code=1, timed_out=False, status="failed", refusal=None)  # a crash, no line
    assert gpu.judge(plain, exit_code=0, timed_out=False, status="completed", refusal=None)
