"""benchmarks/causal.py's pure parts: the centralized run sees what the federation sees (same rounds, clusters x
the local steps, the same data keys), the stock app's run config is the nebula-fl runs' own and parses against
the app's declared keys, bytes per round are counted as comm.py counts them, and the figures are the stated
arithmetic on hand-made curves."""

from __future__ import annotations

import math
import tomllib

import pytest
from flwr.common.config import parse_config_args

from nebula_fl.config import RunConfig
from tests.conftest import REPO, load_script

causal = load_script("nebula_benchmarks_causal", REPO / "benchmarks" / "causal.py")


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_the_centralized_run_takes_clusters_times_the_steps_over_the_same_rounds_and_data():
    mode = causal.QUICK
    fed = causal.nebula_command(mode, clusters=2, seed=3, partition="dirichlet:1.0", link="20mbit:100ms")
    cen = causal.nebula_command(causal.centralized_mode(mode, clusters=2), clusters=1, seed=3, partition="dirichlet:1.0")
    assert _flag(fed, "--clusters") == "2" and _flag(cen, "--clusters") == "1"
    assert int(_flag(cen, "--local-steps")) == 2 * int(_flag(fed, "--local-steps")) == 2 * mode.local_steps
    for same in ("--rounds", "--seed", "--partition", "--run-config", "--task", "--preset", "--outer-optimizer"):
        assert _flag(cen, same) == _flag(fed, same), same
    assert "eval-initial=true" in _flag(fed, "--run-config") and "--wan" not in cen
    # every side parses as a real nebula-fl config: the run's keys are known and valid
    RunConfig().replace(parse_config_args([_flag(fed, "--run-config")]))
    # the data-parallel baseline: the federation's steps, one cluster, the clusters' batches in one
    par = causal.nebula_command(mode, clusters=1, seed=3, partition="dirichlet:1.0", batch_size=8)
    assert _flag(par, "--clusters") == "1" and _flag(par, "--local-steps") == _flag(fed, "--local-steps")
    parsed = RunConfig().replace(parse_config_args([_flag(par, "--run-config")]))
    assert parsed.train.batch_size == 8 and parsed.data.max_examples == mode.max_examples


def test_the_stock_run_config_is_the_nebula_runs_and_every_key_is_one_the_app_declares(tmp_path):
    cfg = causal.run_config(causal.QUICK, partition="dirichlet:1.0", seed=3)
    text = causal.stock_run_config(cfg, clusters=2, folder=tmp_path, controls=[tmp_path / "a.sock", tmp_path / "b.sock"])
    parsed = parse_config_args([text])
    app = tomllib.loads((REPO / "benchmarks" / "stock_flower" / "pyproject.toml").read_text())
    defaults = app["tool"]["flwr"]["app"]["config"]
    assert set(parsed) <= set(defaults), set(parsed) - set(defaults)  # Flower drops keys an app does not declare
    assert parsed["task"] == "causal-lm" and parsed["mode"] == "lora" and parsed["model"] == "smollm2"
    assert parsed["lr"] == cfg.train.lr == 5e-4 and parsed["batch-size"] == 4 and parsed["max-seq-len"] == 96
    assert parsed["lora-target-modules"] == "q_proj,v_proj" and parsed["seed"] == 3
    assert parsed["max-examples"] == causal.QUICK.max_examples and parsed["test-fraction"] == causal.QUICK.test_fraction
    assert parsed["num-server-rounds"] == causal.QUICK.rounds and parsed["local-steps"] == causal.QUICK.local_steps


def _line(rnd, loss, em, clusters=()):
    return {"round": rnd, "loss": loss, "perplexity": math.exp(loss), "exact-match": em, "elapsed_seconds": 1.0,
            "seconds": 1.0, "clusters": {str(i): {"wan_bytes_up": up, "wan_bytes_down": down}
                                         for i, (up, down) in enumerate(clusters)}}


def test_bytes_per_round_is_both_ways_averaged_over_rounds_from_one_and_clusters():
    lines = [_line(0, 3.0, 0.0, [(10**6, 10**6)] * 2),  # round 0: registration and the app, left out
             _line(1, 2.0, 0.5, [(100, 300), (200, 400)]), _line(2, 1.0, 0.6, [(100, 100), (300, 100)])]
    assert causal.bytes_per_round(lines) == (400 + 600 + 200 + 400) / 4
    assert causal.bytes_per_round([_line(1, 2.0, 0.5)]) is None  # no link, no count


def _run(points, per_round=None):
    return {"curve": [{"round": r, "loss": loss, "exact-match": em} for r, loss, em in points],
            "bytes_per_round_per_cluster": per_round}


def test_the_figures_are_the_stated_arithmetic_and_goals_are_judged_as_measured():
    runs = {causal.FEDERATED: _run([(0, 3.0, 0.1), (1, 1.03, 0.80)], per_round=2_000.0),
            causal.CENTRALIZED: _run([(0, 3.0, 0.1), (1, 1.00, 0.82)]),
            causal.DATA_PARALLEL: _run([(0, 3.0, 0.1), (1, 1.25, 0.70)]),
            "federated-topk": _run([(0, 3.0, 0.1), (1, 1.133, 0.75)], per_round=500.0),
            causal.FLOWER: _run([(0, 3.0, 0.1), (1, 1.1, 0.7)], per_round=8_000.0)}
    f = causal.figures(runs, chain_run="federated-topk")
    assert f["loss_gap_relative"] == pytest.approx(0.03)
    assert f["exact_match_gap_points"] == pytest.approx(2.0)
    assert f["bytes_ratio_vs_flower_lora"] == pytest.approx(4.0)
    assert f["bytes_ratio_vs_flower_lora_compressed"] == pytest.approx(16.0)
    assert f["loss_cost_relative_compressed"] == pytest.approx(0.1)
    assert f["exact_match_cost_points_compressed"] == pytest.approx(5.0)
    assert f["zero_shot_loss"] == 3.0 and f["zero_shot_exact_match"] == 0.1
    assert f["loss_gap_relative_vs_data_parallel"] == pytest.approx(-0.176)
    assert f["exact_match_gap_points_vs_data_parallel"] == pytest.approx(-10.0)
    goals = causal.judge(f)
    assert not goals["loss_gap_relative"]["met"] and not goals["exact_match_gap_points"]["met"]
    assert goals["loss_gap_relative_vs_data_parallel"]["met"] and goals["exact_match_gap_points_vs_data_parallel"]["met"]
    assert not goals["packed_text_tokens_kept_ratio"]["met"]  # not measured: not met
    runs[causal.FEDERATED] = _run([(0, 3.0, 0.1), (1, 0.99, 0.83)], per_round=2_000.0)  # the federation may win
    won = causal.figures(runs, chain_run="federated-topk")
    assert all(g["met"] for g in causal.judge({**won, "packed_text_tokens_kept_ratio": 1.0}).values())
    assert not causal.judge({**won, "packed_text_tokens_kept_ratio": 0.82})["packed_text_tokens_kept_ratio"]["met"]
    assert not causal.judge({"loss_gap_relative": float("nan"), "exact_match_gap_points": None})["loss_gap_relative"][
        "met"]


def test_the_round_the_federation_nears_centralized_is_the_first_it_stays_within_the_goal_from():
    centralized = [{"round": r, "loss": loss} for r, loss in ((0, 3.0), (1, 1.0), (2, 0.8), (3, 0.7), (4, 0.65))]
    fed = [{"round": r, "loss": loss} for r, loss in ((0, 3.0), (1, 1.5), (2, 0.81), (3, 0.72), (4, 0.66))]
    assert causal.first_round_within(fed, centralized, relative=0.02) == 4  # round 2 is within 2%, round 3 not
    assert causal.first_round_within(fed, centralized, relative=0.05) == 2
    assert causal.first_round_within(fed[:2], centralized, relative=0.02) is None


def test_the_stock_app_refuses_an_unknown_task_and_a_full_model_decoder():
    app = load_script("nebula_benchmarks_stock_app", REPO / "benchmarks" / "stock_flower" / "stock_flower_app.py")
    assert app._lm({"task": "classify", "mode": "full"}) is None
    with pytest.raises(ValueError, match="'task' is 'mlm'"):
        app._lm({"task": "mlm", "mode": "lora"})
    with pytest.raises(ValueError, match="mode 'lora' only"):
        app._lm({"task": "causal-lm", "mode": "full"})


def test_the_decoder_memory_model_is_the_readme_arithmetic():
    memory = load_script("nebula_benchmarks_decoder_memory", REPO / "benchmarks" / "decoder_memory.py")
    # SmolLM2-135M: 30 layers, hidden 576, MLP 1,536; Llama-3.2-1B: 16 layers, 2,048, 8,192 (README's figures)
    assert memory.modelled_mb_per_token(layers=30, hidden=576, mlp=1536) == pytest.approx(1.362, abs=1e-3)
    assert memory.modelled_mb_per_token(layers=16, hidden=2048, mlp=8192) == pytest.approx(3.25, abs=1e-3)
    assert memory.modelled_mb_per_token(layers=16, hidden=2048, mlp=8192, bytes_per_value=2) == pytest.approx(1.625)


def test_the_round_the_federation_reaches_a_loss_is_the_first_within_the_margin():
    curve = [{"round": r, "loss": loss} for r, loss in ((0, 3.0), (1, 1.2), (2, 0.9), (3, 0.5))]
    assert causal.rounds_to_reach(curve, target=0.89, relative=0.02) == 2  # 0.9 <= 0.9078
    assert causal.rounds_to_reach(curve, target=0.8, relative=0.02) == 3
    assert causal.rounds_to_reach(curve, target=0.1, relative=0.02) is None
    assert causal.rounds_to_reach(curve, target=3.0, relative=0.0) == 1  # round 0 (zero-shot) never counts
