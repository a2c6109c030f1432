"""The pretrain recipe end to end, through the real CLI, on the built-in corpus."""

import csv
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmtrain.cli import main

from conftest import write_tiny_model
from runs import pretrain_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def shared_cache(tmp_path_factory, monkeypatch):
    """One cache for the module: the built-in tokenizer and token files are made once."""
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "shared-cache"))


def read_metrics(out_dir):
    with open(Path(out_dir) / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def train_losses(out_dir):
    return {int(r["step"]): float(r["loss"]) for r in read_metrics(out_dir) if r["loss"]}


def val_losses(out_dir):
    return {int(r["step"]): float(r["val_loss"]) for r in read_metrics(out_dir) if r["val_loss"]}


@pytest.mark.slow
def test_debug_recipe_trains_and_writes_final(tmp_path):
    """The README's main job, shortened to 30 steps on a 2 MB sample of its corpus (tests/convert's sample: it
    tokenizes in about a second of CPU, the whole library in about 11): val loss falls well below the start."""
    out_dir = tmp_path / "debug"
    main(["pretrain", "--config", str(ROOT / "config_hub/pretrain/debug.yaml"), "--train.max_steps", "30",
          "--data.max_bytes", "2000000", "--out_dir", str(out_dir)])
    final = out_dir / "final"
    for name in ("model.safetensors", "model_config.yaml", "hyperparameters.yaml", "tokenizer.json",
                 "tokenizer_config.json", "checkpoint.json"):
        assert (final / name).is_file(), name
    assert (out_dir / "step-00000030" / "training_state.pt").is_file()
    val = val_losses(out_dir)
    assert val[30] < val[0] - 1.5, val  # Python source: from 8.4 (random) to about 4.2 in 30 steps
    # final/ is a model directory other commands accept: it loads into the architecture it names.
    from llmtrain.checkpoint.weights import load_weights
    from llmtrain.config import Config
    from llmtrain.model import GPT

    model = GPT(Config.from_file(final / "model_config.yaml"))
    load_weights(model, final)
    saved = load_file(str(final / "model.safetensors"))
    torch.testing.assert_close(model.wte.weight, saved["wte.weight"], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["auto", "fsdp"], ids=["one-process", "one-rank-fsdp"])
def test_resume_reproduces_uninterrupted_losses(tmp_path, tiny_model_file, strategy):
    """Stop at step 10 of 20, resume, and steps 11-20 equal the uninterrupted run's. One-rank FSDP (DTensor
    parameters and fused AdamW moments) resumes from its full checkpoint too."""
    full = tmp_path / "full"
    main(pretrain_args(tiny_model_file, full, "--train.max_steps", "20", "--train.save_interval", "10",
                   "--strategy", strategy))
    # A run that died right after its step-10 checkpoint: only that checkpoint survives.
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    shutil.copytree(full / "step-00000010", crashed / "step-00000010")
    rows = [r for r in read_metrics(full) if int(r["step"]) <= 13]  # it had logged a few steps past the save
    with open(crashed / "metrics.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    main(pretrain_args(tiny_model_file, crashed, "--train.max_steps", "20", "--train.save_interval", "10",
                   "--resume", "auto", "--strategy", strategy))
    expected, resumed = train_losses(full), train_losses(crashed)
    assert sorted(resumed) == list(range(1, 21))  # rows after the checkpoint were replaced, not duplicated
    assert [resumed[s] for s in range(11, 21)] == [expected[s] for s in range(11, 21)]
    a = load_file(str(full / "final" / "model.safetensors"))
    b = load_file(str(crashed / "final" / "model.safetensors"))
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_resume_true_needs_a_checkpoint(tmp_path, tiny_model_file):
    with pytest.raises(FileNotFoundError, match="--resume true"):
        main(pretrain_args(tiny_model_file, tmp_path / "empty", "--train.max_steps", "2", "--resume", "true"))


def test_out_dir_with_checkpoints_needs_resume(tmp_path, tiny_model_file):
    out_dir = tmp_path / "run"
    main(pretrain_args(tiny_model_file, out_dir, "--train.max_steps", "2"))
    with pytest.raises(ValueError, match="--resume auto"):
        main(pretrain_args(tiny_model_file, out_dir, "--train.max_steps", "2"))


def test_tensorboard_logger_writes_events(tmp_path, tiny_model_file):
    out_dir = tmp_path / "tb"
    main(pretrain_args(tiny_model_file, out_dir, "--train.max_steps", "2", "--logger_name", "tensorboard"))
    assert list((out_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(train_losses(out_dir)) == 2


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-mixed"])
def test_precisions_train(tmp_path, tiny_model_file, precision):
    out_dir = tmp_path / precision
    main(pretrain_args(tiny_model_file, out_dir, "--train.max_steps", "3", "--precision", precision))
    losses = train_losses(out_dir)
    assert len(losses) == 3 and all(l == l and l < 20 for l in losses.values())
    weights = load_file(str(out_dir / "final" / "model.safetensors"))
    expected = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert weights["wte.weight"].dtype == expected


def test_stops_on_max_tokens(tmp_path, tiny_model_file):
    out_dir = tmp_path / "tokens"
    main(pretrain_args(tiny_model_file, out_dir, "--train.max_tokens", str(3 * 4 * 32)))
    assert max(train_losses(out_dir)) == 3


def test_sgd_optimizer_with_arguments(tmp_path, tiny_model_file):
    out_dir = tmp_path / "sgd"
    main(pretrain_args(tiny_model_file, out_dir, "--train.max_steps", "2", "--optimizer", "SGD",
                   "--optimizer.lr", "0.1", "--optimizer.momentum", "0.9"))
    hparams = yaml.safe_load((out_dir / "final" / "hyperparameters.yaml").read_text())
    assert hparams["optimizer"]["class_path"].endswith("SGD")
    assert hparams["optimizer"]["init_args"]["momentum"] == 0.9


def test_initial_checkpoint_dir_starts_from_weights(tmp_path, tiny_model_file):
    first = tmp_path / "first"
    main(pretrain_args(tiny_model_file, first, "--train.max_steps", "2"))
    second = tmp_path / "second"
    main(["pretrain", "--initial_checkpoint_dir", str(first / "final"), "--out_dir", str(second),
          "--data", "BuiltinStories", "--data.num_documents", "400", "--data.num_val_documents", "40",
          "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.max_seq_length", "32",
          "--train.max_steps", "1", "--train.lr_warmup_steps", "0", "--eval.max_iters", "2"])
    # The second run's initial validation loss is the first run's final one: same weights, same data.
    assert val_losses(second)[0] == pytest.approx(val_losses(first)[2], rel=1e-6)


# --------------------------------------------------------------------------------- bad input
def test_unknown_model_suggests_close_names(tmp_path):
    with pytest.raises(ValueError, match="pythia-70m"):
        main(["pretrain", "pythia-70", "--out_dir", str(tmp_path / "x"), "--train.max_steps", "1"])


def test_model_name_and_config_contradict(tmp_path, tiny_model_file):
    with pytest.raises(ValueError, match="not both"):
        main(["pretrain", "llama-debug", "--model_config", str(tiny_model_file), "--out_dir", str(tmp_path)])


def test_resume_and_initial_checkpoint_contradict(tmp_path):
    with pytest.raises(ValueError, match="contradict"):
        main(["pretrain", "llama-debug", "--resume", "auto", "--initial_checkpoint_dir", str(tmp_path),
              "--out_dir", str(tmp_path / "o"), "--train.max_steps", "1"])


def test_batch_arithmetic_error_before_model_is_built(tmp_path, tiny_model_file, monkeypatch):
    import llmtrain.recipes.build as build

    monkeypatch.setattr(build, "build_model", lambda *a, **k: pytest.fail("model built before the check"))
    with pytest.raises(ValueError, match="--train.global_batch_size 5 is not divisible"):
        main(pretrain_args(tiny_model_file, tmp_path / "o", "--train.max_steps", "1", "--train.global_batch_size", "5"))


def test_seq_length_beyond_block_size(tmp_path, tiny_model_file):
    with pytest.raises(ValueError, match="--train.max_seq_length 128 exceeds the block_size 64"):
        main(pretrain_args(tiny_model_file, tmp_path / "o", "--train.max_steps", "1", "--train.max_seq_length", "128"))


def test_tokenizer_larger_than_vocab(tmp_path):
    small = write_tiny_model(tmp_path / "small.yaml", vocab_size=256, padding_multiple=64)
    with pytest.raises(ValueError, match="embedding rows"):
        main(pretrain_args(small, tmp_path / "o", "--train.max_steps", "1"))


def test_missing_data_path_names_the_flag(tmp_path, tiny_model_file):
    with pytest.raises(FileNotFoundError, match="--data.train_data_path"):
        main(["pretrain", "--model_config", str(tiny_model_file), "--out_dir", str(tmp_path / "o"),
              "--data", "TextFiles", "--data.train_data_path", str(tmp_path / "nope"),
              "--tokenizer_dir", str(tmp_path), "--train.max_steps", "1"])


def test_unwritable_out_dir(tmp_path, tiny_model_file):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        import os

        if os.access(locked, os.W_OK):  # root ignores permissions; use a path under a file instead
            target = tmp_path / "a_file"
            target.write_text("")
            out_dir = target / "out"
            with pytest.raises(NotADirectoryError, match="--out_dir"):
                main(pretrain_args(tiny_model_file, out_dir, "--train.max_steps", "1"))
        else:
            with pytest.raises(PermissionError, match="--out_dir"):
                main(pretrain_args(tiny_model_file, locked / "out", "--train.max_steps", "1"))
    finally:
        locked.chmod(0o700)


@pytest.mark.slow
def test_stops_on_epochs(tmp_path, tiny_model_file):
    out_dir = tmp_path / "epochs"
    main(pretrain_args(tiny_model_file, out_dir, "--train.epochs", "0.01"))
    last = out_dir / f"step-{max(train_losses(out_dir)):08d}"
    state = torch.load(last / "training_state.pt", weights_only=True)
    data = state["data"]
    assert data["samples_consumed"] >= 0.01 * data["samples_per_epoch"]
    assert data["samples_consumed"] - 4 < 0.01 * data["samples_per_epoch"]  # stopped at the first step past it


def test_stops_on_max_time_with_a_checkpoint(tmp_path, tiny_model_file):
    out_dir = tmp_path / "time"
    main(pretrain_args(tiny_model_file, out_dir, "--train.max_steps", "100000", "--train.max_time", "1.0"))
    steps = max(train_losses(out_dir))
    assert 1 <= steps < 100000
    assert (out_dir / f"step-{steps:08d}" / "training_state.pt").is_file()
    assert (out_dir / "final" / "model.safetensors").is_file()


def test_too_little_disk_for_one_checkpoint(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * 2**30, 10 * 2**30 - 2**30, 2**30))
    # 1.1B parameters with AdamW need 16 GiB of host memory: on a smaller machine the memory check would speak first.
    monkeypatch.setattr("llmtrain.memory.host_available_bytes", lambda: 2**40)
    with pytest.raises(OSError, match=r"--out_dir .*1\.0 GiB free.*needs about .* GiB") as error:
        main(["pretrain", "tiny-llama-1.1b", "--out_dir", str(tmp_path / "o"), "--train.max_steps", "1"])
    assert "tiny-llama-1.1b" in str(error.value)
    assert not (tmp_path / "o").exists()


def refuse_cuda(monkeypatch) -> None:
    """CUDA "is available", but every torch.cuda call that would initialise it (create a context) raises."""
    def refused(name):
        def call(*args, **kwargs):  # one function per name: torch.compile's rules refuse a shared one
            raise AssertionError(f"a CPU run called {name}")
        return call

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("_lazy_init", "init", "get_rng_state", "set_rng_state", "get_device_name", "set_device",
                 "synchronize", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, refused(f"torch.cuda.{name}"))
    monkeypatch.setattr(torch.Tensor, "pin_memory", refused("Tensor.pin_memory"))


def test_a_cpu_run_on_a_gpu_node_never_calls_into_cuda(tmp_path, tiny_model_file, monkeypatch):
    """--accelerator cpu where CUDA is available: FSDP, a step and its checkpoint."""
    refuse_cuda(monkeypatch)
    out_dir = tmp_path / "cpu"
    main(pretrain_args(tiny_model_file, out_dir, "--accelerator", "cpu", "--strategy", "fsdp", "--devices", "1",
                   "--train.max_steps", "1", "--eval.final_validation", "false"))
    assert sorted(train_losses(out_dir)) == [1]
    assert "cuda" not in torch.load(out_dir / "step-00000001" / "training_state.pt", weights_only=True)["rng"][0]


def test_resuming_a_cpu_run_on_a_gpu_node_leaves_cuda_alone(monkeypatch):
    """A checkpoint written on a GPU holds a CUDA generator; a CPU run restores the CPU ones and never that."""
    from llmtrain.checkpoint.state import capture_rng_state, restore_rng_state

    saved = capture_rng_state(torch.device("cpu"))
    expected = torch.rand(3)
    saved["cuda"] = torch.zeros(16, dtype=torch.uint8)  # as in a checkpoint of a GPU run
    refuse_cuda(monkeypatch)
    restore_rng_state(saved, torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--strategy", "fsdp", "--devices", "1",
                                          "--fsdp.activation_checkpointing", "op")])
def test_compile_trains_each_block_compiled_as_eager_does(tmp_path, tiny_model_file, compiled_blocks, extra):
    """--compile compiles every Block (parallelize.apply_compile) and the losses equal eager's, also under FSDP with
    per-operator checkpointing."""
    compiled = compiled_blocks
    args = ("--train.max_steps", "3", "--eval.final_validation", "false", *extra)
    main(pretrain_args(tiny_model_file, tmp_path / "eager", *args))
    assert compiled == []
    main(pretrain_args(tiny_model_file, tmp_path / "compiled", *args, "--compile", "true"))
    assert compiled and all(compiled)
    eager, fused = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    assert sorted(eager) == sorted(fused) == [1, 2, 3]
    for step in eager:
        assert fused[step] == pytest.approx(eager[step], rel=1e-4)
