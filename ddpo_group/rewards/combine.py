"""Combined rewards: several components, validated, weighted; and the asynchronous runner.

    total_i = sum_k w_k * r_k,i          (rewards of sample i, components k)

`reward_aggregation` tells the trainer how to turn components into advantages:
"sum_then_normalize" (Flow-GRPO: the advantage estimator sees `total`) or
"normalize_then_sum" (MixGRPO: one group advantage per component, then the weighted sum
of those). This module only provides `total` and the per-component rewards.

A group-wise component (`register_reward(name, group_wise=True)`, rewards/base.py) is called once per
prompt group with the whole group, whatever `batch_size`; per-image components are called on chunks of
`batch_size`. `CombinedReward(..., only="per_image" | "group_wise")` runs one kind alone: the rollout
scores the per-image components batch by batch and the group-wise ones once a group is complete.
"""

from __future__ import annotations

import concurrent.futures
import copy
import math
import queue
import threading
import time
import urllib.parse
from typing import Callable

import numpy as np
import torch

from ddpo_group.rewards.base import frame_indices, is_video_reward


from ddpo_group.rewards.base import is_group_wise
from ddpo_group.rewards.registry import (
    RewardError,
    RewardNotReadyError,
    component_name,
    get_reward,
    wants_device_tensors,
)

REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
REWARD_KINDS = ("per_image", "group_wise")


def _prompt_list(prompts, limit: int = 3) -> str:
    shown = ", ".join(repr(p) for p in prompts[:limit])
    return shown + (", ..." if len(prompts) > limit else "")


def validate_rewards(rewards, name: str, prompts, offset: int = 0, indices=None) -> np.ndarray:
    """`rewards` as a float64 array of shape (B,) with B = len(prompts), all finite.

    Otherwise RewardError naming the reward `name`, the sample index (offset + i, or indices[i] when the
    B samples are not contiguous: a prompt group) and its prompt.
    """
    batch = len(prompts)
    number = (lambda i: int(indices[i])) if indices is not None else (lambda i: offset + i)  # noqa: E731
    span = _span(indices) if indices is not None else f"{offset}..{offset + batch - 1}"
    given = type(rewards).__name__
    try:
        if isinstance(rewards, torch.Tensor):
            rewards = rewards.detach()
            rewards = (rewards.to(torch.float64) if rewards.is_floating_point() else rewards).cpu().numpy()
        raw = np.asarray(rewards)
        kind = raw.dtype.kind
        integers = kind in "iu" or (kind == "O" and all(isinstance(v, (int, np.integer)) for v in raw.ravel()))
        if kind == "c":
            raise TypeError(f"complex values ({raw.dtype}) would lose their imaginary part")
        if integers and raw.size and max(abs(int(v)) for v in raw.ravel()) > 2**53:
            raise TypeError("integers above 2**53 would be rounded in float64; return floats, rescaled")
        if kind not in "biuf" and not integers:  # strings, objects, dates: not numbers, even when float() parses them
            raise TypeError(f"values of dtype {raw.dtype}, not numbers")
        array = raw.astype(np.float64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise RewardError(
            f"reward {name!r} returned {given} that is not an array of numbers "
            f"({exc}) for prompts {_prompt_list(prompts)} (samples {span})",
            reward=name,
        ) from exc
    if array.shape != (batch,):
        raise RewardError(
            f"reward {name!r} returned shape {tuple(array.shape)} for a batch of {batch} images; "
            f"expected ({batch},) (prompts {_prompt_list(prompts)}, samples {span})",
            reward=name,
        )
    bad = np.flatnonzero(~np.isfinite(array))
    too_big = np.flatnonzero(np.isfinite(array) & (np.abs(array) > np.finfo(np.float32).max))
    if too_big.size and not bad.size:
        i = int(too_big[0])
        raise RewardError(
            f"reward {name!r} returned {array[i]:.3g} for sample {number(i)} (prompt {prompts[i]!r}), which does not "
            f"fit in float32 (|r| <= {np.finfo(np.float32).max:.3g}); rescale the reward",
            reward=name, index=number(i), prompt=prompts[i],
        )
    if bad.size:
        i = int(bad[0])
        raise RewardError(
            f"reward {name!r} returned {array[i]} for sample {number(i)} (prompt {prompts[i]!r}); "
            f"rewards must be finite ({bad.size} non-finite value(s) in the batch)",
            reward=name, index=number(i), prompt=prompts[i],
        )
    return array


def _span(rows) -> str:
    rows = [int(i) for i in rows]
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return f"{rows[0]}..{rows[-1]}"
    return ", ".join(map(str, rows[:4])) + (", ..." if len(rows) > 4 else "")


def info_metrics(infos):
    """The numbers of reward info dicts ({"<reward>/<key>": value}, one dict per batch) as
    reward_info/<reward>/<key>: the mean of its values (a scalar, or per-sample numbers) over the batches.
    Values that are not real numbers (strings, nested dicts, complex, non-finite) are left out."""
    values = {}
    for info in infos:
        for key, value in (info or {}).items():
            if torch.is_tensor(value):
                value = value.detach()
                value = (value.double() if value.is_floating_point() else value).cpu().numpy()
            try:
                array = np.asarray(value)
            except (TypeError, ValueError):
                continue
            if array.size and array.dtype.kind in "biuf" and np.isfinite(array.astype(np.float64)).all():
                values.setdefault(key, []).extend(array.astype(np.float64).ravel().tolist())
    return {f"reward_info/{key}": float(np.mean(v)) for key, v in values.items()}


class CombinedReward:
    """Calls each component on a batch and returns (total, components, info).

    components: {name: fn(images, prompts, metadata) -> (rewards (B,), info)};
    frames: for videos (B, F, 3, H, W), the evenly spaced frames an image component scores per video, its reward
    weights: {name: w}; batch_size: per-image components are called on chunks of at most this many
    images (None: the whole batch), group-wise ones on whole groups; workers: threads that run the
    (component, chunk or group) calls.
    frames: for videos (B, F, 3, H, W), the evenly spaced frames an image component scores per video, its reward
    the mean over them (0: every frame); a video component (``is_video_reward``) gets the videos (rewards/base.py).
    """

    def __init__(self, components: dict[str, Callable], weights: dict[str, float] | None = None,
                 workers: int = 1, batch_size: int | None = None,
                 aggregation: str = "sum_then_normalize", frames: int = 4):
        if not components:
            raise ValueError("CombinedReward: at least one reward component is needed")
        weights = {name: 1.0 for name in components} if weights is None else dict(weights)
        if set(weights) != set(components):
            raise ValueError(f"CombinedReward: weights keys {sorted(weights)} != components {sorted(components)}")
        if aggregation not in REWARD_AGGREGATIONS:
            raise ValueError(f"reward_aggregation must be one of {REWARD_AGGREGATIONS}, got {aggregation!r}")
        if int(workers) < 1:
            raise ValueError(f"reward_workers must be >= 1, got {workers}")
        if batch_size is not None and int(batch_size) < 1:
            raise ValueError(f"reward_batch_size must be >= 1 or None, got {batch_size}")
        if int(frames) != frames or frames < 0:
            raise ValueError(f"reward_frames must be an integer >= 0 (0: every frame of a video), got {frames}")
        self.frames = int(frames)
        self.components = dict(components)
        self.video_components = [name for name, fn in components.items() if is_video_reward(fn)]
        self.weights = {name: float(w) for name, w in weights.items()}
        self.names = list(self.components)
        # components called on whole prompt groups (register_reward(..., group_wise=True)), in `names` order
        self.group_wise_names = [name for name in self.names if is_group_wise(self.components[name])]
        self.workers = int(workers)
        self.batch_size = batch_size
        self.aggregation = aggregation
        self._executor = None
        self._executor_lock = threading.Lock()  # AsyncRewardRunner may call from several threads

    def check_ready(self) -> None:
        """Load every component's model now (before sampling); RewardNotReadyError if one cannot."""
        for name, fn in self.components.items():
            check = getattr(fn, "check_ready", None)
            if check is None:
                continue
            try:
                check()
            except RewardNotReadyError:
                raise
            except Exception as exc:
                raise RewardNotReadyError(f"reward {name!r} is not ready: {type(exc).__name__}: {exc}",
                                          reward=name) from exc

    def _locate_failure(self, fn, images, prompts, metadata) -> int | None:
        # Error path only: score each sample alone to name the one that fails.
        for i in range(len(prompts)):
            try:
                fn(images[i : i + 1], prompts[i : i + 1], metadata[i : i + 1])
            except Exception:
                return i
        return None

    def _call(self, name, fn, images, prompts, metadata, rows):
        # `images` is this call's own copy (__call__): float32 on the CPU, or on the device when the reward asked;
        # rows: the sample indices of the call (a contiguous chunk, or a prompt group's members)
        group = name in self.group_wise_names
        try:
            output = fn(images, prompts, metadata)
        except RewardError:
            raise
        except (SystemExit, KeyboardInterrupt) as exc:  # raised by the reward itself (a worker thread), not by the user
            detail = f"{type(exc).__name__}({', '.join(map(repr, exc.args))})"
            raise RewardError(
                f"reward {name!r} tried to end the process with {detail} (prompts {_prompt_list(prompts)}); a reward "
                "returns (rewards, info) or raises an exception, it must not exit",
                reward=name,
            ) from exc
        except Exception as exc:
            index = 0 if len(prompts) == 1 else None
            # a group-wise reward is not scored sample by sample: the failure is the group's
            if index is None and not group and getattr(fn, "locate_errors", True):
                index = self._locate_failure(fn, images, prompts, metadata)
            if index is None:
                what = "prompt group" if group else "batch"
                where = (f"on the {what} of samples {_span(rows)} "
                         f"(prompts {_prompt_list(prompts)})")
                raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc} {where}",
                                  reward=name) from exc
            raise RewardError(
                f"reward {name!r} raised {type(exc).__name__}: {exc} on sample {rows[index]} "
                f"(prompt {prompts[index]!r})",
                reward=name, index=int(rows[index]), prompt=prompts[index],
            ) from exc
        if not (isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], dict)):
            raise RewardError(
                f"reward {name!r} must return a tuple (rewards, info dict), got {type(output).__name__} "
                f"(prompts {_prompt_list(prompts)})",
                reward=name,
            )
        return validate_rewards(output[0], name, prompts, indices=rows), output[1]

    def _call_frames(self, name, fn, videos, prompts, metadata, rows):
        """An image reward on videos (b, F, 3, H, W): its rewards of `self.frames` evenly spaced frames per video
        (one call on b * k images, a video's frames consecutive, its prompt and metadata repeated), averaged per
        video: (b,) float64, and the info of that call."""
        index = frame_indices(videos.shape[1], self.frames)
        k = len(index)
        frames = videos[:, index].reshape(-1, *videos.shape[2:])
        rewards, info = self._call(name, fn, frames, [p for p in prompts for _ in range(k)],
                                   [m for m in metadata for _ in range(k)], np.repeat(np.asarray(rows), k))
        return rewards.reshape(-1, k).mean(axis=1), info

    def check_images(self, video: bool, field: str = "reward_fn") -> None:
        """ValueError naming `field` when a video reward would be given images (`video` False: an image model)."""
        if self.video_components and not video:
            raise ValueError(
                f"config.{field}: reward {self.video_components[0]!r} scores videos (registered with video=True) and "
                "this model makes images; use an image reward, or a video model such as Wan"
            )

    def __call__(self, images, prompts, metadata=None, groups=None, only=None):
        """images (B, 3, H, W) in [0, 1] or videos (B, F, 3, H, W), B prompts, B metadata dicts (None: empty
        dicts) -> (total (B,) float64, {name: (B,) float64}, info {"<name>/<key>": value}). On videos an image
        component scores `frames` frames per video and gets their mean; a video component the whole videos.

        groups: B hashable keys, one group per distinct key, for the group-wise components (None: samples with
        equal prompts are one group). only: "per_image" or "group_wise" runs that kind of component alone (the
        components dict and total then hold those only); None runs all."""
        images = torch.as_tensor(images) if not isinstance(images, torch.Tensor) else images
        video = images.ndim == 5
        if images.ndim not in (4, 5) or images.shape[-3] != 3:
            raise ValueError(f"images must have shape (B, 3, H, W) or videos (B, F, 3, H, W), got {tuple(images.shape)}")
        self.check_images(video)
        batch = images.shape[0]
        prompts = list(prompts)
        metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        if len(prompts) != batch or len(metadata) != batch:
            raise ValueError(
                f"got {batch} images, {len(prompts)} prompts and {len(metadata)} metadata dicts; "
                f"they must be equal"
            )
        if only not in (None,) + REWARD_KINDS:
            raise ValueError(f"only must be None or one of {REWARD_KINDS}, got {only!r}")
        keys = prompts if groups is None else list(groups)
        if len(keys) != batch:
            raise ValueError(f"got {len(keys)} group keys for {batch} images; give one per image")
        names = [name for name in self.names
                 if only is None or (name in self.group_wise_names) == (only == "group_wise")]
        step = max(batch if self.batch_size is None else int(self.batch_size), 1)
        chunks = [np.arange(start, min(start + step, batch)) for start in range(0, batch, step)]
        members = {}
        for index, key in enumerate(keys):  # groups in the order of their first sample
            members.setdefault(key, []).append(index)
        whole_groups = [np.asarray(rows) for rows in members.values()]
        calls = [(name, rows) for name in names
                 for rows in (whole_groups if name in self.group_wise_names else chunks)]

        # every reward gets its own copy (registry docstring): moved to the CPU once (float32, or float64 when
        # given float64), cloned per call; a reward that asked for device tensors gets a clone of the original.
        # Prompts and metadata too: a reward that edits them in place changes nothing another call, a later
        # epoch or the evaluation sees (the metadata dicts are the prompt records' own).
        on_host = images.detach().to("cpu", torch.promote_types(images.dtype, torch.float32))

        def run(call):
            name, rows = call
            fn = self.components[name]
            source = images.detach() if wants_device_tensors(fn) else on_host
            if len(rows) and rows[-1] - rows[0] == len(rows) - 1:  # contiguous: a slice's clone
                own = source[int(rows[0]) : int(rows[-1]) + 1].clone()
            else:  # a group spread over the batch: indexing copies
                own = source[torch.as_tensor(rows, device=source.device)]
            own_prompts = [prompts[i] for i in rows]
            own_metadata = copy.deepcopy([metadata[i] for i in rows])
            if video and not is_video_reward(fn):
                return self._call_frames(name, fn, own, own_prompts, own_metadata, rows)
            return self._call(name, fn, own, own_prompts, own_metadata, rows)

        if self.workers > 1 and len(calls) > 1:
            with self._executor_lock:
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(self.workers, "reward")
            results = list(self._executor.map(run, calls))
        else:
            results = [run(call) for call in calls]

        components = {name: np.zeros(batch, dtype=np.float64) for name in names}
        info = {}
        for (name, rows), (rewards, component_info) in zip(calls, results):
            components[name][rows] = rewards
            for key, value in component_info.items():
                key = f"{name}/{key}"
                if key in info:  # chunked call: concatenate per-sample values, keep the first scalar
                    if isinstance(value, (list, np.ndarray, torch.Tensor)) and np.ndim(value) > 0:
                        info[key] = np.concatenate([np.asarray(info[key]), np.asarray(value)])
                else:
                    info[key] = value
        total = self.weighted_total(components, prompts)
        return total, components, info

    def weighted_total(self, components, prompts=None) -> np.ndarray:
        """sum_k w_k * components[k] over the components given (in the order of `names`), (B,) float64;
        validated (finite, fits float32) when it sums more than one component."""
        present = [name for name in self.names if name in components]
        total = np.zeros(len(components[present[0]]) if present else 0, dtype=np.float64)
        for name in present:
            total = total + self.weights[name] * np.asarray(components[name], dtype=np.float64)
        if len(present) > 1:
            prompts = [""] * len(total) if prompts is None else prompts
            validate_rewards(total, "the weighted sum of " + "+".join(present), prompts)
        return total

    def close(self) -> None:
        """Stop the worker threads (a later call starts new ones)."""
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def _component_names(served: dict[str, str | None]) -> dict[str, str]:
    """{spec: name}: the served name of a remote reward (`served[spec]`) or the spec's short name; when two
    collide, a remote's served name @host:port, else the full spec."""
    short = {spec: served[spec] or component_name(spec) for spec in served}
    names = {}
    for spec, name in short.items():
        if list(short.values()).count(name) > 1:
            name = spec
            if served[spec]:
                at = f"{served[spec]}@{urllib.parse.urlsplit(spec).netloc}"
                name = at if sum(f"{served[s]}@{urllib.parse.urlsplit(s).netloc}" == at for s in served) == 1 else spec
        names[spec] = name
    return names


def build_reward_fn(reward_fn: str | None = None, reward_weights: dict[str, float] | None = None,
                    reward_workers: int = 1, reward_kwargs: dict[str, dict] | None = None,
                    reward_aggregation: str = "sum_then_normalize", reward_batch_size: int | None = None,
                    device=None, reward_frames: int = 4) -> CombinedReward:
    """CombinedReward from config values.

    reward_fn: one reward spec (registry name, "module:function", "file.py:function",
    "http://host:port"), weight 1. reward_weights: {spec: weight} for several components
    (when non-empty it replaces reward_fn, which may then be None). reward_kwargs:
    {spec: {keyword: value}} passed to that component's constructor (e.g.
    {"aesthetic": {"mlp_weights": "/path.pth"}}, {"http://h:p": {"timeout": 30}}). device: passed
    to components whose constructor takes `device`. reward_frames: the frames an image reward scores per video.
    Component names (logged as reward/<name>) are the specs' short names (`component_name`; for a remote
    reward the name its server serves), or the full spec when two short names collide.
    """
    if hasattr(reward_weights, "to_dict"):  # ml_collections.ConfigDict
        reward_weights = reward_weights.to_dict()
    if hasattr(reward_kwargs, "to_dict"):
        reward_kwargs = reward_kwargs.to_dict()
    if reward_weights:
        weights = dict(reward_weights)
    elif reward_fn:
        weights = {reward_fn: 1.0}
    else:
        raise ValueError("set reward_fn (config: reward_fn) or reward_weights (config: reward_weights)")
    for spec, weight in weights.items():
        if not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"reward_weights[{spec!r}] must be a finite number, got {weight!r}")
    reward_kwargs = dict(reward_kwargs or {})
    unknown = set(reward_kwargs) - set(weights)
    if unknown:
        raise ValueError(f"reward_kwargs keys {sorted(unknown)} are not rewards in use ({sorted(weights)})")

    for spec, kwargs in reward_kwargs.items():
        if not isinstance(kwargs, dict):
            raise ValueError(f"reward_kwargs[{spec!r}] must be a mapping of keyword arguments, such as "
                             f"{{{spec!r}: {{\"name\": value}}}}, got {kwargs!r}")
    built = {}
    for spec in weights:
        try:
            built[spec] = get_reward(spec, device=device, **reward_kwargs.get(spec, {}))
        except TypeError as err:
            if spec not in reward_kwargs:
                raise
            raise ValueError(f"reward_kwargs[{spec!r}]: {' '.join(str(err).split())}") from None
    names = _component_names({spec: getattr(fn, "served_name", None) for spec, fn in built.items()})
    components = {names[spec]: fn for spec, fn in built.items()}
    return CombinedReward(
        components,
        {names[spec]: weight for spec, weight in weights.items()},
        workers=reward_workers,
        batch_size=reward_batch_size,
        aggregation=reward_aggregation,
        frames=reward_frames,
    )


class AsyncRewardRunner:
    """Runs a reward in worker threads so that sampling continues while images are scored.

        runner = AsyncRewardRunner(reward_fn, workers=2)
        future = runner.submit(images, prompts, metadata)   # returns at once
        ...                                                 # sample the next batch
        result = runner.result(future, timeout=600)         # reward_fn's return value, or RewardError

    `images` is detached (not copied to another device); prompts / metadata are copied
    into new lists, so the caller may reuse its own. The workers are daemon threads: a reward
    that never returns cannot keep the process alive once the run has given up on it.
    """

    def __init__(self, reward_fn: Callable, workers: int = 1):
        if int(workers) < 1:
            raise ValueError(f"reward_workers must be >= 1, got {workers}")
        self.reward_fn = reward_fn
        self.workers = int(workers)
        self._queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._work, name=f"reward_{i}", daemon=True) for i in range(self.workers)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.reward_fn(*args, **kwargs))
            except BaseException as exc:  # delivered to the caller of result()
                future.set_exception(exc)

    def submit(self, images, prompts, metadata=None, **kwargs) -> concurrent.futures.Future:
        """Queue reward_fn(images, prompts, metadata, **kwargs) (kwargs: e.g. CombinedReward's groups, only)."""
        if isinstance(images, torch.Tensor):
            images = images.detach()
        prompts = list(prompts)
        metadata = [{} for _ in prompts] if metadata is None else [dict(m) for m in metadata]
        future = concurrent.futures.Future()
        self._queue.put((future, (images, prompts, metadata), kwargs))
        return future

    def result(self, future: concurrent.futures.Future, timeout: float | None = None):
        """The reward of a submitted batch; RewardError naming the reward when it takes longer than `timeout` s."""
        try:
            return future.result(timeout=timeout or None)
        except concurrent.futures.TimeoutError as exc:
            raise self.timeout_error(timeout) from exc

    def result_or_stop(self, future: concurrent.futures.Future, timeout: float | None, should_stop: Callable):
        """`result`, asking `should_stop()` every 0.2 s while it waits: None when it says True (a stop signal
        need not wait for a reward that may never return; the worker thread is a daemon)."""
        deadline = time.monotonic() + timeout if timeout else None
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise self.timeout_error(timeout)
            done, _ = concurrent.futures.wait([future], timeout=0.2 if left is None else min(left, 0.2))
            if done:
                return future.result()
            if should_stop():
                return None

    def timeout_error(self, timeout: float) -> RewardError:
        """The RewardError of a reward that did not return within `timeout` s, naming it and the field."""
        names = getattr(self.reward_fn, "names", None) or [getattr(self.reward_fn, "__name__", "reward")]
        return RewardError(
            f"reward {'+'.join(names)!r} did not return within reward_timeout={timeout:g} s; fix the reward, or "
            "raise config.reward_timeout (0: no limit)",
            reward=names[0],
        )

    def shutdown(self, wait: bool = True) -> None:
        """Stop the workers; with wait, after the batches already submitted (a hung reward is not waited for
        when wait=False)."""
        for _ in self._threads:
            self._queue.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.shutdown()
