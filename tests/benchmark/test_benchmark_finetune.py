"""``llmtrain benchmark --recipe finetune_lora|finetune_full``: the fine-tuning step timed, with its own FLOPs."""

import json
import math

import pytest
from safetensors.torch import load_file

from llmtrain.benchmark.baseline import baseline_key
from llmtrain.benchmark.command import RECORD_FIELDS, benchmark
from llmtrain.benchmark.training import write_random_model_dir
from llmtrain.model_dir import check_model_dir
from llmtrain.cli import main
from llmtrain.config import Config
from llmtrain.data import BuiltinStories
from llmtrain.flops import flops_per_token, num_parameters
from llmtrain.lora import LoRAArgs
from llmtrain.plan.memory import lora_trainable_parameters

TINY = dict(model="llama-debug", micro_batch_size=1, seq_len=32, steps=2, warmup=1, baseline=None)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def small_peak(small_matmul_peak):
    """What these tests check of the MFU is that it is a positive number: the matmul peak is measured small."""


def run(tmp_path, **flags) -> dict:
    results = tmp_path / "results.jsonl"
    returned = benchmark(**TINY, out_dir=tmp_path / "bench", results=results, **flags)
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert record == json.loads(json.dumps(returned))
    assert set(record) == set(RECORD_FIELDS)
    assert [path.name for path in (tmp_path / "bench").iterdir()] == []  # base model and run are gone
    for key in ("tokens_per_sec", "step_time_median_s", "mfu", "flops_per_token"):
        assert math.isfinite(record[key]) and record[key] > 0, (key, record[key])
    assert record["tokens_per_sec"] == pytest.approx(32 / record["step_time_median_s"])
    return record


@pytest.mark.slow
def test_lora_times_the_adapters_with_their_flops_and_its_own_baseline_key(tmp_path):
    lora = LoRAArgs(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_mlp=True)
    record = run(tmp_path, recipe="finetune_lora", lora=lora)
    config = Config.from_name("llama-debug")
    adapters = lora_trainable_parameters(config, lora)
    assert record["recipe"] == "finetune_lora" and record["lora"]["lora_r"] == 4 and record["lora"]["lora_mlp"]
    assert record["trainable_parameters"] == adapters < num_parameters(config) / 10
    # A frozen weight costs 4 FLOPs per token, not 6: LoRA's step is cheaper than pretraining's.
    assert record["flops_per_token"] == flops_per_token(config, 32, adapter_parameters=adapters)
    assert record["flops_per_token"] < flops_per_token(config, 32)
    assert baseline_key(record).endswith("|finetune_lora|r 4, alpha 8, dropout 0 on query, value, mlp")


@pytest.mark.slow
def test_full_fine_tuning_trains_every_weight_and_keys_apart_from_pretraining(tmp_path):
    record = run(tmp_path, recipe="finetune_full")
    config = Config.from_name("llama-debug")
    assert record["recipe"] == "finetune_full" and record["lora"] is None
    assert record["trainable_parameters"] == num_parameters(config)
    assert record["flops_per_token"] == flops_per_token(config, 32)
    pretraining_key = baseline_key({**record, "recipe": "pretrain"})
    assert baseline_key(record) == pretraining_key + "|finetune_full"
    assert "|finetune" not in pretraining_key  # pretraining baselines keep their stored keys


def test_the_random_base_is_a_model_directory_seeded_and_initialised(tmp_path):
    tokenizer = BuiltinStories().default_tokenizer()
    first = load_file(write_random_model_dir(tmp_path / "a", "llama-debug", tokenizer) / "model.safetensors")
    again = load_file(write_random_model_dir(tmp_path / "b", "llama-debug", tokenizer) / "model.safetensors")
    other = load_file(write_random_model_dir(tmp_path / "c", "llama-debug", tokenizer, seed=1) / "model.safetensors")
    assert first.keys() == again.keys() and all(first[name].equal(again[name]) for name in first)
    weight = "blocks.0.attn.q_proj.weight"
    assert not first[weight].equal(other[weight]) and 0 < first[weight].std() < 0.1
    assert check_model_dir(tmp_path / "a")  # config, weights and tokenizer: what fine-tuning accepts


def test_lora_flags_without_the_lora_recipe_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"--lora\.\* flags set the adapters of --recipe finetune_lora, not of "
                                         r"--recipe finetune_full"):
        main(["benchmark", "--recipe", "finetune_full", "--lora.lora_r", "4", "--out_dir", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def test_quantize_without_the_lora_recipe_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"--quantize bnb\.nf4 quantizes the frozen base of --recipe finetune_lora"):
        main(["benchmark", "--quantize", "bnb.nf4", "--out_dir", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def test_qlora_times_the_adapters_over_a_quantized_base_and_keys_apart_from_lora(tmp_path):
    pytest.importorskip("bitsandbytes")
    lora = LoRAArgs(lora_dropout=0.0)
    record = run(tmp_path, recipe="finetune_lora", lora=lora, quantize="bnb.nf4", precision="bf16-true")
    assert record["quantize"] == "bnb.nf4" and record["precision"] == "bf16-true"
    config = Config.from_name("llama-debug")
    assert record["trainable_parameters"] == lora_trainable_parameters(config, lora)
    assert baseline_key(record) == baseline_key({**record, "quantize": None}) + "|bnb.nf4"
