#!/usr/bin/env bash
# Once per cluster host, as root: the users, groups and folders of the documented deployment (docs: Across machines, Deploying a
# cluster). The trainer runs as TRAINER_USER and alone can read the cluster's data, its state folder (identity
# and secure-aggregation keys, privacy ledger, snapshots, cached replies) and its privacy policy. The SuperNode
# and its ClientApp runner run as NODE_USER; both users are in SOCKET_GROUP, which only the trainer's socket (in
# SOCKET_DIR) belongs to: the node's one way into the cluster. Users and groups are names (made here when missing) or numeric ids.
#   DATA (optional): this cluster's data (a folder or a CSV), handed to TRAINER_USER, unreadable by others
#   PRIVACY_POLICY (optional): the operator's policy file, copied to $TRAINER_DIR/policy.json (mode 0600)
# Then start the cluster with cluster.sh and the same variables; check it with
#   nebula-fl check-access --user "$NODE_USER" "$TRAINER_DIR" "$SOCKET_DIR" "$DATA"
set -euo pipefail
TRAINER_USER="${TRAINER_USER:-nebula-trainer}" NODE_USER="${NODE_USER:-nebula-node}"
SOCKET_GROUP="${SOCKET_GROUP:-nebula-sock}" NEBULA_ROOT="${NEBULA_ROOT:-/srv/nebula}"
TRAINER_DIR="${TRAINER_DIR:-$NEBULA_ROOT/trainer}" NODE_DIR="${NODE_DIR:-$NEBULA_ROOT/node}"
STATE_DIR="${STATE_DIR:-$TRAINER_DIR/state}" SOCKET_DIR="${SOCKET_DIR:-/run/nebula}"
[ "$(id -u)" = 0 ] || { echo "cluster_users.sh: run it as root: it makes users and sets owners" >&2; exit 2; }
numeric() { [[ "$1" =~ ^[0-9]+$ ]]; }
primary() { if numeric "$1"; then echo "$1"; else id -g "$1"; fi; }
[ "$TRAINER_USER" != "$NODE_USER" ] || { echo "cluster_users.sh: TRAINER_USER and NODE_USER must differ" >&2; exit 2; }
numeric "$SOCKET_GROUP" || getent group "$SOCKET_GROUP" > /dev/null || groupadd --system "$SOCKET_GROUP"
for user in "$TRAINER_USER" "$NODE_USER"; do  # the trainer shares its socket with the group, the node connects
  numeric "$user" && continue
  id -u "$user" > /dev/null 2>&1 || useradd --system --user-group --no-create-home --shell /usr/sbin/nologin "$user"
  usermod -aG "$SOCKET_GROUP" "$user"
done
install -d -m 0755 "$NEBULA_ROOT"
install -d -m 0700 -o "$TRAINER_USER" -g "$(primary "$TRAINER_USER")" "$TRAINER_DIR" "$STATE_DIR"
install -d -m 0700 -o "$NODE_USER" -g "$(primary "$NODE_USER")" "$NODE_DIR"
install -d -m 0750 -o "$TRAINER_USER" -g "$SOCKET_GROUP" "$SOCKET_DIR"
if [ -n "${DATA:-}" ]; then
  chown -R "$TRAINER_USER:$(primary "$TRAINER_USER")" "$DATA"
  chmod -R go-rwx "$DATA"
fi
if [ -n "${PRIVACY_POLICY:-}" ]; then
  install -m 0600 -o "$TRAINER_USER" -g "$(primary "$TRAINER_USER")" "$PRIVACY_POLICY" "$TRAINER_DIR/policy.json"
fi
# the secret the SuperNode hands its tasks to its ClientApp runner with (no other process can take them)
if [ ! -s "$NODE_DIR/superexec.secret" ]; then
  (umask 077 && head -c 32 /dev/urandom > "$NODE_DIR/superexec.secret")
  chown "$NODE_USER:$(primary "$NODE_USER")" "$NODE_DIR/superexec.secret"
fi
echo "trainer: $TRAINER_USER owns $TRAINER_DIR (state $STATE_DIR) and the socket folder $SOCKET_DIR (group $SOCKET_GROUP)"
echo "node:    $NODE_USER owns $NODE_DIR (FLWR_HOME, SuperExec secret) and reaches the trainer through $SOCKET_DIR only"
