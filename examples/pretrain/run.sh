#!/usr/bin/env bash
# MLM pre-training across 2 clusters: data-parallel vs DiLoCo (nebula-fl's outer Nesterov and codecs), side by side.
# Ends with the plot of held-out loss against WAN bytes: benchmarks/results/pretrain-<mode>-<time>/pretrain.png
#   examples/pretrain/run.sh                                  # --quick: a 2-layer BERT of width 64, on CPU
#   examples/pretrain/run.sh --full --device cuda --precision bf16   # 4 x 256 BERT, 20,000 steps: a GPU machine's
# Any other arguments go to benchmarks/pretrain.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=(--quick)
name=quick
if [[ "${1:-}" == "--full" ]]; then mode=(); name=full; shift; fi
out="benchmarks/results/pretrain-$name-$(date +%Y%m%d-%H%M%S)"
python="${PYTHON:-.venv/bin/python}"
"$python" benchmarks/pretrain.py "${mode[@]}" --out "$out" "$@"
echo "plot: $out/pretrain.png"
