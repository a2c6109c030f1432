"""finetune_full, finetune_lora (LoRA and QLoRA) and merge_lora end to end through the CLI."""

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from llmtrain.cli import main

from conftest import write_tiny_model
from runs import finetune_args, losses

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ft-cache")


@pytest.fixture(autouse=True)
def shared_cache(cache_dir, monkeypatch):
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(cache_dir))


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, cache_dir):
    """A tiny pretrained model directory (weights, config, tokenizer) to fine-tune."""
    import os

    os.environ["LLMTRAIN_CACHE_DIR"] = str(cache_dir)
    root = tmp_path_factory.mktemp("base")
    model_file = write_tiny_model(root / "tiny.yaml", block_size=128)
    main(["pretrain", "--model_config", str(model_file), "--out_dir", str(root / "run"), "--data", "BuiltinStories",
          "--data.num_documents", "300", "--data.num_val_documents", "20", "--train.global_batch_size", "4",
          "--train.micro_batch_size", "2", "--train.max_seq_length", "64", "--train.max_steps", "3",
          "--eval.max_iters", "1"])
    return root / "run" / "final"


def simulate_crash_after(out_dir, step, target):
    """A run that died after its step checkpoint: only that checkpoint survives in a fresh out_dir."""
    target.mkdir()
    name = f"step-{step:08d}"
    shutil.copytree(out_dir / name, target / name)


@pytest.mark.parametrize("recipe", sorted((ROOT / "config_hub/finetune/debug").glob("*.yaml")), ids=lambda p: p.stem)
def test_debug_recipe_runs_on_a_pretrained_model(tmp_path, base_model, recipe):
    """The README's debug fine-tuning recipes, as written but for two steps and the tiny base in place of the
    debug pretraining's output."""
    command = "finetune_full" if recipe.stem == "full" else "finetune_lora"
    out_dir = tmp_path / recipe.stem
    main([command, "--config", str(recipe), str(base_model), "--out_dir", str(out_dir), "--train.max_steps", "2",
          "--data.num_train", "64", "--eval.max_iters", "1", "--train.log_interval", "1"])
    assert sorted(losses(out_dir)) == [1, 2]
    assert (out_dir / "final" / "model.safetensors").is_file()
    written = yaml.safe_load((out_dir / "final" / "hyperparameters.yaml").read_text())
    assert written["checkpoint_dir"] == str(base_model) and written.get("quantize") == (
        "bnb.nf4" if recipe.stem == "qlora" else None)


def test_lora_trains_only_adapters_and_final_is_the_merge(tmp_path, base_model):
    out_dir = tmp_path / "lora"
    main(finetune_args("finetune_lora", base_model, out_dir, "--train.max_steps", "4", "--lora_r", "4",
                       "--lora_alpha", "8", "--lora_mlp", "true"))
    step = load_file(str(out_dir / "step-00000004" / "lora.safetensors"))
    assert step and all(k.endswith(("lora_A", "lora_B")) for k in step)  # checkpoints hold only adapters
    assert not (out_dir / "step-00000004" / "model.safetensors").exists()
    base = load_file(str(base_model / "model.safetensors"))
    merged = load_file(str(out_dir / "final" / "model.safetensors"))
    assert set(merged) == set(base)
    changed = set()
    for name, weight in base.items():
        prefix = name.rsplit(".", 1)[0]
        if f"{prefix}.lora_A" in step and name.endswith(".weight"):
            delta = step[f"{prefix}.lora_B"] @ step[f"{prefix}.lora_A"] * (8 / 4)
            torch.testing.assert_close(merged[name], weight + delta, rtol=1e-5, atol=1e-6)
            changed.add(name)
        else:  # every weight without an adapter is bit-identical to the base model's
            assert torch.equal(merged[name], weight), name
    assert any(".mlp." in n for n in changed) and any("q_proj" in n for n in changed)
    # merge_lora on the same checkpoint gives the same model as final/.
    main(["merge_lora", str(out_dir / "step-00000004"), "--out_dir", str(tmp_path / "merged")])
    again = load_file(str(tmp_path / "merged" / "model.safetensors"))
    for name in merged:
        torch.testing.assert_close(again[name], merged[name], rtol=0, atol=0)
    assert (tmp_path / "merged" / "prompt_style.yaml").is_file()


def test_merge_lora_of_a_bf16_run_is_its_final(tmp_path, base_model):
    """Under --precision bf16-true the adapters trained against the base in bf16, and final/ merged them into that;
    merge_lora merged the same step into the base in fp32, a model twice the size with other weights."""
    out_dir = tmp_path / "lora"
    main(finetune_args("finetune_lora", base_model, out_dir, "--train.max_steps", "2", "--precision", "bf16-true"))
    main(["merge_lora", str(out_dir / "step-00000002"), "--out_dir", str(tmp_path / "merged")])
    final = load_file(str(out_dir / "final" / "model.safetensors"))
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert {tensor.dtype for tensor in final.values()} == {torch.bfloat16}
    assert sorted(merged) == sorted(final)
    for name in final:
        assert merged[name].dtype == torch.bfloat16 and torch.equal(merged[name], final[name]), name


@pytest.mark.parametrize("recipe", ["finetune_full", "finetune_lora"])
def test_resume_continues_the_loss_curve_exactly(tmp_path, base_model, recipe):
    full = tmp_path / "full"
    main(finetune_args(recipe, base_model, full, "--train.max_steps", "8", "--train.save_interval", "4"))
    crashed = tmp_path / "crashed"
    simulate_crash_after(full, 4, crashed)
    main(finetune_args(recipe, base_model, crashed, "--train.max_steps", "8", "--train.save_interval", "4",
                       "--resume", "auto"))
    expected, resumed = losses(full), losses(crashed)
    assert [resumed[s] for s in range(5, 9)] == [expected[s] for s in range(5, 9)]


def test_full_finetune_on_user_json(tmp_path, base_model):
    records = [{"instruction": f"Add {i} and {i + 1}.", "input": "", "output": str(2 * i + 1)} for i in range(40)]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    out_dir = tmp_path / "json"
    main(["finetune_full", str(base_model), "--out_dir", str(out_dir), "--data", "JSON",
          "--data.json_path", str(path), "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
          "--train.max_seq_length", "128", "--train.max_steps", "3", "--eval.max_iters", "2",
          "--prompt_style", "chatml"])
    style = yaml.safe_load((out_dir / "final" / "prompt_style.yaml").read_text())
    assert "chatml" in json.dumps(style)
    assert len(losses(out_dir)) == 3


def test_a_checkpoints_chat_template_is_the_style_it_is_tuned_and_saved_in(tmp_path, base_model):
    base = tmp_path / "base"
    shutil.copytree(base_model, base)
    template = ("{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (base / "chat_template.jinja").write_text(template)
    out_dir = tmp_path / "out"
    main(finetune_args("finetune_full", base, out_dir, "--train.max_steps", "1"))
    style = yaml.safe_load((out_dir / "final" / "prompt_style.yaml").read_text())
    assert (style["name"], style["template"]) == ("chat_template", template)
    assert (out_dir / "final" / "chat_template.jinja").read_text() == template


def test_no_validation_set_trains_without_validating(tmp_path, base_model):
    """--data.num_val 0 is "no validation": the run trains, writes final/ and logs no validation loss."""
    out_dir = tmp_path / "no-val"
    main(finetune_args("finetune_lora", base_model, out_dir, "--train.max_steps", "2", "--data.num_val", "0"))
    assert sorted(losses(out_dir)) == [1, 2] and (out_dir / "final" / "model.safetensors").is_file()
    with open(out_dir / "metrics.csv") as handle:
        assert not any(row.get("val_loss") for row in csv.DictReader(handle))


def test_an_explicit_max_steps_is_not_capped_by_the_epoch_default(tmp_path, base_model, capsys):
    """12 samples in batches of 4 are 3 steps an epoch. --train.max_steps 5 runs 5 steps (fine-tuning's one epoch is
    a default for a run whose flags give no length), so the step-4 checkpoint a tutorial names exists, and the start
    says how long the run is (given together with --train.epochs, the first limit ends it: test_schedule.py)."""
    out_dir = tmp_path / "steps"
    main(finetune_args("finetune_lora", base_model, out_dir, "--data.num_train", "12", "--train.save_interval", "4",
                       "--train.max_steps", "5"))
    assert sorted(losses(out_dir)) == [1, 2, 3, 4, 5]
    assert "training 5 steps = 1.67 epochs of 12 samples (--train.max_steps 5)" in capsys.readouterr().out
    main(["merge_lora", str(out_dir / "step-00000004"), "--out_dir", str(tmp_path / "merged")])
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    # A step the run never reached: merge_lora says the folder is missing, and which checkpoints the run wrote.
    with pytest.raises(FileNotFoundError, match=r"step-00000008 does not exist; .*steps holds final, step-00000004, "
                                                r"step-00000005$"):
        main(["merge_lora", str(out_dir / "step-00000008")])


@pytest.mark.parametrize("quantize", ["bnb.nf4", "bnb.int8-training"])
def test_qlora_on_one_device_and_merge_dequantizes(tmp_path, base_model, quantize):
    out_dir = tmp_path / "qlora"
    main(finetune_args("finetune_lora", base_model, out_dir, "--train.max_steps", "3", "--quantize", quantize,
                       "--precision", "bf16-true"))
    assert all(l == l for l in losses(out_dir).values())
    merged = load_file(str(out_dir / "final" / "model.safetensors"))
    base = load_file(str(base_model / "model.safetensors"))
    assert set(merged) == set(base)  # plain keys: no quantization state, no adapters
    # Each step's adapters file holds the adapters alone, in the compute dtype, and merges as final/ did.
    (step,) = sorted(out_dir.glob("step-*"))[-1:]
    adapters = load_file(str(step / "lora.safetensors"))
    assert adapters and all(name.endswith((".lora_A", ".lora_B")) for name in adapters), sorted(adapters)[:4]
    assert {tensor.dtype for tensor in adapters.values()} == {torch.bfloat16}
    main(["merge_lora", str(step), "--out_dir", str(tmp_path / "merged")])
    again = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert all(torch.equal(again[name], merged[name]) for name in merged)
    # Earlier QLoRA checkpoints also held bitsandbytes' quantization state, listed first: they merge the same.
    save_file({"blocks.0.attn.k_proj.weight.absmax": torch.ones(4), **adapters}, str(step / "lora.safetensors"))
    main(["merge_lora", str(step), "--out_dir", str(tmp_path / "merged-old")])
    old = load_file(str(tmp_path / "merged-old" / "model.safetensors"))
    assert all(torch.equal(old[name], merged[name]) for name in merged)
    # A layer without adapters was quantized and dequantized: close to, but not exactly, the base weight.
    name = "blocks.0.attn.k_proj.weight"
    error = (merged[name].float() - base[name]).norm() / base[name].norm()
    assert 0 < error < 0.2


@pytest.mark.parametrize("extra, message", [
    (["--quantize", "bnb.nf4", "--devices", "2"], "runs on one device"),
    (["--quantize", "bnb.nf4", "--precision", "bf16-mixed"], "bf16-true"),
    (["--fsdp.state_dict_type", "sharded"], "always full"),
    (["--train.max_tokens", "2048"], "--train.max_tokens counts the tokens of full-width batches"),
    (["--prompt_style", "chatml", "--data.prompt_style", "alpaca"], "--prompt_style chatml and --data.prompt_style alpaca"),
])
def test_lora_contradictions_fail_before_work(tmp_path, base_model, extra, message):
    with pytest.raises(ValueError, match=message):
        main(finetune_args("finetune_lora", base_model, tmp_path / "o", "--train.max_steps", "1", *extra))


def test_checkpoint_dir_must_be_a_model_dir(tmp_path, base_model):
    with pytest.raises(FileNotFoundError, match="is neither a llmtrain model directory .*nor a transformers folder"):
        main(finetune_args("finetune_full", tmp_path, tmp_path / "o", "--train.max_steps", "1"))


def test_fsdp_lora_on_two_processes_matches_one(tmp_path, base_model, dist_env, cache_dir):
    env = dict(dist_env, LLMTRAIN_CACHE_DIR=str(cache_dir))

    def run(out_dir, *extra):
        command = [sys.executable, "-m", "llmtrain", *finetune_args("finetune_lora", base_model, out_dir,
                                                                    "--train.max_steps", "4", *extra)]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result.stdout

    # --lora_head: FSDP shards the adapted head, which has no weight of its own (it crashed in apply_fsdp).
    run(tmp_path / "one", "--lora_dropout", "0", "--lora_head", "true")
    stdout = run(tmp_path / "two", "--devices", "2", "--lora_dropout", "0", "--lora_head", "true")
    assert "fsdp, FULL_SHARD" in stdout
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    for file in ("lora.safetensors", "model.safetensors"):  # the adapters, and the merged model
        one = load_file(str(tmp_path / "one" / "final" / file))
        two = load_file(str(tmp_path / "two" / "final" / file))
        assert sorted(two) == sorted(one)
        assert file == "model.safetensors" or "lm_head.lora_B" in two
        for name in one:
            torch.testing.assert_close(two[name], one[name], rtol=1e-3, atol=1e-5)


@pytest.mark.slow
def test_lora_tuned_model_answers_more_builtin_items_than_its_base(tmp_path):
    """Measured, not assumed: greedy answers on held-out items of the built-in set, checked exactly.

    A small model pretrained for 60 steps answers none; after 150 LoRA steps it answers some. (The
    numbers for the 300-step debug model are in the issue notes: 0/100 before, 6/100 after.)
    """
    from llmtrain.evaluate import builtin_instruct_accuracy

    tasks = ["count_letters", "first_letter", "larger"]
    model_file = write_tiny_model(tmp_path / "model.yaml", block_size=128, n_head=4, n_query_groups=2, n_embd=128,
                                  intermediate_size=256)
    main(["pretrain", "--model_config", str(model_file), "--out_dir", str(tmp_path / "base"), "--data",
          "BuiltinStories", "--data.num_documents", "2000", "--train.global_batch_size", "16",
          "--train.micro_batch_size", "16", "--train.max_seq_length", "128", "--train.max_steps", "60",
          "--train.lr_warmup_steps", "5", "--optimizer", "AdamW", "--optimizer.lr", "0.003", "--eval.max_iters", "2",
          "--train.log_interval", "60"])
    main(["finetune_lora", str(tmp_path / "base" / "final"), "--out_dir", str(tmp_path / "lora"), "--data",
          "BuiltinInstruct", "--data.tasks", json.dumps(tasks), "--data.num_train", "3000", "--data.num_val", "30",
          "--train.max_steps", "150", "--train.global_batch_size", "16", "--train.micro_batch_size", "16",
          "--train.max_seq_length", "128", "--train.lr_warmup_steps", "10", "--train.log_interval", "50",
          "--eval.interval", "150", "--eval.max_iters", "2", "--lora_r", "16", "--lora_alpha", "32",
          "--lora_mlp", "true", "--lora_projection", "true", "--lora_key", "true", "--lora_dropout", "0",
          "--optimizer", "AdamW", "--optimizer.lr", "0.003"])
    base = builtin_instruct_accuracy(tmp_path / "base" / "final", num_items=30, tasks=tasks)
    tuned = builtin_instruct_accuracy(tmp_path / "lora" / "final", num_items=30, tasks=tasks)
    assert tuned["correct"] >= base["correct"] + 2, (base, tuned)


def test_a_prompt_longer_than_the_sequence_skips_the_example_not_the_run(tmp_path, base_model, capsys, monkeypatch):
    from llmtrain.data.instruct import InstructDataModule

    # The training samples fit (a set in which none keeps a response token is an error of its own); the first
    # validation prompt does not.
    long_prompt = [{"role": "user", "content": "Tell me about llamas. " * 40}]
    monkeypatch.setattr(InstructDataModule, "validation_prompts", lambda self: [long_prompt])
    out_dir = tmp_path / "short"
    main(finetune_args("finetune_lora", base_model, out_dir, "--train.max_steps", "2", "--eval.interval", "1"))
    assert "example | skipped: the first validation prompt is longer than --train.max_seq_length 128" in capsys.readouterr().out
    assert (out_dir / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("devices, strategy, seq_len, expected", [
    (1, "auto", 1024, 64), (2, "ddp", 1024, 64), (2, "fsdp", 1024, 16), (1, "auto", 40, 20), (2, "fsdp", 24, 12),
])
def test_the_validation_example_decodes_fewer_tokens_under_fsdp(devices, strategy, seq_len, expected):
    from llmtrain.args import TrainArgs
    from llmtrain.distributed.parallel_plan import ParallelPlan
    from llmtrain.recipes.run import example_tokens

    plan = ParallelPlan.resolve(devices=devices, num_nodes=1, train=TrainArgs(global_batch_size=4, micro_batch_size=2),
                                precision="32-true", strategy=strategy, accelerator="cpu")
    assert plan.wrapper == {"auto": "none"}.get(strategy, strategy)
    assert example_tokens(plan, seq_len) == expected
