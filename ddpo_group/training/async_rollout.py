"""train.async_rollout: epoch k+1's rollout runs while epoch k trains, one epoch off policy (docs/async_rollout.md).

    epoch k:  samples_k = the rollout started during epoch k-1 (drawn with S_{k-1}, the weights at the start of
              epoch k-1's training); the first epoch of a run samples at once with a snapshot of its weights
              S_k = a frozen copy of the trainable weights now (LoRA: the adapters; the frozen weights are shared)
              a background thread samples epoch k+1 (and waits for its rewards) with S_k
              advantages and training of epoch k; pi_old of the ratio is taken with S_{k-1}, the weights that
              sampled samples_k, in the training layout (StepwiseUpdate.recompute_old_log_probs)

The ratio stays exact: the old-log-prob pass runs the very weights that sampled, so the ratio before the first
optimizer step is exactly 1 when the training weights equal them (the first epoch of a run) and differs from 1 by
the one-epoch lag otherwise, which PPO's clip bounds as it bounds the inner epochs' drift.

Two frozen copies of the trainable module exist (the sampler's and the behaviour policy's); each epoch the free one
takes the current weights. The sampling thread uses a view of the policy with its own scheduler (the evaluation and
the training's step math read the policy's). On a GPU both threads queue their kernels on the default stream: what
overlaps there is the host's work and the rewards (a stream of the sampler's own is not done).

Reproducible: the rollout's noise comes from generators seeded by (seed, epoch, batch, process) as in the synchronous
loop, so the same command gives the same numbers. Threads: ``torch.set_num_threads`` holds per thread; the run's
count N is split, the sampler max(1, N // 2), the loop max(1, N - N // 2), and restored at the end.

Checkpoint and resume: a checkpoint holds the sampler's snapshot (sampling_model.safetensors: the weights drawing the
next epoch); a resumed run re-draws that epoch's rollout from it, with the same generators, so it continues exactly as
the uninterrupted run. A checkpoint without it (written without async_rollout) resumes by sampling its first epoch
with the checkpoint's own weights.

train.async_rollout_processes=1: the pending rollouts are drawn by a rollout process instead (rollout_process.py:
the snapshot's trainable state sent to it each epoch, the samples back); the thread then only waits for them.

Accounting (perf.py): the background thread is not accounted in the loop's phases; perf/sampling_seconds and
time/sample of the loop are the seconds the loop waited for the rollout, async/rollout_seconds the background
rollout's own wall seconds (overlapping training), async/wait_seconds the wait; time/sample and time/reward are
the rollout's own, as in the synchronous loop.
"""

import concurrent.futures
import contextlib
import copy
import time

import torch

from ddpo_group.config.registry import ConfigError, register_config_check
from ddpo_group.training import perf
from ddpo_group.training.rollout import sample_epoch


def sampler_view(policy):
    """A shallow copy of `policy` whose pipeline holds its own scheduler (set_timesteps is state): the sampling
    thread's; the models are shared."""
    view = copy.copy(policy)
    pipeline = getattr(policy, "pipeline", None)
    if pipeline is not None and getattr(pipeline, "scheduler", None) is not None:
        pipeline = copy.copy(pipeline)
        pipeline.__dict__["scheduler"] = copy.deepcopy(policy.pipeline.scheduler)
        view.pipeline = pipeline
    return view


class FrozenCopy:
    """A module copy of the trainable module whose trainable parameters are its own (frozen), the others shared."""

    def __init__(self, module):
        shared = {id(p): p for p in module.parameters() if not p.requires_grad}
        self.names = [name for name, p in module.named_parameters() if p.requires_grad]
        self.module = copy.deepcopy(module, memo=dict(shared))
        own = dict(self.module.named_parameters())
        self.params = {name: own[name] for name in self.names}
        for p in self.params.values():
            p.requires_grad_(False)
        self.epoch = None  # the epoch whose training starts from these weights

    @torch.no_grad()
    def take(self, module, epoch):
        current = dict(module.named_parameters())
        for name, p in self.params.items():
            p.copy_(current[name].detach())
        self.module.train(module.training)
        self.epoch = epoch
        return self

    def state_dict(self):
        return {"epoch": self.epoch, "params": {n: p.detach().cpu().contiguous() for n, p in self.params.items()}}

    @torch.no_grad()
    def load_state_dict(self, state):
        params = state.get("params", {})
        if set(params) != set(self.params):
            raise ValueError("the sampler snapshot does not match the model: resume with the same use_lora / lora_rank")
        for name, value in params.items():
            self.params[name].copy_(value)
        self.epoch = state.get("epoch")


class AsyncRollout:
    """The trainer's sampling phase under train.async_rollout (module docstring)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.view = sampler_view(trainer.policy)
        module = trainer.trainable_module
        self.copies = [FrozenCopy(module), FrozenCopy(module)]
        self.behaviour = None  # the FrozenCopy that sampled the epoch being trained
        self.drawn = None  # the epoch whose samples `behaviour` drew
        self.pending = None  # (epoch, FrozenCopy sampling it, future of (samples, metrics, seconds))
        self.resumed = None  # the snapshot read from a checkpoint: it draws the first epoch
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="async_rollout")
        self.process = None  # train.async_rollout_processes=1: the RolloutProcess drawing the pending rollouts
        self.threads = None  # {"sampler", "loop", "before"}: set when the first rollout starts, restored at the end

    def behaviour_model(self):
        """The module that sampled the epoch in training (its pi_old), or None before the first epoch."""
        return None if self.behaviour is None else self.behaviour.module

    def _free_copy(self):
        busy = {id(self.behaviour), id(self.pending[1]) if self.pending else None}
        return next(c for c in self.copies if id(c) not in busy)

    def _draw(self, snapshot, epoch, metrics):
        """One epoch's rollout with `snapshot` (any thread)."""
        tr = self.trainer
        return sample_epoch(self.view, tr.prompts, tr.reward_runner, tr.config, tr.accelerator, epoch, metrics,
                            model=snapshot.module)

    def _background(self, snapshot, epoch):
        torch.set_num_threads(self.threads["sampler"])
        metrics, start = {}, time.perf_counter()
        if self.process is not None:  # drawn by the rollout process; this thread waits for it
            samples, metrics = self.process.draw(snapshot.params, epoch)
        else:
            samples = self._draw(snapshot, epoch, metrics)
        return samples, metrics, time.perf_counter() - start

    def sample_epoch(self, epoch, metrics):
        """`epoch`'s samples (the pending rollout, or drawn now), then the next epoch's rollout started in the
        background from the current weights."""
        tr = self.trainer
        start = time.perf_counter()
        with perf.phase("sampling"):
            if self.pending is not None and self.pending[0] == epoch:
                _, snapshot, future = self.pending
                self.pending = None
                samples, drawn, seconds = future.result()
                metrics.update(drawn)
                metrics["async/rollout_seconds"] = seconds
            else:  # the run's first epoch (or a resume): sampled now, with the checkpoint's snapshot if it has one
                snapshot = self.resumed or self._free_copy().take(tr.trainable_module, epoch)
                self.resumed = None
                self.behaviour = None
                samples = self._draw(snapshot, epoch, metrics)
            metrics["async/wait_seconds"] = time.perf_counter() - start
            metrics["async/sampled_with_epoch"] = snapshot.epoch  # the weights of the start of that epoch's training
        self.behaviour, self.drawn = snapshot, epoch
        if epoch + 1 < tr.config.num_epochs:
            following = self._free_copy().take(tr.trainable_module, epoch)
            if self.threads is None:  # the run's N torch threads split between the loop and the sampler
                total = torch.get_num_threads()
                self.threads = {"sampler": max(1, total // 2), "loop": max(1, total - total // 2), "before": total}
                torch.set_num_threads(self.threads["loop"])
                if tr.config.train.get("async_rollout_processes", 0):
                    from ddpo_group.training.rollout_process import RolloutProcess

                    self.process = RolloutProcess(tr.config, tr.accelerator.device, self.threads["sampler"])
            self.pending = (epoch + 1, following, self.pool.submit(self._background, following, epoch + 1))
        return samples

    def snapshot_for(self, epoch):
        """The FrozenCopy that draws (or drew) `epoch`'s samples, or None: what a checkpoint at `epoch` keeps so
        that the resumed run draws that epoch as the uninterrupted run does."""
        if self.pending is not None and self.pending[0] == epoch:
            return self.pending[1]
        return self.behaviour if self.drawn == epoch else None

    def holder(self, epoch):
        """The checkpoint's weight copy (runs/run_dir.py) of a checkpoint at `epoch` (None: a load)."""
        return _SnapshotHolder(self, epoch)

    def shutdown(self):
        """Wait for a pending rollout (its thread uses the models) and restore the thread count."""
        if self.pending is not None:
            with contextlib.suppress(Exception):
                self.pending[2].result()
            self.pending = None
        self.pool.shutdown(wait=True)
        if self.process is not None:
            self.process.close()
            self.process = None
        if self.threads is not None:
            torch.set_num_threads(self.threads["before"])
            self.threads = None


class _SnapshotHolder:
    """{file stem: holder} of the checkpoint for the sampler's snapshot (runs/run_dir.py's weight copies)."""

    def __init__(self, rollout, epoch):
        self.rollout, self.epoch = rollout, epoch

    def state_dict(self):
        snapshot = self.rollout.snapshot_for(self.epoch)
        return snapshot.state_dict() if snapshot is not None else {"epoch": None, "params": {}}

    def load_state_dict(self, state):
        if not state.get("params"):
            return
        rollout = self.rollout
        rollout.resumed = rollout._free_copy()
        rollout.resumed.load_state_dict(state)


@register_config_check("training")
def check_async_rollout(config, machine):
    """train.async_rollout: one trainer process, the stepwise objective, no critic or Group-PPO design, no sharding;
    train.async_rollout_processes 0 (a thread) or 1 (a rollout process)."""
    from ddpo_group.algos.advantages import get_adv_estimator

    train = config.train
    processes = train.get("async_rollout_processes", 0)
    if processes not in (0, 1):
        raise ConfigError(f"config.train.async_rollout_processes={processes!r}: 0 (the rollout in a thread) or 1 "
                          "(in a process of its own); more rollout processes are not built")
    if not train.get("async_rollout", False):
        if processes:
            raise ConfigError("config.train.async_rollout_processes=1 draws train.async_rollout's rollout: set "
                              "train.async_rollout=True too, or async_rollout_processes=0")
        return
    fix = "or set train.async_rollout=False"
    if machine is not None and machine.num_processes and machine.num_processes > 1:
        raise ConfigError(f"config.train.async_rollout=True runs one trainer process ({machine.num_processes} launched; "
                          f"several trainer processes are not built): launch one process (the rollout in a process "
                          f"of its own: train.async_rollout_processes=1) {fix}")
    if train.objective != "stepwise":
        raise ConfigError(f"config.train.async_rollout=True needs train.objective='stepwise' (train.objective="
                          f"{train.objective!r} samples with its own lagged model already) {fix}")
    estimator = get_adv_estimator(config.algorithm.adv_estimator)
    if estimator.needs_values or estimator.defines_endpoints or estimator.needs_step_rewards:
        raise ConfigError(f"config.train.async_rollout=True cannot run algorithm.adv_estimator="
                          f"{config.algorithm.adv_estimator!r} (its critic / Group-PPO design is on-policy): use "
                          f"'grpo', 'rloo' or the stat tracker {fix}")
    if train.get("sharding", "none") != "none":
        raise ConfigError(f"config.train.async_rollout=True keeps whole frozen copies of the model; train.sharding="
                          f"{train.sharding!r} shards it: set train.sharding='none' {fix}")
