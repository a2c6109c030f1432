"""The global gradient norm and clipping, over gradients that live on different meshes.

``torch.nn.utils.clip_grad_norm_`` stacks the norms of all gradients, which needs them all on one mesh.
A run's gradients are not always: under tensor parallelism without sequence parallelism the norms' weights
are sharded by FSDP alone (a 1-D data-parallel mesh) while the linears are 2-D (data-parallel × tensor), and
under pipeline parallelism each stage holds only its own gradients. Here each mesh's gradients get their norm
on their own (DTensor reduces it over that mesh), the squares are summed, then summed over the pipeline stages.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, *, pp_mesh=None,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most ``max_norm``; return the norm before.

    The norm is a plain 0-dim float32 tensor on the gradients' device, the same on every rank. No host
    synchronisation: a NaN or inf norm makes NaN gradients, which the loop's skip policy handles.

    ``optimizer``: one whose kernel divides the gradients by its ``grad_scale`` as it reads them (fused Adam, AdamW
    and SGD: ``_step_supports_amp_scaling``, as GradScaler uses them). The scaling is then handed to its next step
    as ``grad_scale`` = 1 / the clipping coefficient instead of a pass over every gradient here (1% of a small
    model's CPU step, BENCHMARKS.md), so the gradients are left as they are until that step.
    """
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            grad = parameter.grad
            mesh = grad.device_mesh if isinstance(grad, DTensor) else None
            groups.setdefault((mesh, grad.dtype), []).append(grad)
    if not groups:
        return torch.zeros(())
    squares = []
    for (mesh, dtype), grads in groups.items():
        if mesh is None and dtype in (torch.float32, torch.float64) and all(
                g.device.type == "cpu" and g.is_contiguous() for g in grads):
            # NOTE: on the CPU, BLAS dot products read each gradient once on every core, where torch's foreach
            # norm, one norm per tensor there, took 1.7x as long over llama-20m's gradients (BENCHMARKS.md).
            squares.append(torch.stack([torch.dot(g.view(-1), g.view(-1)) for g in grads]).sum().float())
            continue
        squares.append(_sum_of_squares(grads, mesh))
    total_square = torch.stack(squares).sum()
    if pp_mesh is not None:
        dist.all_reduce(total_square, group=pp_mesh.get_group())
    total = total_square.sqrt()
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if optimizer is not None:
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise ValueError(f"{type(optimizer).__name__} does not unscale gradients in its step: clip them here")
        optimizer.grad_scale = coefficient.reciprocal()
        return total
    for (mesh, dtype), grads in groups.items():
        factor = coefficient.to(dtype) if mesh is None else _replicate(coefficient.to(dtype), mesh)
        torch._foreach_mul_(grads, factor)
    return total


def _sum_of_squares(grads: list[torch.Tensor], mesh) -> torch.Tensor:
    """The sum of the squares of every element of ``grads`` (all on ``mesh``, or plain tensors), as float32.

    NOTE: DTensor gradients are reduced from their local shards: each rank squares what it holds and the sums are
    all-reduced over the mesh dimensions the gradients are split over (their placement a Shard), never over those
    they are replicated on. torch's get_total_norm on them redistributed gradients that FSDP and tensor parallelism
    both split along one dimension (the embedding's and the head's vocabulary rows, a strided shard) to whole tensors:
    on TinyLlama at tp 4 × dp 2, every rank held all 1.1B gradients in fp32 at once inside the clipping, 4.1 GiB,
    two thirds of its peak (``--dry_run.simulate``); on a 70B model, 280 GB.
    """
    from torch.distributed.tensor import DTensor

    if mesh is None:
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0).float().pow(2)
    by_split: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for grad in grads:
        placements = grad.placements
        if any(placement.is_partial() for placement in placements):  # not reduced yet: only DTensor knows how
            norm = torch.nn.utils.get_total_norm([grad], norm_type=2.0)
            by_split.setdefault((), []).append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
            continue
        # NOTE: not is_shard(): FSDP's strided shard of a dimension tensor parallelism split first is no Shard
        split = tuple(dim for dim, placement in enumerate(placements) if not placement.is_replicate())
        by_split.setdefault(split, []).append(grad.to_local())
    total = None
    for split, tensors in by_split.items():
        square = torch.nn.utils.get_total_norm(tensors, norm_type=2.0).float().pow(2)
        for dim in split:
            if mesh.size(dim) > 1:
                dist.all_reduce(square, group=mesh.get_group(dim))
        total = square if total is None else total + square
    return total


def _replicate(tensor: torch.Tensor, mesh) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(tensor, mesh, [Replicate()] * mesh.ndim, run_check=False)

