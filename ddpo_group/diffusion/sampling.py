"""Sampling and re-scoring for any supported pipeline: the function view of the family seam.

``sample_trajectories(pipeline, ...)`` and ``trajectory_log_probs(pipeline, ...)`` find the
pipeline's family (``policy_for``) and call its ``sample`` / ``step_log_prob`` (``base.rescore``):
SD 1.x / 2.x with DDIM (``sd.py``), SD3 / FLUX with SDE steps (``flow_policy.py``). A script that
holds a pipeline, not a policy, uses these; the trainer holds the policy.
"""

import torch

from ddpo_group.diffusion.base import rescore
from ddpo_group.diffusion.policy import policy_for


@torch.no_grad()
def sample_trajectories(pipeline, prompts, num_inference_steps, guidance_scale, eta, generator=None, prompt_ids=None,
                        negative_prompt="", unet=None, show_progress=False, height=None, keep_steps=True):
    """Sample B = len(prompts) trajectories x_0 -> x_T with their per-step log-probabilities.

    The pipeline's family samples (``DiffusionPolicy.sample``): eta is DDIM's eta (SD) or the noise
    level of the SDE steps (flow matching), a number or one value per step. `unet` overrides the
    pipeline's trainable model (e.g. DDP-wrapped); `height` is the image side in pixels (None: the
    model's own). Returns Trajectories (``base.Trajectories``), no autograd graph.
    """
    policy = policy_for(pipeline)
    if height:
        policy.configure(resolution=height)
    return policy.sample(
        prompts, num_inference_steps, guidance_scale, eta, generator=generator, prompt_ids=prompt_ids,
        negative_prompt=negative_prompt, model=unet, show_progress=show_progress, keep_steps=keep_steps,
    )


def trajectory_log_probs(pipeline, trajectories, guidance_scale, eta, step_indices=None, return_means=False, unet=None,
                         micro_batch_size=None):
    """Re-score stored steps with the current weights (``base.rescore`` with the pipeline's family).

    step_indices: None (all T), (K,) or (B, K); return_means: also the means (B, K, C, h, w) and stds;
    unet: the model instead of the pipeline's; micro_batch_size: trajectories per model call (None: all B,
    the sampling layout: equal to ``trajectories.log_probs`` with unchanged weights).
    Returns log_probs (B, K) [, means, stds]. Autograd follows the caller's grad mode.
    """
    return rescore(policy_for(pipeline), trajectories, guidance_scale, eta, step_indices=step_indices,
                   return_means=return_means, model=unet, micro_batch_size=micro_batch_size)
