"""Metrics writing: one row per epoch into metrics.jsonl and the trackers, sample grids, debug dumps
(docs/architecture.md). The run directory's files are named by ``ddpo_group.runs.run_dir``.

    log = MetricsLog(config, accelerator, run_dir)
    log.start()                                     # the trackers (tensorboard / wandb) when config.log_with
    log.epoch_row(epoch, samples, metrics, global_step, prompts)   # adds the epoch's reward statistics, writes
    log.write(metrics)                              # any other row (the final evaluation)

A row is written by the main process and flushed to disk before the next phase starts; every
process sends its numbers to the trackers (Accelerate logs from the main process only).
"""

import os
import resource
import shlex
import sys

import torch

from ddpo_group.config.registry import ConfigError, check_choice, check_positive, register_config_check
from ddpo_group.data.edit_sources import source_images
from ddpo_group.runs.grids import save_epoch_samples
from ddpo_group.runs.run_dir import write_json_atomic


LOG_WITH = ("none", "wandb", "tensorboard")


@register_config_check("run")
def check_logging(config, machine):
    """config.log_with is known and its package installed; config.log_images_every >= 0."""
    check_choice(config.log_with, LOG_WITH, "log_with")
    check_positive(config.log_images_every, "log_images_every", allow_zero=True)
    if config.log_with in ("wandb", "tensorboard"):
        import importlib.util

        package = "wandb" if config.log_with == "wandb" else "tensorboard"
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"config.log_with={config.log_with!r} needs the {package} package: pip install \"ddpo-group[{package}]\" "
                f"(or pip install {package}), or set --config.log_with=none"
            )


def phase_text(seconds):
    """'sample 6 s, train 40 s (old_log_probs 5 s of it), eval 3 s': the phases by time spent, the longest first;
    old_log_probs is a part of train (its exact pi_old pass), shown inside it, not beside it."""
    inner = seconds.get("old_log_probs")
    parts = []
    for name, value in sorted(seconds.items(), key=lambda kv: -kv[1]):
        if name == "old_log_probs" and "train" in seconds:
            continue
        nested = f" (old_log_probs {inner:.0f} s of it)" if name == "train" and inner is not None else ""
        parts.append(f"{name} {value:.0f} s{nested}")
    return ", ".join(parts)


def inspect_command():
    """The report command as it runs from where the user stands: the ddpo-group-inspect beside this Python (e.g.
    .venv/bin/ddpo-group-inspect, relative when under the working directory), else `python scripts/inspect_run.py`
    of the checkout, else the bare name (an activated environment); quoted for the shell."""
    here = os.path.dirname(sys.executable)
    script = os.path.join(here, "ddpo-group-inspect")
    if os.path.isfile(script):
        relative = os.path.relpath(script)
        return shlex.quote(relative if not relative.startswith("..") else script)
    checkout = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts", "inspect_run.py")
    if os.path.isfile(checkout):
        return shlex.join([sys.executable, os.path.relpath(checkout)])
    return "ddpo-group-inspect"


def peak_rss_mb():
    """This process's peak resident memory in MB (Linux: ru_maxrss is in kB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def flatten_config(d, prefix=""):
    """A nested config dict as {dotted.key: scalar} for the trackers (other values as str)."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(flatten_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out


class MetricsLog:
    """The metrics of one run: rows of metrics.jsonl, tracker logs, sample grids (module docstring)."""

    def __init__(self, config, accelerator, run_dir):
        self.config = config
        self.accelerator = accelerator
        self.run_dir = run_dir
        self.phase_seconds = {}  # time/<phase> summed over the rows this process wrote
        self.evals = []  # (epoch, eval reward mean) of the rows written
        self.overalls = {}  # tagged prompts (GenEval): reward -> [(epoch, eval/<reward>/overall)] of the rows written

    @property
    def tracking(self):
        return self.config.log_with != "none"

    def start(self):
        """Start the trackers (config.log_with) with the run's flattened config; wandb runs are named after the run."""
        if self.tracking:
            self.accelerator.init_trackers(
                self.config.project_name,
                config=flatten_config(self.config.to_dict()),
                init_kwargs={"wandb": {"name": os.path.basename(self.run_dir.path), "dir": self.run_dir.path}},
            )

    def write(self, metrics):
        """Append one row to metrics.jsonl (main process, flushed to disk) and send its numbers to the trackers."""
        if self.accelerator.is_main_process:
            self.run_dir.append_metrics(metrics)
        for key, value in metrics.items():
            if key.startswith("time/"):
                self.phase_seconds[key[5:]] = self.phase_seconds.get(key[5:], 0.0) + value
        if "eval/reward_mean" in metrics:
            self.evals.append((metrics["epoch"], metrics["eval/reward_mean"]))
        for key, value in metrics.items():
            if key.startswith("eval/") and key.endswith("/overall"):
                self.overalls.setdefault(key[len("eval/"):-len("/overall")], []).append((metrics["epoch"], value))
        if self.tracking:
            self.accelerator.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=metrics["epoch"])
            self._log_grids(metrics)

    def _log_grids(self, metrics):
        """The row's grids (samples/grid, eval/grid: PNG paths in the run directory) as tracker images at its epoch."""
        grids = {key: path for key, path in metrics.items() if key.endswith("/grid") and isinstance(path, str)}
        if not grids or not self.accelerator.is_main_process:
            return
        import numpy as np
        from PIL import Image

        for key, path in grids.items():
            with Image.open(os.path.join(self.run_dir.path, path)) as image:
                pixels = np.asarray(image.convert("RGB"))
            for tracker in self.accelerator.trackers:
                if tracker.name == "tensorboard":
                    tracker.log_images({key: pixels[None]}, step=metrics["epoch"], dataformats="NHWC")
                elif hasattr(tracker, "log_images"):
                    tracker.log_images({key: [pixels]}, step=metrics["epoch"])

    def epoch_row(self, epoch, samples, metrics, global_step, prompts, audio_sample_rate=None):
        """The epoch's row: reward statistics of the gathered batch, memory, a sample grid every
        config.log_images_every epochs (samples/*.png with rewards and mean advantages; a family with sound: each
        sample's WAV at `audio_sample_rate`), then `write`."""
        config, acc = self.config, self.accelerator
        gathered = samples.gathered
        rewards = gathered.rewards
        metrics.update(
            epoch=epoch,
            global_step=global_step,
            num_processes=acc.num_processes,
            num_samples=int(rewards.numel()),
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std(unbiased=False)),
            peak_rss_mb=peak_rss_mb(),
        )
        for name, values in gathered.components.items():
            metrics[f"reward/{name}"] = float(values.mean())
        if torch.cuda.is_available():
            metrics["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
        log_images = config.log_images_every and epoch % config.log_images_every == 0
        images = acc.gather(samples.images.float().contiguous()) if log_images else None
        audio = acc.gather(samples.audio.float().contiguous()) if log_images and samples.audio is not None else None
        if acc.is_main_process and log_images:
            mask = gathered.mask
            adv = (gathered.advantages * mask).sum(1) / mask.sum(1).clamp(min=1)
            records = [prompts[int(i)] for i in gathered.prompt_ids.tolist()]
            grid = save_epoch_samples(
                self.run_dir.path, epoch, images.cpu(), [record.prompt for record in records],
                rewards.cpu().numpy(), adv.cpu().numpy(), config.sample.group_size,
                sources=source_images(records),  # an editing run's grid: source -> edited (None otherwise)
                audio=None if audio is None else audio.cpu(), audio_sample_rate=audio_sample_rate,
            )
            metrics["samples/grid"] = os.path.relpath(grid, self.run_dir.path)
        self.write(metrics)

    def summary(self, epoch, seconds, checkpoint):
        """The lines the console ends a run with: epochs and wall time by phase, start / best / final evaluation,
        where the run directory, report and trained weights are, and the commands to inspect, compare, resume."""
        path, config = self.run_dir.path, self.config
        phases = phase_text(self.phase_seconds)
        lines = [f"run ended at epoch {epoch} of {config.num_epochs} after {seconds:.0f} s" + (f" ({phases})" if phases else "")]
        def trend(label, evals):
            (first_epoch, first), (last_epoch, last) = evals[0], evals[-1]
            best_epoch, best = max(evals, key=lambda pair: pair[1])
            return (f"{label}: {first:.4f} (epoch {first_epoch}) -> {last:.4f} (epoch {last_epoch}); "
                    f"best {best:.4f} (epoch {best_epoch})")

        if self.evals:  # with tagged prompts the reward's mean is its partial score; the overall is GenEval's number
            lines.append(trend("eval reward" + (" (the reward's mean: GenEval's partial score)" if self.overalls
                                                 else ""), self.evals))
        for reward, evals in self.overalls.items():
            label = f"eval {reward} overall (GenEval's score of the held-out prompts, eval/{reward}/overall)"
            lines.append(trend(label, evals))
        weights = "lora" if config.use_lora else "the trained model"
        quoted = shlex.quote(path)  # the commands paste into a shell whole, whatever the path holds
        lines += [
            f"run directory: {path}" + (f"; {weights} in {checkpoint}" if checkpoint else ""),
            f"report:  {inspect_command()} {quoted}   # writes {os.path.join(path, 'report.html')}",
            f"compare: {inspect_command()} {quoted} --compare OTHER_RUN_DIR --names A,B",
            f"resume:  --config.resume_from={quoted} --config.num_epochs=N",
        ]
        return lines

    def dump_debug(self, epoch, samples):
        """debug/epoch_XXXX_rankR.json: this process's rewards, components, prompt ids, mask and advantages (and the
        step rewards of an estimator that needs_step_rewards)."""
        rank = self.accelerator.process_index
        path = self.run_dir.debug_path(epoch, rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json_atomic(path, {
            "rank": rank,
            "rewards": samples.rewards.tolist(),
            "components": {name: values.tolist() for name, values in samples.components.items()},
            "prompt_ids": samples.prompt_ids.tolist(),
            "mask": samples.mask.tolist(),
            "advantages": samples.advantages.tolist(),
            **({"step_rewards": samples.step_rewards.tolist()} if samples.step_rewards is not None else {}),
        })
