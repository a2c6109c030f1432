"""The measuring scripts' own arithmetic: the profile reader's phase, operator and device sums, and the GPU check's
list of commands (each a valid llmtrain command line)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(path: str):
    """The script at ``path`` (from the repository root) as a module."""
    spec = importlib.util.spec_from_file_location(f"scripts_{Path(path).stem}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def span(name, ts, dur, cat="cpu_op", **extra):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 1, "tid": 1, **extra}


def test_profile_reader_sums_phases_self_times_and_device_work(tmp_path):
    profile_step = load("bench/ab/profile_step.py")
    events = []
    for step, start in enumerate((0, 1000)):  # two steps of 1,000 us each
        events += [span(f"ProfilerStep#{step}", start, 1000, cat="user_annotation"),
                   span("llmtrain.forward", start + 100, 400, cat="user_annotation"),
                   span("aten::linear", start + 100, 300), span("aten::mm", start + 150, 200),
                   span("llmtrain.backward", start + 500, 300, cat="user_annotation"),
                   span("aten::mul", start + 500, 100),
                   # the device: two kernels and a copy, 150 us busy; one launch call and one synchronization
                   span("nvjet_gemm", start + 160, 100, cat="kernel"),
                   span("elementwise", start + 520, 30, cat="kernel"),
                   span("Memcpy DtoH", start + 900, 20, cat="gpu_memcpy"),
                   span("cudaLaunchKernel", start + 155, 5, cat="cuda_runtime"),
                   span("cudaStreamSynchronize", start + 890, 30, cat="cuda_runtime")]
    trace = tmp_path / "rank0.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    result = profile_step.parse_trace(trace, steps=2)
    assert result["step_ms"] == pytest.approx(1.0)
    assert result["phases_ms"]["forward"] == pytest.approx(0.4)
    assert result["phases_ms"]["backward"] == pytest.approx(0.3)
    assert result["phases_ms"]["other"] == pytest.approx(0.3)
    # self times: linear's 300 us less the 200 us of mm inside it
    assert result["operators_ms"]["aten::linear"] == pytest.approx(0.1)
    assert result["operators_ms"]["aten::mm"] == pytest.approx(0.2)
    assert result["device_busy_ms"] == pytest.approx(0.15)
    assert result["launches_per_step"] == 3
    assert result["host_waits_per_step"] == 1
    assert result["device_kernels_ms"]["nvjet_gemm"] == pytest.approx(0.1)


def test_profile_reader_reports_no_device_numbers_for_a_cpu_trace(tmp_path):
    profile_step = load("bench/ab/profile_step.py")
    trace = tmp_path / "rank0.json"
    trace.write_text(json.dumps({"traceEvents": [span("ProfilerStep#0", 0, 500, cat="user_annotation"),
                                                 span("aten::mm", 10, 400)]}))
    result = profile_step.parse_trace(trace, steps=1)
    assert "device_busy_ms" not in result and result["operators_ms"]["aten::mm"] == pytest.approx(0.4)


@pytest.mark.parametrize("cpu", [True, False])
def test_gpu_check_commands_parse_as_llmtrain_commands(tmp_path, cpu, capsys):
    """Every command the GPU check runs is accepted by llmtrain's parser: a typo would cost a lent GPU's time."""
    from llmtrain.cli import main

    gpu_check = load("scripts/gpu_check.py")
    commands = gpu_check.checks(tmp_path, cpu=cpu)
    assert len({name for name, _, _ in commands}) == len(commands) == 13
    for name, arguments, _ in commands:
        if name in gpu_check.PROBES:  # the script's own probes (tests/distributed/test_process_groups.py runs one)
            continue
        with pytest.raises(SystemExit) as stop:  # --print_config parses every flag, prints and exits
            main([*arguments, "--print_config"])
        assert stop.value.code == 0, name
    assert "max_steps" in capsys.readouterr().out



def test_gemm_floor_counts_each_products_flops():
    import torch

    gemm_floor = load("bench/ab/gemm_floor.py")
    a, b = torch.empty(2, 3), torch.empty(3, 4)
    assert gemm_floor.product_flops("mm", [a, b]) == 2 * 2 * 3 * 4
    assert gemm_floor.product_flops("addmm", [torch.empty(4), a, b]) == 2 * 2 * 3 * 4  # the bias adds no product
    assert gemm_floor.product_flops("bmm", [torch.empty(5, 2, 3), torch.empty(5, 3, 4)]) == 5 * 2 * 2 * 3 * 4


def test_gemm_floor_records_every_product_of_a_step():
    """A training step of llama-debug on 32 tokens (SDPA attention: the products are the linear layers', the head's,
    ``out=`` ones included, and the norms' weight gradients): their recorded FLOPs are the step's, and each recorded
    product replays on materialized operands."""
    import torch

    from conftest import tiny_config
    from llmtrain.model import GPT

    gemm_floor = load("bench/ab/gemm_floor.py")
    torch.manual_seed(0)
    model = GPT(tiny_config("llama-debug"))
    model.init_weights()
    tokens = torch.randint(0, model.config.vocab_size, (1, 33))
    recorded = gemm_floor.record_products(lambda: model(tokens[:, :-1], labels=tokens[:, 1:]).backward())
    flops = sum(gemm_floor.product_flops(op.overloadpacket.__name__,
                                         [a for a in args if isinstance(a, gemm_floor.TensorSpec)])
                for op, args, _ in recorded)
    matrices = sum(p.numel() for name, p in model.named_parameters() if p.ndim == 2 and "wte" not in name)
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    # 6 per weight and token; RMSNorm's weight gradient is a product too, a row of token sums (2 per weight and token)
    assert flops == 6 * 32 * matrices + 2 * 32 * norms
    assert any("out" in kwargs for _, _, kwargs in recorded)  # the loss writes the hidden states' gradient in place
    for op, args, kwargs in recorded:
        result = op(*[gemm_floor.materialize(a) for a in args], **{k: gemm_floor.materialize(v) for k, v in kwargs.items()})
        assert result.ndim == len(args[-1].shape)
