"""Combined rewards: several components, validated, weighted; and the asynchronous runner.

    total_i = sum_k w_k * r_k,i          (rewards of sample i, components k)

`reward_aggregation` tells the trainer how to turn components into advantages:
"sum_then_normalize" (Flow-GRPO: the advantage estimator sees `total`) or
"normalize_then_sum" (MixGRPO: one group advantage per component, then the weighted sum
of those). This module only provides `total` and the per-component rewards.
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

from ddpo_group.rewards.registry import (
    RewardError,
    RewardNotReadyError,
    component_name,
    get_reward,
    wants_device_tensors,
)

REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def _prompt_list(prompts, limit: int = 3) -> str:
    shown = ", ".join(repr(p) for p in prompts[:limit])
    return shown + (", ..." if len(prompts) > limit else "")


def validate_rewards(rewards, name: str, prompts, offset: int = 0) -> np.ndarray:
    """`rewards` as a float64 array of shape (B,) with B = len(prompts), all finite.

    Otherwise RewardError naming the reward `name`, the sample index (offset + i) and its prompt.
    """
    batch = len(prompts)
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
            f"({exc}) for prompts {_prompt_list(prompts)} (samples {offset}..{offset + batch - 1})",
            reward=name,
        ) from exc
    if array.shape != (batch,):
        raise RewardError(
            f"reward {name!r} returned shape {tuple(array.shape)} for a batch of {batch} images; "
            f"expected ({batch},) (prompts {_prompt_list(prompts)}, samples "
            f"{offset}..{offset + batch - 1})",
            reward=name,
        )
    bad = np.flatnonzero(~np.isfinite(array))
    too_big = np.flatnonzero(np.isfinite(array) & (np.abs(array) > np.finfo(np.float32).max))
    if too_big.size and not bad.size:
        i = int(too_big[0])
        raise RewardError(
            f"reward {name!r} returned {array[i]:.3g} for sample {offset + i} (prompt {prompts[i]!r}), which does not "
            f"fit in float32 (|r| <= {np.finfo(np.float32).max:.3g}); rescale the reward",
            reward=name, index=offset + i, prompt=prompts[i],
        )
    if bad.size:
        i = int(bad[0])
        raise RewardError(
            f"reward {name!r} returned {array[i]} for sample {offset + i} (prompt {prompts[i]!r}); "
            f"rewards must be finite ({bad.size} non-finite value(s) in the batch)",
            reward=name, index=offset + i, prompt=prompts[i],
        )
    return array


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
    weights: {name: w}; batch_size: components are called on chunks of at most this many
    images (None: the whole batch); workers: threads that run the (component, chunk) calls.
    """

    def __init__(self, components: dict[str, Callable], weights: dict[str, float] | None = None,
                 workers: int = 1, batch_size: int | None = None,
                 aggregation: str = "sum_then_normalize"):
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
        self.components = dict(components)
        self.weights = {name: float(w) for name, w in weights.items()}
        self.names = list(self.components)
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

    def _call(self, name, fn, images, prompts, metadata, offset):
        # `images` is this call's own copy (__call__): float32 on the CPU, or on the device when the reward asked
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
            if index is None and getattr(fn, "locate_errors", True):
                index = self._locate_failure(fn, images, prompts, metadata)
            if index is None:
                where = (f"on the batch of samples {offset}..{offset + len(prompts) - 1} "
                         f"(prompts {_prompt_list(prompts)})")
                raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc} {where}",
                                  reward=name) from exc
            raise RewardError(
                f"reward {name!r} raised {type(exc).__name__}: {exc} on sample {offset + index} "
                f"(prompt {prompts[index]!r})",
                reward=name, index=offset + index, prompt=prompts[index],
            ) from exc
        if not (isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], dict)):
            raise RewardError(
                f"reward {name!r} must return a tuple (rewards, info dict), got {type(output).__name__} "
                f"(prompts {_prompt_list(prompts)})",
                reward=name,
            )
        return validate_rewards(output[0], name, prompts, offset), output[1]

    def __call__(self, images, prompts, metadata=None):
        """images (B, 3, H, W) in [0, 1], B prompts, B metadata dicts (None: empty dicts) ->
        (total (B,) float64, {name: (B,) float64}, info {"<name>/<key>": value})."""
        images = torch.as_tensor(images) if not isinstance(images, torch.Tensor) else images
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must have shape (B, 3, H, W), got {tuple(images.shape)}")
        batch = images.shape[0]
        prompts = list(prompts)
        metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        if len(prompts) != batch or len(metadata) != batch:
            raise ValueError(
                f"got {batch} images, {len(prompts)} prompts and {len(metadata)} metadata dicts; "
                f"they must be equal"
            )
        step = batch if self.batch_size is None else int(self.batch_size)
        calls = [
            (name, start)
            for name in self.names
            for start in range(0, batch, max(step, 1))
        ]

        # every reward gets its own copy (registry docstring): moved to the CPU once (float32, or float64 when
        # given float64), cloned per call; a reward that asked for device tensors gets a clone of the original.
        # Prompts and metadata too: a reward that edits them in place changes nothing another call, a later
        # epoch or the evaluation sees (the metadata dicts are the prompt records' own).
        on_host = images.detach().to("cpu", torch.promote_types(images.dtype, torch.float32))

        def run(call):
            name, start = call
            stop = start + step
            fn = self.components[name]
            source = images.detach() if wants_device_tensors(fn) else on_host
            return self._call(name, fn, source[start:stop].clone(), list(prompts[start:stop]),
                              copy.deepcopy(metadata[start:stop]), start)

        if self.workers > 1 and len(calls) > 1:
            with self._executor_lock:
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(self.workers, "reward")
            results = list(self._executor.map(run, calls))
        else:
            results = [run(call) for call in calls]

        parts = {name: [] for name in self.names}
        info = {}
        for (name, _), (rewards, component_info) in zip(calls, results):
            parts[name].append(rewards)
            for key, value in component_info.items():
                key = f"{name}/{key}"
                if key in info:  # chunked call: concatenate per-sample values, keep the first scalar
                    if isinstance(value, (list, np.ndarray, torch.Tensor)) and np.ndim(value) > 0:
                        info[key] = np.concatenate([np.asarray(info[key]), np.asarray(value)])
                else:
                    info[key] = value
        components = {name: np.concatenate(parts[name]) if parts[name] else np.zeros(0) for name in self.names}
        total = np.zeros(batch, dtype=np.float64)
        for name in self.names:
            total = total + self.weights[name] * components[name]
        if len(self.names) > 1:
            validate_rewards(total, "the weighted sum of " + "+".join(self.names), prompts)
        return total, components, info

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
                    device=None) -> CombinedReward:
    """CombinedReward from config values.

    reward_fn: one reward spec (registry name, "module:function", "file.py:function",
    "http://host:port"), weight 1. reward_weights: {spec: weight} for several components
    (when non-empty it replaces reward_fn, which may then be None). reward_kwargs:
    {spec: {keyword: value}} passed to that component's constructor (e.g.
    {"aesthetic": {"mlp_weights": "/path.pth"}}, {"http://h:p": {"timeout": 30}}). device: passed
    to components whose constructor takes `device`.
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
            future, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.reward_fn(*args))
            except BaseException as exc:  # delivered to the caller of result()
                future.set_exception(exc)

    def submit(self, images, prompts, metadata=None) -> concurrent.futures.Future:
        if isinstance(images, torch.Tensor):
            images = images.detach()
        prompts = list(prompts)
        metadata = [{} for _ in prompts] if metadata is None else [dict(m) for m in metadata]
        future = concurrent.futures.Future()
        self._queue.put((future, (images, prompts, metadata)))
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
