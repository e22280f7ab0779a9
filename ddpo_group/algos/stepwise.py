"""The loss of a training micro-batch, and its exact gradient back-propagated one step at a time.

A micro-batch holds b trajectories and K trained steps. Its loss is a function of the (b, K)
matrix of step log-probabilities and of the KL of each step to the reference (GRPO, docs/design.md §5):

    L(log_probs, kl) = policy_loss(old_log_probs, log_probs, advantages, mask)
                       + beta * agg(kl, mask)                   (the KL term when kl is given)

The trainer back-propagates one step (column) at a time, so that memory holds one model
activation set whatever K is. Column k's backward is the gradient of

    L_k = L(base with column k := log_prob_k, kl with column k := kl_k, other columns 0)

where `base` holds the other columns' values without gradients. In L_k's graph the other
columns are constants, so sum_k grad L_k = grad L exactly, provided `base` holds the values those
columns have now (the current log-probs). For a loss that does not couple the steps (vanilla: a
sum of per-step terms), any base gives the same gradient, so the trainer uses pi_old; for one
that couples them (gspo, geo_mean: `couples_steps=True` in the registry) it computes every
column first. The KL term is a sum of per-step terms: zero columns in L_k are exact. The losses that read
each step's drift from pi_old (dppo, grpo_guard: `reads_drift=True`) are sums of per-step terms too: in L_k
the drift's other columns are constants (their KL 0), column k's carries its gradient.

Pure math: no trainer, no I/O.
"""

import torch

from ddpo_group.algos.drift_losses import StepDrift
from ddpo_group.algos.losses import agg_loss


def grpo_loss(policy_loss, loss_config, old_log_probs, log_probs, advantages, mask, kl=None, beta=0.0, drift=None):
    """L = policy_loss(...) + beta * agg_loss(kl, mask, loss_config.loss_agg_mode) (no KL term when kl is None).

    Args: policy_loss a registered policy loss; old_log_probs, log_probs, advantages, mask, kl (b, K); drift a
    StepDrift of (b, K) tensors, passed to the losses that read it (`policy_loss.reads_drift`).
    Returns: (loss 0-dim, policy loss 0-dim, policy loss metrics dict).
    """
    extra = (drift,) if getattr(policy_loss, "reads_drift", False) else ()
    policy, metrics = policy_loss(old_log_probs, log_probs, advantages, mask, loss_config, *extra)
    if kl is None:
        return policy, policy, metrics
    return policy + beta * agg_loss(kl, mask, loss_config.loss_agg_mode), policy, metrics


def column_loss(policy_loss, loss_config, old_log_probs, base, k, log_prob, advantages, mask, kl=None, beta=0.0,
                drift=None):
    """L_k of the module docstring: the micro-batch's loss with only column k live.

    Args: base (b, K) the other columns' values (detached); k the live column; log_prob (b,) column k's
    log-probs with their graph; kl (b,) column k's KL to the reference with its graph, or None; drift a
    StepDrift whose kl, std, dt are column k's (b,) (kl with its graph), or None.
    Returns: the 0-dim loss whose gradient is column k's share of grad L.
    """
    log_probs = base.detach().clone()
    log_probs[:, k] = log_prob
    kl_matrix = None
    if kl is not None:
        kl_matrix = torch.zeros_like(log_probs, dtype=kl.dtype)
        kl_matrix[:, k] = kl
    drift_matrix = None
    if drift is not None:
        # other columns: KL 0, std 0, dt 0 (their terms are constants here, grpo_guard's weight 0 for dt 0)
        columns = {}
        for name in ("kl", "std", "dt"):
            matrix = torch.zeros_like(log_probs, dtype=getattr(drift, name).dtype)
            matrix[:, k] = getattr(drift, name)
            columns[name] = matrix
        drift_matrix = StepDrift(**columns)
    return grpo_loss(policy_loss, loss_config, old_log_probs, log_probs, advantages, mask, kl_matrix, beta,
                     drift_matrix)[0]
