"""The plan under tensor and pipeline parallelism: memory per device, the pipeline's bubble and micro-batches in
flight, tensor parallelism's traffic, and the layout the dry run suggests, for Llama 3 8B and 70B on 4 × 8 H100."""

from __future__ import annotations

import pytest
import torch

from llmtrain.args import FSDPArgs, TrainArgs
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.flops import ASSUMED_LINK_BYTES_PER_S, gpu_memory_bytes, link_bytes_per_s, num_parameters
from llmtrain.plan.communication import (pipeline_bubble, tensor_parallel_bytes_per_layer,
                                         tensor_parallel_bytes_per_step)
from llmtrain.plan.memory import (activation_bytes, activation_bytes_per_token, estimate_memory, microbatches_in_flight,
                                  rank_parameters, stage_layers, state_bytes)
from llmtrain.plan.search import USABLE_MEMORY_FRACTION, fits, model_splits, suggest_layout

SEQ_LEN = 8192
H100 = gpu_memory_bytes("H100")


def on_4x8(tp: int = 1, pp: int = 1, micro_batch: int = 1, global_batch: int = 256, checkpointing: bool = False,
           schedule=None, virtual_stages=None, sharding=None, sequence_parallel=None,
           skip_sync: bool = True) -> ParallelPlan:
    """A bf16-mixed plan for 4 nodes of 8 H100 (HYBRID_SHARD unless ``sharding`` says otherwise)."""
    return ParallelPlan.resolve(devices=8, num_nodes=4, precision="bf16-mixed", device_type="cuda", tp=tp, pp=pp,
                                train=TrainArgs(global_batch_size=global_batch, micro_batch_size=micro_batch),
                                fsdp=FSDPArgs(activation_checkpointing=checkpointing, sharding_strategy=sharding,
                                              skip_gradient_sync=skip_sync),
                                pp_schedule=schedule, pp_virtual_stages=virtual_stages,
                                sequence_parallel=sequence_parallel)


@pytest.fixture(scope="module")
def llama_8b() -> Config:
    return Config.from_name("llama-3-8b")


@pytest.fixture(scope="module")
def llama_70b() -> Config:
    return Config.from_name("llama-3-70b")


# ---- what a rank holds -----------------------------------------------------------------------------------------
def test_pipeline_ranks_hold_every_parameter_once(llama_70b):
    """The pipeline ranks' parameters add up to the model; a tied embedding is held by the first and the last."""
    for pp in (1, 2, 4):
        assert sum(rank_parameters(llama_70b, on_4x8(pp=pp), rank) for rank in range(pp)) == num_parameters(llama_70b)
    tied = Config.from_name("Llama-3.2-1B")
    assert tied.tie_embeddings
    two = on_4x8(pp=2)
    held = sum(rank_parameters(tied, two, rank) for rank in range(2))
    assert held == num_parameters(tied) + tied.padded_vocab_size * tied.n_embd


def test_blocks_are_split_evenly_over_the_stages(llama_70b):
    assert stage_layers(llama_70b, on_4x8(pp=4)) == [20] * 4
    assert stage_layers(Config.from_name("llama-debug"), on_4x8(pp=4, global_batch=32)) == [1] * 4
    odd = Config.from_name("Llama-3.2-3B")  # 28 blocks
    assert stage_layers(odd, on_4x8(pp=8)) == [4, 4, 4, 4, 3, 3, 3, 3]
    # interleaved: 28 blocks in 2 × 4 stages of 4, 4, 4, 4, 3, 3, 3, 3; rank r holds stages r and r + 4
    assert stage_layers(odd, on_4x8(pp=4, schedule="interleaved_1f1b")) == [7, 7, 7, 7]


def test_tensor_parallelism_halves_a_ranks_weights_not_its_share_of_the_sharded_states(llama_8b):
    """tp 2 leaves a rank half the weights (all but the norms), but takes half the ranks HYBRID_SHARD shards over:
    parameters, gradients and AdamW's moments per device stay (to the norms' replicas). Activations halve with
    sequence parallelism, but for the sequence-gathered inputs of the column-parallel linears, which torch keeps
    whole; without it the norms' and the linears' d-wide inputs stay whole."""
    fsdp, tp2 = on_4x8(), on_4x8(tp=2)
    assert (fsdp.shard_size, tp2.shard_size) == (8, 4)
    norms = (llama_8b.n_layer * 2 + 1) * llama_8b.n_embd
    assert rank_parameters(llama_8b, tp2) == (num_parameters(llama_8b) - norms) // 2 + norms
    alone, split = estimate_memory(llama_8b, fsdp, seq_len=SEQ_LEN), estimate_memory(llama_8b, tp2, seq_len=SEQ_LEN)
    assert split.optimizer == pytest.approx(alone.optimizer, rel=1e-4)
    per_token = {sp: activation_bytes_per_token(llama_8b, torch.bfloat16, False, tp=2, sequence_parallel=sp)
                 for sp in (True, False)}
    whole = activation_bytes_per_token(llama_8b, torch.bfloat16, False)
    # NOTE: torch's DTensor all-gathers the input of attention's q, k, v and of the MLP's first linear over the
    # sequence and keeps it whole for the backward (Megatron-LM gathers it again): 2·d·bytes·(1 - 1/tp) per token
    # more than half, 8 KiB at d 4096 in bf16 and tp 2. --dry_run.simulate measured them (TinyLlama at tp 4: 1.0 GiB
    # more than when the estimate divided them by tp).
    gathered = 2 * llama_8b.n_embd * 2 * (1 - 1 / 2)
    assert per_token[True]["layer"] == whole["layer"] / 2 + gathered == 90116
    assert whole["layer"] / 2 < per_token[True]["layer"] < per_token[False]["layer"] < whole["layer"]
    assert split.activations < 0.51 * alone.activations + SEQ_LEN * llama_8b.n_layer * gathered


def test_full_shard_over_the_data_parallel_ranks_left():
    """FULL_SHARD shards over world / (tp × pp) ranks: a rank's states shrink by tp × pp over their tensor and
    pipeline share, which the shard size gives back (the 70B is what HYBRID_SHARD within a node cannot hold)."""
    config = Config.from_name("llama-3-70b")
    states = {}
    for tp, pp in ((1, 1), (8, 1), (8, 4)):
        plan = on_4x8(tp=tp, pp=pp, sharding="FULL_SHARD" if tp * pp < 32 else None)
        states[tp, pp] = state_bytes(config, plan)[2]  # AdamW's moments: 2 × 4 bytes per parameter held
        assert states[tp, pp] == pytest.approx(8 * rank_parameters(config, plan) / plan.shard_size, rel=1e-6)
    assert states[8, 1] == pytest.approx(states[1, 1], rel=2e-3) == pytest.approx(8 * num_parameters(config) / 32,
                                                                                   rel=2e-3)


def test_pipeline_halves_the_states_and_1f1b_keeps_the_activations(llama_8b):
    """pp 2 (1F1B) on 4 × 8: each rank holds half the blocks and still shards over 8 (replicate 2 × shard 8), so
    its states halve. Its first rank keeps 2 micro-batches of its 16 blocks in flight: the blocks' activations of
    one micro-batch through all 32, as without a pipeline. GPipe keeps all m micro-batches."""
    fsdp, pp2 = on_4x8(), on_4x8(pp=2)
    assert pp2.shard_size == 8 and pp2.pp_microbatches == 16
    alone = estimate_memory(llama_8b, fsdp, seq_len=SEQ_LEN)
    first = state_bytes(llama_8b, pp2, 0)
    assert first[2] == pytest.approx(alone.optimizer / 2, rel=0.05)  # half the blocks, and the embedding
    assert microbatches_in_flight(pp2, 0) == 2 and microbatches_in_flight(pp2, 1) == 1
    kept = SEQ_LEN * llama_8b.n_layer * activation_bytes_per_token(llama_8b, torch.bfloat16, False)["kept"]
    assert activation_bytes(llama_8b, pp2, 0, seq_len=SEQ_LEN) == int(kept)
    gpipe = on_4x8(pp=2, schedule="gpipe")
    assert activation_bytes(llama_8b, gpipe, 0, seq_len=SEQ_LEN) == int(kept / 2 * 16)


def test_interleaved_1f1b_keeps_torchs_warmup_in_flight():
    """Rank r of an interleaved pipeline runs torch's warm-up of chunk forwards, then one more, before its first
    backward; each chunk is one of its v stages."""
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    for pp, v, m in ((2, 2, 4), (4, 2, 8), (4, 3, 4), (4, 2, 16)):
        plan = on_4x8(pp=pp, schedule="interleaved_1f1b", virtual_stages=v, global_batch=m * 32 // pp)
        assert plan.pp_microbatches == m
        for rank in range(pp):
            chunks = min(_get_warmup_ops(rank, v, pp, pp, m, multiply_factor=2) + 1, m * v)
            assert microbatches_in_flight(plan, rank) == chunks / v
    plan = on_4x8(pp=4, schedule="interleaved_1f1b", global_batch=64)  # m 8, v 2: (2 - 1)·4 + 2·3 + 1 = 11 chunks
    assert microbatches_in_flight(plan, 0) == 5.5


def test_the_bubble_formula():
    assert pipeline_bubble(on_4x8()) == 0
    assert pipeline_bubble(on_4x8(pp=4, global_batch=64)) == 3 / (8 + 3)  # m = 64 / 8 data-parallel ranks
    assert pipeline_bubble(on_4x8(pp=4, global_batch=64, schedule="gpipe")) == 3 / 11
    assert pipeline_bubble(on_4x8(pp=4, global_batch=64, schedule="interleaved_1f1b", virtual_stages=2)) == 3 / 19


def test_tensor_parallel_traffic_by_hand(llama_8b):
    """8·(tp - 1)/tp·B·T·C·a bytes per block and micro-batch: for B 1, T 8192, C 4096 in bf16, S = 64 MiB."""
    activation = 1 * 8192 * 4096 * 2
    assert tensor_parallel_bytes_per_layer(llama_8b, on_4x8(tp=2), SEQ_LEN) == 4 * activation == 256 * 2**20
    assert tensor_parallel_bytes_per_layer(llama_8b, on_4x8(tp=8), SEQ_LEN) == 7 * activation
    assert tensor_parallel_bytes_per_layer(llama_8b, on_4x8(tp=2, sequence_parallel=False), SEQ_LEN) == 4 * activation
    assert tensor_parallel_bytes_per_layer(llama_8b, on_4x8(tp=2, checkpointing=True), SEQ_LEN) == 6 * activation
    assert tensor_parallel_bytes_per_layer(llama_8b, on_4x8(micro_batch=2), SEQ_LEN) == 0
    both = on_4x8(tp=2, pp=2)  # 16 blocks per rank, 256 / (8 data-parallel ranks × micro 1) = 32 micro-batches
    assert tensor_parallel_bytes_per_step(llama_8b, both, SEQ_LEN) == 256 * 2**20 * 16 * 32 == 128 * 2**30
    assert link_bytes_per_s("NVIDIA H100 80GB HBM3") == (450e9, True)
    assert link_bytes_per_s("L4")[1] is False
    for pcie in ("NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA H100 PCIe"):  # as torch names them
        assert link_bytes_per_s(pcie) == (ASSUMED_LINK_BYTES_PER_S, False), pcie
    assert link_bytes_per_s("NVIDIA A100-SXM4-80GB") == (300e9, True)


# ---- what fits ---------------------------------------------------------------------------------------------------
def test_gpu_memory_from_the_name_or_the_table():
    assert gpu_memory_bytes("NVIDIA A100-SXM4-40GB") == 40 * 2**30  # the size the name states
    assert gpu_memory_bytes("H100") == gpu_memory_bytes("NVIDIA H100 80GB HBM3") == 80 * 2**30
    assert gpu_memory_bytes("H200") == 141 * 2**30 and gpu_memory_bytes("TPU v5") is None
    # The name torch gives a Grace Hopper superchip states the CPU's memory too; its GPU has 96 GiB of HBM.
    assert gpu_memory_bytes("NVIDIA GH200 480GB") == 96 * 2**30


def test_splits_to_try_smallest_first_tensor_before_pipeline():
    splits = model_splits(8, 32)
    assert splits[:5] == [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2)]
    assert all(tp <= 8 and 8 % tp == 0 and 32 % (tp * pp) == 0 for tp, pp in splits)
    assert splits[-1] == (1, 32)


def test_70b_on_4x8_h100_gets_a_layout_that_fits(llama_70b):
    """No split holds the 70B's activations at micro batch 1 without checkpointing; with it, tp 4 × pp 4 is the
    smallest split that fits."""
    plan = on_4x8()
    assert not fits(estimate_memory(llama_70b, plan, seq_len=SEQ_LEN), H100)
    added, suggestion = suggest_layout(llama_70b, plan, seq_len=SEQ_LEN, train=TrainArgs(global_batch_size=256,
                                       micro_batch_size=1), fsdp=FSDPArgs(), capacity=H100)
    assert added == "--fsdp.activation_checkpointing true" and suggestion is not None
    assert suggestion.plan.activation_checkpointing
    assert suggestion.memory.total <= USABLE_MEMORY_FRACTION * H100
    assert (suggestion.plan.tp, suggestion.plan.pp) == (4, 4) and suggestion.flags == "--tp_size 4 --pp_size 4"
    # NOTE: --tp_size 8 --pp_size 4 was suggested at 62.44 GiB while the estimate divided the sequence-gathered inputs
    # of the column-parallel linears by tp. torch's DTensor keeps them whole for the backward (--dry_run.simulate
    # measured it): 2·d·bytes·(1 - 1/tp) per token more in each of the first stage's 20 blocks, for each of its 4
    # micro-batches in flight, 17.50 GiB, so 79.94 GiB, over the 72 usable.
    old = on_4x8(tp=8, pp=4)
    gathered = (SEQ_LEN * stage_layers(llama_70b, old)[0] * microbatches_in_flight(old, 0)
                * 2 * llama_70b.n_embd * 2 * (1 - 1 / 8))
    assert gathered == 17.5 * 2**30
    assert estimate_memory(llama_70b, old, seq_len=SEQ_LEN).total == pytest.approx(62.44 * 2**30 + gathered,
                                                                                    abs=0.005 * 2**30)
    for tp, pp in model_splits(8, 32):  # no split fits with the run's flags (at pp 1, nor with the sync remedy)
        for skip_sync in (True, False) if pp == 1 else (True,):
            split = on_4x8(tp=tp, pp=pp, skip_sync=skip_sync)
            assert not fits(estimate_memory(llama_70b, split, seq_len=SEQ_LEN), H100), (tp, pp, skip_sync)
    for tp, pp in model_splits(8, 32)[:model_splits(8, 32).index((4, 4))]:  # no smaller split fits checkpointed
        smaller = on_4x8(tp=tp, pp=pp, checkpointing=True, skip_sync=pp > 1)  # a pipeline refuses the sync remedy
        assert not fits(estimate_memory(llama_70b, smaller, seq_len=SEQ_LEN), H100), (tp, pp)


def test_70b_with_too_large_a_micro_batch_is_told_what_else_it_needs(llama_70b):
    added, suggestion = suggest_layout(llama_70b, on_4x8(micro_batch=4), seq_len=SEQ_LEN, fsdp=FSDPArgs(),
                                       train=TrainArgs(global_batch_size=256, micro_batch_size=4), capacity=H100)
    # The gradients sharded after every micro-batch first, then the remedies in their order until one fits. A
    # pipeline split is tried without the first (--pp_size refuses it), so activation checkpointing is enough.
    assert added == "--fsdp.activation_checkpointing true" and suggestion.flags == "--tp_size 4 --pp_size 4"
    assert suggestion.plan.activation_checkpointing and not suggestion.plan.grad_sync_only_last
    assert fits(suggestion.memory, H100)
    # The suggested command is accepted, and its estimate is the suggestion's.
    plan = ParallelPlan.resolve(devices=8, num_nodes=4, precision="bf16-mixed", device_type="cuda", tp=4, pp=4,
                                train=TrainArgs(global_batch_size=256, micro_batch_size=4),
                                fsdp=FSDPArgs(activation_checkpointing=True))
    assert estimate_memory(llama_70b, plan, seq_len=SEQ_LEN).total == suggestion.memory.total


def test_8b_fits_with_fsdp_alone(llama_8b):
    assert fits(estimate_memory(llama_8b, on_4x8(checkpointing=True), seq_len=SEQ_LEN), H100)
    assert fits(estimate_memory(llama_8b, on_4x8(skip_sync=False), seq_len=SEQ_LEN), H100)
    # Accumulating 8 micro-batches with the sync skipped holds the fp32 gradients whole: 32 GB more per device.
    unsharded = estimate_memory(llama_8b, on_4x8(), seq_len=SEQ_LEN)
    assert not fits(unsharded, H100)
    assert unsharded.gradients > 4 * num_parameters(llama_8b) > estimate_memory(
        llama_8b, on_4x8(skip_sync=False), seq_len=SEQ_LEN).gradients


# ---- the dry run prints it ---------------------------------------------------------------------------------------
def dry_run(capsys, *flags: str) -> str:
    from llmtrain.cli import main

    main(["pretrain", *flags, "--devices", "8", "--num_nodes", "4", "--dry_run.gpu", "H100", "--dry_run",
          "--train.global_batch_size", "256", "--train.micro_batch_size", "1"])
    return capsys.readouterr().out


def test_dry_run_of_tensor_and_pipeline_parallelism(capsys, tmp_path):
    out = dry_run(capsys, "llama-3-8b", "--tp_size", "2", "--pp_size", "2", "--out_dir", str(tmp_path / "o"))
    assert "HYBRID_SHARD: replicate 2 × shard 4; tensor 2 (sequence parallel) × pipeline 2 (1f1b)" in out
    assert "memory       per device (estimate, the largest pipeline rank: 0 of 2, 16 blocks + embedding, 2 " \
           "micro-batches in flight)" in out
    assert "pipeline     1f1b over 2 ranks, m = 32 micro-batches per step: bubble (pp - 1)/(m + pp - 1) = 1/33 = " \
           "3.0% of each step idle" in out
    assert "tensor       each of 2 ranks sends 8·(tp - 1)/tp·B·T·C·bytes = 0.25 GiB per block and micro-batch, " \
           "128.00 GiB per step (16 blocks × 32 micro-batches): 0.31 s per step at 450 GB/s (H100 NVLink" in out
    assert "fits         yes" in out and "\nsuggest " not in out
    assert "with the pipeline bubble (3.0% idle)" in out
    assert not (tmp_path / "o").exists()


def test_dry_run_suggests_a_layout_for_70b_and_none_for_8b(capsys, tmp_path):
    out = dry_run(capsys, "llama-3-70b", "--out_dir", str(tmp_path / "o"))
    assert "fits         no: 566." in out
    # NOTE: --tp_size 8 --pp_size 4 (62.44 GiB) fitted until the estimate kept torch's sequence-gathered inputs of
    # the column-parallel linears whole, as --dry_run.simulate measured them (see the test above: 79.94 GiB now)
    assert "suggest      no --tp_size × --pp_size fits with these flags; with --fsdp.activation_checkpointing true " \
           "--tp_size 4 --pp_size 4: 54.42 GiB per device (mesh pipeline 4 × replicate 1 × shard 2 × tensor 4; " \
           "1f1b bubble 2.3%)" in out
    out = dry_run(capsys, "llama-3-8b", "--fsdp.activation_checkpointing", "true", "--out_dir", str(tmp_path / "o"))
    assert "fits         yes: 47.93 GiB per device" in out and "\nsuggest " not in out
    out = dry_run(capsys, "llama-3-8b", "--out_dir", str(tmp_path / "o"))  # the sync skipped: the gradients whole
    assert "fits         no: 85.94 GiB" in out and "suggest      --fsdp.skip_gradient_sync false: " in out


@pytest.mark.parametrize("ddp", [["--strategy", "ddp"], ["--fsdp.sharding_strategy", "NO_SHARD"]])
def test_dry_run_of_ddp_that_does_not_fit_names_the_sharding_it_suggests(capsys, tmp_path, ddp):
    """DDP splits no model: the layout suggested in its place is FSDP's, and the flags say so. Appended to the
    command, they give the estimate the suggestion printed (it named --fsdp.skip_gradient_sync false, or nothing,
    with FSDP's figure, while DDP with them still did not fit)."""
    import re

    from llmtrain.cli import main

    command = ["pretrain", "pythia-1b", "--devices", "8", "--dry_run.gpu", "L4", "--dry_run", "--out_dir",
               str(tmp_path / "o"), "--train.global_batch_size", "256", "--train.micro_batch_size", "4", *ddp]
    main(command)
    out = capsys.readouterr().out
    assert "NO_SHARD (DDP)" in out and "fits         no:" in out
    (flags, total), = re.findall(r"suggest      .*with (--\S.*): ([\d.]+ GiB) per device", out)
    assert flags == "--strategy fsdp --fsdp.sharding_strategy FULL_SHARD"
    main(command + flags.split())
    assert f"fits         yes: {total} per device" in capsys.readouterr().out


def test_dry_run_of_lora_that_does_not_fit_suggests_no_split(capsys, tmp_path):
    from llmtrain.checkpoint.layout import CONFIG_FILE
    from llmtrain.cli import main

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    Config.from_name("llama-3-70b").save(model_dir / CONFIG_FILE)
    for name in ("model.safetensors", "tokenizer.json"):
        (model_dir / name).write_bytes(b"")  # a dry run reads only the architecture
    main(["finetune_lora", str(model_dir), "--dry_run.gpu", "L4", "--out_dir", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert "fits         no:" in out and "of the L4's 24.00 GiB" in out
    assert "suggest      LoRA and QLoRA do not split the model" in out and "--tp_size" not in out
