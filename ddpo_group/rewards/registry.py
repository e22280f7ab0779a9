"""Reward registry and plugin loading.

A reward is any callable

    fn(images, prompts, metadata) -> (rewards, info)

with `images` a float tensor (B, 3, H, W) in [0, 1], `prompts` a list of B strings,
`metadata` a list of B dicts (the extra fields of the prompt records), `rewards` a
sequence / array / tensor of shape (B,) of real numbers and `info` a dict of extra values
to log (its numbers are logged as reward_info/<reward>/<key> in metrics.jsonl).

`images` is the reward's own copy, float32 on the CPU, whatever the training device and
dtype (float64 images, from a caller of the reward's own, stay float64): converting it to
NumPy needs no device move, and editing it in place changes nothing else. A reward that
runs a model on the accelerator says so, `@register_reward("name", device_tensors=True)`
(or a `device_tensors = True` attribute): it gets a copy on the training device instead.

A reward is named by a spec string, resolved in this order:

1. a registered name (`register_reward`), e.g. "jpeg_compressibility", "aesthetic";
   "shapes_*" names import `ddpo_group.rewards.shapes` on first use;
2. an entry point of the group "ddpo_group.rewards" installed by another package
   (pyproject.toml: `[project.entry-points."ddpo_group.rewards"] my_reward = "pkg.mod:fn"`);
3. "http://host:port" or "https://...": a remote reward server (`ddpo_group.rewards.remote`);
4. "path/to/file.py:function": a function (or class) in a Python file;
5. "package.module:function": a function (or class) in an importable module.

What a spec resolves to is used in one of two ways: a class is instantiated with the
reward's keyword arguments (so models load once, when the reward is built, and the
instance is the reward; it may define `check_ready()`), a function is the reward itself
(keyword arguments, if any, are bound with functools.partial).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

ENTRY_POINT_GROUP = "ddpo_group.rewards"

REWARD_REGISTRY: dict[str, Callable] = {}


class RewardError(RuntimeError):
    """A reward failed or returned a bad value; names the reward, prompt and sample index.

    Attributes: `reward` (component name), `index` (sample index in the batch, or None when
    the failure concerns the whole batch), `prompt` (that sample's prompt, or None).
    """

    def __init__(self, message: str, reward: str | None = None, index: int | None = None,
                 prompt: str | None = None):
        super().__init__(message)
        self.reward = reward
        self.index = index
        self.prompt = prompt


class RewardNotReadyError(RewardError):
    """An optional reward cannot run: its package or weights are missing.

    Raised by `check_ready()` before any sampling; the message says the exact install
    command or the path / config field to set.
    """


def register_reward(name: str, device_tensors: bool = False):
    """Decorator: register a reward function or class under `name`.

        @register_reward("my_reward")
        def my_reward(images, prompts, metadata):
            return images.mean(dim=(1, 2, 3)), {}

    device_tensors=True: the reward receives its images on the training device (module docstring).

    Registering a different object under a taken name raises ValueError (re-registering
    the same function, e.g. when its module is imported twice, is allowed).
    """
    if not isinstance(name, str) or not name or ":" in name or name.startswith("http"):
        raise ValueError(
            f"register_reward: name must be a non-empty string without ':' that does not start "
            f"with 'http', got {name!r}"
        )

    def decorator(obj):
        old = REWARD_REGISTRY.get(name)
        if old is not None and old is not obj and _qualname(old) != _qualname(obj):
            raise ValueError(
                f"register_reward: the name {name!r} is already taken by {_qualname(old)}; "
                f"choose another name for {_qualname(obj)}"
            )
        if device_tensors:
            obj.device_tensors = True
        REWARD_REGISTRY[name] = obj
        return obj

    return decorator


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _import_shapes_rewards() -> None:
    """Import the shapes-world rewards (registered by ddpo_group/rewards/shapes.py) if present."""
    try:
        importlib.import_module("ddpo_group.rewards.shapes")
    except ModuleNotFoundError as exc:
        # Only a missing shapes module is tolerated; a broken import inside it is re-raised.
        if exc.name not in ("ddpo_group.rewards.shapes", "ddpo_group.shapes"):
            raise


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def list_rewards() -> list[str]:
    """Names usable as a reward spec without a path: registered rewards and entry points."""
    _import_shapes_rewards()
    return sorted(set(REWARD_REGISTRY) | set(_entry_points()))


def _load_from_file(path: str, attr: str, spec: str):
    if not os.path.isfile(path):
        raise ValueError(f"reward spec {spec!r}: file {path!r} does not exist")
    module_name = "ddpo_group_reward_plugin_" + str(abs(hash(os.path.abspath(path))))
    module = sys.modules.get(module_name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    if not hasattr(module, attr):
        raise ValueError(f"reward spec {spec!r}: {path!r} defines no {attr!r}")
    return getattr(module, attr)


def _load_from_module(module_name: str, attr: str, spec: str):
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"reward spec {spec!r}: cannot import module {module_name!r} ({exc}); use a registered "
            f"name ({', '.join(list_rewards())}), 'package.module:function' of an installed "
            f"package, or 'path/to/file.py:function'"
        ) from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward spec {spec!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve_reward(spec: str):
    """The registered function or class that `spec` names (see the module docstring).

    Raises ValueError for an unknown name or a bad path, listing what is accepted.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in REWARD_REGISTRY:
        return REWARD_REGISTRY[spec]
    if spec.startswith("shapes_"):
        _import_shapes_rewards()
        if spec in REWARD_REGISTRY:
            return REWARD_REGISTRY[spec]
    if spec.startswith(("http://", "https://")):
        from ddpo_group.rewards.remote import RemoteReward

        return functools.partial(RemoteReward, spec)
    if ":" not in spec:
        entry_points = _entry_points()
        if spec in entry_points:
            return entry_points[spec].load()
        raise ValueError(
            f"unknown reward {spec!r}; registered rewards and entry points: "
            f"{', '.join(list_rewards())}. A plugin is named 'package.module:function', "
            f"'path/to/file.py:function' or 'http://host:port'"
        )
    target, attr = spec.rsplit(":", 1)
    if not target or not attr:
        raise ValueError(f"reward spec {spec!r}: expected 'module:function' or 'file.py:function'")
    if target.endswith(".py") or os.sep in target or "/" in target:
        return _load_from_file(target, attr, spec)
    return _load_from_module(target, attr, spec)


def _accepts(obj, name: str) -> bool:
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def wants_device_tensors(fn) -> bool:
    """Whether a reward (function, instance, or partial of one) asked for images on the training device."""
    return bool(getattr(fn, "device_tensors", False) or getattr(getattr(fn, "func", None), "device_tensors", False))


def get_reward(spec: str, device: Any = None, **kwargs) -> Callable:
    """Build the reward named by `spec`: fn(images, prompts, metadata) -> (rewards (B,), info).

    A class is instantiated with `kwargs` (plus `device` when given and its constructor
    takes one); a function gets `kwargs` bound with functools.partial.
    """
    obj = resolve_reward(spec)
    if inspect.isclass(obj) or isinstance(obj, functools.partial):
        if device is not None and "device" not in kwargs and _accepts(obj, "device"):
            kwargs["device"] = device
        return obj(**kwargs)
    if not callable(obj):
        raise ValueError(f"reward spec {spec!r} names {type(obj).__name__} object, not a callable")
    return functools.partial(obj, **kwargs) if kwargs else obj


def component_name(spec: str) -> str:
    """Short name of a reward spec for logging: the registered name, the function name of
    'module:function' / 'file.py:function', or "remote" for an URL."""
    spec = spec.strip()
    if spec.startswith(("http://", "https://")):
        return "remote"
    if ":" in spec:
        return spec.rsplit(":", 1)[1]
    return spec
