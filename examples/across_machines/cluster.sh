#!/usr/bin/env bash
# One cluster: its persistent trainer (DDP over WORKERS ranks on DEVICE) and its SuperNode, which
# reaches the SuperLink over TLS (trusting CA) and signs every request with KEY, this cluster's private
# key from `nebula-fl certs` (registered on the SuperLink with register.sh before this starts).
# DATA is this cluster's own data; nothing of it leaves the host, only adapter updates do.
# PRIVACY_POLICY (optional) is this cluster's own privacy policy, a JSON file such as
#   {"mode": "sample", "target_epsilon": 8, "max_epsilon": 8, "planned_rounds": 20, "planned_local_steps": 10}
# whatever the server asks, nothing weaker leaves the cluster, and its ledger lives in STATE_DIR.
# REQUIRE_SECURE_AGGREGATION=1 (optional) trains only securely aggregated rounds; it needs SECAGG_PEERS, the
# roster of the other clusters' secure-aggregation identity keys (exchanged by the operators out of band);
# MIN_SECAGG_THRESHOLD and MIN_SECAGG_CLUSTERS (optional) raise the fewest clusters unmasked / masked together.
# These override the same fields of PRIVACY_POLICY.
set -euo pipefail
: "${CLUSTER_ID:?set CLUSTER_ID}" "${SUPERLINK:?set SUPERLINK=host:port}" "${DATA:?set DATA to a folder or CSV}"
: "${CA:?set CA to the ca.crt of the federation}" "${KEY:?set KEY to the private key of this cluster (cluster-<i>, mode 0600)}"
export FLWR_HOME="${FLWR_HOME:-$PWD/.flwr-cluster-$CLUSTER_ID}" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
SOCKET="${SOCKET:-/tmp/nebula-trainer-$CLUSTER_ID.sock}"
POLICY=()
if [ -n "${PRIVACY_POLICY:-}" ]; then POLICY=(--privacy-policy "$PRIVACY_POLICY"); fi
if [ "${REQUIRE_SECURE_AGGREGATION:-0}" = 1 ]; then POLICY+=(--require-secure-aggregation); fi
if [ -n "${MIN_SECAGG_THRESHOLD:-}" ]; then POLICY+=(--min-secagg-threshold "$MIN_SECAGG_THRESHOLD"); fi
if [ -n "${MIN_SECAGG_CLUSTERS:-}" ]; then POLICY+=(--min-secagg-clusters "$MIN_SECAGG_CLUSTERS"); fi
if [ -n "${SECAGG_PEERS:-}" ]; then POLICY+=(--secagg-peers "$SECAGG_PEERS"); fi
nebula-fl trainer --socket "$SOCKET" --cluster-id "$CLUSTER_ID" --data "$DATA" \
  --workers "${WORKERS:-1}" --device "${DEVICE:-cpu}" --model "${MODEL:-minilm}" \
  --state-dir "${STATE_DIR:-$PWD/nebula-state-$CLUSTER_ID}" "${POLICY[@]}" &
TRAINER=$!
SUPERNODE=""
trap 'kill $TRAINER $SUPERNODE 2>/dev/null; wait' EXIT INT TERM
flower-supernode --superlink "$SUPERLINK" --root-certificates "$CA" --auth-supernode-private-key "$KEY" \
  --port "${NODE_PORT:-9094}" --node-config "trainer=\"$SOCKET\" cluster-id=$CLUSTER_ID" &
SUPERNODE=$!
wait -n $TRAINER $SUPERNODE
