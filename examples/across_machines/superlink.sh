#!/usr/bin/env bash
# The server host: one SuperLink, TLS on its one port, admitting only SuperNodes whose keys were
# registered (register.sh). CERTS is the folder `nebula-fl certs` wrote on this host (ca.crt,
# server.crt, server.key). The ServerApp it starts for each run is nebula-fl's (installed here).
set -euo pipefail
CERTS="${CERTS:-$PWD/certs}"
for f in ca.crt server.crt server.key; do
  [ -f "$CERTS/$f" ] || { echo "superlink.sh: $CERTS/$f is missing; make it with:" \
    "nebula-fl certs $CERTS --hosts 127.0.0.1,localhost,<this host's name or address> --clusters N" >&2; exit 2; }
done
export FLWR_HOME="${FLWR_HOME:-$PWD/.flwr-superlink}" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
exec flower-superlink --ssl-ca-certfile "$CERTS/ca.crt" --ssl-certfile "$CERTS/server.crt" \
  --ssl-keyfile "$CERTS/server.key" --enable-supernode-auth --disable-runtime-dependency-installation \
  --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}"
