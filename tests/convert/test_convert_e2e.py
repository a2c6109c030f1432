"""From training to transformers and back: checkpoints of real runs open in transformers unchanged."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmtrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
# A 2 MB sample of the recipe's corpus: a two-step run needs no more, and it tokenizes in seconds.
DEBUG = ["--config", str(ROOT / "config_hub/pretrain/debug.yaml"), "--train.max_steps", "2",
         "--train.max_seq_length", "64", "--eval.max_iters", "1", "--train.save_interval", "2",
         "--data.max_bytes", "2000000"]


@pytest.fixture(autouse=True)
def shared_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "shared-cache"))


def greedy_llmtrain(checkpoint_dir, prompt_ids, new_tokens):
    from llmtrain.generate import generate, load_model_dir

    model, *_ = load_model_dir(checkpoint_dir, device="cpu", dtype=torch.float32)
    out = generate(model, torch.tensor(prompt_ids), new_tokens, temperature=0.0, eos_id=None)
    return out[len(prompt_ids):].tolist()


def greedy_transformers(hf_dir, prompt_ids, new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate exactly new_tokens, as llmtrain does here
    model.generation_config.pad_token_id = 0
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.slow
def test_debug_run_converts_and_transformers_generates_the_same_tokens(tmp_path):
    from transformers import AutoTokenizer

    out_dir = tmp_path / "debug"
    main(["pretrain", *DEBUG, "--out_dir", str(out_dir)])
    hf_dir = tmp_path / "hf"
    main(["convert", "to_hf", str(out_dir / "final"), str(hf_dir)])
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (hf_dir / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompt_ids = tokenizer("import os\n\ndef main(argv):\n    ")["input_ids"]
    assert greedy_transformers(hf_dir, prompt_ids, 16) == greedy_llmtrain(out_dir / "final", prompt_ids, 16)

    # And back: an HF folder is a valid starting point for fine-tuning, converted on the fly.
    main(["finetune_lora", str(hf_dir), "--out_dir", str(tmp_path / "lora"), "--data", "BuiltinInstruct",
          "--data.num_train", "40", "--data.num_val", "4", "--train.max_steps", "1", "--train.global_batch_size", "2",
          "--train.micro_batch_size", "2", "--train.max_seq_length", "128", "--eval.max_iters", "1"])
    assert (tmp_path / "lora" / "final" / "model.safetensors").is_file()
    main(["pretrain", "--initial_checkpoint_dir", str(hf_dir), "--out_dir", str(tmp_path / "continued"),
          "--data", "PythonStdlib", "--data.max_bytes", "2000000", "--train.max_steps", "1",
          "--train.max_seq_length", "64", "--train.global_batch_size", "8", "--train.micro_batch_size", "8",
          "--eval.max_iters", "1", "--train.lr_warmup_steps", "0"])
    # It started from the converted weights: its first validation equals the original run's last.
    import csv

    def val_losses(run):
        with open(run / "metrics.csv") as handle:
            return [float(r["val_loss"]) for r in csv.DictReader(handle) if r["val_loss"]]

    assert val_losses(tmp_path / "continued")[0] == pytest.approx(val_losses(out_dir)[-1], rel=1e-5)


def test_sharded_checkpoint_converts_without_its_world_size(tmp_path, dist_env, tmp_path_factory):
    out_dir = tmp_path / "sharded"
    env = dict(dist_env, LLMTRAIN_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "shared-cache"))
    result = subprocess.run([sys.executable, "-m", "llmtrain", "pretrain", *DEBUG, "--out_dir", str(out_dir),
                             "--devices", "2", "--fsdp.state_dict_type", "sharded"],
                            env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    step = out_dir / "step-00000002"
    assert (step / "dcp").is_dir() and not (step / "model.safetensors").exists()
    from_sharded, from_final = tmp_path / "hf-sharded", tmp_path / "hf-final"
    main(["convert", "to_hf", str(step), str(from_sharded)])  # gathered in this single process
    main(["convert", "to_hf", str(out_dir / "final"), str(from_final)])
    a, b = load_file(str(from_sharded / "model.safetensors")), load_file(str(from_final / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
