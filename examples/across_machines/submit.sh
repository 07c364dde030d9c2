#!/usr/bin/env bash
# Submit a run to the SuperLink from the repo root, over TLS (CA = the federation's ca.crt);
# --run-config takes any [tool.flwr.app.config] key.
set -euo pipefail
export FLWR_HOME="${FLWR_HOME:-$PWD/.flwr-submit}"
# shellcheck source=connection.sh
source "$(dirname "$0")/connection.sh"
cd "$(git rev-parse --show-toplevel 2>/dev/null || echo .)"
# nebula-fl submit: flwr run --stream, then exit with the outcome (0 only for a completed run)
exec nebula-fl submit . remote --run-config "min-clusters=${CLUSTERS:-2} ${RUN_CONFIG:-}"
