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


@pytest.mark.parametrize("cpu_offload, backend, device_id", [
    (False, "nccl", torch.device("cuda", 0)),
    (True, "cuda:nccl,cpu:gloo", None),  # unbound: the mesh's groups come from new_group, not split_group
])
def test_the_plan_offload_reaches_the_process_group(cpu_offload, backend, device_id, monkeypatch, clean_launch_env):
    """FSDP on one GPU (--strategy fsdp --devices 1 --fsdp.cpu_offload): the one-rank group gets the plan's backend."""
    started = []
    monkeypatch.setattr(runtime_module, "pick_device", lambda *args, **kwargs: torch.device("cuda", 0))
    monkeypatch.setattr(runtime_module.dist, "init_process_group", lambda **kwargs: started.append(kwargs))
    runtime = Runtime.for_plan(gpu_fsdp_plan(cpu_offload))
    assert [(kwargs["backend"], kwargs["world_size"], kwargs.get("device_id")) for kwargs in started] == [
        (backend, 1, device_id)]
    assert runtime.device == torch.device("cuda", 0)


@pytest.mark.parametrize("device, backend, bound", [
    (torch.device("cuda", 3), "nccl", {"device_id": torch.device("cuda", 3)}),  # NCCL connects now, splits later
    (torch.device("cuda", 3), "cuda:nccl,cpu:gloo", {}),  # --fsdp.cpu_offload: no split of a two-backend group
    (torch.device("cpu"), "gloo", {}),
])
def test_only_a_gpu_group_of_one_backend_is_bound_to_its_device(device, backend, bound):
    assert runtime_module.bound_device(device, backend) == bound


# ----------------------------------------------------------------------------------- GPU binding
@pytest.mark.parametrize("local_rank, local_world_size, visible, share, index", [
    (5, 8, 1, False, 0),  # srun --gpus-per-task 1: each task sees its own GPU only
    (0, 1, 1, True, 0),  # one process, one GPU
    (5, 8, 8, True, 5),  # torchrun / llmtrain's workers: every GPU of the node visible
    (5, 8, 8, False, 5),  # SLURM tasks that see every GPU
    (1, 2, 8, True, 1),  # fewer processes than GPUs
    (0, 1, 4, True, 0),
    (5, 8, 4, False, 1),  # --gpu-bind closest: ranks 4-7 see GPUs 4-7 of the node as 0-3
    (2, 8, 4, False, 2),
    (3, 4, 2, False, 1),  # tasks with blocks of two GPUs each
])
def test_gpu_index(local_rank, local_world_size, visible, share, index):
    assert runtime_module.gpu_index(local_rank, local_world_size, visible, ranks_share_gpus=share) == index


@pytest.mark.parametrize("local_rank", [0, 3])  # every rank refuses, not only those past the last GPU
def test_gpu_index_refuses_more_processes_than_the_gpus_they_share(local_rank):
    with pytest.raises(ValueError, match=r"4 processes on this node share 2 visible GPUs, so local rank "
                                         rf"{local_rank} has none of its own. Start at most 2 per node \(--devices 2"):
        runtime_module.gpu_index(local_rank, 4, 2, ranks_share_gpus=True)
    with pytest.raises(ValueError, match="share 1 visible GPU, so"):
        runtime_module.gpu_index(local_rank, 4, 1, ranks_share_gpus=True)


def test_gpu_index_needs_a_visible_gpu():
    with pytest.raises(ValueError, match="local rank 0 sees no GPU"):
        runtime_module.gpu_index(0, 1, 0, ranks_share_gpus=False)


@pytest.mark.parametrize("environ, layout", [
    ({"WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "run"}, (3, 8, True)),
    ({"WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "SLURM_PROCID": "11"}, (3, 8, False)),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, (1, 2, False)),
    ({}, (0, 1, False)),
])
def test_local_layout_knows_when_the_ranks_share_their_gpus(environ, layout, monkeypatch, clean_launch_env):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert runtime_module._local_layout() == layout


@pytest.mark.parametrize("local_world_size, layout", [("2", (1, 2)), (None, None)])
def test_gpus_are_compared_only_with_a_known_number_of_local_peers(local_world_size, layout, monkeypatch,
                                                                    clean_launch_env):
    """Without LOCAL_WORLD_SIZE a rank could wait for peers that are on other nodes: no comparison then."""
    started = []
    monkeypatch.setattr(runtime_module, "start_process_group", lambda *args, **kwargs: started.append(kwargs))
    environ = {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": local_world_size}
    for name, value in environ.items():
        if value is not None:
            monkeypatch.setenv(name, value)
    Runtime.from_env("cpu")
    assert [kwargs["local_layout"] for kwargs in started] == [layout]


def test_shared_gpus_names_each_gpu_taken_twice_with_its_ranks():
    assert runtime_module.shared_gpus({0: "GPU-a", 1: "GPU-b", 2: "GPU-c"}) == {}
    assert runtime_module.shared_gpus({3: "GPU-a", 0: "GPU-a", 1: "GPU-b", 2: "GPU-a", 4: "GPU-b", 5: "GPU-c"}) == {
        "GPU-a": [0, 2, 3], "GPU-b": [1, 4]}


def exchange_gpu_ids(gpu_ids: list[str]) -> list[str]:
    """Each of len(gpu_ids) local ranks (threads here) checks its GPU through one store; their errors, in order."""
    import threading

    store = torch.distributed.HashStore()
    errors = [""] * len(gpu_ids)

    def local_rank(index: int) -> None:
        try:
            runtime_module.check_own_gpu(store, 10 + index, index, len(gpu_ids), gpu_id=gpu_ids[index], host="node7")
        except RuntimeError as error:
            errors[index] = str(error)

    threads = [threading.Thread(target=local_rank, args=(index,)) for index in range(len(gpu_ids))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return errors


def test_local_ranks_with_their_own_gpus_pass_the_check():
    assert exchange_gpu_ids(["GPU-0", "GPU-1", "GPU-2"]) == ["", "", ""]


def test_local_ranks_on_one_gpu_all_stop_with_the_ranks_and_the_gpu():
    errors = exchange_gpu_ids(["GPU-0", "GPU-1", "GPU-0"])
    assert len(set(errors)) == 1  # every rank, with the same message
    assert errors[0].startswith("on node7, ranks 10, 12 all use GPU GPU-0: each rank needs a GPU of its own")


# ---------------------------------------------------------------------------- timeouts and host waits
COLLECTIVE_TIMEOUT_S = 1.0
HOST_WORK_S = 2.5  # longer than a collective may wait


def waits_worker(out_dir: str) -> None:
    """One of two gloo ranks with a 1 s collective timeout: rank 0 works 2.5 s on the host under
    main_process_first while rank 1 waits; then rank 1 starts an all-reduce that rank 0 never joins."""
    import json
    import os
    import sys
    import time

    plan = ParallelPlan.resolve(devices=2, num_nodes=1, train=TrainArgs(global_batch_size=2, micro_batch_size=1),
                                precision="32-true", accelerator="cpu")
    runtime = Runtime.for_plan(plan, timeout_s=COLLECTIVE_TIMEOUT_S)
    result = {}
    started = time.perf_counter()
    with runtime.main_process_first():
        if runtime.rank == 0:
            time.sleep(HOST_WORK_S)  # tokenizing a corpus, say
    result["host_wait_s"] = time.perf_counter() - started
    if runtime.rank == 1:
        started = time.perf_counter()
        try:
            torch.distributed.all_reduce(torch.ones(1))
            result["collective"] = "finished"
        except Exception as error:  # noqa: BLE001
            result["collective"] = str(error)
        result["collective_s"] = time.perf_counter() - started
    runtime.barrier()  # rank 0 waits here, on the store, while rank 1's collective times out
    with open(os.path.join(out_dir, f"rank{runtime.rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()
    runtime_module.leave_in_order()  # as a worker leaves (launch._close_process_group): rank 0 hosts the store
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.multiproc
def test_collectives_time_out_and_waits_for_host_work_do_not(tmp_path, dist_env, free_port):
    """The timeout reaches the default process group (a lone all-reduce fails after it), while waiting longer
    than it for another rank's host work (main_process_first, around the device) succeeds."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    code = (f"import sys; sys.path.insert(0, {str(tests)!r}); import test_runtime; "
            "test_runtime.waits_worker(sys.argv[1])")
    env = {**dist_env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "PYTHONPATH": str(tests.parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env={**env, "RANK": str(rank),
                                                                                "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[1]["host_wait_s"] >= HOST_WORK_S - 0.1  # waited past the collective timeout, and went on
    assert ranks[1]["collective"] != "finished" and "timed out" in ranks[1]["collective"].lower(), ranks[1]
    assert COLLECTIVE_TIMEOUT_S - 0.1 <= ranks[1]["collective_s"] < HOST_WORK_S, ranks[1]


def test_the_run_starts_its_process_group_with_dist_timeout(monkeypatch):
    from types import SimpleNamespace

    from llmtrain.recipes import run as run_module

    class Started(Exception):
        pass

    def for_plan(plan, timeout_s):
        raise Started(plan, timeout_s)

    monkeypatch.setattr(run_module.Runtime, "for_plan", for_plan)
    with pytest.raises(Started) as started:
        run_module.run(SimpleNamespace(plan="the plan", dist_timeout=1234.0))
    assert started.value.args == ("the plan", 1234.0)


def test_a_host_wait_that_nobody_joins_ends_with_a_message(monkeypatch):
    monkeypatch.setattr(runtime_module, "_host_waits", runtime_module._HostWaits(
        torch.distributed.HashStore(), rank=1, world_size=2, timeout_s=0.2))
    with pytest.raises(RuntimeError, match=r"rank 1: waited 0.2s for the other ranks to finish their host work .* "
                                           "raise --dist_timeout"):
        runtime_module.host_barrier()


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan"])
def test_a_rendezvous_timeout_that_is_not_seconds_is_refused(value, monkeypatch):
    monkeypatch.setenv(runtime_module.RDZV_TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=rf"^LLMTRAIN_RDZV_TIMEOUT='{value}' must be a number of seconds above 0 .*"
                                         "unset it for the default 900$"):
        runtime_module.rendezvous_timeout_s()


def test_the_rendezvous_waits_as_long_as_torchrun_unless_the_user_says(monkeypatch):
    monkeypatch.delenv(runtime_module.RDZV_TIMEOUT_ENV, raising=False)
    assert runtime_module.rendezvous_timeout_s() == 900.0
    monkeypatch.setenv(runtime_module.RDZV_TIMEOUT_ENV, " 1800 ")
    assert runtime_module.rendezvous_timeout_s() == 1800.0
