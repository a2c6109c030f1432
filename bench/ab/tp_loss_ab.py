"""The loss under a vocabulary-sharded head, two ways, on 2 gloo ranks (CPU): time per step and peak memory.

    .venv/bin/python bench/ab/tp_loss_ab.py [--vocab 32768] [--n_embd 256] [--batch 2] [--seq_len 512] [--steps 10]

Each rank holds a (vocab / 2, n_embd) shard of the head and a sequence-parallel half of the hidden states,
as tensor parallelism with sequence parallelism leaves them after the final norm. A step is the loss's forward
and backward alone:

    vocab_parallel    llmtrain.loss.vocab_parallel_loss_sum: hidden states gathered, each rank's vocabulary rows,
                      max / target logit / exp-sum all-reduced per chunk
    gathered_weight   the head's weight gathered whole (its gradient reduce-scattered in backward), then the
                      ordinary fused loss on each rank's own half of the sequence

The steps of the two alternate in one pair of processes; peak memory is that of the tensors one step allocates
(beyond the weight shard, the hidden states and the labels), tracked by torch's MemTracker in a step of its own.
Prints the median step time, the peak, and how far apart their loss and gradients are.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from llmtrain.loss import LinearCrossEntropy, head_chunk_tokens, vocab_parallel_loss_sum  # noqa: E402

WORLD = 2


def gathered_weight_loss_sum(head: torch.nn.Linear, hidden, labels: torch.Tensor) -> torch.Tensor:
    """This rank's share of the loss: the whole head on its own sequence positions (backward it; the shares sum)."""
    from torch.distributed.tensor import Partial, Replicate

    weight = head.weight.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])  # (V, C)
    rank, rows = dist.get_rank(), hidden.to_local().size(1)
    own_labels = labels[:, rank * rows:(rank + 1) * rows]
    return LinearCrossEntropy.apply(hidden.to_local().flatten(0, 1), weight, None, own_labels.flatten(),
                                    head_chunk_tokens(weight.size(0)))


def tracked_peak_bytes(step) -> int:
    """Peak bytes of the tensors that one step allocates (beyond the weight, hidden states and labels)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        step()
    return max(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())


VARIANTS = {"vocab_parallel": vocab_parallel_loss_sum, "gathered_weight": gathered_weight_loss_sum}


def rank_main(rank: int, args, port: int, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    head = torch.nn.Linear(args.n_embd, args.vocab, bias=False)
    head.weight = torch.nn.Parameter(distribute_tensor(head.weight.detach() * 0.02, mesh, [Shard(0)]))
    full_hidden = torch.randn(args.batch, args.seq_len, args.n_embd)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    local_hidden = full_hidden.chunk(WORLD, dim=1)[rank].clone().requires_grad_()

    def step(variant: str):
        """One forward and backward: its seconds, summed loss and gradients (weight gathered, hidden local)."""
        dist.barrier()
        start = time.perf_counter()
        loss = VARIANTS[variant](head, DTensor.from_local(local_hidden, mesh, [Shard(1)], run_check=False), labels)
        loss.backward()
        seconds = time.perf_counter() - start
        grads = (head.weight.grad.full_tensor(), local_hidden.grad.clone())
        head.weight.grad = local_hidden.grad = None
        if variant == "gathered_weight":  # each rank has the loss of its own positions
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        return seconds, loss.detach(), grads

    peaks = {variant: tracked_peak_bytes(lambda v=variant: step(v)) for variant in VARIANTS}  # also the warm-up
    times = {variant: [] for variant in VARIANTS}
    for _ in range(args.steps):  # interleaved, so that the machine's drift hits both alike
        for variant in VARIANTS:
            seconds, loss, grads = step(variant)
            times[variant].append(seconds)
            hidden_grads = [torch.empty_like(grads[1]) for _ in range(WORLD)]
            dist.all_gather(hidden_grads, grads[1])
            if rank == 0:
                results[variant] = dict(step_s=statistics.median(times[variant]), peak_mb=peaks[variant] / 2**20,
                                        loss=loss, weight_grad=grads[0], hidden_grad=torch.cat(hidden_grads, dim=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # NOTE: gloo may abort in the interpreter's teardown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    results = mp.Manager().dict()
    mp.spawn(rank_main, args=(args, 29630, results), nprocs=WORLD)
    for variant in VARIANTS:
        result = results[variant]
        print(f"{variant:16s} {result['step_s'] * 1e3:7.1f} ms/step   peak {result['peak_mb']:6.1f} MiB per rank")
    a, b = results["vocab_parallel"], results["gathered_weight"]
    differences = ", ".join(f"{k} {((a[k] - b[k]).abs().max() / b[k].abs().max()).item():.1e}"
                            for k in ("loss", "weight_grad", "hidden_grad"))
    print(f"largest difference relative to the largest value: {differences}")


if __name__ == "__main__":
    main()
