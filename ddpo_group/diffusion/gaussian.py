"""Gaussian step math shared by every family: the log-density of a step and the dtype it is computed in.

Family-neutral (imports nothing of this package): the DDIM step (``ddim.py``) and the flow-matching
SDE steps (``flow.py``) both return ``gaussian_log_prob`` of their next sample. Precision:
docs/design.md §10.
"""

import math

import torch


def left_broadcast(values, shape):
    """Reshape a (B,) tensor to (B, 1, ..., 1) with len(shape) dims, then expand to shape."""
    return values.reshape(values.shape + (1,) * (len(shape) - values.ndim)).expand(shape)


def step_dtype(dtype):
    """The dtype of the step math for inputs of ``dtype``: float32, or ``dtype`` when it is wider."""
    return torch.promote_types(dtype, torch.float32)


def gaussian_log_prob(value, mean, std):
    """Log-density of N(mean, std^2) at value, averaged over all non-batch dims.

    log N(x; mu, s) = -(x - mu)^2 / (2 s^2) - log s - log sqrt(2 pi), then mean over
    dims 1..n-1 (ddpo-pytorch's convention), shape (B,). ``value`` is treated as data
    (detached); gradients flow through ``mean``. Samples whose std is 0 have no density:
    their log-prob is 0 (they are masked out of training, see ``Trajectories.mask``).
    """
    std = std.expand_as(mean)
    has_density = std > 0
    safe_std = torch.where(has_density, std, torch.ones_like(std))
    log_prob = (
        -((value.detach() - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - math.log(math.sqrt(2 * math.pi))
    )
    log_prob = torch.where(has_density, log_prob, torch.zeros_like(log_prob))
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
