"""Median tokens/s per tool and setting from a peers.jsonl, and llmtrain's ratio to each peer.

    python bench/peers/summarize.py peers.jsonl [RECIPE]

A setting is the recipe (pretrain, finetune_lora with its adapters, finetune_full; a record without one is
pretraining, as every record was before fine-tuning was compared), the model, the precision and compilation.
RECIPE prints only that recipe's settings.

Each peer's line also gives llmtrain's ratio round by round (the i-th llmtrain run over the i-th run of the peer,
which compare.sh ran in the same round) and their range: on a shared machine that spread, not the ratio of the
medians alone, says how far a ratio is settled. Left out where a tool has a different number of runs.
"""

import json
import statistics
import sys
from collections import defaultdict


def setting(record: dict) -> tuple:
    """(recipe with its LoRA settings, model, precision, compiled) of a record of any of the three tools."""
    recipe = record.get("recipe") or "pretrain"
    lora = record.get("lora")
    if lora:
        targets = ",".join(name.removeprefix("lora_") for name, on in lora.items()
                           if on is True)  # the target switches; rank, alpha and dropout are numbers
        recipe += f" (r {lora['lora_r']}, alpha {lora['lora_alpha']}, dropout {lora['lora_dropout']:g}, {targets})"
    if record.get("quantize"):  # QLoRA: its own setting, apart from LoRA over the same adapters
        recipe += f" over a {record['quantize']} base"
    model = record.get("model") or record.get("config", "").rstrip("/").rsplit("/", 1)[-1]
    return recipe, model, record["precision"], bool(record.get("compile"))


def main(path: str, only_recipe: str = "") -> None:
    runs = defaultdict(list)
    for line in open(path):
        record = json.loads(line)
        if only_recipe and (record.get("recipe") or "pretrain") != only_recipe:
            continue
        speed = record.get("tokens_per_sec_per_device", record.get("tokens_per_sec"))
        runs[(*setting(record), record.get("tool", "llmtrain"))].append(speed)
    for key in sorted({key[:4] for key in runs}):
        recipe, model, precision, compiled = key
        label = "" if recipe == "pretrain" else f"{recipe} of "  # pretraining's lines read as they always did
        print(f"{label}{model} {precision}{' compiled' if compiled else ''}:")
        ours = runs.get((*key, "llmtrain"))
        for (*other, tool), speeds in sorted(runs.items()):
            if tuple(other) != key:
                continue
            median = statistics.median(speeds)
            ratio = f", llmtrain / this = {statistics.median(ours) / median:.2f}x" if ours and tool != "llmtrain" else ""
            if ratio and len(ours) == len(speeds):
                rounds = [mine / theirs for mine, theirs in zip(ours, speeds)]
                ratio += (f" (per round {', '.join(f'{r:.2f}' for r in rounds)}: "
                          f"{min(rounds):.2f}-{max(rounds):.2f})")
            print(f"  {tool:<22} median {median:8,.0f} tokens/s over {len(speeds)} runs{ratio}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
