"""The sampling phase of an epoch: trajectories of every process's share of the prompts, and their rewards.

num_batches_per_epoch x batch_size trajectories per process, group_size images per prompt (the copies
of a prompt may sit on different processes: `draw_prompt_indices`); each batch's rewards run in the
reward thread pool while the next batch samples. The ODE/SDE window of the epoch sets each step's noise.

Group-wise rewards (rewards/base.py) see whole prompt groups: a group is every sample of the epoch with the same
prompt id (the GRPO advantages' key), and its members may sit on several processes. `GroupCollector` gathers each
batch's images from every process (accelerator.gather), keeps the members of the groups this process owns (the
epoch's distinct prompt ids in sorted order, dealt round-robin to the processes), submits a group to the reward
thread pool once its last member is sampled, and at the end of the epoch hands every process the values of its
own samples (gather_object). The values do not depend on the number of processes or on sample.batch_size: a group
is scored in one call, its members in the order of their sample index.
"""

import time

import numpy as np
import torch
from tqdm.auto import tqdm

from ddpo_group.config.registry import ConfigError, check_choice, check_positive, register_config_check
from ddpo_group.diffusion.flow import CPS_LOG_PROBS, FLOW_GRIDS, SDE_TYPES
from ddpo_group.training.batch import EpochBatch
from ddpo_group.training import perf
from ddpo_group.training.critic_designs import keeps_x0_hat
from ddpo_group.diffusion.base import window_noise_levels
from ddpo_group.data.edit_sources import reward_metadata, source_images
from ddpo_group.rewards.base import RewardError, with_audio
from ddpo_group.rewards.combine import info_metrics


def source_kwargs(policy, sources):
    """sample()'s source_images argument for an editing family (``conditions_on_images``), none for the others."""
    return {"source_images": sources} if getattr(policy, "conditions_on_images", False) else {}


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


class GroupCollector:
    """Whole prompt groups of an epoch for the group-wise reward components, across processes (module docstring).

    batches: the epoch's prompt indices, one (num_processes * batch_size,) array per sampling batch (every process
    draws the same); a sample's index in the epoch is batch * num_processes * batch_size + its place in the batch.
    """

    def __init__(self, batches, prompts, runner, accelerator):
        self.batches, self.prompts, self.runner, self.acc = batches, prompts, runner, accelerator
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        keys = sorted({int(k) for ids in batches for k in ids})
        self.owned = {k for n, k in enumerate(keys) if n % self.world == self.rank}
        self.last_batch = {int(k): b for b, ids in enumerate(batches) for k in ids}  # the batch completing a group
        self.members = {k: [] for k in self.owned}  # prompt id -> [(sample index, image on the CPU)]
        self.futures = []  # (sample indices, future)

    def add(self, batch_index, images):
        """Gather this batch's images (B_local, 3, H, W) from every process (all call it, in the same order), keep
        the owned groups' members, submit the groups this batch completes."""
        gathered = self.acc.gather(images.float().contiguous()) if self.world > 1 else images.float()
        ids = self.batches[batch_index]
        base = batch_index * len(ids)
        for place, key in enumerate(ids.tolist()):
            if key in self.owned:
                # a copy, not a view: a view would keep the whole gathered batch alive until the group is scored
                self.members[key].append((base + place, gathered[place].to("cpu", copy=True)))
        for key in sorted(self.owned):
            if self.last_batch[key] == batch_index:
                indices, group_images = zip(*self.members.pop(key))
                record = self.prompts[key]
                future = self.runner.submit(torch.stack(group_images), [record.prompt] * len(indices),
                                            [record.metadata] * len(indices), groups=[key] * len(indices),
                                            only="group_wise")
                self.futures.append((indices, future))

    def results(self, local_indices, timeout):
        """({name: (B_local,) float64} for this process's samples (their epoch indices `local_indices`), info dicts).

        Every process calls it; a failure on one process stops all of them with its message (none waits forever
        for the failed one's values)."""
        values, infos, failure = {}, [], None
        for indices, future in self.futures:
            try:
                _, components, info = self.runner.result(future, timeout)
            except RewardError as exc:  # its sample numbers count within the group: name the epoch's too
                failure = RewardError(f"{exc} (the group's samples {', '.join(map(str, indices))} of the epoch)",
                                      reward=exc.reward, prompt=exc.prompt)
                failure.__cause__ = exc
                break
            infos.append(info)
            for n, index in enumerate(indices):
                values[index] = {name: float(part[n]) for name, part in components.items()}
        if self.world > 1:
            from accelerate.utils import gather_object

            shared = gather_object([(str(failure) if failure else None, values)])
            if failure is None and any(message for message, _ in shared):
                message = next(message for message, _ in shared if message)
                raise RewardError(f"another process's group-wise reward failed: {message}")
            values = {index: parts for _, part in shared for index, parts in part.items()}
        if failure is not None:
            raise failure
        names = self.runner.reward_fn.group_wise_names
        return {name: np.array([values[i][name] for i in local_indices], dtype=np.float64) for name in names}, infos


GROUP_NOISES = ("independent", "shared")


SDE_WINDOWS = ("fixed", "random", "sliding")


@register_config_check("sampling")
def check_sampling(config, machine):
    """config.sample: the batch and its groups over every process (machine.num_processes), the step noise (eta,
    sde_type, cps_log_prob), the time grid, the SDE window, the guidance scale."""
    sample = config.sample
    for field in ("num_steps", "batch_size", "num_batches_per_epoch", "group_size"):
        check_positive(sample[field], f"sample.{field}")
    if sample.eta < 0 or (sample.eta == 0 and config.train.objective == "stepwise"):
        raise ConfigError(
            f"config.sample.eta={sample.eta} gives deterministic steps with no log-probability (DDIM's eta, "
            "or a flow model's noise level); RL needs eta > 0 (1.0 is the usual DDIM value); only the "
            "forward-process objectives (train.objective 'nft', 'awm', 'dgpo' or 'dpo') may sample deterministically"
        )
    check_choice(sample.sde_type, ("",) + SDE_TYPES, "sample.sde_type")
    check_choice(sample.cps_log_prob, CPS_LOG_PROBS, "sample.cps_log_prob")
    check_choice(sample.flow_grid, FLOW_GRIDS, "sample.flow_grid")
    check_positive(sample.flow_grid_shift, "sample.flow_grid_shift")
    if sample.cps_log_prob != "normalized" and sample.sde_type != "cps":
        raise ConfigError(
            f"config.sample.cps_log_prob={sample.cps_log_prob!r} is the log-prob of sample.sde_type='cps'; "
            f"sample.sde_type={sample.sde_type!r}: set sample.cps_log_prob='normalized' (the other steps have one form)"
        )
    check_choice(sample.sde_window, SDE_WINDOWS, "sample.sde_window")
    if sample.sde_type == "cps" and sample.eta > 1.0:
        raise ConfigError(
            f"config.sample.eta={sample.eta} is the noise level a of sample.sde_type='cps' (std = sigma' sin(a pi / 2)); "
            "it must lie in (0, 1]"
        )
    for field in ("sde_window_size", "sde_window_start", "max_sequence_length", "resolution", "text_embedding_cache"):
        check_positive(sample[field], f"sample.{field}", allow_zero=True)
    check_positive(sample.sde_window_shift_every, "sample.sde_window_shift_every")
    if sample.sde_window_size > sample.num_steps:
        raise ConfigError(
            f"config.sample.sde_window_size={sample.sde_window_size} exceeds sample.num_steps={sample.num_steps}; "
            "a window is at most every step (0 means every step)"
        )
    if sample.sde_window_size and sample.sde_window == "fixed" and sample.sde_window_start + sample.sde_window_size > sample.num_steps:
        raise ConfigError(
            f"config.sample.sde_window_start={sample.sde_window_start} with sde_window_size={sample.sde_window_size} "
            f"runs past the last of sample.num_steps={sample.num_steps} steps; choose a start <= "
            f"{sample.num_steps - sample.sde_window_size}"
        )
    if sample.guidance_scale < 1.0:
        raise ConfigError(f"config.sample.guidance_scale={sample.guidance_scale} must be >= 1 (1: no guidance)")
    total = sample.batch_size * machine.num_processes
    if total % sample.group_size:
        raise ConfigError(
            f"config.sample.group_size={sample.group_size} does not divide the sampling batch of all processes "
            f"(sample.batch_size={sample.batch_size} x {machine.num_processes} processes = {total}); "
            "choose a group_size that divides it"
        )


@register_config_check("sampling")
def check_group_noise(config, machine=None):
    """ConfigError naming the field for a sample.group_noise that cannot run (before the model loads)."""
    s = config.sample
    group_noise = s.get("group_noise", "independent")  # a config written before the field existed: independent
    if group_noise not in GROUP_NOISES:
        raise ConfigError(f"config.sample.group_noise={group_noise!r} is not one of {list(GROUP_NOISES)}")
    if group_noise == "shared" and s.eta == 0:
        raise ConfigError(
            "config.sample.group_noise='shared' with sample.eta=0 samples every trajectory of a group alike (no "
            "stochastic step to spread them, so every advantage is 0): set sample.eta > 0 or group_noise='independent'"
        )


def group_generators(config, epoch, prompt_indices):
    """One CPU generator per trajectory for its initial noise, seeded by (seed, epoch, prompt): the trajectories of
    a prompt in an epoch start from one noise, on every process and in every batch (sample.group_noise="shared")."""
    return [torch.Generator().manual_seed(int(np.random.default_rng([config.seed, epoch, int(i), 7]).integers(2**62)))
            for i in prompt_indices]


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
    reward_fn = reward_runner.reward_fn
    group_wise = bool(getattr(reward_fn, "group_wise_names", None))
    drawn = [draw_prompt_indices(len(prompts), total, s.group_size, config.seed, epoch, batch_index)
             for batch_index in range(s.num_batches_per_epoch)]
    collector = GroupCollector(drawn, prompts, reward_runner, acc) if group_wise else None
    not_finite = 0  # images of this process holding NaN or inf
    for batch_index in tqdm(range(s.num_batches_per_epoch), desc="sampling", leave=False, disable=not acc.is_main_process):
        indices = drawn[batch_index]
        local = indices[acc.process_index * s.batch_size : (acc.process_index + 1) * s.batch_size]
        records = [prompts[i] for i in local]
        generator = torch.Generator().manual_seed(
            int(np.random.default_rng([config.seed, epoch, batch_index, acc.process_index]).integers(2**62))
        )
        sources = source_images(records, s.resolution)  # an editing run's source images, None otherwise
        shared = {"initial_generator": group_generators(config, epoch, local)} if s.get("group_noise") == "shared" else {}
        with acc.autocast():
            trajectories = policy.sample(
                [r.prompt for r in records], num_steps=s.num_steps, guidance_scale=s.guidance_scale, eta=levels,
                generator=generator, prompt_ids=torch.as_tensor(local, dtype=torch.int64),
                negative_prompt=s.negative_prompt, model=model, keep_steps=keep_steps, **source_kwargs(policy, sources),
                **({"keep_x0_hat": True} if keeps_x0_hat(config) else {}),  # an anchor critic reads it
                **shared,
            )
        # rewards of this batch run in the thread pool while the next batch samples
        # (the group-wise components wait for whole groups: GroupCollector)
        only = {"only": "per_image"} if group_wise else {}
        futures.append(reward_runner.submit(
            trajectories.images.float(), [r.prompt for r in records],
            with_audio(reward_metadata([r.metadata for r in records], sources), trajectories.audio,
                       getattr(policy, "audio_sample_rate", None)), **only
        ))
        if collector is not None:
            collector.add(batch_index, trajectories.images)
        batches.append(trajectories)
        not_finite += int((~torch.isfinite(trajectories.images.flatten(1))).any(dim=1).sum())
    metrics["time/sample"] = time.perf_counter() - start
    _stop_on_non_finite(acc, not_finite, total * s.num_batches_per_epoch, epoch, config)
    perf.switch("reward")  # the accounting's phase (ddpo_group/training/perf.py): waiting for the rewards
    start = time.perf_counter()
    results = [reward_runner.result(future, config.reward_timeout) for future in futures]
    samples = EpochBatch.cat(batches)
    if not keep_steps:
        # one outcome "token" per sample: the advantages are (B, 1), trained at any timestep
        samples.mask = torch.ones(len(samples.prompts), 1, device=samples.latents.device)
    skip = config.train.skip_last_steps
    if skip:
        samples.mask[:, samples.mask.shape[1] - skip :] = 0
    rewards = np.concatenate([r[0] for r in results])
    components = {name: np.concatenate([r[1][name] for r in results]) for name in results[0][1]}
    infos = [r[2] for r in results if len(r) > 2]
    if collector is not None:
        local = [b * total + acc.process_index * s.batch_size + k
                 for b in range(s.num_batches_per_epoch) for k in range(s.batch_size)]
        group_parts, group_infos = collector.results(local, config.reward_timeout)
        components = {name: components.get(name, group_parts.get(name)) for name in reward_fn.names}
        rewards = reward_fn.weighted_total(components, [prompts[int(i)].prompt for b in drawn for i in
                                                        b[acc.process_index * s.batch_size:][: s.batch_size]])
        infos += group_infos
    metrics["time/reward"] = time.perf_counter() - start
    metrics.update(info_metrics(infos))
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
