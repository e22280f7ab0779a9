"""The advantage phase of an epoch: advantages on the gathered batch of all processes (docs/design.md §2-4).

One dispatch through the estimator registry (``ddpo_group.algos.advantages``); what the estimator is
given follows its registered properties: critic values when it ``needs_values``, the grpo outcome
advantages when it ``needs_outcome_advantages``, the per-prompt trackers when it ``uses_tracker``;
endpoints and the adaptive threshold when it ``defines_endpoints``; the step rewards r[:, k] = R(decode(x0_hat(x_k)))
at every step when it ``needs_step_rewards`` (step_gain: each process scores its own samples with the anchor
machinery of critic_designs.py, then they are gathered). With reward_aggregation
"normalize_then_sum" an outcome estimator runs per reward component and the weighted advantages are
summed. `EpochAdvantages` owns the algorithm state a checkpoint keeps (trackers, threshold).
"""

import time

import numpy as np
import torch

from ddpo_group.algos import advantages as adv_lib
from ddpo_group.algos import grouping
from ddpo_group.training.batch import GatheredBatch
from ddpo_group.training import critic_designs
from ddpo_group.config.registry import ConfigError
from ddpo_group.training.critic import compute_values
from ddpo_group.training.diagnostics import advantage_step_stats, step_reward_stats, value_step_stats
from ddpo_group.algos.stat_tracking import PerPromptStatTracker


def group_stats(rewards, prompt_ids):
    """Within-group reward statistics of the gathered batch (prompt groups of the GRPO key)."""
    stds, sizes = [], []
    for pid in torch.unique(prompt_ids):
        group = rewards[prompt_ids == pid]
        sizes.append(group.numel())
        stds.append(float(group.std(unbiased=False)))
    return {
        "prompt_group/num_prompts": len(sizes),
        "prompt_group/mean_size": float(np.mean(sizes)),
        "prompt_group/mean_reward_std": float(np.mean(stds)),
        "prompt_group/zero_std_fraction": float(np.mean([s == 0.0 for s in stds])),
    }


class EpochAdvantages:
    """Advantages of an epoch batch (module docstring), with the trackers and threshold it keeps across epochs."""

    def __init__(self, config, accelerator, reward_fn, prompts):
        self.config = config
        self.accelerator = accelerator
        self.reward_fn = reward_fn
        self.prompts = prompts
        self.estimator = adv_lib.get_adv_estimator(config.algorithm.adv_estimator)
        tracking = config.per_prompt_stat_tracking
        self.trackers = {}
        if self.estimator.uses_tracker:
            self.trackers = {
                name: PerPromptStatTracker(tracking.buffer_size or None, tracking.min_count, config.algorithm.norm_adv_by_std)
                for name in self.streams
            }
        self.threshold = grouping.AdaptiveThreshold.from_config(config.group_ppo)
        if self.estimator.needs_step_rewards and len(self.streams) > 1:
            raise ConfigError(
                f"config.reward_aggregation='normalize_then_sum' with {len(self.streams)} rewards: "
                f"algorithm.adv_estimator={config.algorithm.adv_estimator!r} scores each step with the weighted sum "
                "of the rewards; set reward_aggregation='sum_then_normalize'"
            )
        group_wise = list(getattr(reward_fn, "group_wise_names", []))
        if self.estimator.needs_step_rewards and group_wise:
            raise ConfigError(
                f"config.reward_fn / reward_weights: reward {group_wise[0]!r} scores whole prompt groups, which "
                f"algorithm.adv_estimator={config.algorithm.adv_estimator!r} cannot give it at each step (a group's "
                "members may sit on other processes); use per-image rewards"
            )

    @property
    def streams(self):
        """Advantage streams: one ("reward") unless rewards are normalised one by one before summing."""
        if self.config.reward_aggregation == "normalize_then_sum" and len(self.reward_fn.names) > 1:
            return list(self.reward_fn.names)
        return ["reward"]

    def _anchor_values(self, samples, policy, model, steps):
        """(B_local, T) float32 R(decode(x0_hat(x_k))) of this process's samples at `steps`, 0 elsewhere."""
        records = [self.prompts[int(i)] for i in samples.prompt_ids.tolist()]
        with self.accelerator.autocast():
            values = critic_designs.anchor_values(
                policy, model, samples, self.reward_fn, [r.prompt for r in records], [r.metadata for r in records],
                self.config.sample.guidance_scale, steps=steps,
                micro_batch_size=self.config.train.eval_micro_batch_size or None,
            )
        return values.float()

    def anchor(self, samples, policy, model, metrics):
        """(B_local, T) anchor values at the steps with a density of this process's samples (critic_designs.py)."""
        start = time.perf_counter()
        columns = samples.mask.any(dim=0).nonzero().flatten().tolist()
        anchor = self._anchor_values(samples, policy, model, columns)
        metrics["time/critic_anchor"] = time.perf_counter() - start
        # per process: images the anchor decoded and scored (one per trajectory and step), issue 35's compute; the
        # model calls are sampling's own (Trajectories.x0_hat), one more each only for a batch sampled without it
        metrics["critic/anchor_decodes"] = len(samples.prompts) * len(columns)
        return anchor

    def step_rewards(self, samples, policy, model, metrics):
        """(B_local, T) step rewards r[:, k] = R(decode(x0_hat(x_k))) of this process's samples at EVERY step k (a
        step's gain needs the prediction after it, whether or not that step has a density), for an estimator that
        needs_step_rewards (step_gain)."""
        start = time.perf_counter()
        num_steps = samples.timesteps.shape[1]
        step_rewards = self._anchor_values(samples, policy, model, range(num_steps))
        metrics["time/step_rewards"] = time.perf_counter() - start
        # per process: images decoded and scored, one per trajectory and step; no model call (Trajectories.x0_hat)
        metrics["train/step_reward_decodes"] = len(samples.prompts) * num_steps
        return step_rewards

    def state_dict(self):
        return {"trackers": {name: tracker.state_dict() for name, tracker in self.trackers.items()},
                "threshold": self.threshold.state_dict()}

    def load_state_dict(self, state):
        for name, tracker_state in state.get("trackers", {}).items():
            if name in self.trackers:
                self.trackers[name].load_state_dict(tracker_state)
        self.threshold.load_state_dict(state["threshold"])

    def __call__(self, samples, metrics, critic=None, policy=None, model=None):
        """Advantages (B_local, T) on the gathered batch of all processes: sets samples.gathered and
        samples.advantages (and the critic's returns / old values / mask, the Group-PPO endpoints). policy and
        model (the sampling weights) are read by an anchor critic (config.critic.kind, critic_designs.py)."""
        config, acc = self.config, self.accelerator
        start = time.perf_counter()
        algo = config.algorithm
        gather = acc.gather
        rewards = gather(samples.rewards)
        prompt_ids = gather(samples.prompt_ids.to(acc.device))
        mask = gather(samples.mask.to(acc.device).float())
        b_local = len(samples.prompts)
        local = slice(acc.process_index * b_local, (acc.process_index + 1) * b_local)
        samples.gathered = GatheredBatch(
            rewards=rewards, components={k: gather(v) for k, v in samples.components.items()},
            prompt_ids=prompt_ids, mask=mask,
        )

        streams = self.streams
        weights = dict(self.reward_fn.weights) if len(streams) > 1 else {"reward": 1.0}
        stream_rewards = {"reward": rewards} if streams == ["reward"] else samples.gathered.components
        estimator = self.estimator
        options = {"norm_by_std": algo.norm_adv_by_std, "gamma": algo.gamma, "lam": algo.lam}
        if estimator.uses_tracker:
            options["prompts"] = [self.prompts[int(i)].prompt for i in prompt_ids.tolist()]
        if estimator.needs_step_rewards:  # each process scores its own samples' steps; the estimator sees all
            samples.step_rewards = self.step_rewards(samples, policy, model, metrics).to(acc.device)
            options["step_rewards"] = gather(samples.step_rewards)
            metrics.update(step_reward_stats(options["step_rewards"], rewards))

        def combined_outcome(fn):
            """sum over reward streams of weight x fn's advantages of that stream."""
            return sum(
                weights[name] * fn(
                    rewards=stream_rewards[name], prompt_ids=prompt_ids, mask=mask, tracker=self.trackers.get(name), **options
                )[0]
                for name in streams
            )

        if estimator.needs_values:
            kind = config.critic.get("kind", "network")  # a run stored before critic.kind existed: the network
            with torch.no_grad():
                values_local = torch.zeros(samples.timesteps.shape, device=samples.latents.device)
                if kind != "anchor":
                    values_local = compute_values(
                        acc.unwrap_model(critic), samples.latents, samples.timesteps, samples.prompt_embeds,
                        micro_batch_size=config.train.eval_micro_batch_size or None,
                    )
            anchor = None
            if kind != "network":  # critic_designs.py: the reward of the decoded x0_hat at the steps with a density
                anchor_local = self.anchor(samples, policy, model, metrics)
                values_local = values_local.float() + anchor_local
                anchor = gather(anchor_local)
            values = gather(values_local.float())
            info = {}
            if estimator.needs_outcome_advantages:
                options["outcome_advantages"] = combined_outcome(adv_lib.get_adv_estimator("grpo"))
            if estimator.defines_endpoints:
                gp = config.group_ppo
                options.update(threshold=self.threshold.threshold, max_group_size=gp.max_group_size, eps=gp.eps, info=info,
                               advantage_norm=gp.advantage_norm)
            advantages, returns = estimator(rewards=rewards, prompt_ids=prompt_ids, mask=mask, values=values, **options)
            train_mask = mask
            if "endpoint_mask" in info:
                endpoint_mask = info["endpoint_mask"]
                metrics.update(grouping.grouping_metrics(endpoint_mask, mask, self.threshold.threshold))
                self.threshold.update(endpoint_mask, mask)
                samples.endpoint_mask = endpoint_mask[local]
                samples.group_ids = info["group_ids"][local]
                if config.critic.train_steps == "endpoints":
                    train_mask = endpoint_mask.to(mask.dtype) * mask
            if critic_designs.critic_lambda(config) != algo.lam:  # the critic's own lambda (VC-PPO / VAPO)
                returns = critic_designs.critic_returns(rewards, values, mask, algo.gamma, critic_designs.critic_lambda(config))
            targets, old_values = critic_designs.critic_targets(returns, values, anchor)  # a residual learns R - anchor
            samples.returns = targets[local]
            samples.old_values = old_values[local]
            samples.critic_mask = train_mask[local]
            metrics["critic/value_mean"] = float((values * mask).sum() / mask.sum())
        else:
            advantages = combined_outcome(estimator)
        advantages = advantages.clamp(-config.train.adv_clip_max, config.train.adv_clip_max)
        metrics.update(advantage_step_stats(advantages, mask))
        if estimator.needs_values:
            metrics.update(value_step_stats(values, rewards, mask))
        samples.advantages = advantages[local]
        samples.gathered.advantages = advantages
        if estimator.uses_tracker:
            stats = self.trackers[streams[0]].get_stats()
            metrics.update({f"tracker/{k}": v for k, v in stats.items() if isinstance(v, (int, float))})
        metrics.update(group_stats(rewards, prompt_ids))
        metrics["time/advantages"] = time.perf_counter() - start
