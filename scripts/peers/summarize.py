"""Median tokens/s per tool and setting from a peers.jsonl, and llmtrain's ratio to each peer."""

import json
import statistics
import sys
from collections import defaultdict


def main(path: str) -> None:
    runs = defaultdict(list)
    for line in open(path):
        record = json.loads(line)
        tool = record.get("tool", "llmtrain")
        model = record.get("model") or record.get("config", "").rstrip("/").rsplit("/", 1)[-1]
        speed = record.get("tokens_per_sec_per_device", record.get("tokens_per_sec"))
        runs[(model, record["precision"], bool(record.get("compile")), tool)].append(speed)
    settings = sorted({key[:3] for key in runs})
    for model, precision, compiled in settings:
        print(f"{model} {precision}{' compiled' if compiled else ''}:")
        ours = runs.get((model, precision, compiled, "llmtrain"))
        for (m, p, c, tool), speeds in sorted(runs.items()):
            if (m, p, c) != (model, precision, compiled):
                continue
            median = statistics.median(speeds)
            ratio = f", llmtrain / this = {statistics.median(ours) / median:.2f}x" if ours and tool != "llmtrain" else ""
            print(f"  {tool:<22} median {median:8,.0f} tokens/s over {len(speeds)} runs{ratio}")


if __name__ == "__main__":
    main(sys.argv[1])
