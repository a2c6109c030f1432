"""`llmtrain pretrain --devices N` through the real CLI: spawned workers, FSDP, sharded checkpoints."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from forked_cli import run_forked

ROOT = Path(__file__).resolve().parents[2]


def pretrain_args(tiny_model_file: Path, out_dir: Path, *extra: str) -> list[str]:
    """`llmtrain pretrain` of the tiny model on a few BuiltinStories documents, logging every step's loss."""
    return ["pretrain", "--model_config", str(tiny_model_file), "--out_dir", str(out_dir), "--data", "BuiltinStories",
            "--data.num_documents", "400", "--data.num_val_documents", "40", "--train.global_batch_size", "8",
            "--train.micro_batch_size", "2", "--train.max_seq_length", "32", "--train.lr_warmup_steps", "2",
            "--train.log_interval", "1", "--eval.interval", "100", "--eval.max_iters", "2", "--optimizer", "AdamW",
            "--optimizer.lr", "0.003", *extra]


@pytest.fixture
def cli_env(dist_env, tmp_path_factory) -> dict:
    return dict(dist_env, LLMTRAIN_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "shared-cache"))


@pytest.fixture
def run_cli(tiny_model_file, cli_env):
    def run(out_dir, *extra, timeout=600):
        command = [sys.executable, "-m", "llmtrain", *pretrain_args(tiny_model_file, out_dir, *extra)]
        result = subprocess.run(command, env=cli_env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result

    return run


def losses(out_dir):
    with open(Path(out_dir) / "metrics.csv") as handle:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(handle) if r["loss"]}


REFERENCE_STEPS = 6
# The module's runs that build on no other run, each a `python -m llmtrain pretrain` process of its own, one after
# another, forked from one interpreter that imported the CLI once (tests/helpers/forked_cli.py): {name: (out_dir,
# the command's result)}. Made once for the module, on first use.
_RUNS: dict = {}


def independent_runs(tiny_model_file: Path, env: dict, root: Path) -> dict:
    """- "reference": one process, REFERENCE_STEPS steps, that the multi-process runs compare with. A run of fewer
      steps logs the same losses up to step 4: the loss of step k follows updates 0 .. k-2, and updates 0-1 (warmup,
      --train.lr_warmup_steps 2) and 2 (the first of the decay, at the full rate) use rates that do not depend on the
      run's length (schedule.lr_at).
    - "two": 2 workers under FSDP (the default: gradients synced on the last micro-batch only), 6 steps with sharded
      checkpoints every 3. Its losses up to step 4 are those of any shorter run of the same command (see above), and
      the checkpoint format changes no loss.
    - "ddp": 2 workers under --strategy ddp, 3 steps.
    - "every": 2 workers under FSDP syncing gradients on every micro-batch, 3 steps."""
    extras = {"reference": ["--train.max_steps", str(REFERENCE_STEPS)],
              "two": ["--devices", "2", "--fsdp.state_dict_type", "sharded", "--train.max_steps", "6",
                      "--train.save_interval", "3"],
              "ddp": ["--devices", "2", "--strategy", "ddp", "--train.max_steps", "3"],
              "every": ["--devices", "2", "--train.max_steps", "3", "--fsdp.skip_gradient_sync", "false"]}
    out_dirs = {name: root / name for name in extras}
    done = run_forked([pretrain_args(tiny_model_file, out_dirs[name], *extra) for name, extra in extras.items()],
                      root / "logs", env, timeout_s=600 * len(extras), at_once=1)  # a hang guard
    for result in done:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {name: (out_dirs[name], result) for name, result in zip(extras, done)}


@pytest.fixture
def runs(tiny_model_file, cli_env, tmp_path_factory) -> dict:
    if not _RUNS:
        _RUNS.update(independent_runs(tiny_model_file, cli_env, tmp_path_factory.mktemp("runs")))
    return _RUNS


@pytest.fixture
def reference(runs) -> Path:
    """The out_dir of the single-process run of REFERENCE_STEPS steps (see independent_runs)."""
    return runs["reference"][0]


def reference_losses(reference: Path, steps: int) -> dict[int, float]:
    """The single-process run's losses of its first `steps` steps (at most 4, see independent_runs)."""
    assert steps <= 4
    return {step: loss for step, loss in losses(reference).items() if step <= steps}


@pytest.fixture
def two_workers(runs) -> tuple[Path, str]:
    """The out_dir and output of the 2-worker FSDP run of 6 steps (see independent_runs)."""
    out_dir, result = runs["two"]
    return out_dir, result.stdout


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


def test_ddp_strategy_matches(runs, reference):
    ddp, result = runs["ddp"]
    assert "ddp" in result.stdout
    assert losses(ddp) == pytest.approx(reference_losses(reference, 3), rel=1e-4)


def test_mismatched_devices_under_torchrun_fail_fast(tmp_path, dist_env, free_port):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), "-m", "llmtrain", "pretrain", "llama-debug",
               "--devices", "4", "--out_dir", str(tmp_path / "o"), "--train.max_steps", "1"]
    result = subprocess.run(command, env=dist_env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode != 0
    assert "--devices 4" in result.stdout + result.stderr


def test_two_nodes_as_two_torchrun_commands_use_hybrid_shard(tmp_path, cli_env, free_port, tiny_model_file, reference):
    """4 processes as 2 "nodes" × 2 devices, one launcher command per node: HSDP on a 2-D mesh."""
    out_dir = tmp_path / "hsdp"
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
                   "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                   "-m", "llmtrain", *pretrain_args(tiny_model_file, out_dir, "--devices", "2", "--num_nodes", "2",
                                                    "--train.max_steps", "4")]
        nodes.append(subprocess.Popen(command, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
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


def test_gradient_sync_on_every_micro_batch_gives_the_same_losses(runs, two_workers):
    """Skipping the sync on all but the last micro-batch (the default: the shared 2-worker run's first 3 steps) and
    syncing every one agree."""
    skip, _ = two_workers
    every, _ = runs["every"]
    assert sorted(losses(every)) == [1, 2, 3]
    assert losses(every) == pytest.approx({step: loss for step, loss in losses(skip).items() if step <= 3}, rel=1e-5)
