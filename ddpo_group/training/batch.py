"""The epoch batch: one process's trajectories of an epoch and what each phase adds to them.

Every field is declared here, so ``index`` / ``to`` / ``cat`` (inherited from ``Trajectories``)
carry it, and a phase reads what an earlier phase wrote by name. Local fields hold this
process's B_local rows; ``gathered`` is the all-process view (rows in process order) that the
advantages and the logs are computed on.
"""

from dataclasses import dataclass, field

import torch

from ddpo_group.diffusion.base import Trajectories


@dataclass
class GatheredBatch:
    """The epoch batch of all processes, B = B_local x num_processes rows in process order.

    rewards (B,) float32; components {name: (B,)}; prompt_ids (B,) int64; mask (B, T) float;
    advantages (B, T), set by compute_advantages.
    """

    rewards: torch.Tensor
    components: dict
    prompt_ids: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor | None = None


@dataclass
class EpochBatch(Trajectories):
    """Trajectories (this process's rows) plus, in the order the phases write them:

    sample_epoch        rewards (B_local,) float32; components {name: (B_local,)}
    compute_advantages  gathered (GatheredBatch); advantages (B_local, T); for an estimator that
                        needs_values: returns, old_values (critic values at sampling) and critic_mask
                        (B_local, T); for one that defines_endpoints: endpoint_mask (B_local, T) bool and
                        group_ids (B_local, T) int64 (segments 1, 2, ...; 0 on steps without density); for one
                        that needs_step_rewards: step_rewards (B_local, T) float32, r[:, k] = R(decode(x0_hat(x_k)))
    """

    rewards: torch.Tensor | None = None
    components: dict = field(default_factory=dict)
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    critic_mask: torch.Tensor | None = None
    endpoint_mask: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    step_rewards: torch.Tensor | None = None
    gathered: GatheredBatch | None = field(default=None, metadata={"per_row": False})
