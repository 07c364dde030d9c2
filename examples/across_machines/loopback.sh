#!/usr/bin/env bash
# The across-machines recipe on one machine: certificates (`nebula-fl certs`), a TLS SuperLink that
# admits only registered SuperNodes (superlink.sh), both cluster keys registered (register.sh), two
# clusters (trainer + SuperNode + its ClientApp runner, one with 2 DDP workers) holding shards of the shipped
# BBC News, all as this one user (cluster.sh shows the deployment with a user per side), and
# the run submitted over TLS (submit.sh). Every process it starts is stopped on exit.
# INSECURE=1 is the plaintext shortcut (no certificates, no registration, --insecure everywhere): for
# this loopback only, never across a network.
# Usage: examples/across_machines/loopback.sh [extra run-config]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
WORK="$(mktemp -d /tmp/nebula-loopback.XXXXXX)"
export PATH="$ROOT/.venv/bin:$PATH" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
PORT="${PORT:-8010}"
PIDS=()
tree() { local c; for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do echo "$c"; tree "$c"; done; }
cleanup() {  # each start's session, and every descendant (Flower starts its apps in sessions of their own)
  local all=() p
  for p in "${PIDS[@]}"; do all+=("$p" $(tree "$p")); done
  for p in "${PIDS[@]}"; do pkill -TERM -s "$p" 2>/dev/null || true; done
  for p in "${all[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; sleep 3
  for p in "${PIDS[@]}"; do pkill -KILL -s "$p" 2>/dev/null || true; done
  for p in "${all[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM
start() { setsid "$@" > "$WORK/$(basename "$1")-${#PIDS[@]}.log" 2>&1 & PIDS+=($!); }
RUN_CONFIG="out-dir=\"$WORK/run\" max-examples=${MAX_EXAMPLES:-0} ${1:-}"

if [ "${INSECURE:-0}" = 1 ]; then
  export FLWR_HOME="$WORK/flwr"
  mkdir -p "$FLWR_HOME"
  printf '[superlink]\ndefault = "local"\n[superlink.local]\naddress = "127.0.0.1:%s"\ninsecure = true\n' "$PORT" \
    > "$FLWR_HOME/config.toml"
  start flower-superlink --insecure --disable-runtime-dependency-installation --port "$PORT"
  NODE_FLAGS=(--insecure)
else
  # the server host's part: its certificate covers 127.0.0.1 (its own SuperExec connects there) and
  # every name the clusters use (here: loopback too)
  nebula-fl certs "$WORK/certs" --hosts 127.0.0.1,localhost --clusters 2 > "$WORK/certs.txt"
  CERTS="$WORK/certs" HOST=127.0.0.1 PORT="$PORT" FLWR_HOME="$WORK/flwr-superlink" start "$HERE/superlink.sh"
  for _ in $(seq 60); do (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break; sleep 1; done
  (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null || { cat "$WORK"/superlink.sh-*.log >&2; exit 1; }
  SUPERLINK="127.0.0.1:$PORT" CA="$WORK/certs/ca.crt" FLWR_HOME="$WORK/flwr-submit" \
    "$HERE/register.sh" "$WORK/certs/cluster-0.pub" "$WORK/certs/cluster-1.pub"
fi

SHARD="--dataset bbcnews --num-clusters 2 --partition dirichlet:0.5 --seed 0 --max-examples ${MAX_EXAMPLES:-0}"
# the roster every operator gets from the others (`nebula-fl identity`): masked rounds (secagg.enabled=true) need it
for i in 0 1; do nebula-fl identity --state-dir "$WORK/state-$i" --cluster-id $i; done > "$WORK/peers.txt"
for i in 0 1; do
  # shellcheck disable=SC2086
  FLWR_HOME="$WORK/flwr-cluster-$i" start nebula-fl trainer --socket "$WORK/t$i.sock" --cluster-id $i \
    --workers $((i + 1)) --threads 1 --state-dir "$WORK/state-$i" --secagg-peers "$WORK/peers.txt" $SHARD
done
until [ -S "$WORK/t0.sock" ] && [ -S "$WORK/t1.sock" ]; do sleep 1; done
for i in 0 1; do
  # what cluster.sh runs, with this cluster's key (it holds a shard of the shipped data, not its own)
  [ "${INSECURE:-0}" = 1 ] || NODE_FLAGS=(--root-certificates "$WORK/certs/ca.crt"
                                          --auth-supernode-private-key "$WORK/certs/cluster-$i")
  # in process isolation, served by nebula-fl's ClientApp runner: no app bundle's code runs on a cluster
  (umask 077 && head -c 32 /dev/urandom > "$WORK/superexec-$i.secret")
  FLWR_HOME="$WORK/flwr-cluster-$i" start flower-supernode "${NODE_FLAGS[@]}" --superlink "127.0.0.1:$PORT" \
    --isolation process --superexec-auth-secret-file "$WORK/superexec-$i.secret" --port $((PORT + 1 + i)) \
    --node-config "trainer=\"$WORK/t$i.sock\" cluster-id=$i"
  start nebula-fl clientapp --runtime-api-address "127.0.0.1:$((PORT + 1 + i))" \
    --superexec-auth-secret-file "$WORK/superexec-$i.secret"
done

if [ "${INSECURE:-0}" = 1 ]; then
  cd "$ROOT"
  nebula-fl submit . local --run-config "$RUN_CONFIG"
else
  (cd "$ROOT" && SUPERLINK="127.0.0.1:$PORT" CA="$WORK/certs/ca.crt" FLWR_HOME="$WORK/flwr-submit" CLUSTERS=2 \
    RUN_CONFIG="$RUN_CONFIG" "$HERE/submit.sh")
fi
cat "$WORK/run/summary.json"
