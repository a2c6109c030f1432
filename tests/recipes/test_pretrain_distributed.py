"""`llmtrain pretrain --devices N` through the real CLI: spawned workers, FSDP, sharded checkpoints."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_cli(tiny_model_file, dist_env, tmp_path_factory):
    env = dict(dist_env, LLMTRAIN_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "shared-cache"))

    def run(out_dir, *extra, timeout=600):
        command = [sys.executable, "-m", "llmtrain", "pretrain", "--model_config", str(tiny_model_file),
                   "--out_dir", str(out_dir), "--data", "BuiltinStories", "--data.num_documents", "400",
                   "--data.num_val_documents", "40", "--train.global_batch_size", "8",
                   "--train.micro_batch_size", "2", "--train.max_seq_length", "32", "--train.lr_warmup_steps", "2",
                   "--train.log_interval", "1", "--eval.interval", "100", "--eval.max_iters", "2",
                   "--optimizer", "AdamW", "--optimizer.lr", "0.003", *extra]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result

    return run


def losses(out_dir):
    with open(Path(out_dir) / "metrics.csv") as handle:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(handle) if r["loss"]}


REFERENCE_STEPS = 6
_REFERENCE: dict = {}


@pytest.fixture
def reference(run_cli, tmp_path_factory) -> Path:
    """The out_dir of one single-process run of REFERENCE_STEPS steps, made once for the module, that the
    multi-process runs compare with. A run of fewer steps logs the same losses up to step 4: the loss of step k
    follows updates 0 .. k-2, and updates 0-1 (warmup, --train.lr_warmup_steps 2) and 2 (the first of the decay,
    at the full rate) use rates that do not depend on the run's length (schedule.lr_at)."""
    if not _REFERENCE:
        out_dir = tmp_path_factory.mktemp("reference") / "reference"
        run_cli(out_dir, "--train.max_steps", str(REFERENCE_STEPS))
        _REFERENCE["out_dir"] = out_dir
    return _REFERENCE["out_dir"]


def reference_losses(reference: Path, steps: int) -> dict[int, float]:
    """The single-process run's losses of its first `steps` steps (at most 4, see `reference`)."""
    assert steps <= 4
    return {step: loss for step, loss in losses(reference).items() if step <= steps}


_TWO_WORKERS: dict = {}


@pytest.fixture
def two_workers(run_cli, tmp_path_factory) -> tuple[Path, str]:
    """The out_dir and output of one 2-worker FSDP run (the default: gradients synced on the last micro-batch only)
    of 6 steps with sharded checkpoints every 3, made once for the module. Its losses up to step 4 are those of
    any shorter run of the same command (see `reference`), and the checkpoint format changes no loss."""
    if not _TWO_WORKERS:
        out_dir = tmp_path_factory.mktemp("two") / "two"
        result = run_cli(out_dir, "--devices", "2", "--fsdp.state_dict_type", "sharded", "--train.max_steps", "6",
                         "--train.save_interval", "3")
        _TWO_WORKERS.update(out_dir=out_dir, stdout=result.stdout)
    return _TWO_WORKERS["out_dir"], _TWO_WORKERS["stdout"]


def test_sharded_checkpoint_from_two_workers_resumes_on_one(tmp_path, run_cli, reference, two_workers):
    assert REFERENCE_STEPS == 6
    two, stdout = two_workers
    assert "FULL_SHARD" in stdout and "world 2" in stdout
    assert (two / "step-00000003" / "dcp").is_dir()
    # The 2-worker run's losses equal the 1-process run's: same global batch, same data order.
    assert losses(two) == pytest.approx(losses(reference), rel=1e-4)

    # Crash after step 3: resume the sharded checkpoint in a single process.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    import shutil

    shutil.copytree(two / "step-00000003", resumed / "step-00000003")
    run_cli(resumed, "--train.max_steps", "6", "--resume", "auto")
    continued = losses(resumed)
    assert [continued[s] for s in (4, 5, 6)] == pytest.approx([losses(reference)[s] for s in (4, 5, 6)], rel=1e-4)
    # final/ is always a full model directory.
    weights = load_file(str(resumed / "final" / "model.safetensors"))
    reference_weights = load_file(str(reference / "final" / "model.safetensors"))
    for name, tensor in reference_weights.items():
        assert (weights[name] - tensor).abs().max() < 1e-4, name


def test_ddp_strategy_matches(tmp_path, run_cli, reference):
    ddp = tmp_path / "ddp"
    result = run_cli(ddp, "--devices", "2", "--strategy", "ddp", "--train.max_steps", "3")
    assert "ddp" in result.stdout
    assert losses(ddp) == pytest.approx(reference_losses(reference, 3), rel=1e-4)


def test_mismatched_devices_under_torchrun_fail_fast(tmp_path, dist_env, free_port):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), "-m", "llmtrain", "pretrain", "llama-debug",
               "--devices", "4", "--out_dir", str(tmp_path / "o"), "--train.max_steps", "1"]
    result = subprocess.run(command, env=dist_env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode != 0
    assert "--devices 4" in result.stdout + result.stderr


def test_two_nodes_as_two_torchrun_commands_use_hybrid_shard(tmp_path, run_cli, dist_env, free_port, tmp_path_factory,
                                                             tiny_model_file, reference):
    """4 processes as 2 "nodes" × 2 devices, one launcher command per node: HSDP on a 2-D mesh."""
    out_dir = tmp_path / "hsdp"
    env = dict(dist_env, LLMTRAIN_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "shared-cache"))
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
                   "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                   "-m", "llmtrain", "pretrain", "--model_config", str(tiny_model_file), "--out_dir", str(out_dir),
                   "--devices", "2", "--num_nodes", "2", "--data", "BuiltinStories", "--data.num_documents", "400",
                   "--data.num_val_documents", "40", "--train.global_batch_size", "8", "--train.micro_batch_size",
                   "2", "--train.max_seq_length", "32", "--train.lr_warmup_steps", "2", "--train.log_interval", "1",
                   "--eval.interval", "100", "--eval.max_iters", "2", "--optimizer", "AdamW", "--optimizer.lr",
                   "0.003", "--train.max_steps", "4"]
        nodes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, cwd=ROOT))
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=600)[0])
    finally:
        for node in nodes:
            node.kill()
    assert all(node.returncode == 0 for node in nodes), "\n".join(o[-3000:] for o in outputs)
    # The mesh really is 2-D: replicated across the 2 nodes, sharded over the 2 devices of each.
    assert "HYBRID_SHARD, mesh replicate 2 × shard 2" in outputs[0]
    assert "world 4" in outputs[0]
    assert losses(out_dir) == pytest.approx(reference_losses(reference, 4), rel=1e-4)
    assert (out_dir / "final" / "model.safetensors").is_file()


def test_gradient_sync_on_every_micro_batch_gives_the_same_losses(tmp_path, run_cli, two_workers):
    """Skipping the sync on all but the last micro-batch (the default: the shared 2-worker run's first 3 steps) and
    syncing every one agree."""
    skip, _ = two_workers
    every = tmp_path / "every"
    run_cli(every, "--devices", "2", "--train.max_steps", "3", "--fsdp.skip_gradient_sync", "false")
    assert sorted(losses(every)) == [1, 2, 3]
    assert losses(every) == pytest.approx({step: loss for step, loss in losses(skip).items() if step <= 3}, rel=1e-5)
