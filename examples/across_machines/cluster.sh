#!/usr/bin/env bash
# One cluster: its persistent trainer (DDP over WORKERS ranks on DEVICE) and its SuperNode.
# DATA is this cluster's own data; nothing of it leaves the host, only adapter updates do.
set -euo pipefail
: "${CLUSTER_ID:?set CLUSTER_ID}" "${SUPERLINK:?set SUPERLINK=host:port}" "${DATA:?set DATA to a folder or CSV}"
export FLWR_HOME="${FLWR_HOME:-$PWD/.flwr-cluster-$CLUSTER_ID}" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
SOCKET="${SOCKET:-/tmp/nebula-trainer-$CLUSTER_ID.sock}"
nebula-fl trainer --socket "$SOCKET" --cluster-id "$CLUSTER_ID" --data "$DATA" \
  --workers "${WORKERS:-1}" --device "${DEVICE:-cpu}" --model "${MODEL:-minilm}" \
  --state-dir "${STATE_DIR:-$PWD/nebula-state-$CLUSTER_ID}" &
TRAINER=$!
trap 'kill $TRAINER $SUPERNODE 2>/dev/null; wait' EXIT INT TERM
flower-supernode --insecure --superlink "$SUPERLINK" --port "${NODE_PORT:-9094}" \
  --node-config "trainer=\"$SOCKET\" cluster-id=$CLUSTER_ID" &
SUPERNODE=$!
wait -n $TRAINER $SUPERNODE
