#!/usr/bin/env bash
# Fine-tuning: llmtrain against LitGPT's finetune_lora / finetune_full step and transformers' Trainer (+ peft for
# LoRA), interleaved, same model, data shape, batch, precision; the pretraining comparison is compare.sh.
#   [STEPS=20 WARMUP=5 RESULTS=peers.jsonl PYTHON=.venv/bin/python] \
#       bench/peers/finetune_compare.sh ROUNDS MODEL lora|full [PRECISION]
# MODEL: llama-debug or llama-20m (llmtrain's zoo; litgpt_bench.py knows their shapes). PRECISION: 32-true (default)
# or bf16-true. LoRA: rank 8, alpha 16, dropout 0 on the query and value projections (llmtrain's default targets)
# for all three. Needs the peer venvs of bench/peers/README.md, peft in the Trainer's. Appends a record per run
# (with "recipe": finetune_lora or finetune_full) to RESULTS and prints this recipe's medians and llmtrain's ratios.
set -euo pipefail
rounds=${1:-3}; model=${2:-llama-debug}; mode=${3:-lora}; precision=${4:-32-true}
case "$mode" in
  lora|full) recipe=finetune_$mode ;;
  *) echo "MODE must be lora or full, got '$mode'" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
results=${RESULTS:-$root/peers.jsonl}
steps=(--steps "${STEPS:-20}" --warmup "${WARMUP:-5}")  # timed steps after warm-up, the same for all three
ours=(--recipe "$recipe"); peers=(--recipe "$recipe")
if [ "$mode" = lora ]; then
  ours+=(--lora.lora_r 8 --lora.lora_alpha 16 --lora.lora_dropout 0 --lora.lora_query true --lora.lora_key false
         --lora.lora_value true --lora.lora_projection false --lora.lora_mlp false --lora.lora_head false)
  peers+=(--lora_r 8 --lora_alpha 16 --lora_dropout 0 --lora_targets query,value)
fi
work=$(mktemp -d)
config_dir=$work/$model
"$python" "$root/bench/peers/hf_config.py" "$model" "$config_dir" > /dev/null

# Each run's output goes to a log; a failed run shows its end and stops the comparison.
run() {
  local log=$work/$1.log; shift
  if ! "$@" > "$log" 2>&1; then
    echo "failed: $*" >&2; tail -n 30 "$log" >&2; exit 1
  fi
}
for round in $(seq "$rounds"); do
  echo "round $round: llmtrain"
  run "llmtrain-$round" "$python" -m llmtrain benchmark --model "$model" --precision "$precision" "${ours[@]}" \
      "${steps[@]}" --out_dir "$work/llmtrain" --results "$results" --baseline null
  echo "round $round: litgpt"
  run "litgpt-$round" /work/peers/litgpt-venv/bin/python "$root/bench/peers/litgpt_bench.py" "$model" \
      --precision "$precision" "${peers[@]}" "${steps[@]}" --results "$results"
  echo "round $round: transformers Trainer"
  run "trainer-$round" /work/peers/hf-venv/bin/python "$root/bench/peers/hf_trainer_bench.py" "$config_dir" \
      --precision "$precision" "${peers[@]}" "${steps[@]}" --results "$results"
done
rm -rf "$work"
"$python" "$root/bench/peers/summarize.py" "$results" "$recipe"
