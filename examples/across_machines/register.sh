#!/usr/bin/env bash
# Admit clusters: register each cluster's public key (cluster-<i>.pub from `nebula-fl certs`) with the
# SuperLink. A SuperNode is refused until its key is registered; registrations live as long as the
# SuperLink's state (in memory unless flower-superlink gets --database), so register again after a restart.
# Usage: SUPERLINK=host:port CA=ca.crt ./register.sh cluster-0.pub [cluster-1.pub ...]
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: SUPERLINK=host:port CA=ca.crt $0 cluster-0.pub [cluster-1.pub ...]" >&2; exit 2; }
export FLWR_HOME="${FLWR_HOME:-$PWD/.flwr-submit}"
# shellcheck source=connection.sh
source "$(dirname "$0")/connection.sh"
for pub in "$@"; do
  flwr supernode register "$pub" remote
done
