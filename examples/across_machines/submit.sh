#!/usr/bin/env bash
# Submit a run to the SuperLink from the repo root; --run-config takes any [tool.flwr.app.config] key.
set -euo pipefail
: "${SUPERLINK:?set SUPERLINK=host:port}"
export FLWR_HOME="${FLWR_HOME:-$PWD/.flwr-submit}" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "remote"
[superlink.remote]
address = "$SUPERLINK"
insecure = true
TOML
cd "$(git rev-parse --show-toplevel 2>/dev/null || echo .)"
exec flwr run . remote --stream --run-config "min-clusters=${CLUSTERS:-2} ${RUN_CONFIG:-}"
