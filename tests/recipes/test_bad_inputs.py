"""Bad input through the real command line: a non-zero exit, one paragraph naming the flag or file, no
traceback (unless --debug), and nothing written or damaged.

Every case runs as its own process, exactly as ``python -m llmtrain``: one fresh interpreter imports what
``python -m llmtrain`` imports before it reads a flag, then forks one child per case, which runs
``llmtrain/__main__.py`` with the case's command line (a fresh interpreter per case would spend about two
seconds each importing torch, 40 cases over a minute). The children run two at a time in one module
fixture, and each case is then its own test that checks its result. ``test_debug_shows_the_traceback``
starts a real ``python -m llmtrain``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from llmtrain.cli import main
from llmtrain.checkpoint.layout import DCP_DIR
from llmtrain.tokenizer import train_bpe_tokenizer

from conftest import write_tiny_model
from forked_cli import run_forked
from pickles import RunsCode


@dataclass
class Case:
    """A command (``{in}`` is the inputs folder, ``{out}`` a fresh output folder) and what its message says."""

    name: str
    argv: list[str]
    says: list[str]
    out_dir_stays_absent: bool = True
    exit_code: Optional[int] = None  # None: any non-zero code


def _pretrain(*extra: str) -> list[str]:
    return ["pretrain", "--model_config", "{in}/tiny.yaml", "--out_dir", "{out}", "--data", "BuiltinStories",
            "--data.num_documents", "200", "--data.num_val_documents", "20", "--train.max_steps", "2",
            "--train.global_batch_size", "4", "--train.micro_batch_size", "2", *extra]


def _lora(*extra: str) -> list[str]:
    return ["finetune_lora", "{in}/run/final", "--out_dir", "{out}", "--train.max_steps", "2", *extra]


def _json_data(name: str) -> list[str]:
    return ["--data", "JSON", "--data.json_path", f"{{in}}/{name}"]


def _pretrain_on(*data: str) -> list[str]:
    """A tiny pretraining run on a data module of the data-at-scale family (--tokenizer_dir {in}/tok)."""
    return ["pretrain", "--model_config", "{in}/tiny.yaml", "--out_dir", "{out}", "--tokenizer_dir", "{in}/tok",
            "--train.max_steps", "2", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
            "--train.max_seq_length", "16", *data]


CASES = [
    # which model
    Case("unknown model name", ["pretrain", "pythia-70", "--out_dir", "{out}"],
         ["error: Unknown model name 'pythia-70'", "pythia-70m"], exit_code=2),
    Case("unknown model for finetune", ["finetune_lora", "Llama-3-8", "--out_dir", "{out}"], ["Llama-3-8"]),
    Case("missing model_config file", ["pretrain", "--model_config", "{in}/nope.yaml", "--out_dir", "{out}"],
         ["nope.yaml"]),
    Case("model_config heads do not divide width", _pretrain("--model_config", "{in}/bad_heads.yaml"),
         ["n_head", "n_embd"]),
    Case("missing --config recipe", ["pretrain", "--config", "{in}/nope.yaml"], ["nope.yaml"]),
    Case("recipe YAML that does not parse", ["pretrain", "--config", "{in}/broken.yaml"], ["broken.yaml"]),
    # a model that is not there: where it was looked for, and how to download one that reads like a Hub id
    Case("fine-tune a Hub model not downloaded", ["finetune_lora", "checkpoints/nope-org/nope-model", "--out_dir",
                                                  "{out}"],
         ["checkpoints/nope-org/nope-model does not exist", "relative to the current directory",
          "`llmtrain download nope-org/nope-model`"]),
    Case("generate from a Hub id", ["generate", "nope-org/nope-model"],
         ["nope-org/nope-model does not exist", "`llmtrain download nope-org/nope-model`"]),
    Case("chat with a zoo name", ["chat", "Llama-3.2-1B"],
         ["Llama-3.2-1B does not exist", "`llmtrain download meta-llama/Llama-3.2-1B`"]),
    Case("positional model and --checkpoint_dir disagree",
         ["finetune_lora", "{in}/run/final", "--checkpoint_dir", "{in}/empty-texts", "--out_dir", "{out}"],
         ["finetune_lora got checkpoint_dir twice", "--checkpoint_dir", "give one of them"]),
    Case("positional zoo name and --model_name disagree", ["pretrain", "pythia-14m", "--model_name", "llama-debug"],
         ["pretrain got model_name twice", "pythia-14m", "--model_name llama-debug"]),
    # flags
    Case("misspelled flag", _pretrain("--train.max_stepz", "3"), ["max_stepz", "did you mean --train.max_steps"]),
    Case("misspelled key in a --config recipe", ["pretrain", "--config", "{in}/misspelled.yaml", "--out_dir", "{out}"],
         ["max_stepz", "did you mean --train.max_steps"]),
    Case("misspelled field of --model_config", _pretrain("--model_config.n_layr", "2"),
         ["n_layr", "did you mean --model_config.n_layer"]),
    Case("misspelled argument of --optimizer", _pretrain("--optimizer.lrr", "1e-3"),
         ["lrr", "did you mean --optimizer.lr?"]),
    Case("misspelled field of a data module in a --config recipe",
         ["pretrain", "--config", "{in}/misspelled_data.yaml", "--out_dir", "{out}"],
         ["num_documets", "did you mean --data.num_documents"]),
    Case("unknown precision", _pretrain("--precision", "fp8"), ["precision", "fp8"]),
    Case("unknown optimizer", _pretrain("--optimizer", "Adamm"), ["optimizer", "Adamm"]),
    Case("negative learning rate", _pretrain("--optimizer", "AdamW", "--optimizer.lr", "-1"),
         ["--optimizer: Invalid learning rate: -1"]),
    Case("unknown data module", _pretrain("--data", "NoSuchData"), ["NoSuchData"]),
    Case("zero devices", _pretrain("--devices", "0"), ["--devices"]),
    Case("two nodes from a plain process", _pretrain("--num_nodes", "2"), ["--num_nodes", "torchrun"]),
    Case("negative warmup", _pretrain("--train.lr_warmup_steps", "-1"), ["lr_warmup_steps"]),
    Case("zero sequence length", _pretrain("--train.max_seq_length", "0"), ["max_seq_length"]),
    Case("expert parallelism on a dense model", _pretrain("--devices", "2", "--ep_size", "2"),
         ["--ep_size 2", "is dense (n_expert 0)", "drop --ep_size"]),
    Case("expert parallelism that does not divide the experts",
         ["pretrain", "moe-debug", "--out_dir", "{out}", "--devices", "3", "--ep_size", "3"],
         ["--ep_size 3 must divide the 8 experts (n_expert)", "drop --ep_size"]),
    Case("expert parallelism larger than the FSDP shard", _pretrain("--devices", "2", "--ep_size", "4"),
         ["--ep_size 4 must divide the 2 rank(s) of the data-parallel shard", "use --ep_size 2"]),
    Case("expert parallelism under DDP", _pretrain("--devices", "2", "--strategy", "ddp", "--ep_size", "2"),
         ["--ep_size 2", "DDP (NO_SHARD) replicates every weight", "--strategy fsdp"]),
    Case("expert parallelism under DeepSpeed", _pretrain("--devices", "2", "--strategy", "deepspeed_stage_2",
                                                         "--ep_size", "2"),
         ["--ep_size 2 with --strategy deepspeed_stage_2", "use --strategy fsdp"]),
    # another tool's name for a flag, a flag's abbreviation, a value near a choice
    Case("learning rate by another name", _pretrain("--learning_rate", "1e-3"),
         ["--learning_rate", "did you mean --optimizer.lr?"]),
    Case("learning rate by its short name", _pretrain("--lr", "1e-3"), ["--lr", "did you mean --optimizer.lr?"]),
    Case("learning rate in the wrong group", _pretrain("--train.learning_rate", "1e-3"),
         ["--train.learning_rate", "did you mean --optimizer.lr?"]),
    Case("a flag's abbreviation", _pretrain("--train.max_step", "3"),
         ["--train.max_step", "did you mean --train.max_steps"]),
    Case("a switch's abbreviation", _pretrain("--dry_ru"), ["unrecognized", "--dry_ru", "did you mean --dry_run"]),
    Case("misspelled data module", _pretrain("--data", "Alpaka"),
         ["--data 'Alpaka'", "did you mean Alpaca", "BuiltinStories, PythonStdlib, TextFiles"]),
    Case("devices in words", _pretrain("--devices", "two"), ["--devices 'two'", "an integer or auto"]),
    Case("optimizer in the wrong case", _pretrain("--optimizer", "Adamw"), ["'Adamw'", "did you mean AdamW?"]),
    Case("precision without its mode", _pretrain("--precision", "bf16"),
         ["--precision 'bf16'", "did you mean bf16-mixed or bf16-true?"]),
    Case("generate with an unknown quantization", ["generate", "{in}/run/final", "--prompt", "hi", "--quantize",
                                                   "bnb.int8"],
         ["--quantize 'bnb.int8'", "bnb.nf4, bnb.nf4-dq", "did you mean bnb.int8-training"]),
    # batch arithmetic
    Case("global batch not a multiple of micro batch", _pretrain("--train.global_batch_size", "6",
                                                                 "--train.micro_batch_size", "4"),
         ["global_batch_size", "micro_batch_size"]),
    Case("micro batch larger than global batch", _pretrain("--train.global_batch_size", "2",
                                                           "--train.micro_batch_size", "4"),
         ["global_batch_size", "micro_batch_size"]),
    # float8: tensor cores it needs, bf16 underneath, a layout it is wired for
    Case("float8 on a CPU", _pretrain("--float8", "rowwise"), ["--float8 rowwise", "float8 tensor cores", "cpu"]),
    Case("float8 planned for an A100", _pretrain("--float8", "tensorwise", "--dry_run", "--dry_run.gpu", "A100"),
         ["--float8 tensorwise", "A100", "has none"]),
    Case("float8 without bf16", _pretrain("--float8", "rowwise", "--dry_run", "--dry_run.gpu", "H100",
                                          "--precision", "32-true"), ["--float8 rowwise", "--precision bf16-mixed"]),
    Case("float8 with tensor parallelism", _pretrain("--float8", "rowwise", "--dry_run", "--dry_run.gpu", "H100",
                                                     "--precision", "bf16-mixed", "--devices", "2", "--tp_size", "2"),
         ["--float8 rowwise", "--tp_size 2"]),
    Case("float8 for LoRA", _lora("--float8", "rowwise", "--dry_run", "--dry_run.gpu", "H100", "--precision",
                                  "bf16-true"), ["--float8 rowwise", "finetune_lora", "drop --float8"]),
    Case("fp16 DeepSpeed on a mixture of experts", ["pretrain", "moe-debug", "--out_dir", "{out}", "--strategy",
                                                    "deepspeed_stage_2", "--precision", "16-mixed", "--dry_run",
                                                    "--dry_run.gpu", "A100", "--devices", "2"],
         ["--precision 16-mixed", "DeepSpeed", "mixture of experts", "bf16-mixed"]),
    # contradictions
    Case("resume with an initial checkpoint", _pretrain("--resume", "auto", "--initial_checkpoint_dir",
                                                        "{in}/run/final"), ["--resume", "--initial_checkpoint_dir"]),
    Case("tensor parallelism of a model that normalises q and k",
         _pretrain("--model_config", "{in}/qk_norm.yaml", "--devices", "2", "--tp_size", "2"),
         ["--tp_size 2", "qk_norm='full'", "drop --tp_size"]),
    # fine-tuning decays to --train.min_lr 6e-5: a lower rate, refused by the schedule once the model was loaded
    Case("min_lr above the optimizer's rate", _lora("--optimizer", "AdamW", "--optimizer.lr", "2e-5"),
         ["--train.min_lr 6e-05", "--optimizer.lr"]),
    Case("min_lr above the optimizer's rate in a dry run", _lora("--optimizer.lr", "2e-5", "--dry_run"),
         ["--train.min_lr 6e-05", "--optimizer.lr"]),
    Case("quantized base with mixed precision", _lora("--quantize", "bnb.nf4", "--precision", "16-mixed"),
         ["--quantize", "--precision"]),
    Case("adapters on a mixture of experts' experts under DeepSpeed",
         ["finetune_lora", "{in}/moe", "--out_dir", "{out}", "--lora_mlp", "true", "--strategy", "deepspeed_stage_2"],
         ["--lora_mlp", "mixture of experts", "--strategy deepspeed_stage_2", "drop --lora_mlp"]),
    # the loss skips the label -100 and no other: a flag to choose another would mislabel every masked position
    Case("a label for masked positions", _lora("--data", "BuiltinInstruct", "--data.ignore_index", "0"),
         ["ignore_index"]),
    Case("a data module's field without the module", _lora("--data.num_train", "100"),
         ["--data.num_train sets a field of a data module", "--data BuiltinInstruct"]),
    Case("resume from a folder that does not exist", _pretrain("--resume", "{in}/no-such-step"),
         ["--resume", "no-such-step"]),
    # data
    Case("missing text folder", _pretrain("--data", "TextFiles", "--data.train_data_path", "{in}/no-texts"),
         ["no-texts"]),
    Case("empty text folder", _pretrain("--data", "TextFiles", "--data.train_data_path", "{in}/empty-texts"),
         ["empty-texts"]),
    Case("missing JSON file", _lora(*_json_data("missing.json")), ["missing.json", "--data.json_path"]),
    Case("empty JSON file", _lora(*_json_data("empty.json")), ["empty.json"]),
    Case("JSON that does not parse", _lora(*_json_data("broken.json")), ["broken.json"]),
    Case("JSON record without a response", _lora(*_json_data("no_output.json")), ["no_output.json", "record 2"]),
    Case("JSONL with a broken line", _lora(*_json_data("bad_line.jsonl")), ["bad_line.jsonl", "line 3"]),
    # the Hub, offline (the table runs with HF_HUB_OFFLINE=1): one line, what to do instead
    Case("Alpaca offline", _lora("--data", "Alpaca"),
         ["--data Alpaca", "HF_HUB_OFFLINE=1", "yahma/alpaca-cleaned", "--data.path"]),
    Case("a Hub dataset offline", _pretrain_on("--data", "HFDataset", "--data.path", "no-org/no-dataset"),
         ["--data.path no-org/no-dataset", "HF_HUB_OFFLINE=1", "--data.data_files"]),
    Case("download offline", ["download", "meta-llama/Llama-3.2-1B", "--checkpoint_dir", "{out}"],
         ["HF_HUB_OFFLINE=1 forbids reaching the Hugging Face Hub", "meta-llama/Llama-3.2-1B"]),
    # tokenizer
    Case("missing tokenizer folder", _pretrain("--tokenizer_dir", "{in}/no-tokenizer"), ["no-tokenizer"]),
    Case("folder without tokenizer.json", _pretrain("--tokenizer_dir", "{in}/empty-texts"),
         ["tokenizer.json", "--tokenizer_dir"]),
    Case("tokenizer larger than the model's vocabulary", _pretrain("--tokenizer_dir", "{in}/big-tokenizer"),
         ["vocab", "--tokenizer_dir"]),
    # out_dir and disk
    Case("out_dir holds another run's checkpoints", ["pretrain", "--model_config", "{in}/other.yaml",
                                                     "--out_dir", "{in}/run", "--train.max_steps", "2"],
         ["--out_dir", "--resume"], out_dir_stays_absent=False),
    Case("out_dir inside a file", _pretrain("--out_dir", "{in}/tiny.yaml/out"), ["--out_dir", "not a directory"]),
    Case("unwritable out_dir", _pretrain("--out_dir", "{readonly}/out"), ["--out_dir", "not writable"]),
    # Its size is refused before its disk space (test_pretrain.py fakes the disk for that message).
    Case("model too large for this machine", ["pretrain", "Llama-3.1-405B", "--out_dir", "{out}"],
         ["model Llama-3.1-405B", "too large", "parameters", "GiB are available"]),
    # fine-tuning, conversion and generation inputs
    Case("fine-tune a folder that is no checkpoint", ["finetune_full", "{in}/empty-texts", "--out_dir", "{out}"],
         ["empty-texts"]),
    Case("zero LoRA rank", _lora("--lora_r", "0"), ["--lora_r"]),
    Case("merge_lora without adapters", ["merge_lora", "{in}/run/final"], ["lora"]),
    Case("convert to_hf from a folder that is no checkpoint", ["convert", "to_hf", "{in}/empty-texts", "{out}"],
         ["empty-texts"]),
    Case("convert from_hf an unsupported architecture", ["convert", "from_hf", "{in}/hf-bert", "{out}"],
         ["bert"]),
    Case("convert from_hf a model that needs remote code", ["convert", "from_hf", "{in}/hf-remote", "{out}"],
         ["remote code"]),
    Case("convert from_hf DeepSeek-V3", ["convert", "from_hf", "{in}/hf-deepseek-v3", "{out}"],
         ["DeepseekV3ForCausalLM cannot be converted exactly", "multi-head latent attention"]),
    Case("convert from_hf a Qwen3-MoE with dense layers", ["convert", "from_hf", "{in}/hf-qwen3-moe-dense", "{out}"],
         ["mlp_only_layers=[0]", "dense MLP layers"]),
    Case("convert to_hf an MoE trained with aux-loss-free balancing",
         ["convert", "to_hf", "{in}/moe-biased", "{out}"], ["expert_bias is not zero", "router_bias_update_rate"]),
    Case("resume a sharded checkpoint whose metadata pickle runs code",
         ["pretrain", "--model_config", "{in}/tiny.yaml", "--out_dir", "{in}/evil-run", "--resume", "auto",
          "--fsdp.state_dict_type", "sharded", "--data", "BuiltinStories", "--data.num_documents", "200",
          "--data.num_val_documents", "20", "--train.max_steps", "2", "--train.global_batch_size", "4",
          "--train.micro_batch_size", "2", "--train.max_seq_length", "32"],
         [".metadata", "will not unpickle"], out_dir_stays_absent=False),
    Case("convert a sharded checkpoint whose metadata pickle runs code",
         ["convert", "to_hf", "{in}/evil-run/step-00000001", "{out}"], [".metadata", "will not unpickle"]),
    Case("generate from a missing folder", ["generate", "{in}/no-such-model", "--prompt", "hi"],
         ["no-such-model"]),
    Case("serve a missing folder", ["serve", "{in}/no-such-model"], ["no-such-model", "does not exist"]),
    Case("serve a run folder that is no model directory", ["serve", "{in}/run"],
         ["is neither a llmtrain model directory", "model_config.yaml", "nor a transformers folder"]),
    Case("serve on a port out of range", ["serve", "{in}/run/final", "--port", "70000"], ["--port", "65535"]),
    Case("evaluate a missing folder", ["evaluate", "{in}/no-such-model", "--tasks", "hellaswag"], ["no-such-model"]),
    Case("evaluate with --batch_size 0", ["evaluate", "{in}/run/final", "--tasks", "hellaswag", "--batch_size", "0"],
         ["--batch_size", "at least 1"]),
    Case("evaluate with task YAMLs from a missing folder",
         ["evaluate", "{in}/run/final", "--tasks", "my_task", "--include_path", "{in}/no-such-tasks"],
         ["--include_path", "no-such-tasks", "not a folder"]),
    Case("merge_lora of a step the run never reached", ["merge_lora", "{in}/run/step-00000009"],
         ["step-00000009 does not exist", "holds final, step-00000001, step-00000002"]),
    # data at scale: prepare_data, Prepared, Mixture
    Case("prepare_data of an empty folder", ["prepare_data", "--data", "TextFiles", "--data.train_data_path",
                                             "{in}/empty-texts", "--tokenizer_dir", "{in}/tok", "--out_dir", "{out}"],
         ["--data.train_data_path", "empty-texts", "no .txt files"]),
    Case("mixture weight zero", _pretrain_on("--data", "Mixture", "--data.sources",
                                             '[{"path": "{in}/prepared", "weight": 0.7}, {"path": "{in}/prepared", '
                                             '"weight": 0, "name": "again"}]'),
         ["--data.sources[1]", "weight 0", "positive, finite number"]),
    Case("prepared folder missing a shard", _pretrain_on("--data", "Prepared", "--data.path", "{in}/prepared-broken"),
         ["unit-00000-0001.bin", "is missing", "run the prepare_data command that made the folder again"]),
    Case("prepared with another tokenizer", _pretrain_on("--data", "Prepared", "--data.path", "{in}/prepared",
                                                         "--tokenizer_dir", "{in}/tok2"),
         ["was prepared with the tokenizer in", "--tokenizer_dir"]),
    # a dry run checks the inputs a run checks
    Case("dry run with a missing text folder",
         _pretrain("--data", "TextFiles", "--data.train_data_path", "{in}/no-texts", "--dry_run"),
         ["--data.train_data_path", "no-texts"]),
    Case("dry run with a missing tokenizer folder", _pretrain("--tokenizer_dir", "{in}/no-tokenizer", "--dry_run"),
         ["no-tokenizer", "--tokenizer_dir"]),
    Case("dry run resuming a folder that does not exist", _pretrain("--resume", "{in}/no-such-step", "--dry_run"),
         ["--resume", "no-such-step"]),
    Case("dry run of a finetune on a missing JSON file", _lora(*_json_data("missing.json"), "--dry_run"),
         ["missing.json", "--data.json_path"]),
    Case("dry run on data prepared with another tokenizer",
         _pretrain_on("--data", "Prepared", "--data.path", "{in}/prepared", "--tokenizer_dir", "{in}/tok2",
                      "--dry_run"),
         ["was prepared with the tokenizer in", "--tokenizer_dir"]),
]


def _readonly_dir(inputs: Path) -> Path:
    """A directory this process cannot write to: a chmod 500 folder, or for root a read-only mount."""
    locked = inputs / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    for candidate in (locked, Path("/proc/sys"), Path("/sys/fs")):
        if candidate.is_dir() and not os.access(candidate, os.W_OK):
            return candidate
    raise AssertionError("found no read-only directory for the unwritable out_dir case")


def _make_inputs(inputs: Path) -> None:
    write_tiny_model(inputs / "tiny.yaml")
    write_tiny_model(inputs / "bad_heads.yaml", n_embd=65)
    write_tiny_model(inputs / "other.yaml", name="tiny-other", n_layer=3)
    (inputs / "broken.yaml").write_text("train:\n  max_steps: [3\n")
    (inputs / "misspelled.yaml").write_text(f"model_config: {inputs / 'tiny.yaml'}\ntrain:\n  max_stepz: 3\n")
    (inputs / "misspelled_data.yaml").write_text(f"model_config: {inputs / 'tiny.yaml'}\ndata:\n  class_path: "
                                                 "llmtrain.data.BuiltinStories\n  init_args:\n    num_documets: 20\n")
    (inputs / "empty-texts").mkdir()
    (inputs / "empty.json").write_text("")
    (inputs / "broken.json").write_text('[{"instruction": "a", "output": "b"},')
    records = [{"instruction": "say hi", "output": "hi"}] * 2 + [{"instruction": "say bye"}]
    (inputs / "no_output.json").write_text(json.dumps(records))
    lines = [json.dumps(r) for r in records[:2]] + ['{"instruction": "x", "output": ']
    (inputs / "bad_line.jsonl").write_text("\n".join(lines) + "\n")
    words = [f"word{i} " for i in range(3000)]
    train_bpe_tokenizer(iter(words * 2), vocab_size=2000, out_dir=inputs / "big-tokenizer")
    (inputs / "hf-bert").mkdir()
    (inputs / "hf-bert" / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    (inputs / "hf-remote").mkdir()
    (inputs / "hf-remote" / "config.json").write_text(json.dumps({
        "model_type": "custom_gpt", "architectures": ["CustomGPT"],
        "auto_map": {"AutoModelForCausalLM": "modeling_custom.CustomGPT"}}))
    write_tiny_model(inputs / "qk_norm.yaml", qk_norm="full")
    (inputs / "hf-deepseek-v3").mkdir()
    (inputs / "hf-deepseek-v3" / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}))
    (inputs / "hf-qwen3-moe-dense").mkdir()
    (inputs / "hf-qwen3-moe-dense" / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
        "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128, "intermediate_size": 96,
        "mlp_only_layers": [0]}))
    _write_biased_moe(inputs / "moe-biased")
    # Prepared folders: one intact, one with a shard deleted, both from tokenizer "tok" ("tok2" is another).
    story_words = [f"w{i} " for i in range(200)]
    tokenizer = train_bpe_tokenizer(iter(story_words * 3), vocab_size=300, out_dir=inputs / "tok")
    _write_moe_model_dir(inputs / "moe", tokenizer)
    train_bpe_tokenizer(iter(story_words[::-1] * 3), vocab_size=290, out_dir=inputs / "tok2")
    (inputs / "texts").mkdir()
    (inputs / "texts" / "a.txt").write_text(" ".join(story_words * 40))
    main(["prepare_data", "--data", "TextFiles", "--data.train_data_path", str(inputs / "texts"), "--tokenizer_dir",
          str(inputs / "tok"), "--out_dir", str(inputs / "prepared"), "--shard_tokens", "2000", "--num_workers", "1"])
    shutil.copytree(inputs / "prepared", inputs / "prepared-broken")
    (inputs / "prepared-broken" / "train" / "unit-00000-0001.bin").unlink()
    # A real run with checkpoints: cases point at it and must leave it as it was.
    main(["pretrain", "--model_config", str(inputs / "tiny.yaml"), "--out_dir", str(inputs / "run"),
          "--data", "BuiltinStories", "--data.num_documents", "200", "--data.num_val_documents", "20",
          "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.max_seq_length", "32",
          "--train.max_steps", "2", "--train.save_interval", "1", "--eval.max_iters", "1"])
    _make_evil_sharded_run(inputs)


def _write_biased_moe(directory: Path) -> None:
    """A tiny MoE model directory whose layer 0 has a non-zero aux-loss-free selection bias."""
    from llmtrain.checkpoint.files import write_model_dir
    from llmtrain.config import Config
    from llmtrain.model import GPT

    config = Config.from_name("moe-debug", n_layer=1, n_embd=32, n_head=2, n_query_groups=1, n_expert=4,
                              intermediate_size=16, moe_intermediate_size=16, vocab_size=128,
                              router_bias_update_rate=1e-3)
    state = GPT(config).state_dict()
    state["blocks.0.mlp.expert_bias"][0] = 0.5
    write_model_dir(directory, state_dict=state, model_config=config, hyperparameters=None, tokenizer=None)


def _write_moe_model_dir(directory: Path, tokenizer) -> None:
    """A model directory of a tiny mixture of experts (untrained weights: the cases refuse before reading them)."""
    from llmtrain.checkpoint.files import write_model_dir
    from llmtrain.config import Config
    from llmtrain.model import GPT

    config_file = write_tiny_model(directory.with_suffix(".yaml"), name="tiny-moe", mlp_class_name="LLaMAMLP",
                                   n_expert=4, n_expert_per_token=2, moe_intermediate_size=64)
    config = Config.from_file(config_file)
    write_model_dir(directory, state_dict=GPT(config).state_dict(), model_config=config, hyperparameters=None,
                    tokenizer=tokenizer)


def _make_evil_sharded_run(inputs: Path) -> None:
    main(["pretrain", "--model_config", str(inputs / "tiny.yaml"), "--out_dir", str(inputs / "evil-run"),
          "--data", "BuiltinStories", "--data.num_documents", "200", "--data.num_val_documents", "20",
          "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.max_seq_length", "32",
          "--train.max_steps", "1", "--train.save_interval", "1", "--eval.max_iters", "1",
          "--fsdp.state_dict_type", "sharded"])
    metadata = inputs / "evil-run" / "step-00000001" / DCP_DIR / ".metadata"
    assert metadata.is_file()
    metadata.write_bytes(pickle.dumps(RunsCode(inputs.parent / "code-ran")))


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-inputs")
    cache = root / "cache"
    os.environ["LLMTRAIN_CACHE_DIR"] = str(cache)
    inputs = root / "in"
    inputs.mkdir()
    _make_inputs(inputs)
    readonly = _readonly_dir(inputs)
    before = _digest(inputs)
    env = {**os.environ, "LLMTRAIN_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    logs = root / "logs"
    logs.mkdir()
    commands = []
    for index, case in enumerate(CASES):
        out = root / "out" / f"case-{index}"
        argv = [a.replace("{in}", str(inputs)).replace("{out}", str(out)).replace("{readonly}", str(readonly))
                for a in case.argv]
        commands.append(argv)
    done = run_forked([command for command in commands], logs, env)
    outcome = {case.name: (result, root / "out" / f"case-{index}")
               for index, (case, result) in enumerate(zip(CASES, done))}
    after = _digest(inputs)
    (inputs / "locked").chmod(0o700)
    return outcome, before, after


def test_there_are_at_least_25_cases():
    assert len({case.name for case in CASES}) == len(CASES) >= 25


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_is_one_paragraph_and_changes_nothing(case, results):
    outcome, _, _ = results
    done, out = outcome[case.name]
    message = done.stderr.strip()
    assert done.returncode != 0, f"exit code 0 for {case.name}; stderr:\n{message}"
    assert case.exit_code in (None, done.returncode), f"exit code {done.returncode}; stderr:\n{message}"
    assert "Traceback" not in message, message
    paragraphs = [p for p in message.split("\n\n") if p.strip() and not p.startswith("usage:")]
    assert len(paragraphs) == 1, message
    for text in case.says:
        assert text.lower() in message.lower(), f"{text!r} not in:\n{message}"
    if case.out_dir_stays_absent:
        assert not out.exists(), f"{case.name} created {out}"


@pytest.mark.slow
def test_no_input_or_earlier_checkpoint_was_touched(results):
    outcome, before, after = results
    assert before == after
    done, out = outcome["convert a sharded checkpoint whose metadata pickle runs code"]
    assert not (out.parents[2] / "code-ran").exists()  # the malicious pickle was never executed
    probe = out.parents[2] / "probe"
    pickle.loads(pickle.dumps(RunsCode(probe)))
    assert probe.exists()  # while plain unpickling would have run it


def test_debug_shows_the_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "llmtrain", "pretrain", "pythia-70", "--out_dir",
                           str(tmp_path / "o"), "--debug"], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "Traceback" in done.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("rank, speaks", [("0", True), ("1", False)])
def test_under_a_launcher_rank_0_speaks_and_the_others_wait_for_it(rank, speaks, monkeypatch, capsys):
    """Every rank of a torchrun job checks the same flags. Rank 0 says what is wrong; the others wait before they
    exit, so that the launcher, which stops every process once one has failed, cannot stop rank 0 first."""
    from llmtrain import cli

    waits = []
    monkeypatch.setattr(cli.time, "sleep", waits.append)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(sys, "argv", ["llmtrain", "pretrain", "llama-debug", "--train.max_stepz", "1"])
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert ("error: unrecognized arguments: --train.max_stepz" in err) is speaks
    assert waits == ([] if speaks else [cli.QUIET_RANK_EXIT_DELAY_S])
