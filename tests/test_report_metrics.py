"""The terminal report shows the task's own metrics: a regression run has no accuracy column."""

from __future__ import annotations

from rich.console import Console

from nebula_fl.launcher.report import metric_names, results_table, round_line


def _row(**metrics):
    return {"round": 1, "bytes_up": 1000, "bytes_down": 10, "seconds": 3.0, "clusters": {},
            "accuracy": None, "macro_f1": None, "eval_metrics": list(metrics), **metrics}


def _text(table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_a_regression_run_reports_its_own_metrics_and_no_accuracy():
    rows = [_row(rmse=0.532, mae=0.399, loss=0.28)]
    assert metric_names(rows) == ["rmse", "mae", "loss"]
    line = round_line(rows[0], 4)
    assert line.startswith("round 1/4: rmse 0.5320, mae 0.3990, up") and "accuracy" not in line
    text = _text(results_table(rows, initial={"rmse": 0.682, "mae": 0.557, "loss": 0.47}))
    assert "rmse" in text and "0.6820" in text and "0.5320" in text and "accuracy" not in text


def test_classification_keeps_its_columns_and_old_rows_still_read():
    rows = [_row(accuracy=0.97, macro_f1=0.96, loss=0.1)]
    assert metric_names(rows) == ["accuracy", "macro_f1", "loss"]
    old = {k: v for k, v in rows[0].items() if k != "eval_metrics"}  # recorded before rows named their metrics
    assert metric_names([old]) == ["accuracy", "macro_f1", "loss"]
    assert round_line(old, 5).startswith("round 1/5: accuracy 0.9700, macro-F1 0.9600, up")
