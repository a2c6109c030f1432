#!/usr/bin/env bash
# llmtrain against LitGPT and transformers' Trainer, interleaved, same model, data shape, batch, precision.
#   [STEPS=20 WARMUP=5] bench/peers/compare.sh ROUNDS MODEL PRECISION [--compile]
# Needs /work/peers/hf-venv (transformers, accelerate) and /work/peers/litgpt-venv (litgpt), each with
# torch pinned by constraints.txt (see bench/peers/README.md). Appends to peers.jsonl and prints medians.
set -euo pipefail
rounds=${1:-3}; model=${2:-llama-debug}; precision=${3:-32-true}; compile=${4:-}
root=$(cd "$(dirname "$0")/../.." && pwd)
results=${RESULTS:-$root/peers.jsonl}
steps=(--steps "${STEPS:-20}" --warmup "${WARMUP:-5}")  # timed steps after warm-up, the same for all three
config_dir=$(mktemp -d)/$model
"$root/.venv/bin/python" "$root/bench/peers/hf_config.py" "$model" "$config_dir" > /dev/null
for round in $(seq "$rounds"); do
  echo "round $round: llmtrain"
  "$root/.venv/bin/llmtrain" benchmark --model "$model" --precision "$precision" \
      ${compile:+--compile true} "${steps[@]}" --results "$results" --baseline null > /dev/null
  echo "round $round: litgpt"
  /work/peers/litgpt-venv/bin/python "$root/bench/peers/litgpt_bench.py" "$model" --precision "$precision" \
      $compile "${steps[@]}" --results "$results" > /dev/null 2>&1
  if [ -z "$compile" ]; then
    echo "round $round: transformers Trainer"
    /work/peers/hf-venv/bin/python "$root/bench/peers/hf_trainer_bench.py" "$config_dir" --precision "$precision" \
        "${steps[@]}" --results "$results" > /dev/null 2>&1
  fi
done
"$root/.venv/bin/python" "$root/bench/peers/summarize.py" "$results"
