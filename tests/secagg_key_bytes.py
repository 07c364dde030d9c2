"""What per-round mask keys cost on the wire: bytes a cluster sends and receives for them in each round.

Each cluster masks round r with a key of its own made for r (nebula_fl/secagg/reveal.py, rule 0). That key rides
up on the round r-1 upload (`next-key`: the signed public half and the private half's Shamir shares sealed to each
neighbour) and down on round r's train message (`secagg-keys`: the key each neighbour in the round masks with,
signed; `secagg-key-from` / `secagg-key-tokens`: the neighbours' shares sealed to this cluster). Measured here in
process, on the real cluster stages and the real server wrapper (tests/secagg_harness.py joins them with an
in-memory grid), in a steady round (round 2: every cluster uploaded round 1), as the exact sizes of those fields
in the messages: the same bytes Flower carries between processes, less its framing. The rest of what secure
aggregation adds to an upload (self-mask shares, commitments, receipt) is given beside it for scale.

    .venv/bin/python -m tests.secagg_key_bytes      # a few seconds

Writes results.json under --out (default benchmarks/results/secagg_keys/) and prints a table. It lives beside the
tests (it drives the cluster stages through tests/secagg_harness.py, as they do); run it from the repository root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from nebula_fl.config import SecAggConfig
from nebula_fl.secagg.wire import unpack_upload
from tests.secagg_harness import make_federation, run_round  # the in-memory grid the protocol tests use

ROOT = Path(__file__).resolve().parent.parent

SETTINGS = [(3, 0), (8, 0), (16, 0), (16, 5)]  # (clusters, secagg.num-shares; 0 = every other cluster)
SHAPES = {"a": (64,)}
KEY_FIELDS = ("secagg-keys", "secagg-key-from", "secagg-key-tokens")


def _size(value: Any) -> int:
    return len(value.encode()) if isinstance(value, str) else len(json.dumps(value, separators=(",", ":")).encode())


def measure(clusters: int, num_shares: int, tmp: Path) -> dict[str, Any]:
    """Per cluster, in round 2: key bytes down (train message fields), key bytes up (`next-key` in the upload),
    and the upload head's other secure-aggregation bytes."""
    cfg = SecAggConfig(enabled=True, timeout=0.5, num_shares=num_shares)
    wrapper, _clusters, grid, _layout, initial = make_federation(tmp, n=clusters, shapes=SHAPES, cfg=cfg)
    run_round(wrapper, grid, 1, initial)
    sent_before, pulled = len(grid.sent), []
    pull = grid.pull_messages
    grid.pull_messages = lambda ids: pulled.extend(got := pull(ids)) or got  # what the server receives
    (arrays, _), _ = run_round(wrapper, grid, 2, initial)
    replies = [m for m in pulled if not m.has_error() and "update" in m.content.array_records]
    if arrays is None:
        raise SystemExit(f"round 2 of the {clusters}-cluster federation did not aggregate: {wrapper.report}")
    trains = [m for m in grid.sent[sent_before:] if m.metadata.message_type == "train"]
    down = [sum(_size(dict(m.content.config_records["config"]).get(k, "")) for k in KEY_FIELDS) for m in trains]
    up, head_rest = [], []
    for reply in replies:
        _, head = unpack_upload(reply.content.array_records["update"]["blob"].numpy())
        up.append(_size(head["next-key"]))
        head_rest.append(_size({k: v for k, v in head.items() if k != "next-key"}))
    neighbours = statistics.median(len(v) for v in wrapper.epoch["neighbours"].values())
    return {"clusters": clusters, "num_shares": num_shares, "neighbours": neighbours,
            "key_bytes_down": statistics.median(down), "key_bytes_up": statistics.median(up),
            "key_bytes_per_neighbour": (statistics.median(down) + statistics.median(up)) / neighbours,
            "other_head_bytes_up": statistics.median(head_rest), "key_trips": wrapper.report.get("key_trips", 0),
            "setup_trips": wrapper.report.get("setup_trips", 0)}


def main() -> None:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0  # Messages outside a ServerApp need it
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "secagg_keys")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(n, k, Path(tmp) / f"{n}-{k}") for n, k in SETTINGS]
    out = Table(title="Per-round mask keys: bytes per cluster per round (round 2, medians over clusters)")
    for column in ("clusters", "num-shares", "neighbours", "key bytes down", "key bytes up", "per neighbour",
                   "other secagg head bytes up", "trips for keys"):
        out.add_column(column, justify="right")
    for r in rows:
        out.add_row(str(r["clusters"]), str(r["num_shares"] or "all"), f"{r['neighbours']:g}",
                      f"{r['key_bytes_down']:,.0f}", f"{r['key_bytes_up']:,.0f}", f"{r['key_bytes_per_neighbour']:,.0f}",
                      f"{r['other_head_bytes_up']:,.0f}", str(r["key_trips"] + r["setup_trips"]))
    Console().print(out)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    path.write_text(json.dumps({"benchmark": "secagg_keys", "settings": rows}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
