"""The training step's fast paths: chunked cross-entropy, fused AdamW, no device reads between log steps,
prefetched batches, asynchronous sharded saves."""

import math

import pytest
import torch
import torch.nn.functional as F

import faults
from llmtrain.config import Config
from llmtrain.loss import IGNORE_INDEX, head_loss_sum
from llmtrain.model import GPT
from llmtrain.optim import build_optimizer

CONFIG = dict(name="hot", vocab_size=1000, padding_multiple=8, block_size=64, n_layer=2, n_head=2, n_embd=32,
              n_query_groups=1, intermediate_size=64)


def reference_loss(model, tokens, labels):
    logits = model(tokens)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("chunk_tokens", [16, 50, 1000])  # several chunks, a ragged last one, a single chunk
def test_chunked_loss_and_gradients_equal_the_full_logits_ones(chunk_tokens, monkeypatch):
    torch.manual_seed(0)
    model = GPT(Config(**CONFIG))
    tokens = torch.randint(0, 1000, (2, 64))
    labels = torch.randint(0, 1000, (2, 64))
    labels[0, :10] = IGNORE_INDEX  # prompt tokens of an instruction sample
    expected = reference_loss(model, tokens, labels)
    expected.backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    import llmtrain.model as model_module

    real = model_module.head_loss_sum
    monkeypatch.setattr(model_module, "head_loss_sum",
                        lambda head, hidden, labels: real(head, hidden, labels, chunk_tokens=chunk_tokens))
    loss = model(tokens, labels=labels)
    loss.backward()
    assert torch.allclose(loss, expected, rtol=1e-5)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected_grads[name], rtol=1e-4, atol=1e-6), name



class ScaledHead(torch.nn.Linear):
    """Not a plain nn.Linear (as a LoRA or quantized head is not): the generic checkpointed path."""


@pytest.mark.parametrize("case", ["bias", "frozen_weight", "bf16_mixed", "bf16_true", "generic_head", "all_ignored"])
def test_fused_head_loss_matches_autograd_through_full_logits(case):
    torch.manual_seed(0)
    head_class = ScaledHead if case == "generic_head" else torch.nn.Linear
    head = head_class(24, 300, bias=case == "bias")
    hidden = torch.randn(3, 40, 24, requires_grad=True)
    labels = torch.randint(0, 300, (3, 40))
    labels[:, :7] = IGNORE_INDEX
    if case == "all_ignored":
        labels[:] = IGNORE_INDEX
    if case == "frozen_weight":
        head.weight.requires_grad_(False)
    if case == "bf16_true":
        head, hidden = head.to(torch.bfloat16), hidden.detach().to(torch.bfloat16).requires_grad_()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16_mixed")

    def grads(loss):
        inputs = [t for t in (hidden, head.weight, head.bias) if t is not None and t.requires_grad]
        return loss.detach(), torch.autograd.grad(loss * 0.5, inputs)

    with autocast:
        expected, expected_grads = grads(F.cross_entropy(head(hidden).float().flatten(0, 1), labels.flatten(),
                                                         ignore_index=IGNORE_INDEX, reduction="sum"))
    with autocast:
        got, got_grads = grads(head_loss_sum(head, hidden, labels, chunk_tokens=32))  # 4 chunks, a ragged last
    tolerance = dict(rtol=2e-2, atol=2e-2) if case.startswith("bf16") else dict(rtol=1e-5, atol=1e-6)
    assert torch.allclose(got, expected, **tolerance), (got, expected)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.allclose(g.float(), e.float(), **tolerance)
    if case == "all_ignored":
        assert got == 0 and all(not g.any() for g in got_grads)


def test_both_ways_to_the_chunk_loss_give_cross_entropy_and_its_gradient():
    """The CPU's log-softmax path and the other devices' max-and-sum path (tested here on the CPU): the summed loss
    and softmax minus one-hot of F.cross_entropy, in float64; ignored rows add no loss, and their gradient rows are
    zero (max and sum) or masked out by the caller (log-softmax, whose row mask is the valid rows)."""
    from llmtrain.loss import _loss_and_grad_by_log_softmax, _loss_and_grad_by_max_and_sum

    generator = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(12, 50, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 50, (12,), generator=generator)
    labels[[2, 7]] = IGNORE_INDEX
    valid = labels != IGNORE_INDEX
    x = logits.clone().requires_grad_()
    want = F.cross_entropy(x, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    (want_grad,) = torch.autograd.grad(want, x)
    for way in (_loss_and_grad_by_log_softmax, _loss_and_grad_by_max_and_sum):
        loss, grad = way(logits.clone(), labels, valid)
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad[valid], want_grad[valid], rtol=1e-12, atol=1e-12)
    _, grad = _loss_and_grad_by_max_and_sum(logits.clone(), labels, valid)
    assert not grad[~valid].any()
    for way in (_loss_and_grad_by_log_softmax, _loss_and_grad_by_max_and_sum):
        with pytest.raises((IndexError, RuntimeError), match="out of bounds|index"):
            way(logits.clone(), torch.where(valid, labels, 0).index_fill(0, torch.tensor([4]), 50), valid)


def test_fused_head_loss_fails_loudly_on_a_label_outside_the_vocabulary():
    """A label past the head's rows is an index error, not a token that silently counts its target logit as 0."""
    head = torch.nn.Linear(16, 32)
    hidden, labels = torch.randn(1, 8, 16, requires_grad=True), torch.randint(0, 32, (1, 8))
    labels[0, 3] = 32
    with pytest.raises((IndexError, RuntimeError), match="out of bounds|index"):
        head_loss_sum(head, hidden, labels)


def test_fused_head_loss_is_taken_only_for_a_plain_linear_head_with_gradients(monkeypatch):
    import llmtrain.loss as loss_module

    calls = []
    real = loss_module.LinearCrossEntropy.apply
    monkeypatch.setattr(loss_module.LinearCrossEntropy, "apply", lambda *a: calls.append(1) or real(*a))
    hidden, labels = torch.randn(1, 8, 16, requires_grad=True), torch.randint(0, 32, (1, 8))
    head_loss_sum(torch.nn.Linear(16, 32), hidden, labels)
    assert calls == [1]
    with torch.no_grad():  # validation: the loss only
        head_loss_sum(torch.nn.Linear(16, 32), hidden, labels)
    head_loss_sum(ScaledHead(16, 32), hidden, labels)
    assert calls == [1]


def test_a_hooked_head_runs_so_that_its_hooks_act_in_training_as_in_validation(monkeypatch):
    """A forward hook that changes the logits (soft-capping, say): the fused loss never calls the head, so the head
    runs instead, and training's loss and gradients are the hooked head's, as validation's loss is."""
    import llmtrain.loss as loss_module

    calls = []
    real = loss_module.LinearCrossEntropy.apply
    monkeypatch.setattr(loss_module.LinearCrossEntropy, "apply", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 32, dtype=torch.float64)
    hidden = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 32, (2, 8))
    labels[0, :3] = IGNORE_INDEX
    capped = lambda logits: 3 * torch.tanh(logits / 3)  # noqa: E731
    want = F.cross_entropy(capped(head(hidden)).flatten(0, 1), labels.flatten(), reduction="sum")
    want_grads = torch.autograd.grad(want, (hidden, head.weight, head.bias))
    handle = head.register_forward_hook(lambda module, args, out: capped(out))
    got = head_loss_sum(head, hidden, labels, chunk_tokens=4)
    got_grads = torch.autograd.grad(got, (hidden, head.weight, head.bias))
    with torch.no_grad():
        validation = head_loss_sum(head, hidden, labels, chunk_tokens=4)
    assert not calls
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)  # the loss sums in float32
    torch.testing.assert_close(validation, want.float(), rtol=1e-6, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)  # the generic path: float32 logits
    handle.remove()
    head_loss_sum(head, hidden, labels)
    assert calls == [1]


def test_fused_head_loss_refuses_a_double_backward_loudly():
    """Its forward computes the gradients, which the backward only scales: a gradient of that gradient (a gradient
    penalty) fails rather than come out wrong."""
    head = torch.nn.Linear(16, 32, dtype=torch.float64)
    hidden = torch.randn(1, 8, 16, dtype=torch.float64, requires_grad=True)
    loss = head_loss_sum(head, hidden, torch.randint(0, 32, (1, 8)))
    with pytest.raises(RuntimeError, match="LinearCrossEntropy computes first-order gradients only"):
        torch.autograd.grad(loss, hidden, create_graph=True)


def test_a_gradient_penalty_through_the_model_fails_loudly():
    """Every written-out backward of a training step (RMSNorm, attention, the gated MLP, the loss) refuses
    create_graph: the second-order terms of any of them would be missing, not just of the last one."""
    torch.manual_seed(0)
    model = GPT(Config.from_name("llama-debug"))
    model.init_weights()
    tokens = torch.randint(0, model.config.vocab_size, (2, 33))
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    with pytest.raises(RuntimeError, match="computes first-order gradients only"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()  # without create_graph, as training runs
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.multiproc
def test_fsdp_hooks_on_the_head_keep_the_fused_loss(monkeypatch):
    """FSDP2 hooks the final norm and head to gather their weights; that bookkeeping is not a hook the loss must
    run the head for. One process, a real gloo group and llmtrain's own FSDP units."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import llmtrain.loss as loss_module
    from conftest import free_port_number, tiny_config
    from llmtrain.distributed.parallelize import apply_fsdp
    from llmtrain.fused import runs_hooks
    from llmtrain.precision import Precision

    calls = []
    real = loss_module.LinearCrossEntropy.apply
    monkeypatch.setattr(loss_module.LinearCrossEntropy, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_number()}", rank=0, world_size=1,
                            timeout=__import__("datetime").timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = GPT(tiny_config("llama-debug"))
        model.init_weights()
        tokens = torch.randint(0, model.config.vocab_size, (2, 17))
        want = model(tokens[:, :-1], labels=tokens[:, 1:])
        assert calls == [1]
        apply_fsdp(model, init_device_mesh("cpu", (1,)), reshard_after_forward=True, precision=Precision("32-true"),
                   cpu_offload=False, one_host=True)
        assert model.lm_head._forward_pre_hooks and not runs_hooks(model.lm_head)
        got = model(tokens[:, :-1], labels=tokens[:, 1:])
        got.backward()
        assert calls == [1, 1]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    finally:
        dist.destroy_process_group()


PEAK_SCRIPT = """
import sys, torch, torch.nn.functional as F
from llmtrain.loss import head_loss_sum
torch.manual_seed(0)
head = torch.nn.Linear(64, 32768, bias=False)
hidden = torch.randn(1, 2048, 64, requires_grad=True)
labels = torch.randint(0, 32768, (1, 2048))
warm = torch.nn.Linear(64, 64)  # the math libraries' first-call buffers are not the loss's
F.cross_entropy(warm(hidden[0, :8]), labels[0, :8] % 64).backward()
hidden.grad = None
def high_water():  # this process image's peak RSS (ru_maxrss would carry the forking parent's)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
before = high_water()
if sys.argv[1] == "full":
    F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), reduction="sum").backward()
else:
    head_loss_sum(head, hidden, labels, chunk_tokens=128).backward()
print((high_water() - before) * 1024)
"""


def peak_growth(mode: str) -> int:
    """Growth of the peak resident memory of a fresh process over one loss forward and backward."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, mode], capture_output=True, text=True, timeout=600,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                               # a fixed threshold: large tensors come from mmap and go back when freed, so the
                               # peak RSS follows live tensors rather than glibc's heap growth
                               "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


@pytest.mark.slow
def test_chunked_loss_never_holds_the_full_logits():
    """A 32k vocabulary over 2048 tokens: 256 MiB of fp32 logits, which the chunked loss never allocates."""
    logits_bytes = 2048 * 32768 * 4
    full, chunked = peak_growth("full"), peak_growth("chunked")
    print(f"loss peak growth: full logits {full / 2**20:.0f} MiB, chunked {chunked / 2**20:.0f} MiB")
    assert full > 2 * logits_bytes  # logits, log-softmax and their gradients at once
    assert chunked < 0.75 * logits_bytes  # less than one full logits tensor ever existed


def test_adam_runs_fused_unless_told_otherwise():
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    assert build_optimizer("AdamW", params).defaults["fused"] is True
    assert build_optimizer("torch.optim.Adam", params).defaults["fused"] is True
    explicit = build_optimizer(lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True), params)
    assert explicit.defaults["foreach"] is True and not explicit.defaults["fused"]
    assert build_optimizer(lambda p: torch.optim.AdamW(p, fused=False), params).defaults["fused"] is False
    kept = build_optimizer(lambda p: torch.optim.AdamW(p, lr=0.123, betas=(0.8, 0.9), weight_decay=0.3), params)
    assert kept.defaults["fused"] and kept.defaults["lr"] == 0.123 and kept.defaults["betas"] == (0.8, 0.9)
    assert kept.defaults["weight_decay"] == 0.3


def test_fused_adamw_matches_the_loop_implementation():
    torch.manual_seed(0)
    weights = [torch.randn(64, 64) for _ in range(3)]
    results = []
    for kwargs in ({"foreach": False}, {"fused": True}):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kwargs)
        for step in range(5):
            for index, p in enumerate(params):
                p.grad = torch.sin(p.detach() * (step + index + 1))
            optimizer.step()
        results.append(params)
    for loop, fused in zip(*results):
        assert torch.allclose(loop, fused, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------ host-device reads
class Batches:
    """Random token windows served as micro-batches, with a position like a data module's loader."""

    def __init__(self, micro_batch_size, length=16):
        self.generator = torch.Generator().manual_seed(1)
        self.micro_batch_size, self.length, self.position = micro_batch_size, length, 0

    epoch = property(lambda self: self.position / 1000)

    def __iter__(self):
        return self

    def __next__(self):
        self.position += self.micro_batch_size
        rows = torch.randint(0, 64, (self.micro_batch_size, self.length + 1), generator=self.generator)
        return {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class Rows:
    def __init__(self):
        self.rows = []

    def log(self, metrics):
        self.rows.append(dict(metrics))

    def close(self):
        pass


def train_tiny(optimizer_kwargs, max_steps=8, log_interval=4):
    from llmtrain.args import EvalArgs, TrainArgs, batch_plan
    from llmtrain.distributed.runtime import Runtime
    from llmtrain.train.horizon import plan_horizon
    from llmtrain.train.loop import Fit, fit
    from llmtrain.precision import Precision

    torch.manual_seed(0)
    model = GPT(Config(**{**CONFIG, "vocab_size": 64, "padding_multiple": 64, "block_size": 16}))
    model.init_weights()
    train = TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=max_steps, lr_warmup_steps=0,
                      save_interval=None, log_interval=log_interval, max_nonfinite_steps=3)
    rows = Rows()
    job = Fit(runtime=Runtime(), model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2,
                                                                          **optimizer_kwargs),
              train_loader=Batches(2), val_loader=None, train=train,
              eval=EvalArgs(initial_validation=False, final_validation=False), plan=batch_plan(train, 1),
              horizon=plan_horizon(train, 1, None), precision=Precision("32-true"),
              save_checkpoint=lambda state: None, save_final=lambda state: None, loggers=[rows])
    return job, rows


def test_fused_adamw_steps_read_nothing_from_the_device_between_log_steps(monkeypatch):
    """Every conversion of a tensor to Python is counted by the step it falls in; only log steps may have any.

    A NaN at step 2 is skipped on the device and reported at step 4 (the next log step) with its number,
    and the weights end where the host-decided skip of a foreach AdamW puts them.
    """
    from llmtrain.train import loop, nonfinite
    from llmtrain.train.schedule import WarmupDecaySchedule

    nan_at_step_2 = faults.NanLoss([2])
    reference, _ = train_tiny({"foreach": True})
    with faults.installed(nan_at_step_2):
        loop.fit(reference)
    job, rows = train_tiny({"fused": True})
    assert nonfinite._skips_on_device(job.optimizer, None) and not nonfinite._skips_on_device(reference.optimizer, None)

    reads = {}  # step being trained -> conversions counted
    current = [0]
    real_set_step = WarmupDecaySchedule.set_step

    def set_step(self, step):
        current[0] = step + 1
        return real_set_step(self, step)

    monkeypatch.setattr(WarmupDecaySchedule, "set_step", set_step)
    for name in ("item", "cpu", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, **kwargs):
            reads[current[0]] = reads.get(current[0], 0) + 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    with faults.installed(nan_at_step_2):
        loop.fit(job)
    monkeypatch.undo()

    assert [step for step in range(1, 9) if reads.get(step)] == [4, 8], reads
    assert [(row["step"], math.isnan(row["grad_norm"])) for row in rows.rows if row.get("skipped")] == [(2, True)]
    assert [row["step"] for row in rows.rows if "loss" in row] == [4, 8]
    assert all(0 <= row["data_wait_fraction"] < 1 for row in rows.rows if "loss" in row)
    assert job.optimizer.state[next(iter(job.model.parameters()))]["step"] == 7  # the skipped step is not counted
    for fused, foreach in zip(job.model.parameters(), reference.model.parameters()):
        assert torch.allclose(fused, foreach, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ asynchronous saves
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


def test_two_workers_async_checkpoints_equal_sync_ones_and_resume(tmp_path, dist_env):
    """FSDP on 2 gloo workers: every async checkpoint holds exactly the sync one's state, and resumes."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model_file = tmp_path / "tiny.yaml"
    model_file.write_text(yaml.safe_dump({**CONFIG, "vocab_size": 1100, "padding_multiple": 64}))
    root = Path(__file__).resolve().parents[2]

    def run(out_dir, *extra):
        command = [sys.executable, "-m", "llmtrain", "pretrain", "--model_config", str(model_file), "--out_dir",
                   str(out_dir), "--data", "BuiltinStories", "--data.num_documents", "200",
                   "--data.num_val_documents", "20", "--train.global_batch_size", "4", "--train.micro_batch_size",
                   "2", "--train.max_seq_length", "32", "--eval.interval", "100", "--eval.initial_validation",
                   "false", "--eval.final_validation", "false", "--train.max_steps", "4", "--train.save_interval",
                   "2", "--fsdp.state_dict_type", "sharded", *extra]
        done = subprocess.run(command, env=dict(dist_env, LLMTRAIN_CACHE_DIR=str(tmp_path / "cache")), cwd=root,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    run(tmp_path / "sync", "--devices", "2")
    run(tmp_path / "async", "--devices", "2", "--fsdp.async_save", "true")
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
    import shutil

    shutil.copytree(tmp_path / "async" / "step-00000002", resumed / "step-00000002")
    run(resumed, "--devices", "1", "--resume", "auto")
    final = load_file(str(resumed / "final" / "model.safetensors"))
    for name, tensor in load_file(str(tmp_path / "sync" / "final" / "model.safetensors")).items():
        assert torch.allclose(final[name], tensor, atol=1e-5), name


def _flatten(value, prefix=""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}{key}.")
    else:
        yield prefix, value


# ------------------------------------------------------------------------------ prefetching
def counting_loader(prefetch, made=None):
    """A TrainLoader whose batches are row windows; each batch made is noted in ``made``."""
    import numpy as np

    from llmtrain.data.base import TrainLoader

    def make_batch(indices):
        if made is not None:
            made.append(indices.tolist())
        rows = torch.as_tensor(np.stack([np.arange(i, i + 9) for i in indices.tolist()]))
        return {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}

    loader = TrainLoader(50, make_batch, micro_batch_size=2, dp_rank=1, dp_size=2, seed=3)
    loader.prefetch = prefetch
    return loader


def test_prefetch_hides_batch_making_and_keeps_the_exact_position():
    import time

    made = {"eager": [], "ahead": []}
    eager, ahead = counting_loader(0, made["eager"]), counting_loader(2, made["ahead"])
    for name, loader in (("eager", eager), ("ahead", ahead)):
        batches = []
        for index in range(30):
            batches.append(next(loader))
            if name == "eager":
                assert len(made["eager"]) == index + 1  # made when asked for, never ahead
            elif index == 0:
                # While the first batch trains, the background thread makes the next two without being asked.
                hang_guard = time.monotonic() + 60
                while len(made["ahead"]) < 3 and time.monotonic() < hang_guard:
                    time.sleep(0.01)
                assert len(made["ahead"]) == 3
            if index == 11:
                state = loader.state_dict()  # a checkpoint: only the batches handed out count
                assert state["samples_consumed"] == 12 * 4
        assert loader.samples_consumed == 30 * 4
        if name == "ahead":
            for mine, reference in zip(batches, eager_batches):
                assert torch.equal(mine["input_ids"], reference["input_ids"])
            resumed = counting_loader(2)
            resumed.load_state_dict(state)
            for reference in eager_batches[12:16]:
                assert torch.equal(next(resumed)["input_ids"], reference["input_ids"])
            ahead.load_state_dict(state)  # a loader that moved back drops what it made for later positions
            assert torch.equal(next(ahead)["input_ids"], eager_batches[12]["input_ids"])
        eager_batches = batches
