# Sourced by register.sh and submit.sh: the SuperLink connection "remote" in $FLWR_HOME/config.toml,
# over TLS, trusting only the federation's CA (CA=path to the ca.crt copied from the server host).
: "${SUPERLINK:?set SUPERLINK=host:port}" "${CA:?set CA to the ca.crt of the federation (from the server host)}"
[ -f "$CA" ] || { echo "$(basename "$0"): CA=$CA is not a file; copy ca.crt from the server host" >&2; exit 2; }
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "remote"
[superlink.remote]
address = "$SUPERLINK"
root-certificates = "$(cd "$(dirname "$CA")" && pwd)/$(basename "$CA")"
TOML
