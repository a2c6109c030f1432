"""Fine-tuning a mixture of experts: finetune_lora with adapters on the attention and on every routed expert, QLoRA
with the experts quantized, finetune_full, and merge_lora, through the CLI; the expert adapters and quantized
experts against their definitions on a model in memory."""

import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmtrain.cli import main
from llmtrain.config import Config
from llmtrain.lora import LoRAArgs, LoRAExperts, apply_lora, load_lora_state_dict, mark_only_lora_trainable, \
    merge_lora
from llmtrain.model import GPT
from llmtrain.model_dir import build_model_from_dir, load_model_dir

from conftest import TINY_MODEL
from runs import finetune_args, losses, shared_cache  # noqa: F401 (the module's runs share one token cache)

# 4 experts, top-2, expert width 128 (not n_embd: the adapters' shapes tell gate/up from down); widths are whole
# 64-value blocks, which bitsandbytes' 4-bit CPU path needs.
MOE = dict(TINY_MODEL, name="tiny-moe", block_size=128, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm",
           bias=False, n_expert=4, n_expert_per_token=2, moe_intermediate_size=128, router_aux_loss_coef=0.01)
LORA = ("--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--lora_mlp", "true")
SCALE = 8 / 4
EXPERTS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """A tiny mixture of experts, pretrained for 2 steps: a model directory with a tokenizer."""
    os.environ["LLMTRAIN_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / "shared-cache")  # runs.shared_cache's
    root = tmp_path_factory.mktemp("moe-base")
    (root / "moe.yaml").write_text(yaml.safe_dump(MOE))
    main(["pretrain", "--model_config", str(root / "moe.yaml"), "--out_dir", str(root / "run"), "--data",
          "BuiltinStories", "--data.num_documents", "200", "--data.num_val_documents", "20",
          "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.max_seq_length", "64",
          "--train.max_steps", "2", "--eval.max_iters", "1"])
    return root / "run" / "final"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base_model):
    out_dir = tmp_path_factory.mktemp("moe-lora") / "lora"
    main(finetune_args("finetune_lora", base_model, out_dir, "--train.max_steps", "4", *LORA))
    return out_dir


def test_lora_adapts_every_expert_and_final_is_the_merge(lora_run, base_model, tmp_path):
    run_losses = losses(lora_run)
    assert run_losses[4] < run_losses[1]
    step = lora_run / "step-00000004"
    adapters = load_file(str(step / "lora.safetensors"))
    assert not (step / "model.safetensors").exists()  # a LoRA step checkpoint holds the adapters alone
    assert all(name.endswith((".lora_A", ".lora_B")) for name in adapters)
    assert not any(".router." in name for name in adapters)  # the router stays frozen
    prefix = "blocks.1.mlp.experts"
    E, D, I = 4, MOE["n_embd"], MOE["moe_intermediate_size"]  # noqa: N806
    assert tuple(adapters[f"{prefix}.gate_proj.lora_A"].shape) == (E, 4, D)
    assert tuple(adapters[f"{prefix}.up_proj.lora_B"].shape) == (E, I, 4)
    assert tuple(adapters[f"{prefix}.down_proj.lora_A"].shape) == (E, 4, I)
    assert tuple(adapters[f"{prefix}.down_proj.lora_B"].shape) == (E, D, 4)
    base = load_file(str(base_model / "model.safetensors"))
    final = load_file(str(lora_run / "final" / "model.safetensors"))
    assert sorted(final) == sorted(base)
    for name, weight in base.items():
        module, _, leaf = name.rpartition(".")
        key = f"{module}.{leaf}" if leaf in EXPERTS else module  # experts: the adapter sits on the 3-D weight itself
        if f"{key}.lora_A" in adapters:  # each expert's W_e + B_e A_e * scale
            delta = torch.bmm(adapters[f"{key}.lora_B"], adapters[f"{key}.lora_A"]) if weight.dim() == 3 else \
                adapters[f"{key}.lora_B"] @ adapters[f"{key}.lora_A"]
            torch.testing.assert_close(final[name], weight + delta * SCALE, rtol=1e-5, atol=1e-6)
            assert not torch.equal(final[name], weight), name
        else:  # the router, norms, embeddings: bit-identical
            assert torch.equal(final[name], weight), name
    main(["merge_lora", str(step), "--out_dir", str(tmp_path / "merged")])
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert all(torch.equal(merged[name], final[name]) for name in final)


def test_the_merged_model_gives_the_adapted_models_logits(lora_run, base_model):
    """The step checkpoint's adapters reload onto the base, and that model's logits (fp32) are final/'s; generate
    opens the step checkpoint as that merged model."""
    config = Config.from_file(base_model / "model_config.yaml")
    adapted = build_model_from_dir(base_model, config)
    apply_lora(adapted, LoRAArgs(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_mlp=True))
    load_lora_state_dict(adapted, load_file(str(lora_run / "step-00000004" / "lora.safetensors")))
    merged, *_ = load_model_dir(lora_run / "final")
    base, *_ = load_model_dir(base_model)
    tokens = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = adapted.eval()(tokens)
        torch.testing.assert_close(merged(tokens), expected, rtol=1e-5, atol=1e-5)
        assert (base(tokens) - expected).abs().max() > 1e-2  # the adapters changed the model
    step, *_ = load_model_dir(lora_run / "step-00000004")  # merged in memory
    assert all(torch.equal(tensor, merged.state_dict()[name]) for name, tensor in step.state_dict().items())
    main(["generate", str(lora_run / "step-00000004"), "--prompt", "Hi", "--max_new_tokens", "2"])


@pytest.mark.multiproc
def test_fsdp_trains_the_expert_adapters_as_one_process_does(lora_run, base_model, dist_env, tmp_path):
    """FSDP shards the 3-D adapters with their experts; its step checkpoint holds the adapters alone (not the
    gathered expert_bias buffers), merges, and its final/ is one process's."""
    out_dir = tmp_path / "two"
    command = [sys.executable, "-m", "llmtrain",
               *finetune_args("finetune_lora", base_model, out_dir, "--train.max_steps", "4", *LORA, "--devices", "2")]
    result = subprocess.run(command, env=dict(dist_env, LLMTRAIN_CACHE_DIR=os.environ["LLMTRAIN_CACHE_DIR"]),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "fsdp, FULL_SHARD" in result.stdout
    assert losses(out_dir) == pytest.approx(losses(lora_run), rel=1e-3)
    one = load_file(str(lora_run / "step-00000004" / "lora.safetensors"))
    assert sorted(load_file(str(out_dir / "step-00000004" / "lora.safetensors"))) == sorted(one)
    main(["merge_lora", str(out_dir / "step-00000004"), "--out_dir", str(tmp_path / "merged")])
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    final = load_file(str(out_dir / "final" / "model.safetensors"))
    expected = load_file(str(lora_run / "final" / "model.safetensors"))
    base = load_file(str(base_model / "model.safetensors"))
    for name, tensor in expected.items():
        assert torch.equal(merged[name], final[name]), name
        # The same update as one process's: a summation order flips a rare near-tied top-k choice, and Adam at lr 0.01
        # moves the adapters of the experts it reached differently, so the update is compared as a whole.
        update, expected_update = final[name] - base[name], tensor - base[name]
        assert (update - expected_update).norm() <= 0.05 * expected_update.norm(), name


def _tiny_moe(**overrides) -> GPT:
    config = Config(**{**MOE, "n_layer": 1, "n_shared_expert": 1, "vocab_size": 128, **overrides})
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    return model


def _perturb_adapters_and_backward(model: GPT, tokens: torch.Tensor) -> None:
    mark_only_lora_trainable(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0, 0.05)
    model(tokens).float().square().mean().backward()


def test_expert_adapters_start_as_the_base_and_train_alone():
    model = _tiny_moe()
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(tokens)
    names = apply_lora(model, LoRAArgs(lora_dropout=0.0, lora_mlp=True, lora_query=False, lora_value=False))
    assert names == ["blocks.0.mlp.experts", "blocks.0.mlp.shared_experts.gate_proj",
                     "blocks.0.mlp.shared_experts.up_proj", "blocks.0.mlp.shared_experts.down_proj"]
    assert isinstance(model.blocks[0].mlp.experts, LoRAExperts)
    with torch.no_grad():
        assert torch.equal(model(tokens), before)  # B = 0: a fresh adapter changes nothing
    _perturb_adapters_and_backward(model, tokens)
    for name, param in model.named_parameters():
        assert (param.grad is not None) == name.endswith(("lora_A", "lora_B")), name
        if param.grad is not None:
            assert param.grad.abs().sum() > 0, name  # every expert and projection got tokens and a gradient


def test_qlora_quantizes_each_expert_and_merges_to_the_adapted_logits(base_model):
    """QLoRA's base as finetune_lora builds it (read a block at a time, quantized as read), then adapters on the
    quantized experts; each merge (dequantizing alone, then folding the adapters) gives the model's own logits."""
    from llmtrain.checkpoint.lora import merged_state_dict
    from llmtrain.model_dir import build_quantized_model_from_dir
    from llmtrain.quantize import QuantizedExperts

    config = Config.from_file(base_model / "model_config.yaml")
    plain = load_file(str(base_model / "model.safetensors"))
    model = build_quantized_model_from_dir(base_model, config, "bnb.nf4", compute_dtype=torch.float32)
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full_precision = build_model_from_dir(base_model, config)(tokens)
        quantized = model(tokens)
    moe = model.blocks[1].mlp
    assert isinstance(moe.experts, QuantizedExperts) and type(moe.router) is torch.nn.Linear
    assert torch.equal(moe.router.weight, plain["blocks.1.mlp.router.weight"])  # the router is not quantized
    for name in EXPERTS:  # every expert's slice, 4-bit: close to its weight, not equal
        original = plain[f"blocks.1.mlp.experts.{name}"]
        error = (moe.experts.dequantized_weight(name) - original).norm(dim=(1, 2)) / original.norm(dim=(1, 2))
        assert ((error > 0) & (error < 0.15)).all(), (name, error)
    # the 4-bit model computes about the same function (measured 0.25; unrelated logits are about 1.4 apart)
    assert (quantized - full_precision).norm() < 0.5 * full_precision.norm()
    dequantized = merged_state_dict(model)  # QLoRA's final/ of a run without expert adapters
    assert sorted(dequantized) == sorted(plain)
    assert torch.equal(dequantized["blocks.1.mlp.experts.down_proj"], moe.experts.dequantized_weight("down_proj"))
    apply_lora(model, LoRAArgs(lora_dropout=0.0, lora_mlp=True))
    _perturb_adapters_and_backward(model, tokens)
    assert all((param.grad is not None) == name.endswith(("lora_A", "lora_B"))
               for name, param in model.named_parameters())
    with torch.no_grad():
        adapted = model(tokens)
        merged = merged_state_dict(model)
        merge_lora(model)
        assert type(model.blocks[1].mlp.experts).__name__ == "GroupedExperts"
        assert all(torch.equal(tensor, merged[name]) for name, tensor in model.state_dict().items())
        torch.testing.assert_close(model(tokens), adapted, rtol=1e-5, atol=1e-5)


def test_finetune_full_trains_every_expert(base_model, tmp_path):
    out_dir = tmp_path / "full"
    main(finetune_args("finetune_full", base_model, out_dir, "--train.max_steps", "4"))
    run_losses = losses(out_dir)
    assert run_losses[4] < run_losses[1]
    model, config, *_ = load_model_dir(out_dir / "final")
    assert config.is_moe
    base = load_file(str(base_model / "model.safetensors"))
    tuned = model.state_dict()
    for name in ("blocks.0.mlp.router.weight", *(f"blocks.1.mlp.experts.{p}" for p in EXPERTS)):
        assert not torch.equal(tuned[name], base[name]), name


def test_a_frozen_routers_expert_bias_stays():
    """LoRA freezes the router, and its checkpoints hold no expert_bias: the auxiliary-loss-free update leaves it."""
    from llmtrain.moe import moe_stats, update_expert_bias

    model = _tiny_moe(router_bias_update_rate=0.01)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    model.train()
    model(tokens)
    stats = moe_stats(model)
    update_expert_bias(model, 0.01, stats)
    moved = model.blocks[0].mlp.expert_bias.clone()
    assert moved.abs().sum() > 0  # a trainable router's bias moves
    apply_lora(model, LoRAArgs())
    mark_only_lora_trainable(model)
    update_expert_bias(model, 0.01, stats)
    assert torch.equal(model.blocks[0].mlp.expert_bias, moved)


def test_expert_adapters_in_grouped_gemms_equal_one_product_per_expert():
    """The path a recent GPU takes in bfloat16 (forced here on the CPU in float32) against one expert at a time."""
    from llmtrain.moe import GroupedExperts

    torch.manual_seed(0)
    base = GroupedExperts(4, 32, 24)
    base.init_weights(0.1, 0.1)
    experts = LoRAExperts(base.requires_grad_(False), r=4, alpha=8)
    with torch.no_grad():
        for name in EXPERTS:
            getattr(experts, name).lora_B.normal_(0, 0.1)
    counts = torch.tensor([5, 0, 7, 4])  # an expert with no rows
    rows = torch.randn(int(counts.sum()), 32)
    outputs, grads = [], []
    for grouped in (False, True):
        base.grouped = grouped
        experts.zero_grad()
        out = experts(rows, counts)
        out.square().sum().backward()
        outputs.append(out.detach())
        grads.append({name: param.grad.clone() for name, param in experts.named_parameters() if param.requires_grad})
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-5)
