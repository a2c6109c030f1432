"""The recipes called from Python with the command line's arguments, and what they write loaded with `LLM.load`.

One chain for the module: `llmtrain.pretrain` (2 steps, in this process) → `llmtrain.finetune_lora` of its final/
(2 steps, a step checkpoint of adapters only) → `llmtrain.convert_to_hf`; the LoRA step checkpoint (merged in
memory), its final/ and the transformers folder all answer the same greedy text.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import llmtrain
from llmtrain import LLM
from llmtrain.checkpoint import layout
from llmtrain.cli import CommandLineError
from llmtrain.data import BuiltinInstruct, BuiltinStories

from conftest import write_tiny_model
from runs import shared_cache  # noqa: F401  (the module's runs share one token cache)

PROMPT = "What is 2 + 3?"
SHORT = {"global_batch_size": 4, "micro_batch_size": 2, "lr_warmup_steps": 1, "log_interval": 1}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("api-recipes")


@pytest.fixture(scope="module")
def pretrained(root, tmp_path_factory):
    # Each way of giving an argument: positional-free keywords, a data module object, a group as a dict, a dotted
    # name, a bare switch's group (eval), an optimizer by name with its arguments as a group.
    final = llmtrain.pretrain(model_config=write_tiny_model(root / "tiny.yaml", block_size=128), out_dir=root / "pretrain",
                              data=BuiltinStories(num_documents=400, num_val_documents=40),
                              train={**SHORT, "max_steps": 2, "max_seq_length": 32}, **{"eval.interval": 100},
                              eval={"max_iters": 1}, optimizer="AdamW", **{"optimizer.lr": 0.003}, accelerator="cpu")
    return final


@pytest.fixture(scope="module")
def lora_run(root, pretrained):
    final = llmtrain.finetune_lora(pretrained, out_dir=root / "lora", data=BuiltinInstruct(num_train=64, num_val=8),
                                   train={**SHORT, "max_steps": 2, "save_interval": 2, "max_seq_length": 128},
                                   eval={"interval": 100, "max_iters": 1}, accelerator="cpu", precision="32-true")
    return final


def test_pretrain_returns_its_final_model_directory(root, pretrained):
    assert pretrained == root / "pretrain" / layout.FINAL_DIR
    assert layout.is_complete(pretrained) and (pretrained / layout.MODEL_FILE).is_file()
    assert (root / "pretrain" / "metrics.csv").read_text().count("\n") >= 2  # two steps logged


def test_a_lora_step_a_final_and_its_transformers_folder_answer_alike(root, lora_run):
    assert lora_run == root / "lora" / layout.FINAL_DIR
    step = root / "lora" / "step-00000002"
    assert (step / layout.LORA_FILE).is_file() and not (step / layout.MODEL_FILE).is_file()
    hf_dir = llmtrain.convert_to_hf(lora_run, root / "lora-hf")
    assert hf_dir == root / "lora-hf" and (hf_dir / "config.json").is_file()
    answers = [LLM.load(path, accelerator="cpu", precision="32-true").generate(PROMPT, 16, temperature=0)
               for path in (lora_run, step, hf_dir)]
    assert answers[0] and answers == [answers[0]] * 3, answers


def test_a_misspelt_argument_raises_the_command_lines_suggestion(root):
    with pytest.raises(CommandLineError, match="did you mean --out_dir"):
        llmtrain.pretrain(model_config=write_tiny_model(root / "tiny-typo.yaml"), out_dri=root / "typo")
    with pytest.raises(CommandLineError, match="train.max_stepz"):
        llmtrain.pretrain(model_config=root / "tiny-typo.yaml", train={"max_stepz": 2})
    with pytest.raises(TypeError, match="at most 4 positional arguments"):
        llmtrain.convert_to_hf("a", "b", "float32", "5GB", "extra")
    assert not (root / "typo").exists()


def test_a_dry_run_plans_and_returns_nothing(root, capsys):
    assert llmtrain.pretrain(model_config=write_tiny_model(root / "tiny-dry.yaml"), out_dir=root / "dry",
                             dry_run=True, devices=1, accelerator="cpu") is None
    assert "dry run of `llmtrain pretrain`" in capsys.readouterr().out and not (root / "dry").exists()
