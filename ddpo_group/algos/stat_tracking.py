"""Per-prompt reward statistics: DDPO's history-aware, group-aware form of GRPO (docs/design.md §3).

    tracker = PerPromptStatTracker(buffer_size=32, min_count=16, norm_by_std=True, eps=1e-6)
    advantages = tracker.update(prompts, rewards)   # (B,) numpy array

For each distinct prompt of the batch, its rewards are appended to a per-prompt buffer
that keeps the latest `buffer_size` values (None: all of them). If that buffer then holds
fewer than `min_count` values, the prompt's samples are normalised with the mean and
population std of the whole batch (the fallback); otherwise with its buffer's:

    A_i = (r_i - mean) / (std + eps)      (norm_by_std=True)
    A_i =  r_i - mean                     (norm_by_std=False)

In a multi-process run, call `update` with the batch gathered from all processes (every
process then computes the same advantages), never with a local slice.
"""

import math
import numbers
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ddpo_group.algos import advantages as adv_lib
from ddpo_group.config.registry import ConfigError, check_positive, register_config_check

__all__ = ["PerPromptStatTracker"]


class PerPromptStatTracker:
    """Per-prompt reward buffers and advantages.

    Args:
        buffer_size: rewards kept per prompt (the latest ones); None keeps all.
        min_count: a prompt's buffer is used once it holds at least this many rewards;
            before that, the batch's statistics are used.
        norm_by_std: divide by the std (DDPO, GRPO) or only subtract the mean (Dr.GRPO).
        eps: added to the std.
    """

    def __init__(
        self,
        buffer_size: int | None = 32,
        min_count: int = 16,
        norm_by_std: bool = True,
        eps: float = 1e-6,
    ):
        integral = isinstance(buffer_size, numbers.Integral) and not isinstance(buffer_size, bool)
        if buffer_size is not None and not (integral and buffer_size >= 1):
            raise ValueError(f"buffer_size must be a positive integer or None (unbounded), got {buffer_size!r}")
        if not isinstance(min_count, numbers.Integral) or isinstance(min_count, bool) or min_count < 0:
            raise ValueError(f"min_count must be an integer >= 0, got {min_count!r}")
        if buffer_size is not None and min_count > buffer_size:
            raise ValueError(
                f"min_count ({min_count}) > buffer_size ({buffer_size}): the buffer could never be used; "
                "lower min_count or raise buffer_size"
            )
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        self.buffer_size = None if buffer_size is None else int(buffer_size)
        self.min_count = int(min_count)
        self.norm_by_std = bool(norm_by_std)
        self.eps = float(eps)
        self.buffers: dict[str, deque] = {}
        self._last_stats: dict[str, float] = {}

    def update(self, prompts: Sequence[str], rewards: Any) -> np.ndarray:
        """Add a batch and return its advantages.

        Args:
            prompts: B prompt strings (the group keys).
            rewards: (B,) finite rewards, numpy array, torch tensor or list.

        Returns:
            (B,) numpy array of advantages, float32 for float32 rewards, else float64.
        """
        rewards = self._rewards_array(rewards)
        prompts = self._prompt_list(prompts, len(rewards))
        out_dtype = rewards.dtype if rewards.dtype in (np.float32, np.float64) else np.float64
        rewards = rewards.astype(np.float64)

        batch_mean = rewards.mean()
        batch_std = rewards.std()
        advantages = np.empty(len(rewards), dtype=np.float64)
        group_stds = []
        num_fallback = 0
        groups: dict[str, list[int]] = {}
        for index, prompt in enumerate(prompts):
            groups.setdefault(prompt, []).append(index)
        for prompt, indices in groups.items():
            group_rewards = rewards[indices]
            group_stds.append(group_rewards.std())
            buffer = self.buffers.setdefault(prompt, deque(maxlen=self.buffer_size))
            buffer.extend(group_rewards.tolist())
            if len(buffer) < self.min_count:
                mean, std = batch_mean, batch_std
                num_fallback += len(indices)
            else:
                history = np.asarray(buffer, dtype=np.float64)
                mean, std = history.mean(), history.std()
            centred = group_rewards - mean
            advantages[indices] = centred / (std + self.eps) if self.norm_by_std else centred

        self._last_stats = {
            "num_prompts": len(groups),
            "mean_group_size": len(rewards) / len(groups),
            "mean_group_std": float(np.mean(group_stds)),
            "fallback_fraction": num_fallback / len(rewards),
        }
        return advantages.astype(out_dtype)

    def get_stats(self) -> dict[str, float]:
        """Summary of the last batch (zeros before the first), plus the tracker's size.

        num_prompts: distinct prompts in the batch; mean_group_size: samples per prompt;
        mean_group_std: mean over the batch's prompts of their within-batch population
        std of rewards; fallback_fraction: fraction of samples normalised with the batch
        statistics (buffer below min_count); num_tracked_prompts: prompts with a buffer;
        mean_buffer_count: mean number of rewards per buffer.
        """
        stats = {"num_prompts": 0, "mean_group_size": 0.0, "mean_group_std": 0.0, "fallback_fraction": 0.0}
        stats.update(self._last_stats)
        stats["num_tracked_prompts"] = len(self.buffers)
        stats["mean_buffer_count"] = (
            float(np.mean([len(b) for b in self.buffers.values()])) if self.buffers else 0.0
        )
        return stats

    @property
    def group_stats(self) -> dict[str, dict[str, float]]:
        """{prompt: {"count", "mean", "std", "uses_buffer"}} from each prompt's buffer.

        std is the population std; uses_buffer is whether count >= min_count.
        """
        stats = {}
        for prompt, buffer in self.buffers.items():
            history = np.asarray(buffer, dtype=np.float64)
            stats[prompt] = {
                "count": len(history),
                "mean": float(history.mean()),
                "std": float(history.std()),
                "uses_buffer": len(history) >= self.min_count,
            }
        return stats

    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable state: the settings and every buffer (oldest first)."""
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "norm_by_std": self.norm_by_std,
            "eps": self.eps,
            "buffers": {prompt: [float(r) for r in buffer] for prompt, buffer in self.buffers.items()},
            "last_stats": dict(self._last_stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the buffers of `state_dict()`.

        The settings of this tracker (from the run's config) are kept; a buffer longer than
        this tracker's buffer_size keeps its latest values.
        """
        if not isinstance(state, dict) or not isinstance(state.get("buffers"), dict):
            raise ValueError("state must be a dict from PerPromptStatTracker.state_dict() with a 'buffers' dict")
        buffers = {}
        for prompt, values in state["buffers"].items():
            if not isinstance(prompt, str):
                raise ValueError(f"state['buffers'] keys must be prompt strings, got {prompt!r}")
            values = np.asarray(values, dtype=np.float64)
            if values.ndim != 1 or not np.isfinite(values).all():
                raise ValueError(f"state['buffers'][{prompt!r}] must be a list of finite numbers")
            buffers[prompt] = deque(values.tolist(), maxlen=self.buffer_size)
        self.buffers = buffers
        self._last_stats = dict(state.get("last_stats", {}))

    def clear(self) -> None:
        """Forget every buffer and the last batch's statistics."""
        self.buffers = {}
        self._last_stats = {}

    @staticmethod
    def _rewards_array(rewards: Any) -> np.ndarray:
        if hasattr(rewards, "detach"):  # torch tensor
            rewards = rewards.detach().cpu().numpy()
        rewards = np.asarray(rewards)
        if rewards.ndim != 1:
            raise ValueError(f"rewards must have shape (B,), got {rewards.shape}")
        if len(rewards) == 0:
            raise ValueError("rewards is empty; update needs at least one sample")
        if not (np.issubdtype(rewards.dtype, np.floating) or np.issubdtype(rewards.dtype, np.integer)):
            raise ValueError(f"rewards must be numbers, got dtype {rewards.dtype}")
        if not np.isfinite(rewards).all():
            bad = np.flatnonzero(~np.isfinite(rewards)).tolist()
            raise ValueError(f"rewards contains NaN or inf at indices {bad}; every reward must be finite")
        return rewards

    @staticmethod
    def _prompt_list(prompts: Sequence[str], batch_size: int) -> list[str]:
        if isinstance(prompts, str):
            raise ValueError("prompts must be a sequence of B strings, got a single string")
        prompts = list(prompts)
        if len(prompts) != batch_size:
            raise ValueError(f"prompts has {len(prompts)} entries but rewards has {batch_size}; they must match")
        for prompt in prompts:
            if not isinstance(prompt, str):
                raise ValueError(f"prompts must be strings (the group keys), got {type(prompt).__name__}")
        return [str(p) for p in prompts]


@adv_lib.register_adv_est("ddpo", uses_tracker=True)
def ddpo_estimator(
    *,
    rewards=None,
    prompt_ids=None,
    mask,
    token_level_rewards=None,
    values=None,
    config=None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DDPO's per-prompt advantages from a history-aware tracker, broadcast over the steps.

    A_i = tracker.update(prompts, rewards)[i] (``PerPromptStatTracker``: the prompt's buffer
    statistics, or the batch's while the buffer holds fewer than min_count rewards);
    A[i, t] = A_i * mask[i, t]; returns = advantages. Options: ``tracker`` (required, it keeps
    state across batches) and ``prompts`` (B keys; default: the prompt ids as strings).
    """
    tracker = adv_lib._require(options.get("tracker"), "tracker (a PerPromptStatTracker)", "ddpo")
    mask = adv_lib._check_mask(mask)
    rewards = adv_lib._check_rewards(adv_lib._require(adv_lib._outcome_rewards(rewards, token_level_rewards, mask), "rewards", "ddpo"), mask.shape[0])
    prompts = options.get("prompts")
    if prompts is None:
        prompts = [str(int(i)) for i in torch.as_tensor(adv_lib._require(prompt_ids, "prompt_ids", "ddpo")).tolist()]
    per_sample = tracker.update(list(prompts), rewards.detach().cpu().numpy())
    dtype = adv_lib._float_dtype(rewards, mask)
    advantages = torch.as_tensor(per_sample, dtype=dtype, device=mask.device)[:, None] * mask.to(dtype)
    return advantages, advantages.clone()


@register_config_check("advantages")
def check_stat_tracking(config, machine):
    """config.per_prompt_stat_tracking: sizes >= 0, and a bounded buffer can reach min_count."""
    tracking = config.per_prompt_stat_tracking
    check_positive(tracking.buffer_size, "per_prompt_stat_tracking.buffer_size", allow_zero=True)
    check_positive(tracking.min_count, "per_prompt_stat_tracking.min_count", allow_zero=True)
    if tracking.buffer_size and tracking.min_count > tracking.buffer_size:
        raise ConfigError(
            f"config.per_prompt_stat_tracking.min_count={tracking.min_count} exceeds buffer_size="
            f"{tracking.buffer_size}: the buffer could never be used; lower min_count or raise buffer_size (0: unbounded)"
        )
