"""Several nodes must share out_dir, and the token cache of a module that tokenizes into it: a run whose nodes do
not says so before any tokenizing or training, instead of working per node.

Two torchrun "nodes" of one process each, on this host, each given its own folder where node-local disks would
give one: the ranks of node 1 do not see what rank 0 wrote.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 300


def two_nodes(tiny_model_file: Path, tmp_path: Path, dist_env: dict, port: int, *, own_out_dir: bool,
              own_cache: bool) -> list[str]:
    """Start both "nodes"; their combined output, one per node (each must fail)."""
    nodes = []
    for node in (0, 1):
        out_dir = tmp_path / (f"out-{node}" if own_out_dir else "out")
        cache = tmp_path / (f"cache-{node}" if own_cache else "cache")
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                   "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                   "--rdzv_conf", "timeout=60", "-m", "llmtrain", "pretrain", "--model_config", str(tiny_model_file),
                   "--out_dir", str(out_dir), "--devices", "1", "--num_nodes", "2", "--data", "BuiltinStories",
                   "--data.num_documents", "100", "--data.num_val_documents", "10", "--train.max_steps", "1",
                   "--train.global_batch_size", "2", "--train.micro_batch_size", "1", "--train.max_seq_length", "16"]
        nodes.append(subprocess.Popen(command, env={**dist_env, "LLMTRAIN_CACHE_DIR": str(cache)},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT))
    try:
        outputs = [node.communicate(timeout=HANG_GUARD_S)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert all(node.returncode != 0 for node in nodes), outputs
    return outputs


@pytest.mark.multiproc
@pytest.mark.parametrize("own_out_dir, own_cache, says", [
    (True, False, "is not the same folder on every node: rank(s) [1]"),
    (False, True, "is not shared by every node: rank(s) [1] do not see it, so each node would tokenize --data "
                  "BuiltinStories itself"),
])
def test_folders_the_nodes_do_not_share_stop_the_run_before_any_work(tiny_model_file, tmp_path, dist_env, free_port,
                                                                     own_out_dir, own_cache, says):
    outputs = two_nodes(tiny_model_file, tmp_path, dist_env, free_port(), own_out_dir=own_out_dir,
                        own_cache=own_cache)
    message = " ".join(outputs[0].split())
    assert says in message, outputs[0][-3000:]
    assert "LLMTRAIN_CACHE_DIR" in message or own_out_dir
    # Nothing was tokenized: the check comes before the token cache is written.
    assert not list(tmp_path.glob("cache*/tokens/*.bin"))
