"""The ``llmtrain`` command line: every subcommand is a typed function, parsed by jsonargparse.

One place lists the subcommands (``COMMANDS``); a recipe's flags come from its signature and
docstring, so a new flag is a new typed argument with one line of documentation.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

# Subcommands whose first positional argument is sugar for a flag: `pretrain NAME` = `pretrain --model_name NAME`.
POSITIONAL = {"pretrain": "--model_name"}


def commands() -> dict[str, Callable]:
    """Every subcommand, in one place. Imported lazily so `--help` stays fast."""
    from llmtrain import generate, plot
    from llmtrain.convert.hf import convert_from_hf, convert_to_hf
    from llmtrain.recipes import finetune, pretrain

    return {"pretrain": pretrain.setup, "finetune_full": finetune.setup_full, "finetune_lora": finetune.setup_lora,
            "finetune": finetune.setup_lora, "merge_lora": finetune.merge_lora, "generate": generate.setup,
            "convert": {"to_hf": convert_to_hf, "from_hf": convert_from_hf}, "plot": plot.plot}


def _positional_to_flag(argv: list[str]) -> list[str]:
    """Rewrite ``pretrain NAME ...`` to ``pretrain --model_name NAME ...``."""
    if len(argv) >= 2 and argv[0] in POSITIONAL and not argv[1].startswith("-"):
        return [argv[0], POSITIONAL[argv[0]], argv[1], *argv[2:]]
    return argv


def _qualify_optimizer(argv: list[str]) -> list[str]:
    """``--optimizer AdamW`` means torch.optim.AdamW, even when another imported package (bitsandbytes)
    defines an optimizer class of the same name, which would make jsonargparse's short name ambiguous."""
    import torch.optim

    out = list(argv)
    for index, arg in enumerate(out[:-1]):
        name = out[index + 1]
        if arg == "--optimizer" and "." not in name and isinstance(getattr(torch.optim, name, None), type):
            out[index + 1] = f"torch.optim.{name}"
    return out


# Errors that mean "this input is wrong": shown as one message, without a traceback, unless --debug.
USER_ERRORS = (ValueError, OSError)  # OSError covers missing files, permissions and disk space


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The console script. From the command line (``argv`` None), input errors print one paragraph and exit
    with status 2; ``--debug`` shows the traceback instead. Called with ``argv``, errors propagate."""
    from_command_line = argv is None
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    try:
        run_cli(args)
    except USER_ERRORS as error:
        if debug or not from_command_line:
            raise
        print(f"error: {error}\n(run with --debug for the traceback)", file=sys.stderr)
        sys.exit(2)


def run_cli(args: list[str]) -> None:
    from jsonargparse import CLI, set_parsing_settings

    import llmtrain.data  # noqa: F401  (registers the data modules so `--data NAME` resolves)

    from llmtrain.distributed.launch import WorkerFailedError
    from llmtrain.recipes.common import configure_process

    configure_process()
    # Field docstrings of the argument dataclasses become the flags' help text.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    args = _qualify_optimizer(_positional_to_flag(args))
    try:
        CLI(commands(), args=args, description="Pretrain and fine-tune GPT-style language models.")
    except WorkerFailedError as error:  # the workers' tracebacks were printed already
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
