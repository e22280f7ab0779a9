"""The sampling phase of an epoch: trajectories of every process's share of the prompts, and their rewards.

num_batches_per_epoch x batch_size trajectories per process, group_size images per prompt (the copies
of a prompt may sit on different processes: `draw_prompt_indices`); each batch's rewards run in the
reward thread pool while the next batch samples. The ODE/SDE window of the epoch sets each step's noise.
"""

import time

import numpy as np
import torch
from tqdm.auto import tqdm

from ddpo_group.batch import EpochBatch
from ddpo_group.diffusion.base import window_noise_levels
from ddpo_group.rewards.combine import info_metrics


class SamplesNotFiniteError(RuntimeError):
    """The policy sampled non-finite images: its weights diverged; the message names the epoch and the fix."""


def draw_prompt_indices(num_prompts, total, group_size, seed, epoch, batch_index):
    """The K-repeat sampler: total // group_size distinct prompts, each repeated group_size times, shuffled.

    Every process draws the same list (same seed) and takes its own contiguous slice, so the copies
    of one prompt are spread over processes.
    """
    rng = np.random.default_rng([seed, epoch, batch_index])
    num_groups = total // group_size
    chosen = rng.choice(num_prompts, size=num_groups, replace=num_groups > num_prompts)
    return np.repeat(chosen, group_size)[rng.permutation(total)]


def sample_epoch(policy, prompts, reward_runner, config, accelerator, epoch, metrics, model=None, keep_steps=True):
    """This process's EpochBatch of `epoch` with its rewards and reward components (float32 on the device).

    model: the module that samples (None: the policy's trainable module; the forward-process objectives
    pass their lagged model). keep_steps=False (forward objectives): only the clean latents are kept and
    each sample is one outcome "token" (mask (B, 1) of ones). train.skip_last_steps: the last steps keep
    their log-probs but carry no density for training. Adds time/sample, time/reward, sample/sde_window_start
    and the rewards' info metrics to `metrics`.
    """
    acc, s = accelerator, config.sample
    total = s.batch_size * acc.num_processes
    batches, futures = [], []
    # the ODE/SDE window of this epoch: eta inside, 0 (a deterministic step, mask 0) outside
    levels = window_noise_levels(
        s.eta, s.num_steps, s.sde_window_size, s.sde_window, s.sde_window_start, s.sde_window_shift_every,
        epoch, config.seed,
    )
    if s.sde_window_size:
        metrics["sample/sde_window_start"] = next(i for i, level in enumerate(levels) if level > 0)
    start = time.perf_counter()
    not_finite = 0  # images of this process holding NaN or inf
    for batch_index in tqdm(range(s.num_batches_per_epoch), desc="sampling", leave=False, disable=not acc.is_main_process):
        indices = draw_prompt_indices(len(prompts), total, s.group_size, config.seed, epoch, batch_index)
        local = indices[acc.process_index * s.batch_size : (acc.process_index + 1) * s.batch_size]
        records = [prompts[i] for i in local]
        generator = torch.Generator().manual_seed(
            int(np.random.default_rng([config.seed, epoch, batch_index, acc.process_index]).integers(2**62))
        )
        with acc.autocast():
            trajectories = policy.sample(
                [r.prompt for r in records], num_steps=s.num_steps, guidance_scale=s.guidance_scale, eta=levels,
                generator=generator, prompt_ids=torch.as_tensor(local, dtype=torch.int64),
                negative_prompt=s.negative_prompt, model=model, keep_steps=keep_steps,
            )
        # rewards of this batch run in the thread pool while the next batch samples
        futures.append(
            reward_runner.submit(trajectories.images.float(), [r.prompt for r in records], [r.metadata for r in records])
        )
        batches.append(trajectories)
        not_finite += int((~torch.isfinite(trajectories.images.flatten(1))).any(dim=1).sum())
    metrics["time/sample"] = time.perf_counter() - start
    _stop_on_non_finite(acc, not_finite, total * s.num_batches_per_epoch, epoch, config)
    start = time.perf_counter()
    results = [reward_runner.result(future, config.reward_timeout) for future in futures]
    metrics["time/reward"] = time.perf_counter() - start
    samples = EpochBatch.cat(batches)
    if not keep_steps:
        # one outcome "token" per sample: the advantages are (B, 1), trained at any timestep
        samples.mask = torch.ones(len(samples.prompts), 1, device=samples.latents.device)
    skip = config.train.skip_last_steps
    if skip:
        samples.mask[:, samples.mask.shape[1] - skip :] = 0
    rewards = np.concatenate([r[0] for r in results])
    components = {name: np.concatenate([r[1][name] for r in results]) for name in results[0][1]}
    metrics.update(info_metrics([r[2] for r in results if len(r) > 2]))
    samples.rewards = torch.as_tensor(rewards, dtype=torch.float32, device=acc.device)
    samples.components = {k: torch.as_tensor(v, dtype=torch.float32, device=acc.device) for k, v in components.items()}
    return samples


def _stop_on_non_finite(acc, not_finite, total, epoch, config):
    """SamplesNotFiniteError on every process when any process sampled a non-finite image (one collective: every
    process stops at the same point). Training on such samples skips every step and the run would end 'done'."""
    count = int(acc.gather(torch.tensor([not_finite], device=acc.device)).sum())
    if count:
        raise SamplesNotFiniteError(
            f"epoch {epoch}: {count} of {total} sampled images are not finite (NaN or inf): the policy's weights "
            f"diverged in an earlier update (train.learning_rate={config.train.learning_rate:g}); resume from a "
            "checkpoint before it with a lower train.learning_rate (or a tighter train.max_grad_norm), or start again"
        )
