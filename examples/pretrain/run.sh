#!/usr/bin/env bash
# MLM pre-training across 2 clusters: data-parallel vs DiLoCo (nebula-fl's outer Nesterov and codecs), side by side.
# Ends with the plot of held-out loss against WAN bytes: benchmarks/results/pretrain-<mode>-<time>/pretrain.png
#   examples/pretrain/run.sh            # --quick: a 2-layer BERT of width 64, minutes on 2 cores
#   examples/pretrain/run.sh --full     # the issue's 4-layer BERT of width 256, hours on 2 cores
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=(--quick)
name=quick
if [[ "${1:-}" == "--full" ]]; then mode=(); name=full; fi
out="benchmarks/results/pretrain-$name-$(date +%Y%m%d-%H%M%S)"
.venv/bin/python benchmarks/pretrain.py "${mode[@]}" --out "$out"
echo "plot: $out/pretrain.png"
