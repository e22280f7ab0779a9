"""The epoch loop on Accelerate (docs/design.md §7; the modules it calls: docs/architecture.md).

One epoch, in the order it happens:

    evaluate            every eval_freq epochs: fixed-noise evaluation of the current weights (evaluation/evaluator.py)
    sample_epoch        num_batches_per_epoch x batch_size trajectories per process, group_size images per
                        prompt; rewards run in a thread pool while the next batch samples (rollout.py)
    compute_advantages  on the gathered batch of all processes: PerPromptStatTracker or a registered
                        estimator (grpo, rloo, gae, group_ppo); each process keeps its own slice
                        (epoch_advantages.py)
    train_epoch         the update: per-step PPO / GRPO with exact on-policy ratio (stepwise_update.py), or a
                        forward-process objective, DiffusionNFT / AWM (forward_training.py), DGPO / Diffusion-DPO
                        (preference_training.py)
    update_critic       gae / group_ppo: clipped value loss (critic.py)
    log_epoch           metrics.jsonl, trackers, sample grids (runs/metrics_log.py); atomic checkpoints every
                        save_freq epochs (runs/run_dir.py)

The Trainer holds what the phases share (config, accelerator, policy and models, rewards, prompts, the
step counters) and the optimizer step; the run directory, stop signals, metrics and evaluation are its
collaborators (`files`, `control`, `metrics_log`, `evaluator`).
"""

import logging
import os
import time

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import ProjectConfiguration, set_seed
from tqdm.auto import tqdm

from ddpo_group.config.check import check_config, load_config_prompts
from ddpo_group.training.async_rollout import AsyncRollout
from ddpo_group.training.critic import update_critic
from ddpo_group.training.epoch_advantages import EpochAdvantages
from ddpo_group.evaluation.evaluator import Evaluator
from ddpo_group.training.forward_training import ForwardUpdate
from ddpo_group.training.preference_training import PREFERENCE_OBJECTIVES, PreferenceUpdate
from ddpo_group.runs.metrics_log import MetricsLog
from ddpo_group.training.models import build_models
from ddpo_group.training import perf
from ddpo_group.rewards import AsyncRewardRunner, build_reward_fn
from ddpo_group.training.rollout import sample_epoch
from ddpo_group.runs.run_control import RunControl
from ddpo_group.runs.run_dir import STOPPED_FILE, CheckpointError, RunDir, _lock_run_dir, find_checkpoint  # noqa: F401
from ddpo_group.training.stepwise_update import LossConfig, StepwiseUpdate

logger = logging.getLogger("ddpo_group")


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
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False



def warm_up_learning_rate(optimizer, train, global_step):
    """train.lr_warmup_steps: set the learning rate of the coming optimizer step, learning_rate x min(1, (k + 1) /
    warm-up) at step k = global_step (restored on resume, so a resumed warm-up goes on where it stopped); nothing
    without a warm-up."""
    warmup = int(getattr(train, "lr_warmup_steps", 0) or 0)
    if warmup <= 0:
        return
    rate = train.learning_rate * min(1.0, (global_step + 1) / warmup)
    for group in optimizer.param_groups:
        group["lr"] = rate

class Trainer:
    """Builds everything from a config (models, optimizer, rewards, prompts) and runs the epochs."""

    def __init__(self, config, overrides=None):
        """config: the run's configuration. On resume (config.resume_from) the run's stored config.json is
        used; `overrides` names the fields the user set explicitly (the CLI's --config.FIELD=VALUE), and
        only they may differ from the stored run (None: every field of `config` is compared)."""
        # Checked before anything is created; the launcher's WORLD_SIZE is the number of processes.
        checks = {"num_processes": int(os.environ.get("WORLD_SIZE", 1)), "has_gpu": torch.cuda.is_available()}
        check_config(config, **checks)
        self.files, config = RunDir.resolve(config, overrides)
        if config.resume_from:
            check_config(config, **checks)
        self.config, self.run_dir = config, self.files.path
        self.accelerator = acc = make_accelerator(config, self.run_dir)
        if config.resume_from and acc.is_main_process:
            self.files.lock()  # before anything of the run is read or rewritten
        logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
        set_seed(config.seed, device_specific=True)
        if config.allow_tf32 and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = True

        # Rewards and prompts first: a missing reward model fails before any diffusion model loads.
        self.reward_fn = build_reward_fn(
            config.reward_fn or None, config.reward_weights.to_dict() or None, reward_workers=config.reward_workers,
            reward_kwargs=config.reward_kwargs.to_dict() or None, reward_aggregation=config.reward_aggregation,
            device=acc.device, reward_frames=config.reward_frames,
        )
        self.reward_fn.check_ready()
        self.reward_runner = AsyncRewardRunner(self.reward_fn, config.reward_workers)
        self.prompts = load_config_prompts(config, "prompt_fn")
        self.evaluator = Evaluator(config, acc, self.files, self.prompts, self.reward_fn)  # eval prompts, gold rewards
        # the advantage phase checks what it needs of the rewards (step_gain: one reward stream) before a model loads
        self.advantages = EpochAdvantages(config, acc, self.reward_fn, self.prompts)
        self.estimator, self.trackers = self.advantages.estimator, self.advantages.trackers

        models = build_models(config, acc)
        for name in ("policy", "trainable_module", "model", "trainable_params", "optimizer", "critic_module", "critic",
                     "critic_optimizer", "reference", "policy_loss", "sharded_copies", "sharded_state", "clip_grad_norm"):
            setattr(self, name, getattr(models, name))
        self.loss_config = LossConfig.from_config(config.train)
        # the registry says whether one step's loss reads the other steps' log-probs (gspo, geo_mean)
        self.loss_couples_steps = self.policy_loss.couples_steps
        self.files.register_model_files(acc, self.policy, self.trainable_module, self.critic_module, config.use_lora)
        self.forward_update = None
        if config.train.objective in PREFERENCE_OBJECTIVES:  # DGPO / Diffusion-DPO (docs/forward.md)
            self.forward_update = PreferenceUpdate(self)
        elif config.train.objective != "stepwise":  # DiffusionNFT / AWM: a forward-process update (docs/forward.md)
            self.forward_update = ForwardUpdate(self)
        self.update = self.forward_update or StepwiseUpdate(self)
        # train.async_rollout: epoch k+1 samples in a thread while epoch k trains (training/async_rollout.py)
        self.async_rollout = AsyncRollout(self) if config.train.get("async_rollout", False) else None
        copies = list(self.sharded_copies.values())
        if self.async_rollout is not None:  # its frozen copies: the old-log-prob pass runs them
            copies += [snapshot.module for snapshot in self.async_rollout.copies]
        self.perf = perf.for_run(config, acc.device, self.policy, copies=copies)  # per-phase seconds, MFU (None: off)

        self.first_epoch, self.global_step, self.skipped_steps = 0, 0, 0
        self.scaler_skipped_steps = 0  # fp16: steps the GradScaler skipped while it lowered its scale
        self._saved_at = None  # (epoch, global_step) of the checkpoint on disk that holds the current state
        self._checkpoint = self.files.resume_checkpoint
        # A resume whose checkpoint already holds num_epochs (a requeued job, the printed resume command) has nothing
        # to do, and changes nothing: its metrics rows, finished.json and config.json stay as the run left them.
        self.nothing_to_do = bool(self.files.resume_state) and int(self.files.resume_state["epoch"]) >= config.num_epochs
        if self.files.resume_checkpoint:
            try:
                state = self.files.load_checkpoint(acc, self._weight_copies(), sharded=self.sharded_state,
                                                   truncate_metrics=not self.nothing_to_do)
            except BaseException as err:  # the run cannot go on from its checkpoint: it failed, and says so
                if acc.is_main_process:
                    self.files.mark_failed(int((self.files.resume_state or {}).get("epoch", 0)), err)
                self.files.release()
                raise
            self.first_epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
            self.skipped_steps = int(state.get("skipped_steps", 0))
            self.scaler_skipped_steps = int(state.get("scaler_skipped_steps", 0))
            self.advantages.load_state_dict(state)
            self._saved_at = (self.first_epoch, self.global_step)
        # Written once everything above is accepted: a run that cannot start leaves no directory behind.
        if acc.is_main_process and not self.nothing_to_do:
            self.files.start(config, self.first_epoch, records=list(self.prompts) + list(self.evaluator.prompts))
        acc.wait_for_everyone()
        self.control = RunControl(acc)
        self.metrics_log = MetricsLog(config, acc, self.files)

    def run(self):
        """Run epochs first_epoch .. num_epochs - 1, evaluate the final weights, write the final checkpoint;
        a stop signal ends the run after the current phase (stopped.json), an error marks it (failed.json)."""
        config, acc = self.config, self.accelerator
        if self.nothing_to_do:
            logger.warning("nothing to do: the run already has %d of num_epochs=%d epochs", self.first_epoch, config.num_epochs)
            self._stop_async()
            self.reward_runner.shutdown()
            self.files.release()
            return self.run_dir
        self.metrics_log.start()
        self.control.install()
        logger.info(
            "run %s: %d processes, %d trajectories per epoch, %s", self.run_dir, acc.num_processes,
            config.sample.batch_size * config.sample.num_batches_per_epoch * acc.num_processes,
            config.algorithm.adv_estimator,
        )
        self.epoch, failed, start = self.first_epoch, False, time.perf_counter()
        try:
            with perf.active(self.perf):  # None: no accounting
                epoch = self._epochs()
            if self._saved_at != (epoch, self.global_step):  # not again, when a stop follows a periodic save at once
                self.save_checkpoint(epoch)
            if acc.is_main_process:  # the console's last word: evaluation, time, where things are, what to run next
                summary = self.metrics_log.summary(epoch, time.perf_counter() - start, self._checkpoint)
                tqdm.write("\n".join(summary))
            if epoch < config.num_epochs and acc.is_main_process:
                # stopped by a signal before num_epochs: say so in the run directory (the CLI exits non-zero)
                self.files.mark_stopped(epoch, self.control.signal)
            elif acc.is_main_process:  # the run's last word: whoever launched it can tell it finished
                self.files.mark_finished(epoch, self._checkpoint)
        except BaseException as err:
            failed = True
            if acc.is_main_process:
                self.files.mark_failed(self.epoch, err)
            raise
        finally:
            self.control.restore()
            self._stop_async()
            self.files.release()
            # after an error a reward may never return: its (daemon) worker is not waited for
            self.reward_runner.shutdown(wait=not failed)
            acc.end_training()
        return self.run_dir

    def _epochs(self):
        """The epoch loop: sample -> reward -> advantages -> train -> critic -> log. Returns the epoch it ended at."""
        config, stop = self.config, self.control.should_stop
        bar = tqdm(range(self.first_epoch, config.num_epochs), desc="epoch", disable=not self.accelerator.is_main_process)
        for epoch in bar:
            self.epoch = epoch
            if stop():
                return epoch
            metrics = {"epoch": epoch}
            if config.eval_freq and epoch % config.eval_freq == 0:
                self.evaluate(epoch, metrics)  # the weights after `epoch` epochs, before this epoch's update
                if stop():
                    return epoch
            samples = self.sample_epoch(epoch, metrics)
            if stop():
                return epoch
            self.compute_advantages(samples, metrics)
            if config.debug_dump:
                self.metrics_log.dump_debug(epoch, samples)
            if self.forward_update is not None or epoch >= config.critic.warmup_epochs or self.critic is None:
                self.train_epoch(samples, epoch, metrics)
            if self.critic is not None:
                self.update_critic(samples, epoch, metrics)
            self.log_epoch(epoch, samples, metrics)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}")
            if config.save_freq and (epoch + 1) % config.save_freq == 0 and epoch + 1 < config.num_epochs:
                self.save_checkpoint(epoch + 1)
        epoch = self.epoch = config.num_epochs
        if config.eval_freq:  # the final weights, a row of their own
            metrics = {"epoch": epoch, "eval_only": True}
            self.evaluate(epoch, metrics)
            if "eval/reward_mean" in metrics:  # not when a stop signal interrupted it
                self.metrics_log.write(metrics)
        return epoch

    def evaluate(self, epoch, metrics):
        """Fixed-noise evaluation of the current weights into `metrics` (eval/*) and samples/eval_XXXX.png."""
        with perf.phase("evaluation"):
            self.evaluator(epoch, metrics, self.policy, self.trainable_module, should_stop=lambda: self.control.requested)

    def sample_epoch(self, epoch, metrics):
        """This process's EpochBatch of `epoch` with rewards (the forward objectives sample with their lagged model)."""
        forward = self.forward_update
        if self.async_rollout is not None:  # drawn in the background during the previous epoch's training
            return self.async_rollout.sample_epoch(epoch, metrics)
        with perf.phase("sampling"):  # rollout.py switches to "reward" when it waits for the rewards
            return sample_epoch(
                self.policy, self.prompts, self.reward_runner, self.config, self.accelerator, epoch, metrics,
                model=None if forward is None else forward.sampling_model, keep_steps=forward is None,
            )

    def compute_advantages(self, samples, metrics):
        """Advantages (B_local, T) on the gathered batch of all processes; sets samples.advantages."""
        self.advantages(samples, metrics, critic=self.critic, policy=self.policy, model=self.trainable_module)

    def train_epoch(self, samples, epoch, metrics):
        """The epoch's update (stepwise PPO / GRPO, or the forward-process objective)."""
        with perf.phase("training"):
            self.update.train_epoch(samples, epoch, metrics)

    def update_critic(self, samples, epoch, metrics):
        """Clipped value loss on the critic's steps (endpoints for group_ppo, every valid step for gae)."""
        with perf.phase("critic"):
            update_critic(self.critic, self.critic_optimizer, samples, self.config, self.accelerator, epoch, metrics)

    def log_epoch(self, epoch, samples, metrics):
        if self.perf is not None:  # the phases since the previous row (a checkpoint after it counts in the next)
            metrics.update(self.perf.epoch_metrics())
        self.metrics_log.epoch_row(epoch, samples, metrics, self.global_step, self.prompts,
                                   audio_sample_rate=getattr(self.policy, "audio_sample_rate", None))

    def _optimizer_step(self, bad):
        """Clip, step, zero; a step whose loss or gradient is not finite is skipped and counted.

        fp16: the GradScaler starts at a scale of 2**16 and halves it after each step whose scaled gradients
        overflow, skipping that step; a run's first steps are often skipped so (a short run's, all of them). Such a
        step, with a finite loss and a scale above 1 before it, is counted apart (scaler_skipped_steps) from a step
        skipped for a non-finite loss or gradient (skipped_steps, a warning).

        Returns {"skipped": bool, "grad_norm": the clipped-before norm of a step taken, else None}.
        """
        acc = self.accelerator
        warm_up_learning_rate(self.optimizer, self.config.train, self.global_step)
        grad_norm = self.clip_grad_norm(self.trainable_params, self.config.train.max_grad_norm)  # sharded or not
        flags = acc.gather(torch.tensor([float(bad)], device=acc.device))
        bad = bool(flags.sum() > 0)
        skip = bad or (grad_norm is not None and not torch.isfinite(torch.as_tensor(grad_norm)))
        calibrating = False
        if acc.scaler is not None:
            # fp16: the GradScaler skips a non-finite step itself and lowers its scale; it must see every step.
            scale = float(acc.scaler.get_scale())
            self.optimizer.step()
            # this optimizer's own flag: accelerate's optimizer_step_was_skipped is true when *any* prepared
            # optimizer's last step was skipped (a critic's, whose value loss shares the scaler)
            skip = skip or self.optimizer.step_was_skipped
            calibrating = skip and not bad and scale > 1.0
        elif not skip:
            self.optimizer.step()
        if calibrating:
            self.scaler_skipped_steps += 1
            logger.info("fp16 loss scale %g overflowed: optimizer step skipped, scale now %g (the GradScaler "
                        "lowering its scale; %d such steps so far)", scale, float(acc.scaler.get_scale()),
                        self.scaler_skipped_steps)
        elif skip:
            self.skipped_steps += 1
            logger.warning("non-finite loss or gradient: optimizer step skipped (%d so far)", self.skipped_steps)
        else:
            self.global_step += 1
            if self.reference is not None:
                self.reference.on_optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"skipped": skip, "grad_norm": None if skip or grad_norm is None else float(grad_norm)}

    def step_metrics(self):
        """The optimizer's counters for an epoch's metrics (both update paths): train/skipped_steps,
        train/global_step and, with fp16's loss scaler, train/scaler_skipped_steps and train/grad_scale."""
        metrics = {"train/skipped_steps": self.skipped_steps, "train/global_step": self.global_step,
                   "train/learning_rate": float(self.optimizer.param_groups[0]["lr"])}
        if self.accelerator.scaler is not None:
            metrics["train/scaler_skipped_steps"] = self.scaler_skipped_steps
            metrics["train/grad_scale"] = float(self.accelerator.scaler.get_scale())
        return metrics

    def save_checkpoint(self, epoch):
        """checkpoints/checkpoint_{epoch}, written atomically (``RunDir.save_checkpoint``)."""
        state = {"epoch": epoch, "global_step": self.global_step, "skipped_steps": self.skipped_steps,
                 "scaler_skipped_steps": self.scaler_skipped_steps,
                 **self.advantages.state_dict()}
        with perf.phase("checkpoint"):
            final = self.files.save_checkpoint(self.accelerator, epoch, state, self._weight_copies(epoch),
                                               self.config.num_checkpoint_limit, sharded=self.sharded_state,
                                               export=epoch >= self.config.num_epochs)
        self._saved_at, self._checkpoint = (epoch, self.global_step), final
        return final

    def _stop_async(self):
        if self.async_rollout is not None:  # its thread may still sample: waited for
            self.async_rollout.shutdown()

    def _weight_copies(self, epoch=None):
        """The weight copies a checkpoint (at `epoch`; None: loading) holds beside the model: {file stem: holder with
        state_dict()}; train.async_rollout: the weights that sample the checkpoint's epoch."""
        copies = {}
        if self.async_rollout is not None:
            copies["sampling_model"] = self.async_rollout.holder(epoch)
        if self.reference is not None:
            copies["reference"] = self.reference
        if self.forward_update is not None:
            copies["old_model"] = self.forward_update.old
        return copies


def train(config, overrides=None):
    """Build a Trainer from the config and run it; returns the run directory (see Trainer for `overrides`)."""
    return Trainer(config, overrides=overrides).run()
