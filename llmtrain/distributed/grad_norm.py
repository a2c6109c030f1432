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
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float().pow(2))
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


def _replicate(tensor: torch.Tensor, mesh) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(tensor, mesh, [Replicate()] * mesh.ndim, run_check=False)

