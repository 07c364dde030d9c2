#!/usr/bin/env bash
# One cluster: its persistent trainer (DDP over WORKERS ranks on DEVICE), its SuperNode, which reaches the
# SuperLink over TLS (trusting CA) and signs every request with KEY, this cluster's private key from
# `nebula-fl certs` (registered on the SuperLink with register.sh before this starts), and the SuperNode's
# ClientApp runner (`nebula-fl clientapp`): the SuperNode runs in --isolation process, so no app bundle's code
# ever runs here, only the installed nebula-fl's ClientApp.
# DATA is this cluster's own data; nothing of it leaves the host, only adapter updates do.
# PRIVACY_POLICY (optional) is this cluster's own privacy policy, a JSON file such as
#   {"mode": "sample", "target_epsilon": 8, "max_epsilon": 8, "planned_rounds": 20, "planned_local_steps": 10}
# whatever the server asks, nothing weaker leaves the cluster, and its ledger lives in STATE_DIR.
# SECAGG_PEERS is the roster of every cluster's secure-aggregation identity key (the lines `nebula-fl identity`
# prints, exchanged by the operators out of band): without it this cluster refuses securely aggregated rounds,
# unless SECAGG_TRUST_SERVER_MEMBERSHIP=1 takes the server's word for who the members are (a server that invents
# the others reads this cluster's update). REQUIRE_SECURE_AGGREGATION=1 (optional, needs SECAGG_PEERS) trains
# only securely aggregated rounds; MIN_SECAGG_THRESHOLD and MIN_SECAGG_CLUSTERS (optional) raise the fewest
# clusters unmasked / masked together.
# These override the same fields of PRIVACY_POLICY.
# Users (the documented deployment; run as root after cluster_users.sh with the same variables): with
# TRAINER_USER set, the trainer runs as TRAINER_USER and the SuperNode and runner as NODE_USER (in
# SOCKET_GROUP), so the SuperNode's side can open nothing of the trainer's but its socket. Without it,
# every process runs as the caller (one user: the trainer's files are then the SuperNode's too).
# INSECURE=1 drops TLS and node authentication (CA and KEY unused): for a loopback test only.
set -euo pipefail
: "${CLUSTER_ID:?set CLUSTER_ID}" "${SUPERLINK:?set SUPERLINK=host:port}" "${DATA:?set DATA to a folder or CSV}"
if [ "${INSECURE:-0}" = 1 ]; then
  NODE_FLAGS=(--insecure)
else
  : "${CA:?set CA to the ca.crt of the federation}" "${KEY:?set KEY to the private key of this cluster (cluster-<i>, mode 0600)}"
  NODE_FLAGS=(--root-certificates "$CA" --auth-supernode-private-key "$KEY")
fi
NEBULA_ROOT="${NEBULA_ROOT:-/srv/nebula}"
if [ -n "${TRAINER_USER:-}" ]; then
  NODE_USER="${NODE_USER:-nebula-node}" SOCKET_GROUP="${SOCKET_GROUP:-nebula-sock}"
  TRAINER_DIR="${TRAINER_DIR:-$NEBULA_ROOT/trainer}" NODE_DIR="${NODE_DIR:-$NEBULA_ROOT/node}"
  STATE_DIR="${STATE_DIR:-$TRAINER_DIR/state}" SOCKET="${SOCKET:-${SOCKET_DIR:-/run/nebula}/trainer-$CLUSTER_ID.sock}"
  [ -n "${PRIVACY_POLICY:-}" ] || { [ -f "$TRAINER_DIR/policy.json" ] && PRIVACY_POLICY="$TRAINER_DIR/policy.json"; } || true
  numeric() { [[ "$1" =~ ^[0-9]+$ ]]; }
  primary() { if numeric "$1"; then echo "$1"; else id -g "$1"; fi; }
  AS_TRAINER=(setpriv --reuid "$TRAINER_USER" --regid "$(primary "$TRAINER_USER")" --groups "$SOCKET_GROUP"
              env HOME="$TRAINER_DIR")
  AS_NODE=(setpriv --reuid "$NODE_USER" --regid "$(primary "$NODE_USER")" --groups "$SOCKET_GROUP"
           env HOME="$NODE_DIR")
  TRAINER_FLAGS=(--socket-group "$SOCKET_GROUP")
  export FLWR_HOME="${FLWR_HOME:-$NODE_DIR/.flwr}"
else
  NODE_DIR="${NODE_DIR:-$PWD/.nebula-node-$CLUSTER_ID}" STATE_DIR="${STATE_DIR:-$PWD/nebula-state-$CLUSTER_ID}"
  SOCKET="${SOCKET:-/tmp/nebula-trainer-$CLUSTER_ID.sock}"
  AS_TRAINER=() AS_NODE=() TRAINER_FLAGS=()
  echo "cluster.sh: one user runs the trainer and the SuperNode; set TRAINER_USER (docs: Across machines, Deploying a cluster)" >&2
  mkdir -p -m 0700 "$NODE_DIR"
  export FLWR_HOME="${FLWR_HOME:-$PWD/.flwr-cluster-$CLUSTER_ID}"
fi
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
SECRET="$NODE_DIR/superexec.secret"
[ -s "$SECRET" ] || "${AS_NODE[@]}" sh -c 'umask 077 && head -c 32 /dev/urandom > "$0"' "$SECRET"
POLICY=()
if [ -n "${PRIVACY_POLICY:-}" ]; then POLICY=(--privacy-policy "$PRIVACY_POLICY"); fi
if [ "${REQUIRE_SECURE_AGGREGATION:-0}" = 1 ]; then POLICY+=(--require-secure-aggregation); fi
if [ -n "${MIN_SECAGG_THRESHOLD:-}" ]; then POLICY+=(--min-secagg-threshold "$MIN_SECAGG_THRESHOLD"); fi
if [ -n "${MIN_SECAGG_CLUSTERS:-}" ]; then POLICY+=(--min-secagg-clusters "$MIN_SECAGG_CLUSTERS"); fi
if [ -n "${SECAGG_PEERS:-}" ]; then POLICY+=(--secagg-peers "$SECAGG_PEERS"); fi
if [ "${SECAGG_TRUST_SERVER_MEMBERSHIP:-0}" = 1 ]; then POLICY+=(--secagg-trust-server-membership); fi
NODE_PORT="${NODE_PORT:-9094}"
"${AS_TRAINER[@]}" nebula-fl trainer --socket "$SOCKET" "${TRAINER_FLAGS[@]}" --cluster-id "$CLUSTER_ID" \
  --data "$DATA" --workers "${WORKERS:-1}" --device "${DEVICE:-cpu}" --model "${MODEL:-minilm}" \
  --state-dir "$STATE_DIR" "${POLICY[@]}" &
TRAINER=$!
SUPERNODE="" RUNNER=""
trap 'kill $TRAINER $SUPERNODE $RUNNER 2>/dev/null; wait' EXIT INT TERM
"${AS_NODE[@]}" flower-supernode --superlink "$SUPERLINK" "${NODE_FLAGS[@]}" --isolation process \
  --superexec-auth-secret-file "$SECRET" --port "$NODE_PORT" \
  --node-config "trainer=\"$SOCKET\" cluster-id=$CLUSTER_ID" &
SUPERNODE=$!
"${AS_NODE[@]}" nebula-fl clientapp --runtime-api-address "127.0.0.1:$NODE_PORT" --superexec-auth-secret-file "$SECRET" &
RUNNER=$!
wait -n $TRAINER $SUPERNODE $RUNNER
