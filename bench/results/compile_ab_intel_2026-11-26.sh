#!/bin/bash
# interleaved compile A/B: pythia-160m and llama-20m, fp32, on this CPU
for round in 1 2 3; do
  for model in pythia-160m llama-20m; do
    if [ $((round % 2)) = 1 ]; then order="false true"; else order="true false"; fi
    for c in $order; do
      s=$(date +%s.%N)
      /work/main/.venv/bin/llmtrain benchmark --model $model --precision 32-true --micro_batch_size 4 --seq_len 256 --steps 4 --warmup 2 --compile $c --baseline null --out_dir /tmp/cab/o --results /tmp/cab/results.jsonl > /tmp/cab/log_${model}_${c}_$round.txt 2>&1
      e=$(date +%s.%N)
      echo "$round $model $c wall $(echo "$e - $s" | bc)" >> /tmp/cab/walls.txt
    done
  done
done
