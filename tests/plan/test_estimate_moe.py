"""The dry run of a mixture of experts: every expert's state sharded as planned, the MoE block's activations, the
all-to-all's bytes under expert parallelism, and an ``--ep_size`` suggestion for Qwen3-235B-A22B on 8 × 8 H100s."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llmtrain.args import FSDPArgs, TrainArgs
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.flops import expert_parameters, gpu_memory_bytes, num_parameters
from llmtrain.plan.communication import all_to_all_bytes_per_step, communication_bytes_per_step
from llmtrain.plan.memory import estimate_memory, moe_bytes_per_token, state_bytes
from llmtrain.plan.search import USABLE_MEMORY_FRACTION, expert_splits, suggest_layout

sys.path.insert(0, str(Path(__file__).parent))
from test_estimate_vs_measured import layout, measured_peak  # noqa: E402

H100 = gpu_memory_bytes("H100")

def qwen3_235b() -> Config:
    return Config.from_name("Qwen3-235B-A22B")


def fsdp_plan(devices: int, nodes: int, *, micro: int = 1, accumulation: int = 1, seq_len: int = 4096,
              sharding: str = "FULL_SHARD", checkpointing: bool = True, ep: int = 1) -> ParallelPlan:
    train = TrainArgs(global_batch_size=devices * nodes * micro * accumulation, micro_batch_size=micro,
                      max_seq_length=seq_len)
    plan = ParallelPlan.resolve(devices=devices, num_nodes=nodes, train=train, precision="bf16-mixed",
                                fsdp=FSDPArgs(sharding_strategy=sharding, activation_checkpointing=checkpointing,
                                              skip_gradient_sync=False),
                                device_type="cuda", accelerator="cuda", gpu="H100", ep=ep)
    return plan


def test_moe_state_counts_every_expert_and_ep_shrinks_only_what_a_rank_gathers():
    """FSDP stores 1/dp_shard of every expert whatever ep is (the experts over ep × dp_shard/ep ranks); what ep
    changes is the block a rank gathers (and its unsharded gradients): E/ep experts instead of E."""
    moe, dense = Config.from_name("moe-debug"), Config.from_name("llama-debug")
    one = layout("32-true", 1, device_type="cpu")
    params, gradients, optimizer = state_bytes(moe, one)
    assert params == gradients == 4 * num_parameters(moe) and optimizer == 8 * num_parameters(moe)
    assert params > 2 * state_bytes(dense, one)[0]  # all 8 experts of width 320, not llama-debug's 640-wide MLP

    config = qwen3_235b()
    ranks = {ep: estimate_memory(config, fsdp_plan(8, 8, ep=ep), seq_len=4096) for ep in (1, 2, 8, 64)}
    experts_of_a_block = config.n_expert * expert_parameters(config)
    for ep, memory in ranks.items():
        assert memory.optimizer == ranks[1].optimizer == 8 * num_parameters(config) // 64
        # two blocks gathered in bf16 (the one computing and the next prefetched), one block's bf16 gradients
        fewer = experts_of_a_block - experts_of_a_block // ep
        assert ranks[1].parameters - memory.parameters == 2 * 2 * fewer
        assert ranks[1].gradients - memory.gradients == 2 * fewer
    assert ranks[1].total - ranks[8].total > 10 * 2**30  # a block holds 2.4B expert weights; ep 8 gathers 0.3B


def test_moe_block_activations_are_what_autograd_keeps():
    """moe_bytes_per_token against the tensors autograd saves in an MoE block's forward (saved-tensor hooks), in
    float32 and bfloat16, for Mixtral-like softmax top-2 and for sigmoid routing with a shared expert."""
    from llmtrain.moe import MoE

    base = Config.from_name("moe-debug")
    for config in (base, replace(base, n_shared_expert=1, router_score="sigmoid", norm_topk_prob=False)):
        for dtype in (torch.float32, torch.bfloat16):
            block = MoE(config).to(dtype).train()
            for parameter in block.parameters():
                torch.nn.init.normal_(parameter, std=0.02)
            tokens = 256
            x = torch.randn(tokens, config.n_embd, dtype=dtype, requires_grad=True)
            saved = {}

            def pack(tensor):
                storage = tensor.untyped_storage()
                saved[storage.data_ptr()] = storage.nbytes()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                block(x)
            inputs = {p.untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}
            measured = sum(size for pointer, size in saved.items() if pointer not in inputs) / tokens
            estimate = moe_bytes_per_token(config, dtype.itemsize)
            assert estimate == pytest.approx(measured, rel=0.01), (config.n_shared_expert, dtype)


def test_moe_memory_estimate_is_within_25_percent_of_the_measured_peak():
    """A step of moe-debug (one block) in one process, measured by torch's MemTracker, as the dense models are in
    test_estimate_vs_measured. Not measured at ep 2 (the estimate there is checked by hand only): that needs 2 gloo
    ranks, or the fake process group of --dry_run.simulate, which cannot run an MoE (its fake tensors have no values
    for the routing's data-dependent sizes: bincount, split)."""
    config = replace(Config.from_name("moe-debug"), n_layer=1)  # the tracker's cost is per operator: one block
    estimate = estimate_memory(config, layout("32-true", 2, device_type="cpu"), seq_len=128)
    measured = measured_peak(config, "32-true", 2, 128, False)
    print(f"moe-debug (1 block) 32-true micro 2 seq 128: estimate {estimate.total / 2**20:.1f} MiB, measured "
          f"{measured / 2**20:.1f} MiB")
    assert 0.75 <= estimate.total / measured <= 1.25, (estimate, measured)


def fsdp_rank_peak(config: Config, plan: ParallelPlan, train: TrainArgs, seq_len: int) -> dict[str, int]:
    """Rank 0 of ``plan`` (a CUDA plan, run on the CPU as --dry_run.simulate runs it) through one step of the loop's
    own TrainStep, under torch's fake process group but with real tensors: the routing needs values, which the
    simulation's fake tensors do not have. FSDPMemTracker's peak by category."""
    from llmtrain.distributed.runtime import Runtime
    from llmtrain.kernel_device import simulated_device_type
    from llmtrain.optim import build_optimizer
    from llmtrain.recipes import simulate
    from llmtrain.recipes.build import build_model

    # NOTE: a forked child of a process whose OpenMP pool has run (any test before this one) hangs in its first
    # parallel region; one thread runs none.
    torch.set_num_threads(1)
    simulate._untrack_sharding_propagation()
    on_cpu = replace(plan, device_type="cpu")
    with simulate.fake_world(0, plan.world_size), simulated_device_type(plan.device_type):
        runtime = Runtime.simulated(on_cpu, 0)
        model = build_model(config, plan=on_cpu, runtime=runtime, seed=0)
        model.max_seq_length = seq_len
        optimizer = build_optimizer("AdamW", list(model.parameters()))
        step = simulate._train_step(config, on_cpu, runtime, model, optimizer, train, seq_len)
        with simulate.HealthyReads():  # the fake group's all-reduced numbers (the gradient norm) read as healthy
            simulate._create_optimizer_state(optimizer)
            tracker = simulate._memory_tracker(model, optimizer)
            with tracker:
                step()
        return simulate._peak_by_category(tracker)


def test_moe_under_fsdp_is_within_15_percent_of_fsdp_mem_tracker():
    """moe-debug (2 blocks) FULL_SHARD over 4 ranks, bf16-mixed: every expert's weights and AdamW moments sharded
    1/4 on the rank, as estimated (to AdamW's step counters), and the peak within the simulation's bound (15%).
    Not at --ep_size 2, where the experts' shards live on a 2-D mesh: a gap of this test."""
    from llmtrain.recipes.simulate import start_child_process

    config = replace(Config.from_name("moe-debug"), n_layer=2)
    train = TrainArgs(global_batch_size=16, micro_batch_size=4, max_seq_length=256)
    plan = ParallelPlan.resolve(devices=4, num_nodes=1, train=train, precision="bf16-mixed", fsdp=FSDPArgs(),
                                device_type="cuda", accelerator="cuda", gpu="H100")
    child, finish = start_child_process(fsdp_rank_peak, config, plan, train, 256)
    peak = finish(child)
    estimate = estimate_memory(config, plan, seq_len=256)
    print(f"moe-debug FULL_SHARD 4, bf16-mixed, 4 x 256: estimate {estimate.describe()}; measured "
          f"{ {key: round(value / 2**20, 2) for key, value in peak.items()} } MiB")
    assert peak["Sharded Param"] == 4 * num_parameters(config) // 4  # fp32 weights, every expert, a quarter each
    assert estimate.optimizer == 2 * peak["Sharded Param"]
    assert estimate.optimizer <= peak["OptState"] <= estimate.optimizer + 2**10  # + AdamW's step counters
    assert abs(estimate.total - peak["total"]) <= 0.15 * peak["total"], (estimate, peak)


def test_all_to_all_volume_per_step_and_rank():
    """Each MoE block sends a rank's B·T·k rows of C elements to their experts and back, forward and backward (4
    buffers), 2 more where checkpointing recomputes the forward; FSDP moves the experts over dp_shard / ep ranks."""
    config = qwen3_235b()
    plan = fsdp_plan(8, 8, micro=1, accumulation=2, ep=8)
    rows = 4096 * config.n_expert_per_token
    buffer = rows * config.n_embd * 2  # bf16
    assert all_to_all_bytes_per_step(config, plan, 4096) == 6 * buffer * config.n_layer * 2
    plain = replace(plan, activation_checkpointing=False)
    assert all_to_all_bytes_per_step(config, plain, 4096) == 4 * buffer * config.n_layer * 2
    assert all_to_all_bytes_per_step(config, replace(plan, ep=1), 4096) == 0

    volume = communication_bytes_per_step(config, plan, 4096)
    without = communication_bytes_per_step(config, replace(plan, ep=1), 4096)
    assert volume["ep"] == all_to_all_bytes_per_step(config, plan, 4096)
    experts = config.n_layer * config.n_expert * expert_parameters(config)
    # per micro-batch the forward's and the backward's gathers (bf16), once per micro-batch the fp32 reduce-scatter
    assert volume["dp_shard_mod_ep"] == 2 * (2 * 2 * experts / 8 + 4 * experts / 8)
    assert volume["dp_shard"] + volume["dp_shard_mod_ep"] < without["dp_shard"] / 5
    assert "dp_shard_mod_ep" not in communication_bytes_per_step(config, fsdp_plan(8, 1, ep=8), 4096)  # ep = shard


def test_expert_splits_divide_the_experts_and_the_shard():
    config = qwen3_235b()
    assert expert_splits(config, fsdp_plan(8, 8)) == [1, 2, 4, 8, 16, 32, 64]
    assert expert_splits(config, fsdp_plan(8, 8, sharding="HYBRID_SHARD")) == [1, 2, 4, 8]  # dp_shard 8
    assert expert_splits(replace(config, n_expert=6, n_expert_per_token=2), fsdp_plan(8, 1)) == [1, 2]
    assert expert_splits(Config.from_name("llama-debug"), fsdp_plan(8, 1)) == [1]


def test_qwen3_235b_on_8x8_h100_gets_an_expert_parallel_layout():
    """Plain FSDP over 64 H100s does not fit (every rank gathers all 128 experts of a block: 2.4B weights, and the
    next block's); the search adds ep before any tensor or pipeline split, the largest that stays within a node."""
    config = qwen3_235b()
    plan = fsdp_plan(8, 8, checkpointing=False)
    train = TrainArgs(global_batch_size=64, micro_batch_size=1, max_seq_length=4096)
    assert not any(estimate_memory(config, fsdp_plan(8, 8, checkpointing=checkpointing), seq_len=4096).total
                   <= USABLE_MEMORY_FRACTION * H100 for checkpointing in (False, True))
    fsdp = FSDPArgs(sharding_strategy="FULL_SHARD", skip_gradient_sync=False)
    added, suggestion = suggest_layout(config, plan, seq_len=4096, train=train, fsdp=fsdp, capacity=H100)
    assert added == "--fsdp.activation_checkpointing true"
    assert suggestion.flags == "--ep_size 8"
    assert (suggestion.plan.ep, suggestion.plan.tp, suggestion.plan.pp) == (8, 1, 1)
    assert suggestion.memory.total <= USABLE_MEMORY_FRACTION * H100


def test_dry_run_of_qwen3_235b_on_8x8_h100_suggests_ep_and_says_why(capsys, tmp_path):
    """`llmtrain pretrain --model_config qwen3-235b.yaml --devices 8 --num_nodes 8 --dry_run`: total and active
    parameters, the experts' line, and a layout with --ep_size and the traffic it saves."""
    from llmtrain.cli import main

    main(["pretrain", "Qwen3-235B-A22B", "--devices", "8", "--num_nodes", "8", "--dry_run",
          "--dry_run.gpu", "H100", "--train.max_seq_length", "4096", "--out_dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "model        Qwen3-235B-A22B: 235,093.6M parameters (22,190.7M active per token)" in out
    assert "experts      128 routed per block, 8 per token; no expert parallelism: FSDP gathers all" in out
    assert "fits         no:" in out
    suggestion = next(line for line in out.splitlines() if line.startswith("suggest"))
    assert "--fsdp.sharding_strategy FULL_SHARD --ep_size 8: " in suggestion, suggestion
    assert "ep 8: each rank gathers 16 of each block's 128 experts, so FSDP moves" in suggestion
    assert "for an all-to-all of" in suggestion
    assert not (tmp_path / "out").exists()
