#!/usr/bin/env bash
# The across-machines recipe on one machine, by hand: a SuperLink, two clusters (trainer + SuperNode,
# one with 2 DDP workers) holding shards of the shipped BBC News, and `flwr run .` from the repo root.
# Every process it starts is stopped on exit. Usage: examples/across_machines/loopback.sh [extra run-config]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="$(mktemp -d /tmp/nebula-loopback.XXXXXX)"
export PATH="$ROOT/.venv/bin:$PATH" FLWR_HOME="$WORK/flwr" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
PORT="${PORT:-8010}"
mkdir -p "$FLWR_HOME"
printf '[superlink]\ndefault = "local"\n[superlink.local]\naddress = "127.0.0.1:%s"\ninsecure = true\n' "$PORT" \
  > "$FLWR_HOME/config.toml"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do pkill -TERM -s "$p" 2>/dev/null || true; done; sleep 3;
            for p in "${PIDS[@]}"; do pkill -KILL -s "$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
start() { setsid "$@" > "$WORK/$(basename "$1")-${#PIDS[@]}.log" 2>&1 & PIDS+=($!); }
start flower-superlink --insecure --disable-runtime-dependency-installation --port "$PORT"
SHARD="--dataset bbcnews --num-clusters 2 --partition dirichlet:0.5 --seed 0 --max-examples ${MAX_EXAMPLES:-0}"
for i in 0 1; do
  # shellcheck disable=SC2086
  start nebula-fl trainer --socket "$WORK/t$i.sock" --cluster-id $i --workers $((i + 1)) --threads 1 \
    --state-dir "$WORK/state-$i" $SHARD
done
until [ -S "$WORK/t0.sock" ] && [ -S "$WORK/t1.sock" ]; do sleep 1; done
for i in 0 1; do
  start flower-supernode --insecure --superlink "127.0.0.1:$PORT" --port $((PORT + 1 + i)) \
    --node-config "trainer=\"$WORK/t$i.sock\" cluster-id=$i"
done
cd "$ROOT"
flwr run . local --stream --run-config "out-dir=\"$WORK/run\" max-examples=${MAX_EXAMPLES:-0} ${1:-}"
cat "$WORK/run/summary.json"
