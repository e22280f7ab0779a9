"""The update of the preference objectives, train.objective "dgpo" / "dpo" (docs/forward.md; losses: algos/preference.py).

The Trainer samples, rewards and computes outcome advantages as for every method (the sampler may be
deterministic: sample.eta 0, DDIM's eta 0 or the flow ODE, as DGPO samples); this module replaces the update.
A training unit is a group (DGPO: the rows of one prompt_id) or a pair (DPO: the best and the worst row of a
group, or an offline pair of forward.preference_file). Per epoch, for every micro-batch of units (about
train.batch_size images) and each of forward.num_timesteps timesteps t drawn without replacement from the
trajectories' sampling grid, with one t and one eps shared by the members of a unit (a pair's winner and loser
see the same noise, as in Diffusion-DPO; a group's members likewise):

    x_t, target = policy.forward_noise(x_0, eps, t)                          the family's forward process
    prediction = policy.predict(model, x_t, t, ...)                          with gradient
    reference  = policy.predict(frozen reference, x_t, t, ...)               pi_ref, no gradient
    loss = dgpo_loss / diffusion_dpo_loss (mean over units)                  ddpo_group.algos.preference
           (+ train.beta * ||prediction - reference||^2 with train.use_kl_loss)

one backward per timestep, one optimizer step per train.gradient_accumulation_steps micro-batches. The lagged
sampling model of ForwardUpdate stays (forward.old_decay_*; 0 and 0 sample with the policy itself).

Offline pairs (forward.dpo_pairs="offline"): the file's images are read per micro-batch, resized to the size of
the epoch's sampled images and encoded by the family's VAE (``policy.encode_images``), their prompts encoded as
sampling encodes them (``policy.conditioning``); their timesteps come from the epoch's sampling grid. The epoch's
own samples are then only rewarded and logged.

Groups and pairs are formed from one process's samples, so these objectives run on one process (checked).
"""

import contextlib
import os
import time

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from ddpo_group.algos.preference import dgpo_clip_mask, dgpo_loss, diffusion_dpo_loss
from ddpo_group.algos.forward import squared_error
from ddpo_group.config.registry import ConfigError, check_choice, register_config_check
from ddpo_group.data.prompts import jsonl_items
from ddpo_group.training import perf
from ddpo_group.training.forward_training import ForwardUpdate

PREFERENCE_OBJECTIVES = ("dgpo", "dpo")
DPO_PAIRS = ("online", "offline")


def load_preference_pairs(path):
    """The pairs of a preference file: [{"prompt", "chosen", "rejected"}] with absolute image paths.

    One JSON object a line (blank lines skipped, read by data/prompts.py's jsonl_items); image paths relative to the
    file's folder. Raises ValueError naming the file and the line of the first bad record (not UTF-8, not JSON, a
    missing or non-string field, a missing image).
    """
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such preference file (config.forward.preference_file)")
    root = os.path.dirname(os.path.abspath(path))
    pairs = []
    for record, where in jsonl_items(path, hint='; one pair a line: {"prompt": ..., "chosen": ..., "rejected": ...}'):
        if not isinstance(record, dict):
            raise ValueError(f"{where}: a pair must be a JSON object with prompt, chosen and rejected")
        pair = {}
        for key in ("prompt", "chosen", "rejected"):
            if not isinstance(record.get(key), str) or not record[key]:
                raise ValueError(f"{where}: the field {key!r} must be a non-empty string")
            pair[key] = record[key]
        for key in ("chosen", "rejected"):
            image = pair[key] if os.path.isabs(pair[key]) else os.path.join(root, pair[key])
            if not os.path.isfile(image):
                raise ValueError(f"{where}: the {key} image {pair[key]!r} does not exist (paths are relative to "
                                 "the file's folder)")
            pair[key] = image
        pairs.append(pair)
    if not pairs:
        raise ValueError(f"{path}: the preference file holds no pair")
    return pairs


@register_config_check("algorithm")
def check_preference_objective(config, machine):
    """train.objective 'dgpo' / 'dpo': a frozen reference, their betas, the pair source and its file, one process."""
    train, forward = config.train, config.forward
    if train.objective not in PREFERENCE_OBJECTIVES:
        return
    objective = f"config.train.objective={train.objective!r}"
    if not train.use_reference_model:
        raise ConfigError(f"{objective} compares the policy with a frozen reference: set train.use_reference_model=True")
    if machine.num_processes > 1:
        raise ConfigError(f"{objective} forms its groups and pairs from one process's samples: launch one process "
                          f"(got {machine.num_processes})")
    if train.objective == "dgpo":
        if not forward.dgpo_beta > 0:
            raise ConfigError(f"config.forward.dgpo_beta={forward.dgpo_beta} must be > 0 (DGPO's beta; 100 in its code)")
        if not forward.dgpo_clip_range >= 0:
            raise ConfigError(f"config.forward.dgpo_clip_range={forward.dgpo_clip_range} must be >= 0 (0: no clip; "
                              "DGPO's code: 1e-3)")
        if config.sample.group_size < 2:
            raise ConfigError(f"config.sample.group_size={config.sample.group_size}: DGPO compares the samples of a "
                              "group; use 2 or more")
        return
    if not forward.dpo_beta > 0:
        raise ConfigError(f"config.forward.dpo_beta={forward.dpo_beta} must be > 0 (Diffusion-DPO's beta T; 5000 for SD 1.5)")
    check_choice(forward.dpo_pairs, DPO_PAIRS, "forward.dpo_pairs")
    if forward.dpo_pairs == "online":
        if config.sample.group_size < 2:
            raise ConfigError(f"config.sample.group_size={config.sample.group_size}: online DPO pairs the best and the "
                              "worst sample of a group; use 2 or more")
        if forward.preference_file:
            raise ConfigError("config.forward.preference_file is read by forward.dpo_pairs='offline' only: clear it "
                              "or set forward.dpo_pairs='offline'")
        return
    if not forward.preference_file:
        raise ConfigError("config.forward.dpo_pairs='offline' needs config.forward.preference_file (a JSON-lines file "
                          "of {prompt, chosen, rejected})")
    try:
        load_preference_pairs(forward.preference_file)
    except ValueError as err:
        raise ConfigError(f"config.forward.preference_file: {err}") from None


def group_units(prompt_ids):
    """The rows of each group (one prompt_id), in order of first appearance: a list of (n_g,) int64 tensors."""
    ids = prompt_ids.cpu()
    _, inverse = torch.unique(ids, return_inverse=True)
    order = []
    for g in inverse.tolist():
        if g not in order:
            order.append(g)
    return [torch.nonzero(inverse == g).flatten() for g in order]


def best_worst_pairs(prompt_ids, scores):
    """Online DPO's pairs: (winner row, loser row) of each group, the highest and the lowest score (the first row on
    ties); a group whose scores are all equal gives none. A list of (2,) int64 tensors."""
    pairs = []
    scores = scores.cpu()
    for rows in group_units(prompt_ids):
        values = scores[rows]
        if len(rows) < 2 or bool((values == values[0]).all()):
            continue
        pairs.append(torch.stack([rows[values.argmax()], rows[values.argmin()]]))
    return pairs


def _load_images(paths, size):
    """(n, 3, H, W) float32 in [0, 1] of image files, resized to size = (H, W) with bicubic filtering."""
    images = []
    for path in paths:
        with Image.open(path) as image:
            image = image.convert("RGB")
            if image.size != (size[1], size[0]):
                image = image.resize((size[1], size[0]), Image.BICUBIC)
            images.append(torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1))
    return torch.stack(images)


class PreferenceUpdate(ForwardUpdate):
    """The update of train.objective 'dgpo' / 'dpo' for a Trainer (module docstring)."""

    def __init__(self, trainer):
        super().__init__(trainer)
        f = trainer.config.forward
        self.offline = self.objective == "dpo" and f.dpo_pairs == "offline"
        self.pairs = load_preference_pairs(f.preference_file) if self.offline else None

    def _units(self, samples):
        if self.objective == "dgpo":
            return group_units(samples.prompt_ids)
        if self.offline:
            return [torch.tensor([i]) for i in range(len(self.pairs))]
        return best_worst_pairs(samples.prompt_ids, samples.advantages[:, 0].float())

    def train_epoch(self, samples, epoch, metrics):
        tr = self.trainer
        config, acc = tr.config, tr.accelerator
        t, f = config.train, config.forward
        start = time.perf_counter()
        tr.model.train()
        num_steps = samples.timesteps.shape[1]
        k_steps = f.num_timesteps or num_steps
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch * 101 + acc.process_index)
        units = self._units(samples)
        per_batch = max(1, t.batch_size // (2 if self.objective == "dpo" else config.sample.group_size))
        plan = []
        for _ in range(t.num_inner_epochs):
            perm = torch.randperm(len(units), generator=generator).tolist()
            plan += [[units[i] for i in perm[j : j + per_batch]] for j in range(0, len(units), per_batch)]
        info = {key: [] for key in ("loss", "policy_loss", "kl", "reward_margin", "accuracy", "clipfrac")}
        window = t.gradient_accumulation_steps
        bad = False
        calls = 0
        for n, batch in enumerate(tqdm(plan, desc="training", leave=False, disable=not acc.is_main_process)):
            window_start = n - n % window
            window_len = min(window, len(plan) - window_start)
            closes_window = n + 1 == window_start + window_len
            columns = torch.stack([torch.randperm(num_steps, generator=generator)[:k_steps] for _ in batch])
            for k in range(k_steps):
                sync = closes_window and k == k_steps - 1
                with contextlib.nullcontext() if sync else acc.no_sync(tr.model):
                    loss, stats = self._unit_loss(samples, batch, columns[:, k], generator)
                    with perf.model_time():  # the backward's seconds are model seconds (perf.py)
                        acc.backward(loss / (k_steps * window_len))
                calls += 1
                bad = bad or not bool(torch.isfinite(loss))
                for key, value in stats.items():
                    info[key].append(value)
            if closes_window:
                step = tr._optimizer_step(bad)
                if step["grad_norm"] is not None:
                    info.setdefault("grad_norm", []).append(step["grad_norm"])
                bad = False
        decay = self.old_decay(tr.global_step)
        self.old.mixup(alpha=1.0 - decay)  # the next epoch's sampler (d = 0: the policy itself)
        for key, values in info.items():
            if values:
                name = key if key in ("loss", "policy_loss", "kl", "clipfrac", "grad_norm") else f"preference/{key}"
                metrics[name] = float(np.mean(values))
        metrics[f"preference/{'groups' if self.objective == 'dgpo' else 'pairs'}"] = len(units)
        metrics["forward/old_decay"] = decay
        metrics["time/train"] = time.perf_counter() - start
        metrics["train/unet_calls"] = calls
        metrics["train/unet_steps_per_sample"] = float(k_steps)
        metrics.update(tr.step_metrics())
        if tr.reference is not None:
            metrics.update(tr.reference.metrics())
            if "kl" in metrics:
                metrics["ref/kl"] = metrics["kl"]

    def _inputs(self, samples, batch, column):
        """(x0 (n, ...), timesteps (n,), conditioning batch, its rows (n,), unit index of each row (n,)).

        DGPO: the rows of the micro-batch's groups. DPO: winners first, then losers, pair p at rows p and P + p."""
        device = samples.latents.device
        if self.offline:
            pairs = [self.pairs[int(unit[0])] for unit in batch]
            size = tuple(samples.images.shape[-2:])
            images = _load_images([p["chosen"] for p in pairs] + [p["rejected"] for p in pairs], size)
            x0 = self.trainer.policy.encode_images(images).to(device)
            prompts = [p["prompt"] for p in pairs] * 2
            guidance = self._guidance()
            cond = self.trainer.policy.conditioning(prompts, guidance)
            grid = samples.timesteps[0]
            timesteps = torch.cat([grid[column.to(grid.device)]] * 2)
            unit = torch.arange(len(pairs)).repeat(2)
            return x0, timesteps.to(device), cond, torch.arange(len(prompts), device=device), unit
        if self.objective == "dpo":
            rows = torch.cat([torch.stack([u[0] for u in batch]), torch.stack([u[1] for u in batch])])
            unit = torch.arange(len(batch)).repeat(2)
        else:
            rows = torch.cat(batch)
            unit = torch.cat([torch.full((len(u),), i) for i, u in enumerate(batch)])
        rows = rows.to(device)
        timesteps = samples.timesteps[rows, column[unit].to(device)]
        return samples.latents[rows, -1], timesteps, samples, rows, unit

    def _guidance(self):
        config = self.trainer.config
        return config.sample.guidance_scale if config.train.cfg else 1.0

    def _unit_loss(self, samples, batch, column, generator):
        """The loss of one timestep of a micro-batch of units (mean over units) and its detached statistics."""
        tr = self.trainer
        t, f = tr.config.train, tr.config.forward
        policy = tr.policy
        x0, timesteps, cond, rows, unit = self._inputs(samples, batch, column)
        # one eps per unit: a pair's winner and loser (a group's members) are noised alike
        noise = torch.randn((len(batch),) + tuple(x0.shape[1:]), generator=generator).to(x0.device)[unit.to(x0.device)]
        x_t, target, _ = policy.forward_noise(x0, noise, timesteps)
        guidance = self._guidance()
        clip = self.objective == "dgpo" and f.dgpo_clip_range > 0
        with tr.accelerator.autocast():
            prediction = policy.predict(tr.model, x_t, timesteps, cond, rows, guidance).float()
            with torch.no_grad():
                reference = policy.predict(tr.reference, x_t, timesteps, cond, rows, guidance).float()
                old = policy.predict(self.old, x_t, timesteps, cond, rows, guidance).float() if clip else None
        stats = {}
        if self.objective == "dgpo":
            advantages = samples.advantages[rows, 0].float()
            clipped = dgpo_clip_mask(prediction, old, target, advantages, f.dgpo_clip_range) if clip else None
            policy_loss = dgpo_loss(prediction, reference, target, advantages, unit, f.dgpo_beta, clipped).mean()
            if clip:
                stats["clipfrac"] = float(clipped.float().mean())
        else:
            p = len(batch)
            pair_losses = diffusion_dpo_loss(prediction[:p], reference[:p], target[:p],
                                             prediction[p:], reference[p:], target[p:], f.dpo_beta)
            policy_loss = pair_losses.mean()
            with torch.no_grad():  # the implicit reward margin -(D_w - D_l): > 0 where the policy prefers the winner
                gap = (squared_error(prediction, target) - squared_error(reference, target)).detach()
                margin = gap[p:] - gap[:p]
                stats.update(reward_margin=float(margin.mean()), accuracy=float((margin > 0).float().mean()))
        loss = policy_loss
        kl = squared_error(prediction, reference).mean()
        stats["kl"] = float(kl.detach())
        if t.use_kl_loss:
            loss = loss + t.beta * kl
        stats.update(loss=float(loss.detach()), policy_loss=float(policy_loss.detach()))
        return loss, stats
