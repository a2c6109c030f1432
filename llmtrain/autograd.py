"""What llmtrain's written-out backward passes share: they compute first-order gradients only.

Each :class:`torch.autograd.Function` here (RMSNorm, block attention, the fused q/k/v projections, the in-place gated
product, the fused loss) writes its backward out of torch operators and treats what it saved as constants. A double
backward (``create_graph=True``: a gradient penalty, a Hessian-vector product) through one of them would silently miss
its second-order terms, so it fails instead.
"""

from __future__ import annotations

import functools

import torch


def first_order_only(backward):
    """Decorate an ``autograd.Function``'s backward: a double backward through it raises a RuntimeError naming it,
    where torch's ``once_differentiable`` would return constants when the incoming gradients are constants."""

    @functools.wraps(backward)
    def checked(ctx, *grads):
        # NOTE: autograd runs a backward with gradients on exactly when it records a graph (create_graph=True).
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{backward.__qualname__.split('.')[0]} computes first-order gradients only: a double backward "
                "(create_graph=True, as a gradient penalty or a Hessian-vector product needs) would miss its "
                "second-order terms. llmtrain's models support backward without create_graph")
        return backward(ctx, *grads)

    return checked
