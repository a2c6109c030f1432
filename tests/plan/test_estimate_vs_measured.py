"""The memory estimate against measured peaks, and ``--dry_run`` for devices this machine does not have."""

import os
import subprocess

from pathlib import Path
from typing import Optional

import pytest
import torch

from llmtrain.args import FSDPArgs, TrainArgs
from llmtrain.cli import main
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.plan.memory import activation_bytes_per_token, estimate_memory


def layout(precision: str, micro_batch: int, checkpointing: bool | str = False, devices: int = 1,
           sharding: Optional[str] = None, device_type: str = "cuda") -> ParallelPlan:
    return ParallelPlan.resolve(devices=devices, num_nodes=1, precision=precision, device_type=device_type,
                                train=TrainArgs(global_batch_size=micro_batch * devices, micro_batch_size=micro_batch),
                                fsdp=FSDPArgs(sharding_strategy=sharding, activation_checkpointing=checkpointing))


_MEASURED: dict[tuple, int] = {}
"""measured_peak's measurements in this process, by (the model config's repr, precision, micro batch, seq len,
checkpointing mode, ddp): the tests below measure some settings twice (llama-debug in fp32 at 8 x 256 without and
with full checkpointing), and a setting's peak is the same each time it is measured."""


def measured_peak(config: Config, precision: str, micro_batch: int, seq_len: int, checkpointing: bool | str,
                  ddp: bool = False) -> int:
    """Peak bytes of live tensors over two training steps of the model the recipes build, as torch's
    MemTracker counts them on the CPU (the CPU's analogue of torch.cuda.max_memory_allocated).

    ``ddp``: wrapped in DistributedDataParallel, as ``--strategy ddp`` wraps it, in a one-rank gloo group (a DDP
    rank's memory does not depend on how many there are)."""
    from llmtrain.args import canonical_checkpointing

    key = (repr(config), precision, micro_batch, seq_len, canonical_checkpointing(checkpointing), ddp)
    if key not in _MEASURED:
        _MEASURED[key] = _measure_peak(config, precision, micro_batch, seq_len, checkpointing, ddp)
    return _MEASURED[key]


def _measure_peak(config: Config, precision: str, micro_batch: int, seq_len: int, checkpointing: bool | str,
                  ddp: bool) -> int:
    from llmtrain.distributed.runtime import Runtime
    from llmtrain.recipes.build import build_model

    runtime = Runtime.from_env("cpu")
    plan = layout(precision, micro_batch, checkpointing)
    model = build_model(config, plan=plan, runtime=runtime, seed=0)
    if not ddp:
        return _peak_of_two_steps(model, plan, config, micro_batch, seq_len)
    import torch.distributed as dist

    from conftest import free_port_number
    from llmtrain.distributed.parallelize import apply_ddp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_number()}", rank=0, world_size=1)
    try:
        return _peak_of_two_steps(apply_ddp(model, runtime.device), plan, config, micro_batch, seq_len)
    finally:
        dist.destroy_process_group()


def _peak_of_two_steps(model: torch.nn.Module, plan: ParallelPlan, config: Config, micro_batch: int,
                       seq_len: int) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    precision = plan.precision
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (micro_batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    for _ in range(2):  # the second step has optimizer state, as every later one does
        tracker.reset_mod_stats()
        with tracker:
            with precision.autocast(torch.device("cpu"), enabled=not plan.mixed_precision_policy):
                loss = model(tokens[:, :-1], labels=tokens[:, 1:]) / tokens[:, 1:].numel()  # as the loop does
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            del loss
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


SETTINGS = [
    ("llama-debug", "32-true", 16, 512, False),  # 8192 tokens: the loss runs in chunks
    ("llama-debug", "32-true", 8, 256, False),
    ("llama-debug", "bf16-true", 8, 256, False),
    ("llama-debug", "32-true", 8, 256, True),
    ("llama-debug", "bf16-mixed", 4, 256, False),
    ("gpt-neox-debug", "32-true", 8, 256, False),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,precision,micro_batch,seq_len,checkpointing", SETTINGS)
def test_memory_estimate_is_within_25_percent_of_the_measured_peak(name, precision, micro_batch, seq_len,
                                                                    checkpointing):
    config = Config.from_name(name)
    estimate = estimate_memory(config, layout(precision, micro_batch, checkpointing, device_type="cpu"),
                               seq_len=seq_len)  # planned for the CPU it is measured on
    measured = measured_peak(config, precision, micro_batch, seq_len, checkpointing)
    ratio = estimate.total / measured
    print(f"{name} {precision} micro {micro_batch} seq {seq_len} checkpointing {checkpointing}: "
          f"estimate {estimate.total / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB, ratio {ratio:.2f}")
    assert 0.75 <= ratio <= 1.25, (estimate, measured)


@pytest.mark.slow
def test_each_checkpointing_mode_saves_the_memory_the_estimate_says():
    """Measured peaks of full, selective:2 and op checkpointing against none (llama-debug, 4 layers, fp32), each
    within 25% of the estimate, and in the estimate's order: full keeps least, op keeps the matmul outputs."""
    config = Config.from_name("llama-debug")
    modes = [False, "full", "selective:2", "op"]
    peaks = {mode: measured_peak(config, "32-true", 8, 256, mode) for mode in modes}
    for mode in modes:
        estimate = estimate_memory(config, layout("32-true", 8, mode, device_type="cpu"), seq_len=256).total
        print(f"checkpointing {mode}: measured {peaks[mode] / 2**20:.1f} MiB, estimate {estimate / 2**20:.1f} MiB")
        assert 0.75 <= estimate / peaks[mode] <= 1.25, (mode, estimate, peaks[mode])
    assert peaks["full"] < peaks["selective:2"] < peaks[False]
    assert peaks["full"] < peaks["op"] < peaks[False]


@pytest.mark.multiproc  # a one-rank process group
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_ddp_costs_what_the_estimate_adds_to_one_process(precision, monkeypatch):
    """DDP copies every gradient into its buckets, which stay allocated, and autocasts as one process does (low-
    precision weight copies): measured against one process, the estimate adds what the measured peak does. Short
    sequences, so that the weights and not the activations make the peak."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    config = Config.from_name("llama-debug")
    one = layout(precision, 1, device_type="cpu")
    ddp = ParallelPlan.resolve(devices=2, num_nodes=1, precision=precision, device_type="cpu", strategy="ddp",
                               train=TrainArgs(global_batch_size=2, micro_batch_size=1))
    estimated = {name: estimate_memory(config, plan, seq_len=32).total for name, plan in (("one", one), ("ddp", ddp))}
    measured = {name: measured_peak(config, precision, 1, 32, False, ddp=name == "ddp") for name in ("one", "ddp")}
    print(f"{precision}: estimate {estimated}, measured {measured}")
    added, measured_added = estimated["ddp"] - estimated["one"], measured["ddp"] - measured["one"]
    assert measured_added > 0
    assert 0.75 <= added / measured_added <= 1.25, (added, measured_added)
    assert 0.75 <= estimated["ddp"] / measured["ddp"] <= 1.25


@pytest.mark.multiproc
def test_fsdp_gradients_kept_unsharded_through_accumulation_are_in_the_estimate(tmp_path):
    """--fsdp.skip_gradient_sync (the default) keeps every micro-batch's gradients unsharded until the step's last:
    2 FULL_SHARD ranks, 4 micro-batches a step, measured with it and without. Each estimate is within 10% of its
    peak, and the estimate adds about what the flag costs (all the gradients against their shard, less what the
    peak without the flag holds besides)."""
    import dist_worker

    result = dist_worker.launch(2, "memory", tmp_path, timeout_s=600)
    estimated, measured = {}, {}
    for skip, peak in result["peaks"].items():
        assert peak["plan"].grad_sync_only_last == skip and peak["plan"].batch.grad_accum_steps == 4
        estimated[skip] = estimate_memory(result["config"], peak["plan"], seq_len=result["seq_len"]).total
        measured[skip] = peak["measured"]
        print(f"skip_gradient_sync {skip}: estimate {estimated[skip] / 2**20:.1f} MiB, measured "
              f"{measured[skip] / 2**20:.1f} MiB")
        assert 0.9 <= estimated[skip] / measured[skip] <= 1.1, (skip, estimated[skip], measured[skip])
    added, measured_added = estimated[True] - estimated[False], measured[True] - measured[False]
    assert measured_added > 0.05 * measured[False]
    assert 0.5 <= added / measured_added <= 2, (added, measured_added)


def test_estimate_follows_the_layout():
    """Sharding divides the states, checkpointing shrinks activations, LoRA drops most optimizer state."""
    config = Config.from_name("tiny-llama-1.1b")
    one = estimate_memory(config, layout("bf16-mixed", 4), seq_len=2048)
    sharded = estimate_memory(config, layout("bf16-mixed", 4, devices=8, sharding="FULL_SHARD"), seq_len=2048)
    assert sharded.optimizer * 8 == one.optimizer
    assert sharded.parameters < one.parameters / 4
    checkpointed = estimate_memory(config, layout("bf16-mixed", 4, True, devices=8, sharding="FULL_SHARD"),
                                   seq_len=2048)
    assert checkpointed.activations < sharded.activations / 2
    lora = estimate_memory(config, layout("bf16-true", 4), seq_len=2048, trainable_parameters=2_000_000)
    assert lora.optimizer == 2 * 2_000_000 * 2
    per_token = activation_bytes_per_token(config, torch.bfloat16, checkpointing=False)
    assert per_token["stack"] == config.n_layer * per_token["layer"]


DRY_RUNS = {
    "32 gpus": ["pretrain", "tiny-llama-1.1b", "--devices", "8", "--num_nodes", "4", "--dry_run",
                "--train.global_batch_size", "512", "--train.micro_batch_size", "4",
                "--train.max_seq_length", "2048", "--train.max_tokens", "3000000000000",
                "--precision", "bf16-mixed", "--dry_run.gpu", "H100", "--out_dir", "{root}/out"],
    "full": ["pretrain", "llama-debug", "--dry_run", "--fsdp.state_dict_type", "full", "--out_dir", "{root}/ckpt"],
    "sharded": ["pretrain", "llama-debug", "--dry_run", "--fsdp.state_dict_type", "sharded", "--out_dir",
                "{root}/ckpt"],
    "lora": ["finetune_lora", "{root}/model", "--dry_run", "--lora_r", "8", "--out_dir", "{root}/o"],
    "bad input": ["pretrain", "tiny-llama-1.1b", "--devices", "8", "--num_nodes", "4", "--dry_run",
                  "--train.global_batch_size", "100", "--out_dir", "{root}/bad"],
}
"""The dry runs below, as command lines ({root}: the fixture's folder)."""


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> tuple[dict[str, subprocess.CompletedProcess], Path]:
    """Each of DRY_RUNS as `python -m llmtrain ...`, a process of its own, forked from one interpreter
    (tests/helpers/forked_cli): their results by name, and the folder their paths are in."""
    from llmtrain.checkpoint.layout import CONFIG_FILE

    from forked_cli import run_forked

    root = tmp_path_factory.mktemp("dry-runs")
    model_dir = root / "model"  # for finetune_lora: a dry run reads only the architecture
    model_dir.mkdir()
    Config.from_name("llama-debug").save(model_dir / CONFIG_FILE)
    for name in ("model.safetensors", "tokenizer.json"):
        (model_dir / name).write_bytes(b"")
    argvs = [[arg.replace("{root}", str(root)) for arg in argv] for argv in DRY_RUNS.values()]
    # NOTE: the timeout is a hang guard: a dry run takes a few seconds, far longer only on a busy machine.
    done = run_forked(argvs, root / "logs", dict(os.environ), timeout_s=600)
    return dict(zip(DRY_RUNS, done)), root


def test_dry_run_plans_32_gpus_on_this_machine(dry_runs):
    results, root = dry_runs
    done = results["32 gpus"]
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "HYBRID_SHARD: replicate 4 × shard 8" in out
    assert "micro 4 × 32 ranks × 4 accumulation steps = global 512" in out
    assert "tokens/step  1,048,576" in out
    assert "2,861,023 steps" in out
    assert "memory       per device (estimate)" in out and "checkpoint   weights 4.10 GiB" in out
    assert "step checkpoint 12.29 GiB (one file gathered on rank 0; --fsdp.state_dict_type sharded: 8 shards of " \
           "1.54 GiB)" in out  # weights + two AdamW moments, fp32; HYBRID_SHARD's replicas write no extra copy
    assert "H100 at 40% MFU" in out
    assert not (root / "out").exists()  # nothing was written


def test_dry_run_mfu_needs_the_gpu_it_is_assumed_on():
    from llmtrain.args import DryRunArgs

    with pytest.raises(ValueError, match="--dry_run.mfu is the utilization assumed on --dry_run.gpu"):
        DryRunArgs(mfu=0.9)
    assert DryRunArgs(mfu=0.9, gpu="H100").requested


def test_a_dry_run_for_a_gpu_without_bfloat16_says_so_and_names_the_precisions_it_has(tmp_path):
    """A V100 has no bf16 units: its time estimate is refused for that reason, not for an unknown peak."""
    with pytest.raises(ValueError, match="'V100' has no bfloat16 units, so --precision bf16-true would run emulated"
                                         ".*pass --precision 16-mixed or 32-true"):
        main(["pretrain", "llama-debug", "--precision", "bf16-true", "--dry_run", "--dry_run.gpu", "V100",
              "--out_dir", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="'NoSuchGPU': its peak FLOP/s is unknown"):
        main(["pretrain", "llama-debug", "--precision", "bf16-true", "--dry_run", "--dry_run.gpu", "NoSuchGPU",
              "--out_dir", str(tmp_path / "out")])


def test_dry_run_says_what_one_process_writes_for_each_checkpoint_format(dry_runs):
    for state_dict_type, says in (("full", "(one file, rank 0)"), ("sharded", "(sharded: one DCP shard)")):
        done = dry_runs[0][state_dict_type]
        assert done.returncode == 0, done.stderr
        assert says in done.stdout, done.stdout


def test_dry_run_for_lora_counts_only_the_adapters(dry_runs):
    done = dry_runs[0]["lora"]
    assert done.returncode == 0, done.stderr
    # q and v adapters of 4 layers: r · (in + out) each = 8 · (256 + 256) + 8 · (256 + 128)
    assert "4.9M parameters, 0.0M trainable" in done.stdout
    assert "each resumable step checkpoint" in done.stdout


def test_dry_run_still_rejects_bad_input(dry_runs):
    done = dry_runs[0]["bad input"]
    assert done.returncode == 2 and "--train.global_batch_size 100" in done.stderr
    assert "batch        PROBLEM: global 100 is no multiple of micro 4 × 32 ranks" in done.stdout  # the plan still shows
    assert "memory       per device (estimate)" in done.stdout


def test_shared_memory_for_fsdp_on_one_cpu_host_is_two_slots_of_the_largest_unit(monkeypatch):
    """pythia-160m's largest unit is [final norm, head]: 50,304 x 768 + 1,536 parameters. The all-gather slots hold
    it in the gather dtype, the reduce-scatter slots each process's copy in the reduction dtype, in whole MiB."""
    from llmtrain.plan.memory import host_collective_bytes

    config = Config.from_name("pythia-160m")
    unit = 50_304 * 768 + 2 * 768
    mib = 2**20

    def slots(nbytes: int) -> int:
        return 2 * (-(-nbytes // mib) * mib)

    def plan(devices=2, precision="32-true", strategy="fsdp", num_nodes=1, accelerator="cpu"):
        train = TrainArgs(global_batch_size=8, micro_batch_size=1, max_seq_length=256)
        return ParallelPlan.resolve(devices=devices, num_nodes=num_nodes, train=train, precision=precision,
                                    strategy=strategy, accelerator=accelerator)

    assert host_collective_bytes(config, plan()) == slots(unit * 4) + slots(2 * unit * 4)  # 0.87 GiB
    assert host_collective_bytes(config, plan(devices=4)) == slots(unit * 4) + slots(4 * unit * 4)
    # bf16-mixed gathers bf16 weights and reduces fp32 gradients
    assert host_collective_bytes(config, plan(precision="bf16-mixed")) == slots(unit * 2) + slots(2 * unit * 4)
    # none where the collectives are not FSDP's between processes of one CPU host
    assert host_collective_bytes(config, plan(strategy="ddp")) == 0
    assert host_collective_bytes(config, plan(devices=1, num_nodes=2)) == 0
    monkeypatch.setenv("LLMTRAIN_HOST_COLLECTIVES", "0")
    assert host_collective_bytes(config, plan()) == 0


def test_dry_run_names_the_shared_memory_and_warns_when_dev_shm_is_small(monkeypatch, capsys):
    import shutil
    from collections import namedtuple

    from llmtrain.cli import main

    args = ["pretrain", "pythia-160m", "--devices", "2", "--strategy", "fsdp", "--accelerator", "cpu", "--dry_run"]
    main(args)
    out = capsys.readouterr().out
    assert "shared mem   0.87 GiB of /dev/shm for FSDP's collectives between the 2 processes" in out
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**26, 0, 2**26) if path == "/dev/shm" else real(path))
    main(args)
    assert "warning      /dev/shm has 64.0 MiB free here, under the 0.87 GiB above" in capsys.readouterr().out
