"""Where an MoE step's time goes at --ep_size 1 and 2: routing, all-to-all and expert products, 2 gloo ranks.

    GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 bench/ab/moe_time_split.py \
        [--model moe-debug] [--seq_len 256] [--micro_batch_size 4] [--rounds 4] [--steps 3]

Both layouts are built in the same two processes (FSDP over both ranks; at ep 2 each holds 4 of the 8 experts and
the tokens cross by all-to-all, ``llmtrain.distributed.expert_parallel``), with the same weights and batches, and
run in alternating rounds (ep1, ep2, ep1, ...) of ``--steps`` training steps (forward, backward, AdamW) under
torch.profiler. The forward's MoE time is split by record_function spans: ``moe.block`` around each MoE forward,
``moe.experts`` around its experts call (at ep 2: the all-to-alls, the local products and the regrouping), and the
spans expert parallelism records itself, ``moe.all_to_all`` and ``moe.expert_products``; routing is the block
less its experts call (router, top-k, sort by expert, combine, balancing losses). Backward is one number: its
operators do not run inside the forward's spans. Rank 0 prints medians over rounds, in ms per step, averaged
over both ranks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from llmtrain.args import TrainArgs
from llmtrain.config import Config
from llmtrain.distributed.expert_parallel import ExpertParallelExperts
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.distributed.parallelize import materialize, parallelize
from llmtrain.distributed.runtime import Runtime
from llmtrain.model import GPT
from llmtrain.moe import MoE, GroupedExperts

SPANS = ("moe.block", "moe.experts", "moe.all_to_all", "moe.expert_products", "step.forward", "step.backward",
         "step.optimizer")


def _spanned(name: str, forward):
    def spanned(self, *args, **kwargs):
        with record_function(name):
            return forward(self, *args, **kwargs)
    return spanned


def build(config: Config, ep: int, seq_len: int, micro_batch_size: int):
    plan = ParallelPlan.resolve(devices=2, num_nodes=1, train=TrainArgs(global_batch_size=2 * micro_batch_size,
                                                                         micro_batch_size=micro_batch_size),
                                precision="32-true", accelerator="cpu", ep=ep)
    plan.check_model(config, seq_len)
    runtime = Runtime.for_plan(plan)
    with torch.device("meta"):
        model = GPT(config)
    model.max_seq_length = seq_len
    model = parallelize(model, plan, device=runtime.device)
    materialize(model, runtime.device, seed=0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), runtime


def run_round(model, optimizer, batches) -> tuple[float, dict]:
    """Wall seconds per step and each span's CPU milliseconds per step."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for inputs, labels in batches:
            with record_function("step.forward"):
                loss = model(inputs, labels=labels)
            with record_function("step.backward"):
                loss.backward()
            with record_function("step.optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        wall = (time.perf_counter() - start) / len(batches)
    totals = {event.key: event.cpu_time_total / 1000 / len(batches) for event in prof.key_averages()
              if event.key in SPANS}
    return wall, totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="moe-debug")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    MoE.forward = _spanned("moe.block", MoE.forward)
    GroupedExperts.forward = _spanned("moe.experts", GroupedExperts.forward)
    ExpertParallelExperts.forward = _spanned("moe.experts", ExpertParallelExperts.forward)
    config = Config.from_name(args.model)
    layouts = {ep: build(config, ep, args.seq_len, args.micro_batch_size) for ep in (1, 2)}
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, config.vocab_size, (args.steps, args.micro_batch_size, args.seq_len + 1),
                           generator=generator)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    for model, optimizer, _ in layouts.values():  # warm-up: allocations, first collectives
        run_round(model, optimizer, batches[:1])
    results: dict[int, list] = {1: [], 2: []}
    for _ in range(args.rounds):
        for ep, (model, optimizer, _) in layouts.items():
            results[ep].append(run_round(model, optimizer, batches))
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        report(gathered, args)
    dist.barrier()
    dist.destroy_process_group()


def report(per_rank: list[dict], args) -> None:
    print(f"{args.model}, {args.micro_batch_size} x {args.seq_len} tokens per rank and step, 2 ranks x 1 thread, "
          f"medians of {args.rounds} rounds of {args.steps} steps, ms per step (mean of the ranks)")
    print("| ep | step (wall) | forward | MoE forward | routing | experts call | all-to-all | expert products "
          "| backward | optimizer |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for ep in (1, 2):
        def median(pick) -> float:
            return statistics.median(statistics.mean(pick(results[ep][r]) for results in per_rank)
                                     for r in range(args.rounds))

        def span(name: str) -> float:
            return median(lambda row: row[1].get(name, 0.0))

        block, experts = span("moe.block"), span("moe.experts")
        products = span("moe.expert_products") if ep > 1 else experts
        cells = [median(lambda row: row[0]) * 1000, span("step.forward"), block, block - experts, experts,
                 span("moe.all_to_all"), products, span("step.backward"), span("step.optimizer")]
        print(f"| {ep} | " + " | ".join(f"{value:.1f}" for value in cells) + " |")


if __name__ == "__main__":
    main()
