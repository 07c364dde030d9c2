#!/usr/bin/env bash
# The server host: one SuperLink. The ServerApp it starts for each run is nebula-fl's (installed here).
set -euo pipefail
export FLWR_HOME="${FLWR_HOME:-$PWD/.flwr-superlink}" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
exec flower-superlink --insecure --disable-runtime-dependency-installation --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}"
