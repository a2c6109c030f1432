"""llmtrain/distributed/runtime.py: the process group a run starts (backend, timeouts), the GPU each rank takes,
and the waits for host work that go around the device's collectives."""

from __future__ import annotations

import pytest
import torch

from llmtrain.args import FSDPArgs, TrainArgs
from llmtrain.distributed import runtime as runtime_module
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.distributed.runtime import Runtime, process_group_backend


# ------------------------------------------------------------------------------------- backend
@pytest.mark.parametrize("device_type, cpu_offload, backend", [
    ("cpu", False, "gloo"),
    ("cpu", True, "gloo"),  # a CPU run's tensors are all on the host already
    ("cuda", False, "nccl"),
    ("cuda", True, "cuda:nccl,cpu:gloo"),  # offloaded gradients are reduced on the host (clipping's norm)
])
def test_process_group_backend(device_type, cpu_offload, backend):
    assert process_group_backend(device_type, cpu_offload) == backend


def test_process_group_backend_refuses_other_devices():
    with pytest.raises(ValueError, match="'mps'"):
        process_group_backend("mps", False)


def gpu_fsdp_plan(cpu_offload: bool) -> ParallelPlan:
    return ParallelPlan.resolve(devices=1, num_nodes=1, train=TrainArgs(global_batch_size=4, micro_batch_size=4),
                                precision="32-true", strategy="fsdp", fsdp=FSDPArgs(cpu_offload=cpu_offload),
                                device_type="cuda")


@pytest.mark.parametrize("cpu_offload, backend", [(False, "nccl"), (True, "cuda:nccl,cpu:gloo")])
def test_the_plan_offload_reaches_the_process_group(cpu_offload, backend, monkeypatch, clean_launch_env):
    """FSDP on one GPU (--strategy fsdp --devices 1 --fsdp.cpu_offload): the one-rank group gets the plan's backend."""
    started = []
    monkeypatch.setattr(runtime_module, "pick_device", lambda *args, **kwargs: torch.device("cuda", 0))
    monkeypatch.setattr(runtime_module.dist, "init_process_group", lambda **kwargs: started.append(kwargs))
    runtime = Runtime.for_plan(gpu_fsdp_plan(cpu_offload))
    assert [(kwargs["backend"], kwargs["world_size"], kwargs["device_id"]) for kwargs in started] == [
        (backend, 1, torch.device("cuda", 0))]
    assert runtime.device == torch.device("cuda", 0)
