"""Asynchronous sharded saves: a checkpoint only once its write finished, the sharded format only, and equal to
synchronous saves on two workers, resumed."""

import pytest
import torch


from tiny_fit import CONFIG, train_tiny


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the single-process write, in its thread
def test_an_async_save_is_no_checkpoint_until_its_write_finished(tmp_path):
    """Killed between save() and wait(), an async save leaves only a temporary directory: resume ignores it."""
    from llmtrain.checkpoint import layout
    from llmtrain.checkpoint.checkpointer import Checkpointer
    from llmtrain.distributed.runtime import Runtime
    from llmtrain.train.loop import TrainState

    job, _ = train_tiny({"fused": True}, max_steps=1)
    checkpointer = Checkpointer(runtime=Runtime(), out_dir=tmp_path, model=job.model, optimizer=job.optimizer,
                                train_loader=job.train_loader, model_config=job.model.config, tokenizer=None,
                                hyperparameters=None, format="sharded", async_save=True)
    weights = {name: p.detach().clone() for name, p in job.model.named_parameters()}
    checkpointer.save(TrainState(step=1, tokens=64))
    with torch.no_grad():  # training goes on while the write runs: the checkpoint keeps the staged weights
        for p in job.model.parameters():
            p.add_(1.0)
    assert layout.list_checkpoints(tmp_path) == [] and layout.latest_checkpoint(tmp_path) is None
    checkpointer.wait()
    assert [step for step, _ in layout.list_checkpoints(tmp_path)] == [1]
    fresh, _ = train_tiny({"fused": True}, max_steps=1)
    reader = Checkpointer(runtime=Runtime(), out_dir=tmp_path, model=fresh.model, optimizer=fresh.optimizer,
                          train_loader=fresh.train_loader, model_config=None, tokenizer=None, hyperparameters=None,
                          format="sharded")
    reader.load(tmp_path / "step-00000001", TrainState())
    for name, p in fresh.model.named_parameters():
        assert torch.equal(p, weights[name]), name


def test_async_flag_needs_the_sharded_format():
    from llmtrain.args import FSDPArgs

    with pytest.raises(ValueError, match="--fsdp.async_save true needs --fsdp.state_dict_type sharded"):
        FSDPArgs(async_save=True)
    assert FSDPArgs(async_save=True, state_dict_type="sharded").async_save
    from llmtrain.checkpoint.checkpointer import build_checkpointer

    with pytest.raises(ValueError, match="--fsdp.async_save true needs --fsdp.state_dict_type sharded"):
        build_checkpointer("full", async_save=True)


def test_two_workers_async_checkpoints_equal_sync_ones_and_resume(tmp_path, dist_env, monkeypatch):
    """FSDP on 2 gloo workers: every async checkpoint holds exactly the sync one's state, and resumes. The two runs are
    real ``python -m llmtrain`` processes forked one after the other from one interpreter (tests/helpers/forked_cli.py;
    each spawns its two workers); the resume on one process runs in this one."""
    import shutil

    import yaml
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from forked_cli import run_forked
    from llmtrain.cli import main

    model_file = tmp_path / "tiny.yaml"
    model_file.write_text(yaml.safe_dump({**CONFIG, "vocab_size": 1100, "padding_multiple": 64}))
    cache = str(tmp_path / "cache")

    def run(out_dir, *extra):
        return ["pretrain", "--model_config", str(model_file), "--out_dir", str(out_dir), "--data", "BuiltinStories",
                "--data.num_documents", "200", "--data.num_val_documents", "20", "--train.global_batch_size", "4",
                "--train.micro_batch_size", "2", "--train.max_seq_length", "32", "--eval.interval", "100",
                "--eval.initial_validation", "false", "--eval.final_validation", "false", "--train.max_steps", "4",
                "--train.save_interval", "2", "--fsdp.state_dict_type", "sharded", *extra]

    runs = run_forked([run(tmp_path / "sync", "--devices", "2"),
                       run(tmp_path / "async", "--devices", "2", "--fsdp.async_save", "true")],
                      tmp_path / "logs", dict(dist_env, LLMTRAIN_CACHE_DIR=cache), timeout_s=1200, at_once=1)
    for done in runs:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for step in ("step-00000002", "step-00000004"):
        states = []
        for kind in ("sync", "async"):
            dcp_to_torch_save(tmp_path / kind / step / "dcp", tmp_path / f"{kind}-{step}.pt")
            states.append(torch.load(tmp_path / f"{kind}-{step}.pt", weights_only=False))
        flat = [dict(_flatten(state)) for state in states]
        assert flat[0].keys() == flat[1].keys() and any("exp_avg" in key for key in flat[0])
        for key, value in flat[0].items():
            assert torch.equal(value, flat[1][key]) if torch.is_tensor(value) else value == flat[1][key], key
        assert not list((tmp_path / "async").glob(".step-*"))

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "async" / "step-00000002", resumed / "step-00000002")
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", cache)
    main(run(resumed, "--devices", "1", "--resume", "auto"))
    final = load_file(str(resumed / "final" / "model.safetensors"))
    for name, tensor in load_file(str(tmp_path / "sync" / "final" / "model.safetensors")).items():
        assert torch.allclose(final[name], tensor, atol=1e-5), name


def _flatten(value, prefix=""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}{key}.")
    else:
        yield prefix, value
