"""--float8: when it is refused, and torchao's conversion of a GPT on this CPU (its float8 products emulated)."""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.distributed.parallelize import parallelize
from llmtrain.args import TrainArgs
from llmtrain.float8 import convert_to_float8, float8_problem
from llmtrain.model import GPT



@pytest.mark.parametrize("kwargs, words", [
    (dict(device_type="cpu", precision="bf16-mixed"), ["float8 tensor cores", "cpu"]),
    (dict(device_type="cuda", precision="bf16-mixed", capability=(8, 0)), ["compute capability 8.0", "has none"]),
    (dict(device_type="cuda", precision="bf16-true", gpu="A100"), ["the A100", "has none"]),
    (dict(device_type="cuda", precision="bf16-true", gpu="NVIDIA A10G"), None),  # not in the table: not refused
    (dict(device_type="cuda", precision="32-true", capability=(9, 0)), ["--precision bf16-mixed or bf16-true"]),
    (dict(device_type="cuda", precision="bf16-mixed", capability=(9, 0)), None),
    (dict(device_type="cuda", precision="bf16-true", gpu="H100"), None),
    (dict(device_type="cuda", precision="bf16-true", capability=(8, 9)), None),  # Ada: L4, L40S, RTX 4090
])
def test_float8_is_refused_where_there_are_no_float8_tensor_cores(kwargs, words):
    problem = float8_problem("rowwise", **kwargs)
    if words is None:
        assert problem is None
    else:
        assert problem is not None and all(word in problem for word in words), problem


def _model() -> GPT:
    torch.manual_seed(0)
    model = GPT(Config.from_name("llama-debug", n_layer=2, n_embd=64, intermediate_size=128, vocab_size=512))
    model.init_weights()
    return model.to(torch.bfloat16)


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1]).float()
    return nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_conversion_swaps_the_block_linears_and_trains_close_to_bf16(recipe):
    reference = _model()
    model = copy.deepcopy(reference)
    converted = convert_to_float8(model, recipe, emulate=True)
    names = {name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"}
    assert converted == len(names) == 2 * 7  # q, k, v, o, gate, up, down in each block
    assert type(model.lm_head) is nn.Linear  # the head stays in bf16
    idx = torch.randint(0, model.config.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = _loss(model, idx).item(), _loss(reference, idx).item()
    assert ours == pytest.approx(theirs, rel=0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):  # the same batch: float8's gradients must reach every weight and lower its loss
        loss = _loss(model, idx)
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


def test_the_plan_s_float8_reaches_parallelize():
    plan = ParallelPlan.resolve(devices=1, num_nodes=1, train=TrainArgs(global_batch_size=2, micro_batch_size=2),
                                precision="bf16-true", accelerator="cpu")
    model = parallelize(_model(), dataclasses.replace(plan, float8="rowwise"), device=torch.device("cpu"))
    assert sum(type(m).__name__ == "Float8Linear" for m in model.modules()) == 14
    untouched = parallelize(_model(), plan, device=torch.device("cpu"))
    assert not any(type(m).__name__ == "Float8Linear" for m in untouched.modules())


def test_the_dry_run_plans_float8_for_an_h100(capsys, tmp_path):
    from llmtrain.cli import main

    main(["pretrain", "llama-debug", "--dry_run", "--dry_run.gpu", "H100", "--precision", "bf16-mixed", "--float8",
          "tensorwise", "--devices", "8", "--out_dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "precision    bf16-mixed" in out and "float8 tensorwise products in the blocks" in out


def test_an_moe_keeps_its_router_and_experts_out_of_float8():
    config = Config.from_name("moe-debug", n_layer=1, n_embd=64, intermediate_size=64, moe_intermediate_size=32,
                              n_expert=16, vocab_size=512)  # 16 experts: the router's width would qualify
    model = GPT(config)
    assert convert_to_float8(model, "rowwise", emulate=True) == 4  # q, k, v, o
    assert type(model.blocks[0].mlp.router) is nn.Linear
