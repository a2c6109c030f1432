"""The process groups a run starts, on real gloo ranks: a default group of two backends under a 2-D mesh
(--fsdp.cpu_offload), and a sharded checkpoint's load, which waits for the slowest rank's reads off the device's
collectives (tests/helpers/pg_worker.py holds the ranks)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import dist_worker as worker
import pg_worker
from llmtrain.distributed.runtime import Runtime
from parity import assert_same_training


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("process_groups")


@pytest.fixture(scope="module")
def single(workdir) -> dict:
    """The reference: one process, sharded checkpoints at steps 4 and 8 in workdir/single/sharded."""
    return worker.train(Runtime(), out_dir=workdir / "single")


@pytest.fixture(scope="module")
def launched(workdir, single) -> dict:
    """One launch of 4 ranks for both suites: offload_mesh on all 4, then slow_load on the first 2 (which resumes
    ``single``'s checkpoint) in a process group of their own."""
    return worker.launch(4, "offload_mesh+slow_load", workdir, script=Path(pg_worker.__file__))


@pytest.mark.multiproc
def test_a_default_group_of_two_backends_serves_a_2d_mesh_with_cpu_offload(launched, single):
    """--fsdp.cpu_offload gives a GPU run the default group ``cuda:nccl,cpu:gloo``, unbound to a device so that
    init_device_mesh creates each dimension's groups with new_group rather than splitting it
    (runtime.bound_device). Here gloo serves both halves: HYBRID_SHARD's 2 × 2 mesh over such a group, with
    FSDP's CPU offload and gradient clipping's host all-reduce, trains as one process does."""
    result = launched["offload_mesh"]
    assert result["default_backend"] == pg_worker.TWO_BACKENDS and result["bound_device"] is None
    assert result["mesh_dims"] == {"dp_replicate": 2, "dp_shard": 2}
    assert result["dim_backends"] == {"dp_replicate": pg_worker.TWO_BACKENDS, "dp_shard": pg_worker.TWO_BACKENDS}
    # Ranks are laid out dp_replicate × dp_shard: replicas are 2 apart, a node's shards neighbours.
    assert result["rank_sums"] == [{"dp_replicate": 2.0, "dp_shard": 1.0}, {"dp_replicate": 4.0, "dp_shard": 1.0},
                                   {"dp_replicate": 2.0, "dp_shard": 5.0}, {"dp_replicate": 4.0, "dp_shard": 5.0}]
    assert (result["mesh_ndim"], result["offload_policies"]) == (2, ["CPUOffloadPolicy"])
    assert_same_training(result, single)


@pytest.mark.multiproc
def test_a_sharded_load_waits_for_a_slow_reader_past_the_collective_timeout(launched, single):
    """Two ranks with a 3 s --dist_timeout resume a sharded checkpoint while the last rank's reads take 8 s: the
    other rank waits for them in DCP's last collective, on the long-waiting host group, and the run trains on
    exactly as the uninterrupted one did."""
    result = launched["slow_load"]
    assert result["load_s"] >= pg_worker.SLOW_READ_S > pg_worker.SHORT_TIMEOUT_S  # rank 0 did wait that long
    assert_same_training(result, single, steps=range(5, worker.MAX_STEPS + 1))


@pytest.mark.multiproc
def test_the_gpu_checks_offload_mesh_probe_runs_here(tmp_path, dist_env):
    """scripts/gpu_check.py's probes, which a lent GPU runs, through its own runner in --cpu mode: FSDP with CPU offload
    on a 1 × 1 replicate × shard mesh trains on the process group that a multi-rank run starts (gloo on a CPU), and
    the split probe, which needs an accelerator, says so without failing the check."""
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("gpu_check", root / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, str(root / "scripts" / "gpu_check.py"), "--cpu", "--only", "(probe)",
                           "--out_dir", str(out)], cwd=root, env=dist_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((out / "gpu_check.json").read_text())
    checks = {check["name"]: check for check in record["checks"]}
    assert list(checks) == [gpu_check.OFFLOAD_MESH_CHECK, gpu_check.SPLIT_CHECK] and record["ok"]
    mesh = checks[gpu_check.OFFLOAD_MESH_CHECK]["numbers"]
    assert {key: mesh[key] for key in ("backend", "bound_device", "mesh", "mesh_ndim", "weights_on")} == {
        "backend": "gloo", "bound_device": "None", "mesh": "replicate 1 × shard 1", "mesh_ndim": 2,
        "weights_on": "cpu"}
    assert mesh["losses"][1] < mesh["losses"][0]
    split = checks[gpu_check.SPLIT_CHECK]
    assert split["numbers"] == {"skipped": "split_group needs an accelerator"} and split["informational"]
