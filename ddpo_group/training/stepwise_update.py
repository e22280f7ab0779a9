"""The stepwise update: PPO / GRPO on denoising steps, one step column at a time (docs/design.md §7).

The part a researcher edits is `StepwiseUpdate.update` (about 40 lines): for each micro-batch of
the epoch's plan, the trained steps are re-scored one column at a time with gradients; step k's
backward uses the micro-batch's (b, K) loss with column k live and every other column detached
(`base`), so the gradients summed over the steps are exactly the gradient of the whole loss while
memory holds one model activation set whatever T is. Losses that couple the steps of a sequence
(gspo, geo_mean) first compute every column without gradients. One clipped optimizer step per
gradient_accumulation_steps micro-batches (``Trainer._optimizer_step``).

Around it: which steps of a trajectory are trained (`select_steps`), the epoch's plan of
micro-batches (`StepwiseUpdate.plan`), pi_old recomputed in the training layout (exact on-policy
ratio, `recompute_old_log_probs`), and what the update measures while it runs (`UpdateStats`: no
extra model call). The forward-process objectives (DiffusionNFT, AWM) are ``forward_training.py``.
"""

import contextlib
import dataclasses
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from ddpo_group.algos.drift_losses import StepDrift
from ddpo_group.algos.losses import agg_loss, gaussian_kl, kl_penalty
from ddpo_group.algos.stepwise import column_loss, grpo_loss
from ddpo_group.config.registry import ConfigError, check_choice, check_positive, register_config_check
from ddpo_group.training import perf
from ddpo_group.training.diagnostics import GradShare, StepAccumulator


@dataclasses.dataclass
class MicroBatch:
    """One training micro-batch: trajectories `rows` of the epoch batch and the K steps trained for each.

    rows (b,) int64; step_idx (b, K) step index of each column; step_mask (b, K) 1 where that step
    has a density; advantages (b, K); old_log_probs (b, K) float32 log pi_old of those steps;
    layout_noise: max |recomputed - sampled| log-prob when pi_old was recomputed, else None;
    old_means: (b, K, ...) pi_old's step means, kept for a loss that reads the drift (dppo, grpo_guard), else None.
    """

    rows: torch.Tensor
    step_idx: torch.Tensor
    step_mask: torch.Tensor
    advantages: torch.Tensor
    old_log_probs: torch.Tensor
    layout_noise: float | None = None
    old_means: torch.Tensor | None = None


@dataclasses.dataclass
class LossConfig:
    """The attributes a registered policy loss reads (docs/design.md §9)."""

    clip_ratio: float
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    loss_agg_mode: str
    dppo_kl_max: float = 1e-5
    guard_reweight: str = "dt"

    @classmethod
    def from_config(cls, train):
        """From config.train: clip_range, clip_ratio_low / high (None: clip_range), clip_ratio_c, loss_agg_mode,
        dppo_kl_max, guard_reweight."""
        return cls(
            clip_ratio=train.clip_range,
            clip_ratio_low=train.clip_ratio_low if train.clip_ratio_low is not None else train.clip_range,
            clip_ratio_high=train.clip_ratio_high if train.clip_ratio_high is not None else train.clip_range,
            clip_ratio_c=train.clip_ratio_c,
            loss_agg_mode=train.loss_agg_mode,
            dppo_kl_max=train.dppo_kl_max,
            guard_reweight=train.guard_reweight,
        )


def max_abs_diff(a, b, mask):
    """max |a - b| over the entries where mask > 0 (0.0 when there are none)."""
    diff = torch.where(mask > 0, (a.float() - b.float()).abs(), torch.zeros_like(a, dtype=torch.float32))
    return float(diff.max()) if diff.numel() else 0.0


def select_steps(train, samples, rows, generator):
    """Step indices (b, K), their mask (b, K) and loss weights (b, K) for the trajectories `rows`
    (train.timestep_selection).

    all: every step with a density; fraction: a random subset per trajectory (DDPO); endpoints: the
    Group-PPO segment endpoints; segment_start: the first (noisiest) step of each Group-PPO segment, with the
    segment's advantage; segment_sample: one step drawn uniformly inside each Group-PPO
    segment (shared by the micro-batch), weighted by len(segment) * K / T so that the token-mean over
    the K drawn steps is an unbiased estimate of the token-mean over all T (exactly so for a loss
    linear in the advantage, as vanilla PPO is); early: the first train.early_steps steps with a
    density (the noisiest: Flow-GRPO-Fast / MixGRPO's window). Weights are 1 except for segment_sample.
    """
    mask = samples.mask[rows].float()
    b, T = mask.shape
    selection = train.timestep_selection
    weights = None
    valid_columns = samples.mask.any(dim=0).nonzero().flatten().cpu()
    if selection == "all":
        # the steps that have a density (every step for DDIM; the SDE window of a flow model)
        idx = valid_columns.expand(b, len(valid_columns))
    elif selection == "early":
        columns = valid_columns[: train.early_steps]
        idx = columns.expand(b, len(columns))
    elif selection == "fraction":
        k = max(1, int(T * train.timestep_fraction))
        idx = torch.stack([torch.randperm(T, generator=generator)[:k] for _ in range(b)])
    elif selection == "segment_start":
        group_ids = samples.group_ids.max(dim=0).values.cpu()  # segments are shared by the batch
        columns = [int((group_ids == g).nonzero()[0]) for g in range(1, int(group_ids.max()) + 1) if (group_ids == g).any()]
        columns = torch.tensor(columns, dtype=torch.int64)
        idx = columns.expand(b, len(columns))
    elif selection == "segment_sample":
        group_ids = samples.group_ids.max(dim=0).values.cpu()  # segments are shared by the batch
        segments = [(group_ids == g).nonzero().flatten() for g in range(1, int(group_ids.max()) + 1)]
        segments = [steps for steps in segments if len(steps)]
        columns = torch.stack([steps[torch.randint(len(steps), (1,), generator=generator)][0] for steps in segments])
        lengths = torch.tensor([float(len(steps)) for steps in segments])
        idx = columns.expand(b, len(columns))
        weights = (lengths * len(segments) / lengths.sum()).expand(b, len(columns))
    else:
        columns = samples.endpoint_mask.any(dim=0).nonzero().flatten().cpu()
        idx = columns.expand(b, len(columns))
    idx = idx.to(mask.device)
    weights = torch.ones(idx.shape, device=mask.device) if weights is None else weights.to(mask.device)
    return idx, mask.gather(1, idx), weights


class UpdateStats:
    """What the stepwise update measures while it runs, from values it computes anyway: the flat loss
    metrics (loss, policy_loss, kl, clipfrac, approx_kl, grad_norm), the per-step diagnostics
    (``diagnostics.StepAccumulator``, ``GradShare`` every train.grad_share_every epochs), the on-policy
    ratio before the first optimizer step and the layout noise that recomputing pi_old removed."""

    def __init__(self, trainer, num_steps, measure_grads):
        self.trainer = trainer
        self.info = {"loss": [], "policy_loss": [], "kl": [], "clipfrac": [], "approx_kl": [], "clipfrac_lower": []}
        self.grad_norms = []
        self.on_policy_ratio = []
        loss_config = trainer.loss_config
        self.steps = StepAccumulator(num_steps, loss_config.clip_ratio_low, loss_config.clip_ratio_high)
        self.grad_share = GradShare(trainer.trainable_params, num_steps) if measure_grads else None

    def column_starts(self, mb, k):
        """Before column k's backward: the gradient share counts it for its step when every row trains the same one."""
        if self.grad_share is not None:
            column = mb.step_idx[:, k]
            self.grad_share.step = int(column[0]) if bool((column == column[0]).all()) else None

    def column_ends(self):
        if self.grad_share is not None:
            self.grad_share.close_column()

    def micro_batch(self, mb, live, kl, before_first_step, sampled, drift=None):
        """A micro-batch done: `live` (b, K) the log-probs its backward used, `kl` (b, K) to the reference,
        `sampled` the log-probs stored at sampling when pi_old was taken from this forward (else None), `drift`
        the StepDrift (b, K) of a loss that reads it (else None)."""
        tr, t = self.trainer, self.trainer.config.train
        self.steps.add(mb.step_idx, mb.old_log_probs, live, mb.advantages, mb.step_mask,
                       kl=kl if tr.reference is not None else None, drift=drift)
        if before_first_step:
            self.on_policy_ratio.append(max_abs_diff(live, mb.old_log_probs, mb.step_mask))
        if sampled is not None:
            mb.layout_noise = max_abs_diff(mb.old_log_probs, sampled, mb.step_mask)
        with torch.no_grad():
            loss, policy_loss, loss_metrics = grpo_loss(
                tr.policy_loss, tr.loss_config, mb.old_log_probs, live, mb.advantages, mb.step_mask,
                kl=kl if t.use_kl_loss else None, beta=t.beta, drift=drift,
            )
            kl_value = agg_loss(kl, mb.step_mask, t.loss_agg_mode) if tr.reference is not None else torch.zeros(())
        self.info["policy_loss"].append(float(policy_loss))
        self.info["kl"].append(float(kl_value))
        self.info["loss"].append(float(loss))
        for key, value in loss_metrics.items():  # clipfrac, approx_kl, clipfrac_lower and a loss's own (dppo/...)
            self.info.setdefault(key, []).append(float(value))

    def optimizer_step(self, step):
        if step["grad_norm"] is not None:
            self.grad_norms.append(step["grad_norm"])

    def metrics(self, plan, num_samples):
        """The epoch's update metrics (docs/diagnostics.md)."""
        tr = self.trainer
        metrics = self.steps.metrics()
        if self.grad_share is not None:
            metrics.update(self.grad_share.metrics())
        metrics.update({key: float(np.mean(values)) for key, values in self.info.items() if values})
        if self.grad_norms:
            metrics["grad_norm"] = float(np.mean(self.grad_norms))
        # max |log pi_theta - log pi_old| before the first optimizer step: exactly 0 with "recompute"
        metrics["train/on_policy_max_abs_log_ratio"] = max(self.on_policy_ratio)
        noise = [mb.layout_noise for mb in plan if mb.layout_noise is not None]
        if noise:
            # what recomputing removed: |log pi_old in the training layout - log pi stored at sampling|
            metrics["train/layout_noise_max_abs_log_ratio"] = max(noise)
        # batched forward+backward calls of the denoising model (the key keeps its first name, "unet")
        metrics["train/unet_calls"] = sum(mb.step_idx.shape[1] for mb in plan)
        metrics["train/unet_steps_per_sample"] = sum(mb.step_idx.numel() for mb in plan) / num_samples
        metrics.update(tr.step_metrics())
        if tr.reference is not None:
            metrics.update(tr.reference.metrics())
            metrics["ref/kl"] = metrics["kl"]
        return metrics


class StepwiseUpdate:
    """The stepwise update of train.objective="stepwise" for a Trainer (module docstring). It reads the
    trainer's model, policy, loss, reference and optimizer step when it runs."""

    def __init__(self, trainer):
        self.trainer = trainer

    def train_epoch(self, samples, epoch, metrics):
        """num_inner_epochs passes of per-step PPO updates over the epoch's samples.

        pi_old: with train.old_log_probs="recompute" (default), the log-probs of the behaviour
        policy are taken in the training layout (`recompute_old_log_probs`): micro-batches of
        the first accumulation window (no optimizer step has happened yet) use their own forward's
        value, the later ones a pass made before the first step. The on-policy ratio is then
        exactly 1 (approx_kl and clipfrac exactly 0 with one optimizer step per epoch).
        "sampled" uses the log-probs stored at sampling, as ddpo-pytorch does (ratio 1 up to noise).
        """
        tr = self.trainer
        t = tr.config.train
        start = time.perf_counter()
        tr.model.train()
        plan = self.plan(samples, epoch)
        first_window = min(t.gradient_accumulation_steps, len(plan))
        recompute = t.old_log_probs == "recompute"
        # train.async_rollout: the samples come from a frozen copy of earlier weights (training/async_rollout.py);
        # pi_old is that copy's, for every micro-batch (no forward of the training weights is pi_old)
        behaviour = tr.async_rollout.behaviour_model() if getattr(tr, "async_rollout", None) is not None else None
        own_window = first_window if behaviour is None else 0
        if recompute:
            old_start = time.perf_counter()
            with perf.phase("old_log_probs"):
                self.recompute_old_log_probs(samples, plan[own_window:], model=behaviour)
            metrics["time/old_log_probs"] = time.perf_counter() - old_start
            # its no-grad forwards in trajectory-steps per sample (benchmarks/critic_compute.py counts them)
            metrics["train/recompute_steps_per_sample"] = (
                sum(mb.step_idx.numel() for mb in plan[own_window:]) / len(samples.prompts))
        measure_grads = bool(t.grad_share_every) and epoch % t.grad_share_every == 0
        stats = UpdateStats(tr, samples.mask.shape[1], measure_grads)
        with stats.grad_share if measure_grads else contextlib.nullcontext():
            self.update(samples, plan, first_window, recompute and behaviour is None, stats)
        metrics.update(stats.metrics(plan, len(samples.prompts) * t.num_inner_epochs))
        metrics["time/train"] = time.perf_counter() - start

    def update(self, samples, plan, first_window, recompute, stats):
        """The stepwise update: each micro-batch's trained steps forward and backward one column at a time,
        one clipped optimizer step per accumulation window (`train_epoch`'s docstring)."""
        tr, t = self.trainer, self.trainer.config.train
        acc = tr.accelerator
        bad = False
        for n, mb in enumerate(tqdm(plan, desc="training", leave=False, disable=not acc.is_main_process)):
            on_policy = recompute and n < first_window  # this forward's value is pi_old (before any step)
            sampled = mb.old_log_probs.clone() if on_policy else None
            window_start = n - n % t.gradient_accumulation_steps
            window_len = min(t.gradient_accumulation_steps, len(plan) - window_start)
            closes_window = n + 1 == window_start + window_len
            base = self.sequence_base(samples, mb, on_policy) if tr.loss_couples_steps else mb.old_log_probs
            live = base.clone()
            kl = torch.zeros_like(mb.old_log_probs)
            drift = (StepDrift(*(torch.zeros_like(mb.old_log_probs) for _ in range(3)))
                     if tr.policy_loss.reads_drift else None)
            num_columns = mb.step_idx.shape[1]
            for k in range(num_columns):
                # DDP all-reduces on the last backward of the window only; forward and backward both run
                # inside no_sync, and every rank runs the same number of columns.
                sync = closes_window and k == num_columns - 1
                stats.column_starts(mb, k)
                with contextlib.nullcontext() if sync else acc.no_sync(tr.model):
                    log_prob, kl_k, drift_k, finite = self.train_column(samples, mb, k, base, window_len, on_policy)
                stats.column_ends()
                bad = bad or not finite
                live[:, k] = log_prob
                if kl_k is not None:
                    kl[:, k] = kl_k
                if drift is not None:
                    for name in ("kl", "std", "dt"):
                        getattr(drift, name)[:, k] = getattr(drift_k, name)
            stats.micro_batch(mb, live, kl, n < first_window, sampled, drift)
            if closes_window:
                stats.optimizer_step(tr._optimizer_step(bad))
                bad = False

    def train_column(self, samples, mb, k, base, window_len, on_policy):
        """Forward and backward of step column k of micro-batch `mb`.

        Returns its detached log-prob (b,), KL to the reference (b,) or None, its detached StepDrift of (b,)
        columns (a loss that reads the drift) or None, and whether the loss was finite.

        The loss is the micro-batch's whole loss with column k live and the other columns detached
        (`base`), scaled by 1 / window_len (micro-batches in this accumulation window). On-policy
        (before the epoch's first optimizer step, train.old_log_probs="recompute"), this forward's
        value is log pi_old of the step in this layout: it is written into mb.old_log_probs and base.
        """
        tr = self.trainer
        t = tr.config.train
        valid = mb.step_mask[:, k] > 0
        log_prob, mean, std = self.step(tr.model, samples, mb.rows, mb.step_idx[:, k])
        log_prob = torch.where(valid, log_prob.float(), mb.old_log_probs[:, k])
        if on_policy:
            mb.old_log_probs[:, k] = log_prob.detach()
            base[:, k] = log_prob.detach()
        drift = self.column_drift(samples, mb, k, mean, std, valid, on_policy) if tr.policy_loss.reads_drift else None
        kl = None
        if tr.reference is not None:
            with torch.no_grad(), perf.phase("reference"):
                ref_log_prob, ref_mean, _ = self.step(tr.reference, samples, mb.rows, mb.step_idx[:, k])
            if t.kl_type == "gaussian":
                kl = gaussian_kl(mean.float(), ref_mean.float(), std.float())
            elif t.kl_type == "flow_grpo":
                kl_std = tr.policy.flow_grpo_kl_std(samples, mb.rows, mb.step_idx[:, k], std.float())
                kl = gaussian_kl(mean.float(), ref_mean.float(), kl_std)
            else:
                kl = kl_penalty(log_prob, ref_log_prob.float(), t.kl_type)
            kl = torch.where(valid, kl, torch.zeros_like(kl))
        loss = column_loss(
            tr.policy_loss, tr.loss_config, mb.old_log_probs, base, k, log_prob, mb.advantages, mb.step_mask,
            kl=kl if t.use_kl_loss else None, beta=t.beta, drift=drift,
        )
        with perf.model_time():  # the backward's seconds are model seconds (perf.py)
            tr.accelerator.backward(loss / window_len)
        if drift is not None:
            drift = StepDrift(drift.kl.detach(), drift.std, drift.dt)
        return log_prob.detach(), None if kl is None else kl.detach(), drift, bool(torch.isfinite(loss))

    def column_drift(self, samples, mb, k, mean, std, valid, on_policy):
        """Column k's StepDrift (b,): the exact KL of this forward's Gaussian step (mean with its graph, std) to
        pi_old's (its mean from the recompute pass, or this forward's own on-policy), the step's std and length."""
        tr, t = self.trainer, self.trainer.config.train
        mean = mean.float()
        if on_policy:
            if mb.old_means is None:
                mb.old_means = torch.zeros((mean.shape[0], mb.step_idx.shape[1]) + mean.shape[1:], device=mean.device)
            mb.old_means[:, k] = mean.detach()
        std = std.float()
        kl = gaussian_kl(mean, mb.old_means[:, k], std)
        kl = torch.where(valid, kl, torch.zeros_like(kl))
        row_std = std.reshape(std.shape[0], -1)[:, 0] if std.dim() else std.expand(mean.shape[0])
        row_std = torch.where(valid, row_std.detach(), torch.zeros_like(row_std))
        if t.guard_reweight == "dt" and t.policy_loss == "grpo_guard":
            dt = tr.policy.step_dt(samples, mb.rows, mb.step_idx[:, k]).to(kl.device).float()
        else:
            dt = torch.ones_like(kl)
        return StepDrift(kl, row_std, torch.where(valid, dt, torch.zeros_like(dt)))

    def sequence_base(self, samples, mb, on_policy):
        """For a loss that couples the steps (gspo, geo_mean): every column's current log-prob, without gradients
        (the detached columns of each column's loss); on-policy it is pi_old as well."""
        tr = self.trainer
        with torch.no_grad():
            base = torch.stack(
                [self.step(tr.trainable_module, samples, mb.rows, mb.step_idx[:, k])[0] for k in range(mb.step_idx.shape[1])], 1
            ).float()
        base = torch.where(mb.step_mask > 0, base, mb.old_log_probs)
        if on_policy:
            mb.old_log_probs = base.clone()
        return base

    def step(self, model, samples, rows, step_index):
        """log pi(x_{t+1} | x_t, c), mean, std for trajectories `rows` at their steps step_index (b,).

        The model runs under the accelerator's autocast (as in sampling); the step math is float32.
        """
        config = self.trainer.config
        guidance_scale = config.sample.guidance_scale if config.train.cfg else 1.0
        with self.trainer.accelerator.autocast():
            return self.trainer.policy.step_log_prob(model, samples, rows, step_index, guidance_scale, config.sample.eta)

    def plan(self, samples, epoch):
        """The epoch's training plan: num_inner_epochs shuffled passes, each cut into train.batch_size rows.

        Returns a list of MicroBatch (rows, trained steps, advantages and sampled log-probs of those steps).
        """
        tr = self.trainer
        t = tr.config.train
        b_local = len(samples.prompts)
        generator = torch.Generator().manual_seed(tr.config.seed * 1_000_003 + epoch * 101 + tr.accelerator.process_index)
        permutations = [torch.randperm(b_local, generator=generator) for _ in range(t.num_inner_epochs)]
        plan = []
        for perm in permutations:
            for i in range(0, b_local, t.batch_size):
                rows = perm[i : i + t.batch_size].to(samples.latents.device)
                step_idx, step_mask, weights = select_steps(t, samples, rows, generator)
                plan.append(
                    MicroBatch(
                        rows=rows,
                        step_idx=step_idx,
                        step_mask=step_mask,
                        advantages=samples.advantages[rows].gather(1, step_idx) * weights,
                        old_log_probs=samples.log_probs[rows].gather(1, step_idx).float(),
                    )
                )
        return plan

    def recompute_old_log_probs(self, samples, micro_batches, model=None):
        """log pi_old of each micro-batch's trained steps, recomputed in the training layout.

        Why: a model call's result depends on the batch it runs in (rows, their order, batch size:
        other kernels, other reduction orders). The log-probs stored at sampling come from the
        sampling batch; the training pass sees other batches, so with unchanged weights its
        ratio exp(log pi - log pi_old) differs from 1 by rounding noise, measured on an H200 at
        SD-1.5 size up to 7.8e-5 (fp16) and 4.1e-4 (bf16): the size of PPO's clip range. Computed
        here with the weights that sampled (before the epoch's first optimizer step), in the same
        micro-batch, by the same call as the training forward (grad enabled, autocast, train mode;
        the graph is dropped at once), the ratio is exactly 1 on-policy. Only the trained steps
        are recomputed (K per trajectory for Group-PPO). Micro-batches before the first optimizer
        step need no extra pass: their own forward gives pi_old (see `train_epoch`).

        model: the weights that sampled when they are not the training weights (train.async_rollout's frozen copy,
        run in the same mode and call); None: the trainable module.
        """
        trainable = self.trainer.trainable_module
        model = trainable if model is None else model.train(trainable.training)
        keep_means = self.trainer.policy_loss.reads_drift  # dppo, grpo_guard: pi_old's step means as well
        for mb in micro_batches:
            columns, means = [], []
            for k in range(mb.step_idx.shape[1]):
                # detached in the same statement: no name keeps this forward's graph (its activations) alive
                # while the next column's forward builds its own, so the pass peaks at one forward's memory
                with torch.enable_grad():
                    log_prob, mean, _ = self.step(model, samples, mb.rows, mb.step_idx[:, k])
                    columns.append(log_prob.detach().float())
                    if keep_means:
                        means.append(mean.detach().float())
                    del log_prob, mean
            if keep_means:
                mb.old_means = torch.stack(means, 1)
            recomputed = torch.stack(columns, 1)
            mb.layout_noise = max_abs_diff(recomputed, mb.old_log_probs, mb.step_mask)
            mb.old_log_probs = torch.where(mb.step_mask > 0, recomputed, mb.old_log_probs)


TIMESTEP_SELECTIONS = ("all", "fraction", "endpoints", "segment_start", "segment_sample", "early")
OLD_LOG_PROBS = ("recompute", "sampled")


@register_config_check("training")
def check_update_fields(config, machine):
    """The update's plan: the batch sizes and how the epoch's trajectories split, pi_old, the optimizer's
    step sizes and warm-up, the gradient share."""
    sample, train = config.sample, config.train
    check_choice(train.old_log_probs, OLD_LOG_PROBS, "train.old_log_probs")
    for field in ("batch_size", "gradient_accumulation_steps", "num_inner_epochs", "learning_rate", "max_grad_norm"):
        check_positive(train[field], f"train.{field}")
    check_positive(train.grad_share_every, "train.grad_share_every", allow_zero=True)
    if not isinstance(train.lr_warmup_steps, int) or isinstance(train.lr_warmup_steps, bool) or train.lr_warmup_steps < 0:
        raise ConfigError(f"config.train.lr_warmup_steps={train.lr_warmup_steps!r} must be a whole number of optimizer "
                          "steps >= 0 (0: no warm-up)")
    per_epoch = sample.batch_size * sample.num_batches_per_epoch
    if per_epoch % train.batch_size:
        raise ConfigError(
            f"config.train.batch_size={train.batch_size} must divide the trajectories each process samples per "
            f"epoch (sample.batch_size x sample.num_batches_per_epoch = {per_epoch})"
        )


@register_config_check("training")
def check_step_selection(config, machine):
    """Which steps of a trajectory train (`select_steps`): train.timestep_selection and the fields it reads,
    against the estimator's endpoints and sample.num_steps."""
    from ddpo_group.algos.advantages import get_adv_estimator

    sample, train, algo = config.sample, config.train, config.algorithm
    check_choice(train.timestep_selection, TIMESTEP_SELECTIONS, "train.timestep_selection")
    check_positive(train.skip_last_steps, "train.skip_last_steps", allow_zero=True)
    if train.skip_last_steps >= sample.num_steps:
        raise ConfigError(
            f"config.train.skip_last_steps={train.skip_last_steps} leaves no step of sample.num_steps="
            f"{sample.num_steps} to train: use at most {sample.num_steps - 1}"
        )
    if not 0.0 < train.timestep_fraction <= 1.0:
        raise ConfigError(f"config.train.timestep_fraction={train.timestep_fraction} must be in (0, 1]")
    estimator = get_adv_estimator(algo.adv_estimator)
    if train.timestep_selection in ("endpoints", "segment_start", "segment_sample") and not estimator.defines_endpoints:
        raise ConfigError(
            f"config.train.timestep_selection={train.timestep_selection!r} needs an estimator that defines segment "
            f"endpoints, such as algorithm.adv_estimator='group_ppo' (got {algo.adv_estimator!r})"
        )
    check_positive(train.early_steps, "train.early_steps")
    if estimator.defines_endpoints and train.timestep_selection == "fraction":
        raise ConfigError(
            f"config.train.timestep_selection='fraction' contradicts algorithm.adv_estimator={algo.adv_estimator!r}, "
            "which chooses its steps itself; use 'endpoints' (train at the segment endpoints) or 'all'"
        )
    if train.timestep_selection != "fraction" and train.timestep_fraction != 1.0:
        raise ConfigError(
            f"config.train.timestep_fraction={train.timestep_fraction} has no effect unless "
            "train.timestep_selection='fraction'; set both"
        )
