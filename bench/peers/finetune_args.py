"""The fine-tuning flags both peer benches share (plain argparse: imported from either peer's venv).

`--recipe finetune_lora` with llmtrain's LoRA flags, named as `llmtrain finetune_lora` and LitGPT's
finetune_lora name them; each bench turns them into its own tool's adapters.
"""

import argparse

RECIPES = ("pretrain", "finetune_lora", "finetune_full")
LORA_TARGETS = ("query", "key", "value", "projection", "mlp", "head")
DEFAULT_TARGETS = ("query", "value")  # llmtrain's and LitGPT's defaults


def add_finetune_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="pretrain", choices=RECIPES)
    parser.add_argument("--lora_r", type=int, default=8)
    parser.add_argument("--lora_alpha", type=int, default=16)
    parser.add_argument("--lora_dropout", type=float, default=0.0)
    parser.add_argument("--lora_targets", default=",".join(DEFAULT_TARGETS),
                        help=f"comma-separated, of {', '.join(LORA_TARGETS)}")


def lora_settings(args: argparse.Namespace) -> dict:
    """llmtrain's LoRAArgs fields for the flags (a record's `lora`), or None when the recipe has no adapters."""
    if args.recipe != "finetune_lora":
        return None
    targets = [target.strip() for target in args.lora_targets.split(",") if target.strip()]
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown or not targets:
        raise SystemExit(f"--lora_targets {args.lora_targets!r}: name one or more of {', '.join(LORA_TARGETS)}")
    return {"lora_r": args.lora_r, "lora_alpha": args.lora_alpha, "lora_dropout": args.lora_dropout,
            **{f"lora_{target}": target in targets for target in LORA_TARGETS}}
