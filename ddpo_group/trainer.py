"""The epoch loop on Accelerate (docs/design.md §7).

One epoch, in the order it happens (each phase one method of `Trainer`):

    sample_epoch        num_batches_per_epoch x batch_size trajectories per process, group_size images
                        per prompt (the copies of a prompt may sit on different processes); rewards run in
                        a thread pool while the next batch samples
    gather              rewards, reward components, prompt ids (and critic values) of all processes
    compute_advantages  PerPromptStatTracker ("ddpo") or a registered estimator (grpo, rloo, gae,
                        group_ppo) on the gathered batch; each process keeps its own slice
    train_epoch         num_inner_epochs passes over shuffled samples; pi_old recomputed in the training
                        layout (exact on-policy ratio); the selected steps of each
                        trajectory (all | fraction | endpoints) are re-scored one step at a time with
                        gradients, losses back-propagated per step and accumulated over steps and
                        micro-batches; one clipped optimizer step per gradient_accumulation_steps
                        micro-batches; reference mixup after each optimizer step
    update_critic       gae / group_ppo: clipped value loss (endpoints only for group_ppo)
    log / save          metrics.jsonl, trackers, sample grids, atomic checkpoints

Per-step back-propagation keeps memory at one model activation set whatever T is. The loss of a
micro-batch is a function of its (b, K) matrix of step log-probs; step k's backward uses that
matrix with column k live and every other column detached, so the gradients summed over the
steps are exactly the gradient of the whole loss. Losses that couple the steps of a sequence
(gspo, geo_mean) first compute every column without gradients.
"""

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import re
import resource
import shutil
import signal
import socket
import time
import zipfile

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import ProjectConfiguration, set_seed
from tqdm.auto import tqdm

from ddpo_group.algos import advantages as adv_lib
from ddpo_group.algos import grouping
from ddpo_group.algos.losses import agg_loss, compute_value_loss, gaussian_kl, get_policy_loss, kl_penalty
from ddpo_group.algos.stepwise import column_loss, grpo_loss
from ddpo_group.config_check import ConfigError, check_config
from ddpo_group.diagnostics import GradShare, StepAccumulator, advantage_step_stats, value_step_stats
from ddpo_group.diffusion.policy import load_policy
from ddpo_group.diffusion.base import window_noise_levels
from ddpo_group.batch import EpochBatch, GatheredBatch
from ddpo_group.prompts import load_prompts
from ddpo_group.reference import ReferencePolicy
from ddpo_group.stat_tracking import PerPromptStatTracker

logger = logging.getLogger("ddpo_group")

CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")
TRAINER_STATE = "trainer_state.json"


# Written into the run directory when a signal stopped the run before num_epochs; removed when it resumes.
STOPPED_FILE = "stopped.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the path and the fix."""


@dataclasses.dataclass
class MicroBatch:
    """One training micro-batch: trajectories `rows` of the epoch batch and the K steps trained for each.

    rows (b,) int64; step_idx (b, K) step index of each column; step_mask (b, K) 1 where that step
    has a density; advantages (b, K); old_log_probs (b, K) float32 log pi_old of those steps;
    layout_noise: max |recomputed - sampled| log-prob when pi_old was recomputed, else None.
    """

    rows: torch.Tensor
    step_idx: torch.Tensor
    step_mask: torch.Tensor
    advantages: torch.Tensor
    old_log_probs: torch.Tensor
    layout_noise: float | None = None


def _max_abs_diff(a, b, mask):
    """max |a - b| over the entries where mask > 0 (0.0 when there are none)."""
    diff = torch.where(mask > 0, (a.float() - b.float()).abs(), torch.zeros_like(a, dtype=torch.float32))
    return float(diff.max()) if diff.numel() else 0.0


@dataclasses.dataclass
class LossConfig:
    """The attributes a registered policy loss reads (docs/design.md §9)."""

    clip_ratio: float
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    loss_agg_mode: str


def make_accelerator(config, run_dir):
    """An Accelerator for GPUs, one CPU, or several CPU processes (gloo) under torchrun / accelerate launch."""
    log_with = None if config.log_with == "none" else config.log_with
    if log_with == "wandb" and "WANDB_MODE" not in os.environ and not _network_reachable("api.wandb.ai", 443):
        os.environ["WANDB_MODE"] = "offline"
    # AcceleratorState is a per-process singleton that refuses another mixed_precision; forget the previous
    # run's settings (the process group, PartialState, is kept) so that one process can run several trainings.
    AcceleratorState._reset_state()
    return Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=config.mixed_precision,
        log_with=log_with,
        project_config=ProjectConfiguration(
            project_dir=run_dir, logging_dir=os.path.join(run_dir, "tensorboard"), automatic_checkpoint_naming=False
        ),
    )


def _network_reachable(host, port, timeout=2.0):
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def draw_prompt_indices(num_prompts, total, group_size, seed, epoch, batch_index):
    """The K-repeat sampler: total // group_size distinct prompts, each repeated group_size times, shuffled.

    Every process draws the same list (same seed) and takes its own contiguous slice, so the copies
    of one prompt are spread over processes.
    """
    rng = np.random.default_rng([seed, epoch, batch_index])
    num_groups = total // group_size
    chosen = rng.choice(num_prompts, size=num_groups, replace=num_groups > num_prompts)
    return np.repeat(chosen, group_size)[rng.permutation(total)]


def find_checkpoint(path):
    """(checkpoint_N directory, its trainer state, the run directory) for config.resume_from = `path`.

    `path` is a checkpoint_N directory, or a run directory holding checkpoints/checkpoint_N (the
    trainer's layout) or checkpoint_N directly; the latest complete checkpoint is taken. The run
    directory is the one named (or the one above checkpoints/), never a parent of it.
    """
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"config.resume_from={path!r} does not exist; give a run directory or a checkpoint_N")
    if CHECKPOINT_RE.match(os.path.basename(path)):
        candidates = [path]
        parent = os.path.dirname(path)
        run_dir = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else parent
    else:
        run_dir = path
        root = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
        names = [n for n in os.listdir(root) if CHECKPOINT_RE.match(n)]
        candidates = [os.path.join(root, n) for n in sorted(names, key=lambda n: -int(CHECKPOINT_RE.match(n)[1]))]
    if not candidates:
        raise CheckpointError(f"config.resume_from={path!r} holds no checkpoint_N directory to resume from")
    checkpoint = candidates[0]
    state_path = os.path.join(checkpoint, TRAINER_STATE)
    try:
        with open(state_path) as f:
            state = json.load(f)
        int(state["epoch"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"checkpoint {checkpoint} is incomplete or corrupt ({state_path}: {err}); delete it or point "
            "config.resume_from at an earlier checkpoint_N"
        ) from err
    return checkpoint, state, run_dir


# Fields a resumed run may change: how long it runs and what it writes, not what it trains.
SAFE_RESUME_FIELDS = (
    "num_epochs", "save_freq", "num_checkpoint_limit", "log_images_every", "log_with", "project_name",
    "resume_from", "resume_allow_changes", "run_name", "logdir", "reward_workers", "reward_timeout", "debug_dump",
)


def _flat(d, prefix=""):
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resumed_config(given, run_dir, overrides=None):
    """The config a resumed run trains with, and the fields it changes: {field: [stored, given]}.

    The run's stored config.json, with the user's values of the fields in `overrides` (None: every
    field). Changing a field outside SAFE_RESUME_FIELDS mixes two experiments in one run: refused,
    naming the fields, unless given.resume_allow_changes. Reads only; writes nothing.
    """
    import ml_collections

    from ddpo_group.config_check import load_base_config

    path = os.path.join(run_dir, "config.json")
    try:
        with open(path) as f:
            stored = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot resume {run_dir}: its config {path} is missing or unreadable ({err})") from err
    base = load_base_config()
    with base.unlocked():
        for key, value in stored.items():
            if key in base:
                base[key] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value
    stored_flat = _flat(json.loads(json.dumps(base.to_dict(), default=str)))
    given_flat = _flat(json.loads(json.dumps(given.to_dict(), default=str)))
    fields = given_flat.keys() if overrides is None else [f for f in given_flat if any(
        f == o or f.startswith(o + ".") for o in overrides)]
    changes = {f: [stored_flat.get(f), given_flat[f]] for f in fields if stored_flat.get(f) != given_flat[f]}
    experiment = [f for f in changes if f.split(".")[0] not in SAFE_RESUME_FIELDS]
    if experiment and not given.resume_allow_changes:
        listed = ", ".join(f"{f} ({changes[f][0]!r} -> {changes[f][1]!r})" for f in experiment[:8])
        raise ConfigError(
            f"config.resume_from={given.resume_from!r}: the run {run_dir} was trained with other settings: {listed}; "
            "resume with the run's own config (give only --config.resume_from), start a new run, or set "
            "--config.resume_allow_changes=True to continue it with the new settings"
        )
    resumed = given if overrides is None else base
    if overrides is not None:
        with resumed.unlocked():
            for field in changes:
                node = resumed
                *parents, leaf = field.split(".")
                for part in parents:
                    node = node[part]
                node[leaf] = _get_path(given, field)
    return resumed, changes


def _get_path(config, dotted):
    for part in dotted.split("."):
        config = config[part]
    return config


def _write_json_atomic(path, obj):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=float)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Trainer:
    """Builds everything from a config (models, optimizer, rewards, prompts) and runs the epochs."""

    def __init__(self, config, overrides=None):
        """config: the run's configuration. On resume (config.resume_from) the run's stored config.json is
        used; `overrides` names the fields the user set explicitly (the CLI's --config.FIELD=VALUE), and
        only they may differ from the stored run (None: every field of `config` is compared)."""
        # Checked before anything is created; the launcher's WORLD_SIZE is the number of processes.
        check_config(config, num_processes=int(os.environ.get("WORLD_SIZE", 1)), has_gpu=torch.cuda.is_available())
        self._resume_checkpoint, self._resume_state, self._resume_changes = None, None, {}
        if config.resume_from:
            self._resume_checkpoint, self._resume_state, self.run_dir = find_checkpoint(config.resume_from)
            config, self._resume_changes = resumed_config(config, self.run_dir, overrides)
            check_config(config, num_processes=int(os.environ.get("WORLD_SIZE", 1)), has_gpu=torch.cuda.is_available())
        else:
            run_name = config.run_name or datetime.datetime.now().strftime("%Y.%m.%d_%H.%M.%S")
            self.run_dir = os.path.abspath(os.path.join(config.logdir, run_name))
            _refuse_an_earlier_run(self.run_dir, config.overwrite)
        self.config = config
        self.accelerator = make_accelerator(config, self.run_dir)
        acc = self.accelerator
        self._lock = None
        if config.resume_from and acc.is_main_process:
            self._lock = _lock_run_dir(self.run_dir)  # before anything of the run is read or rewritten
        logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
        set_seed(config.seed, device_specific=True)
        if config.allow_tf32 and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = True

        # Rewards and prompts first: a missing reward model fails before any diffusion model loads.
        from ddpo_group.rewards import AsyncRewardRunner, build_reward_fn

        self.reward_fn = build_reward_fn(
            config.reward_fn or None,
            config.reward_weights.to_dict() or None,
            reward_workers=config.reward_workers,
            reward_kwargs=config.reward_kwargs.to_dict() or None,
            reward_aggregation=config.reward_aggregation,
            device=self.accelerator.device,
        )
        self.reward_fn.check_ready()
        self.reward_runner = AsyncRewardRunner(self.reward_fn, config.reward_workers)
        self.prompts = load_prompts(config.prompt_fn, **dict(config.prompt_fn_kwargs))

        self._build_models()
        self._build_algorithm_state()
        self.first_epoch, self.global_step, self.skipped_steps = 0, 0, 0
        self._saved_at = None  # (epoch, global_step) of the checkpoint on disk that holds the current state
        if self._resume_checkpoint:
            self._load_checkpoint()
            self._saved_at = (self.first_epoch, self.global_step)
        # Written once everything above is accepted: a run that cannot start leaves no directory behind.
        if acc.is_main_process:
            if config.overwrite and not config.resume_from and _holds_a_run(self.run_dir):
                _lock_run_dir(self.run_dir).close()  # not while the earlier run is live
                shutil.rmtree(self.run_dir)
            os.makedirs(self.run_dir, exist_ok=True)
            if self._lock is None:
                self._lock = _lock_run_dir(self.run_dir)  # held until run() ends (or this Trainer is dropped)
            _write_json_atomic(os.path.join(self.run_dir, "config.json"), config.to_dict())
            with contextlib.suppress(FileNotFoundError):  # a stopped run that goes on is no longer stopped
                os.remove(os.path.join(self.run_dir, STOPPED_FILE))
            failed_path = os.path.join(self.run_dir, "failed.json")
            previous_failure = None
            if self._resume_checkpoint and os.path.exists(failed_path):
                # the run goes on: its earlier failure moves into resumes.jsonl, failed.json marks this attempt only
                with contextlib.suppress(OSError, ValueError):
                    with open(failed_path) as f:
                        previous_failure = json.load(f)
                previous_failure = previous_failure or {"error": "unreadable failed.json"}
            if self._resume_changes or previous_failure:
                with open(os.path.join(self.run_dir, "resumes.jsonl"), "a") as f:
                    record = {"epoch": self.first_epoch, "changed": self._resume_changes}
                    if previous_failure:
                        record["previous_failure"] = previous_failure
                    f.write(json.dumps(record, default=str) + "\n")
                if previous_failure:
                    os.remove(failed_path)
        acc.wait_for_everyone()
        self.stop_requested, self.stop_signal = False, None

    def _build_models(self):
        config, acc = self.config, self.accelerator
        # the model family (SD / DDIM today) is behind the policy: the trainer names no UNet, VAE or scheduler
        inference_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.mixed_precision, torch.float32)
        self.policy = load_policy(
            config.pretrained.model, revision=config.pretrained.revision or None, torch_dtype=inference_dtype
        )
        s = config.sample
        try:
            self.policy.configure(
                sde_type=s.sde_type, max_sequence_length=s.max_sequence_length, resolution=s.resolution
            )
        except ValueError as err:
            raise ConfigError(str(err)) from err
        module = self.policy.prepare(
            acc.device, inference_dtype, config.use_lora, config.lora_rank, config.lora_alpha or None
        )
        if config.sample.negative_prompt and self.policy.family == "flux":
            raise ConfigError(
                f"config.sample.negative_prompt={config.sample.negative_prompt!r}: FLUX.1 has no classifier-free "
                "guidance, so a negative prompt would be ignored; set sample.negative_prompt=''"
            )
        if config.train.kl_type == "flow_grpo" and not self.policy.supports_flow_grpo_kl:
            raise ConfigError(
                f"config.train.kl_type='flow_grpo' is Flow-GRPO's KL of a flow-matching step; "
                f"config.pretrained.model={config.pretrained.model!r} is a {self.policy.family} model: "
                "use train.kl_type='gaussian'"
            )
        self.trainable_module = module
        self.trainable_params = [p for p in module.parameters() if p.requires_grad]
        if config.train.use_8bit_adam:
            try:
                import bitsandbytes as bnb
            except ImportError as err:
                raise ImportError(
                    "config.train.use_8bit_adam=True needs bitsandbytes: `pip install bitsandbytes` (GPU only), "
                    "or set --config.train.use_8bit_adam=False"
                ) from err
            optimizer_cls = bnb.optim.AdamW8bit
        else:
            optimizer_cls = torch.optim.AdamW
        t = config.train
        optimizer = optimizer_cls(
            self.trainable_params,
            lr=t.learning_rate,
            betas=(t.adam_beta1, t.adam_beta2),
            weight_decay=t.adam_weight_decay,
            eps=t.adam_epsilon,
        )
        self.critic = self.critic_module = self.critic_optimizer = None
        acc.register_save_state_pre_hook(self._save_model_hook)
        acc.register_load_state_pre_hook(self._load_model_hook)
        self.estimator = adv_lib.get_adv_estimator(config.algorithm.adv_estimator)
        if self.estimator.needs_values:
            from ddpo_group.critic import ValueNetwork

            self.critic_module = ValueNetwork(**self.policy.critic_sizes(), hidden=config.critic.hidden).to(acc.device)
            critic_optimizer = torch.optim.AdamW(self.critic_module.parameters(), lr=config.critic.learning_rate)
            self.model, self.optimizer, self.critic, self.critic_optimizer = acc.prepare(
                module, optimizer, self.critic_module, critic_optimizer
            )
        else:
            self.model, self.optimizer = acc.prepare(module, optimizer)
        self.policy.trainable_module = self.trainable_module  # sampling runs the unwrapped module
        # Built after prepare(): DDP has broadcast rank 0's initial weights, so every rank holds the same pi_ref.
        self.reference = None
        if t.use_reference_model:
            self.reference = ReferencePolicy(
                self.trainable_module, config.use_lora, t.reference_model_mixup_alpha, t.reference_update_freq
            )
        self.forward_update = None
        if t.objective != "stepwise":  # DiffusionNFT / AWM: a forward-process update (docs/forward.md)
            from ddpo_group.forward_training import ForwardUpdate

            self.forward_update = ForwardUpdate(self)
        self.loss_config = LossConfig(
            clip_ratio=t.clip_range,
            clip_ratio_low=t.clip_ratio_low if t.clip_ratio_low is not None else t.clip_range,
            clip_ratio_high=t.clip_ratio_high if t.clip_ratio_high is not None else t.clip_range,
            clip_ratio_c=t.clip_ratio_c,
            loss_agg_mode=t.loss_agg_mode,
        )
        self.policy_loss = get_policy_loss(t.policy_loss)
        # the registry says whether one step's loss reads the other steps' log-probs (gspo, geo_mean)
        self.loss_couples_steps = self.policy_loss.couples_steps

    def _build_algorithm_state(self):
        config = self.config
        names = self._reward_names()
        tracking = config.per_prompt_stat_tracking
        self.trackers = {}
        if self.estimator.uses_tracker:
            self.trackers = {
                name: PerPromptStatTracker(
                    tracking.buffer_size or None, tracking.min_count, config.algorithm.norm_adv_by_std
                )
                for name in names
            }
        self.threshold = grouping.AdaptiveThreshold.from_config(config.group_ppo)

    def _reward_names(self):
        """Advantage streams: one ("reward") unless rewards are normalised one by one before summing."""
        if self.config.reward_aggregation == "normalize_then_sum" and len(self.reward_fn.names) > 1:
            return list(self.reward_fn.names)
        return ["reward"]

    def run(self):
        config, acc = self.config, self.accelerator
        if self.first_epoch >= config.num_epochs:
            logger.warning("nothing to do: the run already has %d of num_epochs=%d epochs", self.first_epoch, config.num_epochs)
            self.reward_runner.shutdown()
            self._release_lock()
            return self.run_dir
        if config.log_with != "none":
            acc.init_trackers(
                config.project_name,
                config=_flatten(config.to_dict()),
                init_kwargs={"wandb": {"name": os.path.basename(self.run_dir), "dir": self.run_dir}},
            )
        self._install_signal_handlers()
        logger.info(
            "run %s: %d processes, %d trajectories per epoch, %s", self.run_dir, acc.num_processes,
            config.sample.batch_size * config.sample.num_batches_per_epoch * acc.num_processes,
            config.algorithm.adv_estimator,
        )
        epoch, failed = self.first_epoch, False
        try:
            bar = tqdm(range(self.first_epoch, config.num_epochs), desc="epoch", disable=not acc.is_main_process)
            for epoch in bar:
                if self._should_stop():
                    break
                metrics = {"epoch": epoch}
                if config.eval_freq and epoch % config.eval_freq == 0:
                    self.evaluate(epoch, metrics)  # the weights after `epoch` epochs, before this epoch's update
                    if self._should_stop():
                        break
                samples = self.sample_epoch(epoch, metrics)
                if self._should_stop():
                    break
                self.compute_advantages(samples, metrics)
                if config.debug_dump:
                    self._dump_debug(epoch, samples)
                if self.forward_update is not None:
                    self.forward_update.train_epoch(samples, epoch, metrics)
                elif epoch >= config.critic.warmup_epochs or self.critic is None:
                    self.train_epoch(samples, epoch, metrics)
                if self.critic is not None:
                    self.update_critic(samples, epoch, metrics)
                self.log_epoch(epoch, samples, metrics)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}")
                if config.save_freq and (epoch + 1) % config.save_freq == 0 and epoch + 1 < config.num_epochs:
                    self.save_checkpoint(epoch + 1)
            else:
                epoch = config.num_epochs
                if config.eval_freq:  # the final weights, a row of their own
                    metrics = {"epoch": epoch, "eval_only": True}
                    self.evaluate(epoch, metrics)
                    if "eval/reward_mean" in metrics:  # not when a stop signal interrupted it
                        self._write_metrics_row(metrics)
            if self._saved_at != (epoch, self.global_step):  # not again, when a stop follows a periodic save at once
                self.save_checkpoint(epoch)
            if epoch < config.num_epochs and acc.is_main_process:
                # stopped by a signal before num_epochs: say so in the run directory (the CLI exits non-zero)
                _write_json_atomic(os.path.join(self.run_dir, STOPPED_FILE), {
                    "epoch": epoch, "signal": self.stop_signal, "time": datetime.datetime.now().isoformat(),
                    "resume": f"--config.resume_from={self.run_dir}",
                })
        except BaseException as err:
            failed = True
            self._mark_failed(epoch, err)
            raise
        finally:
            self._restore_signal_handlers()
            self._release_lock()
            # after an error a reward may never return: its (daemon) worker is not waited for
            self.reward_runner.shutdown(wait=not failed)
            acc.end_training()
        return self.run_dir

    def evaluate(self, epoch, metrics):
        """Fixed-noise evaluation of the current weights (ddpo_group.evaluation) into `metrics` (eval/*), and
        the fixed grid samples/eval_XXXX.png; every process evaluates a share of the prompts."""
        from ddpo_group.evaluation import evaluate

        config, acc = self.config, self.accelerator
        start = time.perf_counter()
        if not hasattr(self, "eval_prompts"):
            self.eval_prompts = load_prompts(config.eval_prompt_fn) if config.eval_prompt_fn else self.prompts
        result = evaluate(
            self.policy, self.trainable_module, self.eval_prompts, self.reward_fn, config.eval_images_per_prompt,
            config.sample.num_steps, config.sample.guidance_scale, config.sample.eta, seed=config.eval_seed,
            batch_size=config.eval_batch_size or config.sample.batch_size, accelerator=acc,
            grid_prompts=config.eval_grid_prompts, should_stop=lambda: self.stop_requested,
        )
        if result is None:  # stopped by a signal between evaluation batches: no partial numbers are logged
            logger.warning("evaluation of epoch %d interrupted by a stop signal", epoch)
            return
        metrics["eval/reward_mean"] = result["reward_mean"]
        metrics["eval/reward_std"] = result["reward_std"]
        for name, value in result["components"].items():
            metrics[f"eval/{name}"] = value
        if acc.is_main_process and result["images"] is not None:
            from ddpo_group.grids import save_epoch_samples

            per_image = config.eval_images_per_prompt
            shown = len(result["grid_prompts"])
            grid = save_epoch_samples(
                self.run_dir, epoch, result["images"], [p for p in result["grid_prompts"] for _ in range(per_image)],
                result["rewards"][:shown].reshape(-1), None, per_image, max_rows=shown, prefix="eval",
            )
            metrics["eval/grid"] = os.path.relpath(grid, self.run_dir)
        metrics["time/eval"] = time.perf_counter() - start

    def _write_metrics_row(self, metrics):
        """Append one row to metrics.jsonl (main process, flushed to disk) and send it to the trackers."""
        config, acc = self.config, self.accelerator
        if acc.is_main_process:
            with open(os.path.join(self.run_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(metrics) + "\n")
                f.flush()
                os.fsync(f.fileno())
        if config.log_with != "none":
            acc.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=metrics["epoch"])

    def _mark_failed(self, epoch, err):
        """failed.json in the run directory: a run that stopped on an error says so, and where."""
        if not self.accelerator.is_main_process:
            return
        with contextlib.suppress(OSError):
            _write_json_atomic(
                os.path.join(self.run_dir, "failed.json"),
                {"epoch": epoch, "error": f"{type(err).__name__}: {err}", "time": datetime.datetime.now().isoformat()},
            )

    def _install_signal_handlers(self):
        def request_stop(signum, frame):
            if self.stop_requested:  # a second signal exits at once (metrics.jsonl is written row by row)
                logger.warning("second signal %d: exiting now, without a final checkpoint", signum)
                logging.shutdown()
                os._exit(128 + signum)
            self.stop_requested = True
            self.stop_signal = signum
            logger.warning("signal %d: finishing the current phase, then writing a final checkpoint", signum)

        self._previous_handlers = {}
        with contextlib.suppress(ValueError):  # not in the main thread
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous_handlers[signum] = signal.signal(signum, request_stop)

    def _restore_signal_handlers(self):
        for signum, handler in getattr(self, "_previous_handlers", {}).items():
            signal.signal(signum, handler)

    def _should_stop(self):
        """True on every process as soon as one process was asked to stop."""
        flag = torch.tensor([1.0 if self.stop_requested else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.gather(flag).sum().item() > 0)

    def sample_epoch(self, epoch, metrics):
        config, acc = self.config, self.accelerator
        s = config.sample
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
        for batch_index in tqdm(
            range(s.num_batches_per_epoch), desc="sampling", leave=False, disable=not acc.is_main_process
        ):
            indices = draw_prompt_indices(len(self.prompts), total, s.group_size, config.seed, epoch, batch_index)
            local = indices[acc.process_index * s.batch_size : (acc.process_index + 1) * s.batch_size]
            records = [self.prompts[i] for i in local]
            generator = torch.Generator().manual_seed(
                int(np.random.default_rng([config.seed, epoch, batch_index, acc.process_index]).integers(2**62))
            )
            with acc.autocast():
                trajectories = self.policy.sample(
                    [r.prompt for r in records],
                    num_steps=s.num_steps,
                    guidance_scale=s.guidance_scale,
                    eta=levels,
                    generator=generator,
                    prompt_ids=torch.as_tensor(local, dtype=torch.int64),
                    negative_prompt=s.negative_prompt,
                    # the forward-process objectives sample with their lagged model and keep the clean latents only
                    model=None if self.forward_update is None else self.forward_update.sampling_model,
                    keep_steps=self.forward_update is None,
                )
            # rewards of this batch run in the thread pool while the next batch samples
            futures.append(
                self.reward_runner.submit(trajectories.images.float(), [r.prompt for r in records], [r.metadata for r in records])
            )
            batches.append(trajectories)
        metrics["time/sample"] = time.perf_counter() - start
        start = time.perf_counter()
        results = [self.reward_runner.result(future, config.reward_timeout) for future in futures]
        metrics["time/reward"] = time.perf_counter() - start
        samples = EpochBatch.cat(batches)
        if self.forward_update is not None:
            # one outcome "token" per sample: the advantages are (B, 1), trained at any timestep
            samples.mask = torch.ones(len(samples.prompts), 1, device=samples.latents.device)
        skip = config.train.skip_last_steps
        if skip:
            # the last steps keep their log-probs but carry no density for training (train.skip_last_steps)
            samples.mask[:, samples.mask.shape[1] - skip :] = 0
        rewards = np.concatenate([r[0] for r in results])
        components = {name: np.concatenate([r[1][name] for r in results]) for name in results[0][1]}
        from ddpo_group.rewards.combine import info_metrics

        metrics.update(info_metrics([r[2] for r in results if len(r) > 2]))
        device = acc.device
        samples.rewards = torch.as_tensor(rewards, dtype=torch.float32, device=device)
        samples.components = {k: torch.as_tensor(v, dtype=torch.float32, device=device) for k, v in components.items()}
        return samples

    def compute_advantages(self, samples, metrics):
        """Advantages (B_local, T) on the gathered batch of all processes; sets samples.advantages.

        One dispatch through the estimator registry; what the estimator is given follows its
        registered properties (``ddpo_group.algos.advantages``): critic values when it
        ``needs_values``, the grpo outcome advantages when it ``needs_outcome_advantages``, the
        per-prompt trackers when it ``uses_tracker``; endpoints when it ``defines_endpoints``.
        With normalize_then_sum an outcome estimator runs per reward component and the
        weighted advantages are summed.
        """
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

        streams = self._reward_names()
        weights = dict(self.reward_fn.weights) if len(streams) > 1 else {"reward": 1.0}
        stream_rewards = {"reward": rewards} if streams == ["reward"] else samples.gathered.components
        estimator = self.estimator
        options = {"norm_by_std": algo.norm_adv_by_std, "gamma": algo.gamma, "lam": algo.lam}
        if estimator.uses_tracker:
            options["prompts"] = [self.prompts[int(i)].prompt for i in prompt_ids.tolist()]

        def combined_outcome(fn):
            """sum over reward streams of weight x fn's advantages of that stream."""
            return sum(
                weights[name] * fn(
                    rewards=stream_rewards[name], prompt_ids=prompt_ids, mask=mask, tracker=self.trackers.get(name), **options
                )[0]
                for name in streams
            )

        if estimator.needs_values:
            from ddpo_group.critic import compute_values

            with torch.no_grad():
                values_local = compute_values(
                    acc.unwrap_model(self.critic), samples.latents, samples.timesteps, samples.prompt_embeds,
                    micro_batch_size=config.train.eval_micro_batch_size or None,
                )
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
            samples.returns = returns[local]
            samples.old_values = values[local]
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
        metrics.update(_group_stats(rewards, prompt_ids))
        metrics["time/advantages"] = time.perf_counter() - start

    def _selected_steps(self, samples, rows, generator):
        """Step indices (b, K), their mask (b, K) and loss weights (b, K) for the trajectories `rows`.

        all: every step with a density; fraction: a random subset per trajectory (DDPO); endpoints: the
        Group-PPO segment endpoints; segment_start: the first (noisiest) step of each Group-PPO segment, with the
        segment's advantage; segment_sample: one step drawn uniformly inside each Group-PPO
        segment (shared by the micro-batch), weighted by len(segment) * K / T so that the token-mean over
        the K drawn steps is an unbiased estimate of the token-mean over all T (exactly so for a loss
        linear in the advantage, as vanilla PPO is); early: the first train.early_steps steps with a
        density (the noisiest: Flow-GRPO-Fast / MixGRPO's window). Weights are 1 except for segment_sample.
        """
        config = self.config
        mask = samples.mask[rows].float()
        b, T = mask.shape
        selection = config.train.timestep_selection
        weights = None
        valid_columns = samples.mask.any(dim=0).nonzero().flatten().cpu()
        if selection == "all":
            # the steps that have a density (every step for DDIM; the SDE window of a flow model)
            idx = valid_columns.expand(b, len(valid_columns))
        elif selection == "early":
            columns = valid_columns[: config.train.early_steps]
            idx = columns.expand(b, len(columns))
        elif selection == "fraction":
            k = max(1, int(T * config.train.timestep_fraction))
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

    def _step(self, model, samples, rows, step_index):
        """log pi(x_{t+1} | x_t, c), mean, std for trajectories `rows` at their steps step_index (b,).

        The model runs under the accelerator's autocast (as in sampling); the step math is float32.
        """
        config = self.config
        guidance_scale = config.sample.guidance_scale if config.train.cfg else 1.0
        with self.accelerator.autocast():
            return self.policy.step_log_prob(model, samples, rows, step_index, guidance_scale, config.sample.eta)

    def _micro_batches(self, samples, epoch):
        """The epoch's training plan: num_inner_epochs shuffled passes, each cut into train.batch_size rows.

        Returns a list of MicroBatch (rows, trained steps, advantages and sampled log-probs of those steps).
        """
        config, acc = self.config, self.accelerator
        t = config.train
        b_local = len(samples.prompts)
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch * 101 + acc.process_index)
        permutations = [torch.randperm(b_local, generator=generator) for _ in range(t.num_inner_epochs)]
        plan = []
        for perm in permutations:
            for i in range(0, b_local, t.batch_size):
                rows = perm[i : i + t.batch_size].to(samples.latents.device)
                step_idx, step_mask, weights = self._selected_steps(samples, rows, generator)
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

    def _recompute_old_log_probs(self, samples, micro_batches):
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
        step need no extra pass: their own forward gives pi_old (see train_epoch).
        """
        for mb in micro_batches:
            columns = []
            for k in range(mb.step_idx.shape[1]):
                with torch.enable_grad():
                    log_prob = self._step(self.trainable_module, samples, mb.rows, mb.step_idx[:, k])[0]
                columns.append(log_prob.detach().float())
            recomputed = torch.stack(columns, 1)
            mb.layout_noise = _max_abs_diff(recomputed, mb.old_log_probs, mb.step_mask)
            mb.old_log_probs = torch.where(mb.step_mask > 0, recomputed, mb.old_log_probs)

    def train_epoch(self, samples, epoch, metrics):
        """num_inner_epochs passes of per-step PPO updates over the epoch's samples.

        pi_old: with train.old_log_probs="recompute" (default), the log-probs of the behaviour
        policy are taken in the training layout (``_recompute_old_log_probs``): micro-batches of
        the first accumulation window (no optimizer step has happened yet) use their own forward's
        value, the later ones a pass made before the first step. The on-policy ratio is then
        exactly 1 (approx_kl and clipfrac exactly 0 with one optimizer step per epoch).
        "sampled" uses the log-probs stored at sampling, as ddpo-pytorch does (ratio 1 up to noise).
        """
        config, acc = self.config, self.accelerator
        t = config.train
        b_local = len(samples.prompts)
        info = {"loss": [], "policy_loss": [], "kl": [], "clipfrac": [], "approx_kl": [], "clipfrac_lower": []}
        start = time.perf_counter()
        self.model.train()
        micro_batches = self._micro_batches(samples, epoch)
        first_window = min(t.gradient_accumulation_steps, len(micro_batches))
        recompute = t.old_log_probs == "recompute"
        if recompute:
            old_start = time.perf_counter()
            self._recompute_old_log_probs(samples, micro_batches[first_window:])
            metrics["time/old_log_probs"] = time.perf_counter() - old_start
        on_policy_ratio = []
        num_steps = samples.mask.shape[1]
        step_stats = StepAccumulator(num_steps, self.loss_config.clip_ratio_low, self.loss_config.clip_ratio_high)
        measure_grads = bool(t.grad_share_every) and epoch % t.grad_share_every == 0
        grad_share = GradShare(self.trainable_params, num_steps) if measure_grads else contextlib.nullcontext()
        with grad_share:
            self._train_micro_batches(samples, micro_batches, first_window, recompute, step_stats,
                                      grad_share if measure_grads else None, info, on_policy_ratio)
        metrics.update(step_stats.metrics())
        if measure_grads:
            metrics.update(grad_share.metrics())
        model_calls = sum(mb.step_idx.shape[1] for mb in micro_batches)
        model_steps = sum(mb.step_idx.numel() for mb in micro_batches)
        metrics["time/train"] = time.perf_counter() - start
        for key, values in info.items():
            if values and key != "grad_norm":
                metrics[key] = float(np.mean(values))
        if info.get("grad_norm"):
            metrics["grad_norm"] = float(np.mean(info["grad_norm"]))
        # max |log pi_theta - log pi_old| before the first optimizer step: exactly 0 with "recompute"
        metrics["train/on_policy_max_abs_log_ratio"] = max(on_policy_ratio)
        noise = [mb.layout_noise for mb in micro_batches if mb.layout_noise is not None]
        if noise:
            # what recomputing removed: |log pi_old in the training layout - log pi stored at sampling|
            metrics["train/layout_noise_max_abs_log_ratio"] = max(noise)
        # batched forward+backward calls of the denoising model (the key keeps its first name, "unet")
        metrics["train/unet_calls"] = model_calls
        metrics["train/unet_steps_per_sample"] = model_steps / (b_local * t.num_inner_epochs)
        metrics["train/skipped_steps"] = self.skipped_steps
        metrics["train/global_step"] = self.global_step
        if self.reference is not None:
            metrics.update(self.reference.metrics())
            metrics["ref/kl"] = metrics["kl"]

    def _train_micro_batches(self, samples, micro_batches, first_window, recompute, step_stats, grad_share, info,
                             on_policy_ratio):
        """The stepwise update: each micro-batch's trained steps forward and backward one column at a time,
        one clipped optimizer step per accumulation window (train_epoch's docstring)."""
        config, acc = self.config, self.accelerator
        t = config.train
        sequence_loss = self.loss_couples_steps
        bad = False
        for n, mb in enumerate(tqdm(micro_batches, desc="training", leave=False, disable=not acc.is_main_process)):
            on_policy = recompute and n < first_window
            sampled = mb.old_log_probs.clone() if on_policy else None
            window_start = n - n % t.gradient_accumulation_steps
            window_len = min(t.gradient_accumulation_steps, len(micro_batches) - window_start)
            closes_window = n + 1 == window_start + window_len
            base = mb.old_log_probs
            if sequence_loss:
                with torch.no_grad():
                    base = torch.stack(
                        [self._step(self.trainable_module, samples, mb.rows, mb.step_idx[:, k])[0] for k in range(mb.step_idx.shape[1])], 1
                    ).float()
                base = torch.where(mb.step_mask > 0, base, mb.old_log_probs)
                if on_policy:
                    mb.old_log_probs = base.clone()
            live = base.clone()
            kl_mat = torch.zeros_like(mb.old_log_probs)
            num_columns = mb.step_idx.shape[1]
            for k in range(num_columns):
                # DDP all-reduces on the last backward of the window only; forward and backward both run
                # inside no_sync, and every rank runs the same number of columns.
                sync = closes_window and k == num_columns - 1
                if grad_share is not None:
                    column = mb.step_idx[:, k]
                    grad_share.step = int(column[0]) if bool((column == column[0]).all()) else None
                with contextlib.nullcontext() if sync else acc.no_sync(self.model):
                    log_prob, kl, finite = self._train_column(samples, mb, k, base, window_len, on_policy)
                if grad_share is not None:
                    grad_share.close_column()
                bad = bad or not finite
                live[:, k] = log_prob
                if kl is not None:
                    kl_mat[:, k] = kl
            step_stats.add(mb.step_idx, mb.old_log_probs, live, mb.advantages, mb.step_mask)
            if n < first_window:
                on_policy_ratio.append(_max_abs_diff(live, mb.old_log_probs, mb.step_mask))
            if on_policy:
                mb.layout_noise = _max_abs_diff(mb.old_log_probs, sampled, mb.step_mask)
            with torch.no_grad():
                loss, policy_loss, loss_metrics = grpo_loss(
                    self.policy_loss, self.loss_config, mb.old_log_probs, live, mb.advantages, mb.step_mask,
                    kl=kl_mat if t.use_kl_loss else None, beta=t.beta,
                )
                kl_value = agg_loss(kl_mat, mb.step_mask, t.loss_agg_mode) if self.reference is not None else torch.zeros(())
            info["policy_loss"].append(float(policy_loss))
            info["kl"].append(float(kl_value))
            info["loss"].append(float(loss))
            for key in ("clipfrac", "approx_kl", "clipfrac_lower"):
                if key in loss_metrics:
                    info[key].append(float(loss_metrics[key]))
            if closes_window:
                step = self._optimizer_step(bad)
                if step["grad_norm"] is not None:
                    info.setdefault("grad_norm", []).append(step["grad_norm"])
                bad = False

    def _train_column(self, samples, mb, k, base, window_len, on_policy):
        """Forward and backward of step column k of micro-batch `mb`.

        Returns its detached log-prob (b,), KL to the reference (b,) or None, and whether the loss was finite.

        The loss is the micro-batch's whole loss with column k live and the other columns detached
        (`base`), scaled by 1 / window_len (micro-batches in this accumulation window). On-policy
        (before the epoch's first optimizer step, train.old_log_probs="recompute"), this forward's
        value is log pi_old of the step in this layout: it is written into mb.old_log_probs and base.
        """
        t = self.config.train
        valid = mb.step_mask[:, k] > 0
        log_prob, mean, std = self._step(self.model, samples, mb.rows, mb.step_idx[:, k])
        log_prob = torch.where(valid, log_prob.float(), mb.old_log_probs[:, k])
        if on_policy:
            mb.old_log_probs[:, k] = log_prob.detach()
            base[:, k] = log_prob.detach()
        kl = None
        if self.reference is not None:
            with torch.no_grad():
                ref_log_prob, ref_mean, _ = self._step(self.reference, samples, mb.rows, mb.step_idx[:, k])
            if t.kl_type == "gaussian":
                kl = gaussian_kl(mean.float(), ref_mean.float(), std.float())
            elif t.kl_type == "flow_grpo":
                kl_std = self.policy.flow_grpo_kl_std(samples, mb.rows, mb.step_idx[:, k], std.float())
                kl = gaussian_kl(mean.float(), ref_mean.float(), kl_std)
            else:
                kl = kl_penalty(log_prob, ref_log_prob.float(), t.kl_type)
            kl = torch.where(valid, kl, torch.zeros_like(kl))
        loss = column_loss(
            self.policy_loss, self.loss_config, mb.old_log_probs, base, k, log_prob, mb.advantages, mb.step_mask,
            kl=kl if t.use_kl_loss else None, beta=t.beta,
        )
        self.accelerator.backward(loss / window_len)
        return log_prob.detach(), None if kl is None else kl.detach(), bool(torch.isfinite(loss))

    def _optimizer_step(self, bad):
        """Clip, step, zero; a step whose loss or gradient is not finite is skipped and counted.

        Returns {"skipped": bool, "grad_norm": the clipped-before norm of a step taken, else None}.
        """
        acc = self.accelerator
        grad_norm = acc.clip_grad_norm_(self.trainable_params, self.config.train.max_grad_norm)
        flags = acc.gather(torch.tensor([float(bad)], device=acc.device))
        skip = bool(flags.sum() > 0) or (grad_norm is not None and not torch.isfinite(torch.as_tensor(grad_norm)))
        if acc.scaler is not None:
            # fp16: the GradScaler skips a non-finite step itself and lowers its scale; it must see every step.
            self.optimizer.step()
            skip = skip or acc.optimizer_step_was_skipped
        elif not skip:
            self.optimizer.step()
        if skip:
            self.skipped_steps += 1
            logger.warning("non-finite loss or gradient: optimizer step skipped (%d so far)", self.skipped_steps)
        else:
            self.global_step += 1
            if self.reference is not None:
                self.reference.on_optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"skipped": skip, "grad_norm": None if skip or grad_norm is None else float(grad_norm)}

    def update_critic(self, samples, epoch, metrics):
        """Clipped value loss on the critic's steps (endpoints for group_ppo, every valid step for gae)."""
        config, acc = self.config, self.accelerator
        start = time.perf_counter()
        b_local = len(samples.prompts)
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch * 101 + acc.process_index + 7)
        losses, clipfracs = [], []
        self.critic.train()
        for _ in range(config.critic.num_epochs):
            perm = torch.randperm(b_local, generator=generator)
            for i in range(0, b_local, config.train.batch_size):
                rows = perm[i : i + config.train.batch_size].to(samples.latents.device)
                mask = samples.critic_mask[rows]
                r, s = mask.nonzero(as_tuple=True)
                latents = samples.latents[rows][r, s]
                values = self.critic(latents, samples.timesteps[rows][r, s], samples.prompt_embeds[rows][r].float())
                loss, clipfrac = compute_value_loss(
                    values[None], samples.returns[rows][r, s][None], samples.old_values[rows][r, s][None],
                    torch.ones_like(values)[None], config.critic.cliprange_value,
                )
                acc.backward(loss)
                acc.clip_grad_norm_(self.critic.parameters(), config.critic.max_grad_norm)
                self.critic_optimizer.step()
                self.critic_optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
                clipfracs.append(float(clipfrac))
        metrics["critic/value_loss"] = float(np.mean(losses))
        metrics["critic/clipfrac"] = float(np.mean(clipfracs))
        metrics["time/critic"] = time.perf_counter() - start

    def log_epoch(self, epoch, samples, metrics):
        config, acc = self.config, self.accelerator
        gathered = samples.gathered
        rewards = gathered.rewards
        metrics.update(
            epoch=epoch,
            global_step=self.global_step,
            num_processes=acc.num_processes,
            num_samples=int(rewards.numel()),
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std(unbiased=False)),
            peak_rss_mb=_peak_rss_mb(),
        )
        for name, values in gathered.components.items():
            metrics[f"reward/{name}"] = float(values.mean())
        if torch.cuda.is_available():
            metrics["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
        log_images = config.log_images_every and epoch % config.log_images_every == 0
        images = acc.gather(samples.images.float().contiguous()) if log_images else None
        if acc.is_main_process:
            if log_images:
                from ddpo_group.grids import save_epoch_samples

                mask = gathered.mask
                adv = (gathered.advantages * mask).sum(1) / mask.sum(1).clamp(min=1)
                prompts = [self.prompts[int(i)].prompt for i in gathered.prompt_ids.tolist()]
                metrics["samples/grid"] = os.path.relpath(
                    save_epoch_samples(
                        self.run_dir, epoch, images.cpu(), prompts,
                        rewards.cpu().numpy(), adv.cpu().numpy(), config.sample.group_size,
                    ),
                    self.run_dir,
                )
        self._write_metrics_row(metrics)

    def _dump_debug(self, epoch, samples):
        acc = self.accelerator
        path = os.path.join(self.run_dir, "debug", f"epoch_{epoch:04d}_rank{acc.process_index}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_json_atomic(
            path,
            {
                "rank": acc.process_index,
                "rewards": samples.rewards.tolist(),
                "components": {name: values.tolist() for name, values in samples.components.items()},
                "prompt_ids": samples.prompt_ids.tolist(),
                "mask": samples.mask.tolist(),
                "advantages": samples.advantages.tolist(),
            },
        )

    def save_checkpoint(self, epoch):
        """accelerator.save_state (every process) into a temporary directory, then an atomic rename."""
        config, acc = self.config, self.accelerator
        root = os.path.join(self.run_dir, "checkpoints")
        final = os.path.join(root, f"checkpoint_{epoch}")
        tmp = os.path.join(root, f".tmp_checkpoint_{epoch}")
        if acc.is_main_process:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        try:
            acc.save_state(tmp)
        except (OSError, RuntimeError) as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(_checkpoint_write_error(root, final, err)) from err
        acc.wait_for_everyone()  # every rank's files are in tmp before it is renamed
        if acc.is_main_process:
            state = {
                "epoch": epoch,
                "global_step": self.global_step,
                "skipped_steps": self.skipped_steps,
                "trackers": {name: tracker.state_dict() for name, tracker in self.trackers.items()},
                "threshold": self.threshold.state_dict(),
            }
            for name, holder in self._weight_copies().items():
                copy_state = holder.state_dict()
                if copy_state["params"]:
                    from safetensors.torch import save_file

                    try:
                        save_file(copy_state["params"], os.path.join(tmp, f"{name}.safetensors"))
                    except (OSError, RuntimeError) as err:
                        shutil.rmtree(tmp, ignore_errors=True)
                        raise CheckpointError(_checkpoint_write_error(root, final, err)) from err
                state[name] = {k: v for k, v in copy_state.items() if k != "params"}
            try:
                _write_json_atomic(os.path.join(tmp, TRAINER_STATE), state)
            except OSError as err:
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(_checkpoint_write_error(root, final, err)) from err
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune_checkpoints(root)
            logger.info("checkpoint written: %s", final)
        acc.wait_for_everyone()
        self._saved_at = (epoch, self.global_step)
        return final

    def _release_lock(self):
        if self._lock is not None:
            self._lock.close()  # releases the run directory's lock
            self._lock = None

    def _weight_copies(self):
        """The weight copies a checkpoint holds beside the model: {file stem: holder with state_dict()}."""
        copies = {}
        if self.reference is not None:
            copies["reference"] = self.reference
        if self.forward_update is not None:
            copies["old_model"] = self.forward_update.old
        return copies

    def _prune_checkpoints(self, root):
        limit = self.config.num_checkpoint_limit
        if not limit:
            return
        names = sorted((n for n in os.listdir(root) if CHECKPOINT_RE.match(n)), key=lambda n: int(CHECKPOINT_RE.match(n)[1]))
        for name in names[:-limit]:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def _load_checkpoint(self):
        checkpoint, state = self._resume_checkpoint, self._resume_state
        try:
            self.accelerator.load_state(checkpoint)
        except Exception as err:
            broken = _unreadable_checkpoint_file(checkpoint)
            if broken:
                raise CheckpointError(
                    f"could not load checkpoint {checkpoint}: {broken[0]} is unreadable ({broken[1]}); delete "
                    "this checkpoint or point config.resume_from at an earlier checkpoint_N"
                ) from err
            raise CheckpointError(
                f"could not load checkpoint {checkpoint}: {err}; delete it or point config.resume_from at an "
                "earlier checkpoint_N (was it written with the same use_lora / model settings?)"
            ) from err
        self.first_epoch = int(state["epoch"])
        self.global_step = int(state["global_step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        for name, tracker_state in state.get("trackers", {}).items():
            if name in self.trackers:
                self.trackers[name].load_state_dict(tracker_state)
        self.threshold.load_state_dict(state["threshold"])
        for name, holder in self._weight_copies().items():
            if name not in state:
                continue
            copy_state = dict(state[name])
            path = os.path.join(checkpoint, f"{name}.safetensors")
            try:
                if os.path.exists(path):
                    from safetensors.torch import load_file

                    copy_state["params"] = load_file(path)
                holder.load_state_dict(copy_state)
            except Exception as err:
                raise CheckpointError(
                    f"could not load the {name.replace('_', ' ')} {path}: {err}; delete checkpoint {checkpoint} or "
                    "point config.resume_from at an earlier checkpoint_N"
                ) from err
        if self.accelerator.is_main_process:
            _truncate_metrics(os.path.join(self.run_dir, "metrics.jsonl"), self.first_epoch)
        logger.info("resumed from %s at epoch %d", checkpoint, self.first_epoch)

    def _save_model_hook(self, models, weights, output_dir):
        if self.accelerator.is_main_process:
            for model in models:
                module = self.accelerator.unwrap_model(model)
                if module is self.trainable_module:
                    self.policy.save_trainable(module, output_dir, self.config.use_lora)
                elif module is self.critic_module:
                    from safetensors.torch import save_file

                    save_file(module.state_dict(), os.path.join(output_dir, "critic.safetensors"))
        while weights:
            weights.pop()

    def _load_model_hook(self, models, input_dir):
        while models:
            module = self.accelerator.unwrap_model(models.pop())
            if module is self.trainable_module:
                self.policy.load_trainable(module, input_dir, self.config.use_lora)
            elif module is self.critic_module:
                from safetensors.torch import load_file

                module.load_state_dict(load_file(os.path.join(input_dir, "critic.safetensors")))


RUN_MARKERS = ("config.json", "metrics.jsonl", "checkpoints")
LOCK_FILE = ".lock"


def _holds_a_run(run_dir):
    return any(os.path.exists(os.path.join(run_dir, name)) for name in RUN_MARKERS)


def _refuse_an_earlier_run(run_dir, overwrite):
    """A new run may not write into a directory that holds another run (it would mix or overwrite its files)."""
    if _holds_a_run(run_dir) and not overwrite:
        raise ConfigError(
            f"{run_dir} already holds a run: resume it with --config.resume_from={run_dir}, pick another "
            "config.run_name, or pass --config.overwrite=True to delete it and start again"
        )


def _lock_run_dir(run_dir):
    """An exclusive lock on run_dir/.lock (released when the returned file is closed, or the process exits);
    ConfigError when another live run holds it. No-op where the platform has no fcntl."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        return open(os.devnull, "w")
    handle = open(os.path.join(run_dir, LOCK_FILE), "a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(
            f"{run_dir} is in use by a live run ({holder}); wait for it to end, or pick another config.run_name"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def _unreadable_checkpoint_file(checkpoint):
    """(path, reason) of the first file of a checkpoint that cannot be read (a truncated or overwritten
    optimizer.bin, safetensors file or random state), or None; only asked after loading the checkpoint failed."""
    from safetensors import safe_open

    for root, _, names in sorted(os.walk(checkpoint)):
        for name in sorted(names):
            path = os.path.join(root, name)
            try:
                if name.endswith(".safetensors"):
                    with safe_open(path, "pt") as f:
                        for key in f.keys():
                            f.get_slice(key)
                elif name.endswith((".bin", ".pkl", ".pt", ".pth")):  # torch.save's zip format: CRCs, nothing unpickled
                    with zipfile.ZipFile(path) as archive:
                        damaged = archive.testzip()
                    if damaged:
                        raise ValueError(f"member {damaged} fails its CRC check")
            except Exception as err:  # any failure to read is the answer
                return path, " ".join(str(err).split())[:200] or type(err).__name__
    return None


def _checkpoint_write_error(root, final, err):
    """One line for a checkpoint that could not be written: the cause, free space, the checkpoint kept."""
    import errno

    try:
        free_mb = shutil.disk_usage(root).free / 2**20
    except OSError:
        free_mb = float("nan")
    full = getattr(err, "errno", None) == errno.ENOSPC or "iostream error" in str(err) or free_mb < 64
    kept = [n for n in os.listdir(root) if CHECKPOINT_RE.match(n)] if os.path.isdir(root) else []
    latest = max(kept, key=lambda n: int(CHECKPOINT_RE.match(n)[1])) if kept else None
    cause = f"the disk holding {root} is full ({free_mb:.0f} MB free)" if full else f"{type(err).__name__}: {err}"
    return (
        f"could not write checkpoint {final}: {cause}; "
        + (f"the last complete checkpoint {os.path.join(root, latest)} is kept" if latest else "no earlier checkpoint exists")
        + "; free space (or lower num_checkpoint_limit) and resume with --config.resume_from"
    )


def _truncate_metrics(path, first_epoch):
    """On resume, drop metrics rows of epochs that the resumed run will redo.

    A torn last line (power loss, full disk) is dropped with a warning; a bad line elsewhere is a
    CheckpointError naming the file and the line.
    """
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except ValueError as err:
            if number == len(lines):
                logger.warning("%s: dropping its torn last line %d (%s)", path, number, err)
                continue
            raise CheckpointError(
                f"{path}, line {number}: not a JSON row ({err}); repair or delete that line to resume"
            ) from err
        if row.get("epoch", -1) < first_epoch:
            rows.append(json.dumps(row) + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(rows)
    os.replace(tmp, path)


def _group_stats(rewards, prompt_ids):
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


def _flatten(d, prefix=""):
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out


def train(config, overrides=None):
    """Build a Trainer from the config and run it; returns the run directory (see Trainer for `overrides`)."""
    return Trainer(config, overrides=overrides).run()
