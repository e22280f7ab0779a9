"""The update of the forward-process objectives, train.objective "nft" / "awm" (docs/forward.md).

The Trainer samples, rewards and computes outcome advantages as for every method; this module
replaces its stepwise update. Per epoch, for every micro-batch of clean samples x_0 and each of
forward.num_timesteps timesteps t drawn without replacement from the trajectory's sampling grid:

    eps ~ N(0, I); x_t, target, c = policy.forward_noise(x_0, eps, t)     the family's forward process
    prediction = policy.predict(model, x_t, t, ...)                         with gradient
    old = policy.predict(old model, x_t, t, ...)                            the lagged sampling model
    loss = nft_loss(prediction, old, target, r(A)) / awm's clipped ratio    ddpo_group.algos.forward
           (+ train.beta * ||prediction - reference prediction||^2 with train.use_kl_loss)

one backward per timestep, one optimizer step per train.gradient_accumulation_steps micro-batches.
After the epoch the old model moves towards the policy: old <- d old + (1 - d) theta with
d = min(forward.old_decay_rate * optimizer steps, forward.old_decay_max). It is the model the next
epoch samples with; it starts equal to the policy, so with d = 0 the first window is exactly
on-policy (logged as forward/first_window_max_abs_deviation, exactly 0 then).
"""

import contextlib
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from ddpo_group.algos.forward import matching_log_prob, nft_loss, nft_optimality, squared_error
from ddpo_group.training import perf
from ddpo_group.training.reference import ReferencePolicy


class ForwardUpdate:
    """The forward-process update of a Trainer (its model, optimizer step, reference and accelerator)."""

    def __init__(self, trainer):
        config = trainer.config
        self.trainer = trainer
        self.objective = config.train.objective
        # the sampling (old) model: a copy of the trainable weights (LoRA: the adapters), swapped in per call
        self.old = ReferencePolicy(trainer.trainable_module, config.use_lora, copy=True,
                                   sharded_copy=getattr(trainer, "sharded_copies", {}).get("old_model"))

    @property
    def sampling_model(self):
        """The model the epoch's samples come from (pi_old)."""
        return self.old

    def old_decay(self, global_step):
        f = self.trainer.config.forward
        return min(f.old_decay_rate * global_step, f.old_decay_max)

    def _plan(self, num_rows, generator):
        t = self.trainer.config.train
        plan = []
        for _ in range(t.num_inner_epochs):
            perm = torch.randperm(num_rows, generator=generator)
            plan += [perm[i : i + t.batch_size] for i in range(0, num_rows, t.batch_size)]
        return plan

    def train_epoch(self, samples, epoch, metrics):
        tr = self.trainer
        config, acc = tr.config, tr.accelerator
        t, f = config.train, config.forward
        start = time.perf_counter()
        tr.model.train()
        device = samples.latents.device
        num_steps = samples.timesteps.shape[1]
        k_steps = f.num_timesteps or num_steps
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch * 101 + acc.process_index)
        plan = self._plan(len(samples.prompts), generator)
        info = {key: [] for key in ("loss", "policy_loss", "kl", "old_deviation", "clipfrac", "approx_kl")}
        first_window_deviation = 0.0
        window = t.gradient_accumulation_steps
        bad = False
        for n, rows in enumerate(tqdm(plan, desc="training", leave=False, disable=not acc.is_main_process)):
            window_start = n - n % window
            window_len = min(window, len(plan) - window_start)
            closes_window = n + 1 == window_start + window_len
            rows = rows.to(device)
            columns = torch.stack([torch.randperm(num_steps, generator=generator)[:k_steps] for _ in range(len(rows))])
            x0 = samples.latents[rows, -1]
            noise = torch.randn((len(rows), k_steps) + tuple(x0.shape[1:]), generator=generator).to(device)
            advantages = samples.advantages[rows, 0].float()
            for k in range(k_steps):
                sync = closes_window and k == k_steps - 1
                timesteps = samples.timesteps[rows, columns[:, k].to(device)]
                with contextlib.nullcontext() if sync else acc.no_sync(tr.model):
                    loss, stats = self._column_loss(samples, rows, x0, noise[:, k], timesteps, advantages)
                    with perf.model_time():  # the backward's seconds are model seconds (perf.py)
                        acc.backward(loss / (k_steps * window_len))
                bad = bad or not bool(torch.isfinite(loss))
                for key, value in stats.items():
                    if key in info:
                        info[key].append(value)
                if n < window:
                    first_window_deviation = max(first_window_deviation, stats["max_abs_deviation"])
            if closes_window:
                step = tr._optimizer_step(bad)
                if step["grad_norm"] is not None:
                    info.setdefault("grad_norm", []).append(step["grad_norm"])
                bad = False
        decay = self.old_decay(tr.global_step)
        self.old.mixup(alpha=1.0 - decay)  # old <- decay * old + (1 - decay) * theta: the next epoch's sampler
        for key, values in info.items():
            if values:
                name = key if key in ("loss", "policy_loss", "kl", "clipfrac", "approx_kl", "grad_norm") else f"forward/{key}"
                metrics[name] = float(np.mean(values))
        metrics["forward/old_decay"] = decay
        metrics["forward/first_window_max_abs_deviation"] = first_window_deviation
        metrics["time/train"] = time.perf_counter() - start
        metrics["train/unet_calls"] = len(plan) * k_steps
        metrics["train/unet_steps_per_sample"] = float(k_steps)
        metrics.update(tr.step_metrics())
        if tr.reference is not None:
            metrics.update(tr.reference.metrics())
            if "kl" in metrics:
                metrics["ref/kl"] = metrics["kl"]

    def _column_loss(self, samples, rows, x0, noise, timesteps, advantages):
        """The loss of one timestep column of a micro-batch (mean over its rows) and its detached statistics."""
        tr = self.trainer
        config = tr.config
        t, f = config.train, config.forward
        policy = tr.policy
        guidance = config.sample.guidance_scale if t.cfg else 1.0
        x_t, target, x0_scale = policy.forward_noise(x0, noise, timesteps)
        with tr.accelerator.autocast():
            prediction = policy.predict(tr.model, x_t, timesteps, samples, rows, guidance).float()
            with torch.no_grad():
                old = policy.predict(self.old, x_t, timesteps, samples, rows, guidance).float()
                reference = None
                if tr.reference is not None:
                    reference = policy.predict(tr.reference, x_t, timesteps, samples, rows, guidance).float()
        stats = {}
        if self.objective == "nft":
            optimality = nft_optimality(advantages, t.adv_clip_max)
            policy_loss = nft_loss(prediction, old, target, optimality, f.nft_beta, x0_scale, f.weighting).mean()
        else:
            log_q = matching_log_prob(prediction, target, x0_scale, f.weighting)
            old_log_q = matching_log_prob(old, target, x0_scale, f.weighting)
            ones = torch.ones_like(log_q)[:, None]
            policy_loss, loss_metrics = tr.policy_loss(
                old_log_q[:, None], log_q[:, None], advantages[:, None], ones, tr.loss_config
            )
            stats.update({key: float(value) for key, value in loss_metrics.items() if key in ("clipfrac", "approx_kl")})
        loss = policy_loss
        if reference is not None:
            kl = squared_error(prediction, reference).mean()
            stats["kl"] = float(kl.detach())
            if t.use_kl_loss:
                loss = loss + t.beta * kl
        with torch.no_grad():
            deviation = prediction.detach() - old
            stats.update(
                loss=float(loss.detach()), policy_loss=float(policy_loss.detach()),
                old_deviation=float(deviation.pow(2).flatten(1).mean(1).mean()),
                max_abs_deviation=float(deviation.abs().max()),
            )
        return loss, stats

    def state_dict(self):
        return self.old.state_dict()

    def load_state_dict(self, state):
        self.old.load_state_dict(state)
