"""``--fsdp.activation_checkpointing`` modes: full, selective:N (every Nth block) and op (keep matmul outputs).

Each mode must train exactly as no checkpointing does (recomputation repeats the same arithmetic), checkpoint
the blocks it names, and be known to the memory estimate and the dry run. The measured memory each mode saves
is test_estimate_vs_measured.py's estimate-against-peak test.
"""

from __future__ import annotations

import pytest
import torch

from llmtrain.args import FSDPArgs, TrainArgs, canonical_checkpointing
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.distributed.parallelize import apply_activation_checkpointing
from llmtrain.model import GPT
from llmtrain.plan.communication import tensor_parallel_passes
from llmtrain.plan.memory import activation_bytes_per_token, estimate_memory

MODES = [False, "full", "selective:2", "selective:3", "op"]


def tiny_model(n_layer: int = 4) -> GPT:
    config = Config.from_name("llama-debug", n_layer=n_layer, n_embd=64, n_head=4, n_query_groups=2,
                              intermediate_size=128, vocab_size=256, block_size=32)
    model = GPT(config)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        model.init_weights()
    return model


@pytest.mark.parametrize("value, canonical", [
    (False, False), ("false", False), ("none", False), (True, "full"), ("true", "full"), ("full", "full"),
    ("selective:1", "full"), ("selective:2", "selective:2"), ("Selective:04", "selective:4"), ("op", "op")])
def test_every_spelling_has_one_canonical_mode(value, canonical):
    assert canonical_checkpointing(value) == canonical
    assert FSDPArgs(activation_checkpointing=value).activation_checkpointing == canonical


@pytest.mark.parametrize("value", ["selective", "selective:0", "selective:-1", "selective:x", "ops", "2"])
def test_a_mode_that_does_not_exist_is_refused_naming_the_flag_and_the_modes(value):
    with pytest.raises(ValueError, match=r"--fsdp\.activation_checkpointing .* full .* selective:N .* op "):
        FSDPArgs(activation_checkpointing=value)


@pytest.mark.parametrize("mode, checkpointed", [
    ("full", [0, 1, 2, 3, 4]), ("selective:2", [0, 2, 4]), ("selective:3", [0, 3]), ("op", [0, 1, 2, 3, 4])])
def test_the_mode_checkpoints_the_blocks_it_names(mode, checkpointed):
    model = tiny_model(n_layer=5)
    apply_activation_checkpointing(model, mode)
    kinds = [type(block).__name__ for block in model.blocks]
    wanted = "OpCheckpointedBlock" if mode == "op" else "CheckpointedBlock"
    assert [i for i, kind in enumerate(kinds) if kind == wanted] == checkpointed, kinds
    assert all(kind in (wanted, "Block") for kind in kinds), kinds


def test_a_pipeline_stage_counts_its_blocks_by_their_layer_index():
    """A stage holding layers 3-5 of a model under selective:2 checkpoints layer 4, as the whole model would."""
    model = tiny_model(n_layer=6)
    model.blocks = torch.nn.ModuleDict({str(i): model.blocks[i] for i in (3, 4, 5)})
    apply_activation_checkpointing(model, "selective:2")
    assert [key for key, block in model.blocks.items() if type(block).__name__ == "CheckpointedBlock"] == ["4"]


def train_steps(mode, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = tiny_model()
    apply_activation_checkpointing(model, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(steps):  # the same batch each step: its loss must fall
        loss = model(batch[:, :-1], labels=batch[:, 1:]) / batch[:, 1:].numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def uncheckpointed():
    return train_steps(False)


@pytest.mark.parametrize("mode", MODES[1:])
def test_every_mode_trains_exactly_as_no_checkpointing(mode, uncheckpointed):
    losses, weights = train_steps(mode)
    reference_losses, reference_weights = uncheckpointed
    assert losses == reference_losses
    assert losses[-1] < losses[0]  # it trained
    for name, tensor in reference_weights.items():
        assert torch.equal(weights[name], tensor), name


def test_op_mode_runs_no_matmul_again_in_backward():
    """What makes ``op`` cheap: backward recomputes the elementwise operators, never a matmul or attention."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append(func)
            return func(*args, **(kwargs or {}))

    def backward_calls(mode) -> tuple[int, int]:
        """(matmuls, attention forwards) that a backward runs."""
        model = tiny_model()
        apply_activation_checkpointing(model, mode)
        batch = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
        loss = model(batch[:, :-1], labels=batch[:, 1:])
        with Count() as count:
            loss.backward()
        matmuls = sum(call in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) for call in count.calls)
        attention = sum(call == torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
                        for call in count.calls)
        return matmuls, attention

    plain, full, op = (backward_calls(mode) for mode in (False, "full", "op"))
    assert plain[1] == 0
    # full runs each of the 4 blocks' forward again: its attention, and its projections (q, k, v, o, gate, up,
    # down: at least 5 separate matmuls)
    assert full[1] == 4 and full[0] >= plain[0] + 4 * 5
    assert op == plain


def plan(mode, **kwargs) -> ParallelPlan:
    return ParallelPlan.resolve(devices=kwargs.pop("devices", 1), num_nodes=1, precision="bf16-true",
                                device_type="cuda", train=TrainArgs(global_batch_size=8, micro_batch_size=1),
                                fsdp=FSDPArgs(activation_checkpointing=mode), **kwargs)


def test_the_estimate_orders_the_modes_by_what_they_keep():
    config = Config.from_name("tiny-llama-1.1b")
    kept = {mode: activation_bytes_per_token(config, torch.bfloat16, mode)["kept"] for mode in MODES}
    assert kept["full"] < kept["op"] < kept[False]
    assert kept["full"] < kept["selective:2"] < kept["selective:3"] < kept[False]
    # 22 layers: selective:2 checkpoints 11 of them, selective:3 eight
    for mode, count in (("selective:2", 11), ("selective:3", 8)):
        assert kept[mode] == pytest.approx((count * kept["full"] + (22 - count) * kept[False]) / 22)
    activations = {mode: estimate_memory(config, plan(mode), seq_len=2048).activations for mode in MODES}
    assert activations["full"] < activations["op"] < activations[False]


def test_tensor_parallel_traffic_follows_the_mode():
    """The forward's collectives run again only where a whole block is recomputed."""
    assert tensor_parallel_passes(plan(False), 22) == 8
    assert tensor_parallel_passes(plan("full"), 22) == 12
    assert tensor_parallel_passes(plan("selective:2"), 22) == 10
    assert tensor_parallel_passes(plan("op"), 22) == 8
    assert tensor_parallel_passes(plan("op", devices=2, tp=2), 22) == 10  # sequence parallel: the all-gathers


@pytest.mark.parametrize("mode", ["op", "selective:2"])
def test_the_dry_run_names_the_mode_and_estimates_less(mode, capsys, tmp_path):
    from llmtrain.cli import main

    def dry(*flags):
        main(["pretrain", "tiny-llama-1.1b", "--dry_run", "--dry_run.gpu", "H100", "--out_dir", str(tmp_path / "o"),
              "--train.micro_batch_size", "4", "--train.global_batch_size", "8", "--train.max_seq_length", "2048",
              *flags])
        out = capsys.readouterr().out
        return out, next(line for line in out.splitlines() if line.startswith("memory"))

    plain, plain_memory = dry()
    out, memory = dry("--fsdp.activation_checkpointing", mode)
    assert f"; activation checkpointing {mode}" in out
    assert "activation checkpointing" not in plain
    assert memory != plain_memory
    assert not (tmp_path / "o").exists()
