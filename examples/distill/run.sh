#!/usr/bin/env bash
# Distil each cluster's MiniLM teacher into a 2-layer student across a 2-cluster federation on this machine.
# Pass a completed classify run folder to distil that run's global model instead: ./run.sh runs/demo-...
set -euo pipefail
teacher="${1:-local:100}"
[[ "$teacher" == local:* ]] || teacher="$(realpath "$teacher")"  # the trainers must find it wherever they run
cd "$(dirname "$0")/../.."
exec .venv/bin/nebula-fl run --task distill --preset demo --port 0 --run-config "task.teacher=\"${teacher}\""
