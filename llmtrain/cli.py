"""The ``llmtrain`` command line: every subcommand is a typed function, parsed by jsonargparse.

One place lists the subcommands (``COMMANDS``); a recipe's flags come from its signature and
docstring, so a new flag is a new typed argument with one line of documentation.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

from llmtrain.errors import DEBUG_ENV, USER_ERRORS, close_matches, told_status

# Subcommands whose first positional argument is sugar for a flag: `pretrain NAME` = `pretrain --model_name NAME`.
POSITIONAL = {"pretrain": "--model_name"}


def commands() -> dict[str, Callable]:
    """Every subcommand, in one place. Imported lazily so `--help` stays fast."""
    from llmtrain import chat, evaluate, generate, plot, serve
    from llmtrain.download import download
    from llmtrain.benchmark.command import benchmark
    from llmtrain.convert.hf import convert_from_hf, convert_to_hf
    from llmtrain.recipes import finetune, prepare_data, pretrain

    return {"pretrain": pretrain.setup, "finetune_full": finetune.setup_full, "finetune_lora": finetune.setup_lora,
            "finetune": finetune.setup_lora, "merge_lora": finetune.merge_lora, "generate": generate.setup,
            "chat": chat.setup, "evaluate": evaluate.setup,
            "convert": {"to_hf": convert_to_hf, "from_hf": convert_from_hf}, "plot": plot.plot,
            "benchmark": benchmark, "prepare_data": prepare_data.setup,
            "serve": serve.setup, "download": download}


LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")
"""What the deepspeed launcher (and torch.distributed.launch, hyphenated) puts before the program's own arguments."""


def _drop_launcher_local_rank(argv: list[str]) -> list[str]:
    """Accept and drop a launcher's ``--local_rank=N`` when it agrees with the LOCAL_RANK it also set.

    NOTE: llmtrain reads every rank coordinate from the environment, as under torchrun, so the flag adds nothing;
    refusing it would make ``deepspeed --module llmtrain ...`` need --no_local_rank. One that disagrees with
    LOCAL_RANK, or comes without it (the process could not know its peers), is an error.
    """
    out, index = [], 0
    while index < len(argv):
        arg = argv[index]
        name, _, value = arg.partition("=")
        if name not in LOCAL_RANK_FLAGS:
            out.append(arg)
            index += 1
            continue
        if not value and index + 1 < len(argv):
            value, index = argv[index + 1], index + 1
        index += 1
        launcher_value = os.environ.get("LOCAL_RANK")
        if launcher_value is None:
            raise ValueError(f"{name} {value} came without the LOCAL_RANK variable that launchers set beside it; "
                             "llmtrain reads each process's rank from RANK, WORLD_SIZE and LOCAL_RANK: drop "
                             f"{name}, and start the processes with torchrun, srun or the deepspeed launcher")
        if value.strip() != launcher_value.strip():
            raise ValueError(f"{name} {value} disagrees with LOCAL_RANK={launcher_value} from the launcher; drop "
                             f"{name} (llmtrain reads LOCAL_RANK)")
    return out


def _positionals_after_config(argv: list[str], table: dict[str, Any]) -> list[str]:
    """A command's positional arguments win over ``--config``, whatever their order.

    jsonargparse applies the command line in order, so ``finetune_lora MY_MODEL --config recipe.yaml`` trained the
    recipe's ``checkpoint_dir``: the positionals move to just after the last ``--config`` (a command-line positional
    is more specific than a recipe file). ``pretrain NAME`` becomes ``--model_name NAME`` (:data:`POSITIONAL`), and
    ``--checkpoint_dir X`` (LitGPT's older spelling) is the positional; the same argument given both ways, with two
    values, is refused.
    """
    import inspect

    depth, target = 1, table.get(argv[0]) if argv else None
    if isinstance(target, dict):  # `convert to_hf ...`
        depth, target = 2, target.get(argv[1]) if len(argv) > 1 else None
    if target is None:
        return argv
    sugar = POSITIONAL.get(argv[0])
    names = [sugar[2:]] if sugar else [name for name, parameter in inspect.signature(target).parameters.items()
                                       if parameter.default is parameter.empty
                                       and parameter.kind is parameter.POSITIONAL_OR_KEYWORD]
    units: list[list[str]] = []  # each flag with its value, each positional alone, in order
    positional_units: list[int] = []
    named: dict[str, str] = {}
    rest, index = argv[depth:], 0
    while index < len(rest):
        arg = rest[index]
        if not arg.startswith("-") or arg == "-":
            positional_units.append(len(units))
            units.append([arg])
            index += 1
            continue
        flag, equals, value = arg.partition("=")
        # A flag takes the next word as its value, unless that is another flag (--print_config, --help, ...).
        alone = equals or flag in ("-h", "--help") or index + 1 == len(rest) or rest[index + 1].startswith("--")
        width = 1 if alone else 2
        name = flag[2:] if flag.startswith("--") else ""
        if name in names and (equals or index + 1 < len(rest)):
            named[name] = value if equals else rest[index + 1]
            positional_units.append(len(units))
            units.append([])  # the positional's place; its value is placed below
        else:
            units.append(rest[index:index + width])
        index += width
    given = [units[i][0] for i in positional_units if units[i]]
    for name, value in named.items():
        position = names.index(name)
        if position < len(given) and given[position] != value:
            raise ValueError(f"{' '.join(argv[:depth])} got {name} twice: {given[position]} (the positional argument) "
                             f"and --{name} {value}; give one of them")
    values = list(given)
    for name, value in named.items():
        if names.index(name) >= len(values):
            values.append(value)
    positional = [[value] for value in values]
    if sugar and values:
        positional[0] = [sugar, values[0]]  # a second positional stays one, for the parser to refuse
    kept = [unit for i, unit in enumerate(units) if i not in positional_units]
    configs = [i for i, unit in enumerate(kept) if unit[0] == "--config" or unit[0].startswith("--config=")]
    # After the last --config; without one, where the first positional was (its order among flags is immaterial).
    at = configs[-1] + 1 if configs else positional_units[0] if positional_units else 0
    ordered = kept[:at] + positional + kept[at:]
    return argv[:depth] + [token for unit in ordered for token in unit]


def _zoo_model_with_overrides(argv: list[str]) -> list[str]:
    """``pretrain NAME --model_config.n_layer 2``: the zoo model NAME with only the fields given changed.

    The zoo entry replaces ``--model_name NAME`` as a whole ``--model_config``, which the ``--model_config.FIELD``
    flags after it then change, so a field the user did not pass keeps the zoo's value."""
    import json

    if not argv or argv[0] not in POSITIONAL or not any(a.startswith("--model_config.") for a in argv):
        return argv
    out = list(argv)
    for index, arg in enumerate(out):
        if arg == "--model_name" and index + 1 < len(out):
            name, width = out[index + 1], 2
        elif arg.startswith("--model_name="):
            name, width = arg.split("=", 1)[1], 1
        else:
            continue
        from llmtrain.config import MODEL_ZOO, resolve_name

        canonical = resolve_name(name)
        entry = next(e for e in MODEL_ZOO if e["name"] == canonical)
        out[index:index + width] = ["--model_config", json.dumps(entry)]
        break
    return out


# Flag groups whose bare name switches them on: `--dry_run` = `--dry_run.enabled true`.
SWITCHES = ("--dry_run", "--profile")


def _bare_switches(argv: list[str]) -> list[str]:
    """``--dry_run`` alone (or ``--dry_run true|false``) sets ``--dry_run.enabled``, and ``--profile`` likewise;
    their other fields stay flags."""
    out: list[str] = []
    for index, arg in enumerate(argv):
        following = argv[index + 1] if index + 1 < len(argv) else None
        if arg in SWITCHES and following in ("true", "false", "True", "False"):
            out.append(f"{arg}.enabled")
        elif arg in SWITCHES:
            out.extend([f"{arg}.enabled", "true"])
        else:
            out.append(arg)
    return out


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


class CommandLineError(ValueError):
    """A flag or value the parser rejected; the message names it, the hint says how to list the flags."""

    def __init__(self, message: str, command: str) -> None:
        super().__init__(message)
        self.hint = f"`{command} --help` lists every flag"


FLAG_SYNONYMS = {
    ("lr", "learning_rate"): ("--optimizer.lr",),
    ("wd", "weight_decay"): ("--optimizer.weight_decay",),
    ("batch_size", "bs", "gradient_accumulation_steps"): ("--train.global_batch_size", "--train.micro_batch_size"),
    ("num_epochs", "num_train_epochs"): ("--train.epochs",),
    ("steps", "num_steps", "max_iters", "iters", "train_steps"): ("--train.max_steps",),
    ("warmup", "warmup_steps"): ("--train.lr_warmup_steps",),
    ("seq_len", "max_seq_len", "seq_length", "context_length", "max_length"): ("--train.max_seq_length",),
    ("grad_clip", "max_grad_norm", "clip_grad_norm", "gradient_clipping"): ("--train.max_norm",),
    ("output_dir", "out", "output"): ("--out_dir",),
    ("gpus", "num_gpus", "num_devices", "nproc_per_node"): ("--devices",),
    ("nodes", "nnodes"): ("--num_nodes",),
    ("dtype", "mixed_precision", "fp16", "bf16"): ("--precision",),
    ("model", "model_name_or_path"): ("--model_name", "--checkpoint_dir"),
    ("resume_from_checkpoint",): ("--resume",),
    ("tokenizer", "tokenizer_path"): ("--tokenizer_dir",),
}
"""Other tools' names for llmtrain's flags, by the last part of the unknown flag (``--train.learning_rate``: lr).
A flag is suggested only where the command has it."""

SUGGESTED_OPTIMIZER = "torch.optim.AdamW"
"""Whose arguments (``--optimizer.lr``, ...) suggestions offer: the default optimizer's."""


def _suggest(message: str, options: Sequence[str]) -> str:
    """Add the closest known flags to an "Unrecognized arguments" message, and to a --config file's unknown key
    ("does not accept option 'train.max_step'") or class argument ("class_path 'llmtrain.config.Config': Option
    'n_layr' is not accepted", from the command line or a file)."""
    import difflib
    import re

    hints = []
    keys = [f"--{key}" for key in re.findall(r"does not accept option '([\w.\-]+)'", message)]
    if "--optimizer" in options:  # its arguments are flags too, though the parser lists none of them
        options = [*options, *(f"--optimizer.{name}" for name in _init_arguments(SUGGESTED_OPTIMIZER))]
    for flag in dict.fromkeys(re.findall(r"(--[\w.\-]+)", message) + keys):
        name = flag.split("=", 1)[0]
        if name not in options and not name.startswith("--data."):  # a data module's fields: _plain explains them
            close = _close_flags(name, options)
            if close:
                hints.append(f"instead of {name}, did you mean {' or '.join(close)}?")
    group = message.split(":", 1)[0] if message.startswith("--") else None
    found = re.findall(r"class_path '([\w.]+)': Option '(\w+)' is not accepted", message)
    # A callable's arguments (--optimizer's): "Option 'lrr' is not accepted. Got value: Namespace(class_path='...'".
    found += [(class_path, name) for name, class_path in
              re.findall(r"Option '(\w+)' is not accepted\. Got value: Namespace\(class_path='([\w.]+)'", message)]
    for class_path, name in found:
        close = difflib.get_close_matches(name, _init_arguments(class_path), n=3, cutoff=0.6)
        if close and group:
            hints.append(f"instead of {group}.{name}, did you mean {' or '.join(f'{group}.{c}' for c in close)}?")
    return message + ("; " + "; ".join(hints) if hints else "")


def _close_flags(name: str, options: Sequence[str]) -> list[str]:
    """The flags an unknown ``name`` may mean: another tool's name for one (FLAG_SYNONYMS), else the flags spelled
    alike, whole or by their last part (``--max_step``: ``--train.max_steps``)."""
    import difflib

    last = name.lstrip("-").rsplit(".", 1)[-1].lower().replace("-", "_")
    synonyms = next((flags for names, flags in FLAG_SYNONYMS.items() if last in names), ())
    found = [flag for flag in synonyms if flag in options]
    if found:
        return found
    options = [option for option in options if option.startswith("--") and not option.endswith(".help")]
    by_last: dict[str, list[str]] = {}
    for option in options:
        by_last.setdefault(option.rsplit(".", 1)[-1].lstrip("-"), []).append(option)
    if last in by_last:  # the right name in the wrong group (--max_steps)
        return by_last[last][:3]
    found = [flag for close in difflib.get_close_matches(last, list(by_last), n=3, cutoff=0.75)
             for flag in by_last[close]]
    found += difflib.get_close_matches(name, options, n=3, cutoff=0.6)
    return list(dict.fromkeys(found))[:3]


def _init_arguments(class_path: str) -> list[str]:
    """The arguments a class's constructor takes (a data module's, the model config's, an optimizer's)."""
    import inspect
    import pydoc

    cls = pydoc.locate(class_path)
    if not isinstance(cls, type):
        return []
    return [name for name, parameter in inspect.signature(cls).parameters.items()
            if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)]


def _plain(message: str) -> str:
    """jsonargparse's wording in flag terms: 'Parser key "precision": Expected a typing.Literal['a', 'b'].
    Got value: x' becomes '--precision: expected one of 'a', 'b'. Got value: x'."""
    import re

    message = re.sub(r'^Parser key "([\w.]+)":\s*', lambda m: f"--{m.group(1)}: ", message)
    message = re.sub(r"Expected a typing\.Literal\[(.*?)\]", r"expected one of \1", message)
    # A field of the data module with no module named: jsonargparse tries it on the base class and says so at length.
    field = re.search(r"class_path 'llmtrain\.data\.(?:base\.)?DataModule'.*NestedArg\(key='(\w+)'", message)
    if message.startswith("--data:") and field:
        return (f"--data.{field.group(1)} sets a field of a data module, and no --data names one: name it first, "
                f"e.g. --data BuiltinInstruct --data.{field.group(1)} ... (fine-tuning's default) or --data "
                "BuiltinStories (pretraining's)")
    return message


def _bad_value(message: str, options: dict) -> Optional[str]:
    """A value outside what a typed flag takes ('Parser key "data": ... Given value: Alpaka'), said in one line
    with what it takes and the close matches: ``--data 'Alpaka': expected a data module (BuiltinStories, ...);
    did you mean Alpaca?``. None when the message is about something else."""
    import pydoc
    import re
    import typing

    match = re.match(r'Parser key "([\w.]+)":.*(?:Given value type: <class \'str\'> Given value|Got value): (.*)$',
                     message)
    # A class's field (--data.num_workers x): "Parser key "data": ... class_path 'llmtrain.data.TextFiles': Parser
    # key "num_workers": ... Given value: NestedArg(key='num_workers', val='x')".
    field = re.match(r'Parser key "([\w.]+)":.*class_path \'([\w.]+)\': Parser key "\w+".*'
                     r"Given value: NestedArg\(key='(\w+)', val='(.*)'\)$", message)
    if field:
        group, class_path, name, value = field.groups()
        key, hint = f"{group}.{name}", typing.get_type_hints(pydoc.locate(class_path) or object).get(name)
    elif match:
        (key, value), hint = match.groups(), getattr(options.get(f"--{match[1]}"), "_typehint", None)
    else:
        return None
    accepted = _accepted_values(hint)
    if accepted is None or value in accepted[1] or (accepted[2] and "." in value):
        return None  # a choice, or an import path, that failed for another reason: jsonargparse's message says it
    what, names, _ = accepted
    close = close_matches(value, names)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return f"--{key} {value!r}: expected {' or '.join(what)}{hint}"


def _accepted_values(hint) -> Optional[tuple[list[str], list[str], bool]]:
    """What a flag of type ``hint`` takes, in words; the names among it; whether it takes a class by import path.
    None for a type this does not describe (one that takes any string, a path, a dataclass)."""
    import typing

    from llmtrain.data import REGISTRY, DataModule

    what, names, takes_class = [], [], False
    members = typing.get_args(hint) if typing.get_origin(hint) is typing.Union else (hint,)
    for member in members:
        if member is type(None):
            continue
        if typing.get_origin(member) is typing.Literal:
            literals = [str(value) for value in typing.get_args(member)]
            names += literals
            what.append(literals[0] if len(literals) == 1 else f"one of {', '.join(literals)}")
        elif member in (int, float, bool):
            what.append({int: "an integer", float: "a number", bool: "true or false"}[member])
        elif isinstance(member, type) and issubclass(member, DataModule):
            names += list(REGISTRY)
            takes_class = True
            what.append(f"a data module ({', '.join(REGISTRY)}, or an import path package.module.Class)")
        else:
            return None
    return (what, names, takes_class) if what else None


def _parser_class():
    """jsonargparse's parser, but a rejected command line raises :class:`CommandLineError` (one paragraph)
    instead of printing the whole usage and exiting."""
    import argparse

    from jsonargparse import ArgumentParser

    class DebugFlag(argparse.Action):
        """``--debug`` in every command's --help; main() takes the flag off the command line before parsing."""

        def __init__(self, option_strings: Sequence[str], dest: str, **kwargs) -> None:
            super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0,
                             help=DEBUG_HELP)

        def __call__(self, parser, namespace, values, option_string=None) -> None:
            os.environ[DEBUG_ENV] = "1"

    class Parser(ArgumentParser):
        def __init__(self, *args, **kwargs) -> None:
            # NOTE: an abbreviation would take a misspelled flag (--train.max_step) for the flag it begins.
            super().__init__(*args, **{**kwargs, "allow_abbrev": False})

        def parse_args(self, *args, **kwargs):
            _add_debug_flag(self)  # to the parser of every command, which exist now (and not to a type's parser)
            return super().parse_args(*args, **kwargs)

        def error(self, message: str, ex: Optional[Exception] = None):
            if not self.exit_on_error:  # jsonargparse trying alternatives internally
                return super().error(message, ex)
            parser = getattr(ex, "subcommand_parser", None) or self
            command = parser.prog.replace(" [options]", "").replace("__main__.py", "llmtrain")
            command = "llmtrain" + command.split("llmtrain", 1)[-1] if "llmtrain" in command else command
            text = " ".join(line.strip() for line in str(message).splitlines() if line.strip())
            text = _bad_value(text, parser._option_string_actions) or _plain(text)
            raise CommandLineError(_suggest(text, list(parser._option_string_actions)), command) from ex

    def _add_debug_flag(parser) -> None:
        if "--debug" not in parser._option_string_actions:
            parser.add_argument("--debug", action=DebugFlag)
        subcommands = getattr(parser, "_subcommands_action", None)
        for subparser in (subcommands._name_parser_map.values() if subcommands else ()):
            _add_debug_flag(subparser)

    return Parser


DEBUG_HELP = "On an error, show its traceback instead of one line (also in the workers of a launched run)."

QUIET_RANK_EXIT_DELAY_S = 10.0
"""How long a rank other than 0 waits before it exits on an input error that rank 0 reports (see main())."""



def main(argv: Optional[Sequence[str]] = None) -> None:
    """The console script. From the command line (``argv`` None), input errors print one paragraph and exit
    with status 2; ``--debug`` shows the traceback instead. Called with ``argv``, errors propagate."""
    from_command_line = argv is None
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    if debug:
        os.environ[DEBUG_ENV] = "1"  # the workers of a launched run print tracebacks too
    from llmtrain.distributed.launch import record_invocation
    from llmtrain.train.nonfinite import NonFiniteError

    record_invocation(args)
    try:
        run_cli(args)
    except KeyboardInterrupt:  # Ctrl-C: a choice, not a failure; the exit code says it (llmtrain.signals)
        if debug or not from_command_line:
            raise
        print("interrupted (Ctrl-C): the run stopped without a checkpoint of its own; --resume auto continues from the "
              "last one written (SIGTERM or SIGUSR1 checkpoint before they stop)", file=sys.stderr)
        sys.exit(130)
    except NonFiniteError as error:  # the run stopped itself with a reason; its checkpoints are sound
        if debug or not from_command_line:
            raise
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    except USER_ERRORS as error:
        if debug or not from_command_line:
            raise
        from llmtrain.distributed.launch import is_first_process

        if is_first_process():  # every rank checks the same flags: rank 0 says it once, all exit 2
            hint = getattr(error, "hint", "run with --debug for the traceback")
            print(f"error: {error}\n({hint})", file=sys.stderr)
        else:
            # NOTE: a launcher stops every process once one has failed. Were another rank to exit first, rank 0
            # could be stopped before it has said why; so the others wait for it (the launcher ends them then).
            time.sleep(QUIET_RANK_EXIT_DELAY_S)
        sys.exit(told_status(error))  # 2, or the status the error's class declares (a full disk: 1)


def _check_config_files(argv: list[str]) -> None:
    """A recipe YAML that does not parse is named with its line, before jsonargparse reports it without the
    file's name."""
    import yaml

    for index, arg in enumerate(argv):
        path = argv[index + 1] if arg == "--config" and index + 1 < len(argv) else None
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        if path is None or not os.path.isfile(path):
            continue  # a missing file is the parser's error, which names it
        try:
            with open(path) as handle:
                yaml.safe_load(handle)
        except yaml.YAMLError as error:
            where = getattr(error, "problem_mark", None)
            line = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise ValueError(f"--config {path} is not valid YAML{line}: {problem}; fix the file") from error


def run_cli(args: list[str]) -> None:
    from llmtrain.distributed.supervise import WorkerFailedError

    try:
        dispatch(args)
    except WorkerFailedError as error:  # an unexpected error's traceback was printed already
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_status)


def dispatch(args: list[str]) -> Any:
    """Parse ``args`` (a subcommand and its flags) as the command line does and run the subcommand; returns what
    it returns (a recipe: its final/ folder). The Python API (llmtrain.api) calls this too, so a recipe called from
    Python has the command line's flags, defaults, checks and messages."""
    from jsonargparse import CLI, set_parsing_settings

    import llmtrain.data  # noqa: F401  (registers the data modules so `--data NAME` resolves)

    from llmtrain.distributed.runtime import configure_process

    configure_process()
    # Field docstrings of the argument dataclasses become the flags' help text.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    # NOTE: bare switches first: `--dry_run MY_MODEL` is a switch and a positional, not a flag and its value.
    args = _positionals_after_config(_bare_switches(_drop_launcher_local_rank(args)), commands())
    args = _qualify_optimizer(_zoo_model_with_overrides(args))
    _check_config_files(args)
    table = commands()
    # Only the named subcommand's parser is built: building all of them costs every command about a second.
    if args and args[0] in table:
        table = {args[0]: table[args[0]]}
    return CLI(table, args=args, description="Pretrain and fine-tune GPT-style language models.",
               parser_class=_parser_class())


if __name__ == "__main__":
    main()
