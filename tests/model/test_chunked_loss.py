"""The loss without the full logits: chunked cross-entropy and the fused head loss, equal to full-logits autograd,
loud where they cannot apply, and never holding a whole logits tensor."""

import pytest
import torch
import torch.nn.functional as F

from llmtrain.config import Config
from llmtrain.loss import IGNORE_INDEX, head_loss_sum
from llmtrain.model import GPT

from tiny_fit import CONFIG


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
