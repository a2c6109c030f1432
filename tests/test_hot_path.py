"""The training step's fast paths: chunked cross-entropy, fused AdamW."""

import pytest
import torch
import torch.nn.functional as F

from llmtrain.config import Config
from llmtrain.model import GPT, IGNORE_INDEX, head_loss_sum
from llmtrain.recipes.common import build_optimizer

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


PEAK_SCRIPT = """
import sys, torch, torch.nn.functional as F
from llmtrain.model import head_loss_sum
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

    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, mode], capture_output=True, text=True, timeout=120,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                               # a fixed threshold: large tensors come from mmap and go back when freed, so the
                               # peak RSS follows live tensors rather than glibc's heap growth
                               "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


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
