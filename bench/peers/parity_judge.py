"""Held-out loss of transformers folders on the windows loss_parity.py exported. Run with a venv that has
transformers (torch pinned as llmtrain's):

    /work/peers/hf-venv/bin/python bench/peers/parity_judge.py SEED_DIR/val.pt MODEL_DIR [MODEL_DIR ...]

Every folder is loaded with LlamaForCausalLM.from_pretrained in fp32; its loss is the mean token cross-entropy
over every window's max_seq_length next-token predictions. A folder with parity_check.pt (litgpt_train.py writes
one) must reproduce the logits saved there to within 1e-4, or the conversion is wrong and the script fails.
Prints one JSON line per folder.
"""

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

CHECK_TOLERANCE = 1e-4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("windows", type=Path, help="val.pt written by loss_parity.py")
    parser.add_argument("model_dirs", type=Path, nargs="+")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    windows = torch.load(args.windows)["windows"].long()
    for model_dir in args.model_dirs:
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        check_max_diff = check_logits(model, model_dir / "parity_check.pt")
        loss = held_out_loss(model, windows, args.batch_size)
        print(json.dumps({"model": str(model_dir), "loss": loss, "ppl": math.exp(loss), "windows": len(windows),
                          "tokens": windows[:, 1:].numel(), "check_max_diff": check_max_diff}), flush=True)


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for rows in windows.split(batch_size):
        logits = model(rows[:, :-1]).logits
        total += F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum").double()
    return (total / windows[:, 1:].numel()).item()


@torch.no_grad()
def check_logits(model: LlamaForCausalLM, check_path: Path) -> float | None:
    """The largest difference to the logits the training tool saved (None without a check file)."""
    if not check_path.is_file():
        return None
    check = torch.load(check_path)
    difference = (model(check["input_ids"]).logits - check["logits"]).abs().max().item()
    assert difference < CHECK_TOLERANCE, (
        f"{check_path.parent}: transformers' logits differ from the training tool's by {difference:.2e} "
        f"(more than {CHECK_TOLERANCE}): the weights or the config were converted wrongly")
    return difference


if __name__ == "__main__":
    main()
