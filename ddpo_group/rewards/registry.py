"""Resolve a reward spec string to a reward: the registered rewards, entry points, remote servers and plugins.

The reward contract, the error types and ``register_reward`` live in ``ddpo_group.rewards.base``
(re-exported here). This module imports every reward module of the package, which registers
its rewards (the registration lines below), and nothing imports it back.

A reward is named by a spec string, resolved in this order:

1. a registered name (`register_reward`), e.g. "jpeg_compressibility", "aesthetic", "shapes_alignment";
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

import difflib
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

from ddpo_group.rewards import aesthetic, builtin, optional, shapes  # noqa: F401  the registration lines
from ddpo_group.rewards import judge, ocr  # noqa: F401  the registration lines (issue 33: OCR, VLM judge)
from ddpo_group.rewards.geneval import reward as geneval_reward  # noqa: F401  registers "geneval"
from ddpo_group.rewards.base import (  # noqa: F401  (re-exported: the public names of the reward registry)
    REWARD_REGISTRY,
    RewardError,
    RewardNotReadyError,
    register_reward,
    wants_device_tensors,
)
from ddpo_group.rewards.remote import RemoteReward

ENTRY_POINT_GROUP = "ddpo_group.rewards"


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def list_rewards() -> list[str]:
    """Names usable as a reward spec without a path: registered rewards and entry points."""
    return sorted(set(REWARD_REGISTRY) | set(_entry_points()))


def closest_rewards(name: str, n: int = 1) -> list[str]:
    """The registered reward and entry-point names closest to `name` (difflib), best first."""
    return difflib.get_close_matches(name, list_rewards(), n=n, cutoff=0.6)


def unknown_reward_message(spec: str) -> str:
    """One line for a reward name that is neither registered nor an entry point: the closest names, then all."""
    close = closest_rewards(spec)
    hint = f" (did you mean {' or '.join(repr(name) for name in close)}?)" if close else ""
    return (
        f"unknown reward {spec!r}{hint}; registered rewards and entry points: {', '.join(list_rewards())}. "
        "A plugin is named 'package.module:function', 'path/to/file.py:function' or 'http://host:port'"
    )


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
    if spec.startswith(("http://", "https://")):
        return functools.partial(RemoteReward, spec)
    if ":" not in spec:
        entry_points = _entry_points()
        if spec in entry_points:
            return entry_points[spec].load()
        raise ValueError(unknown_reward_message(spec))
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


def get_reward(spec: str, device: Any = None, **kwargs) -> Callable:
    """Build the reward named by `spec`: fn(images, prompts, metadata) -> (rewards (B,), info).

    A class is instantiated with `kwargs` (plus `device` when given and its constructor
    takes one); a function gets `kwargs` bound with functools.partial.
    """
    obj = resolve_reward(spec)
    if kwargs:
        check_reward_keywords(spec, obj, kwargs)
    if inspect.isclass(obj) or isinstance(obj, functools.partial):
        if device is not None and "device" not in kwargs and _accepts(obj, "device"):
            kwargs["device"] = device
        return obj(**kwargs)
    if not callable(obj):
        raise ValueError(f"reward spec {spec!r} names {type(obj).__name__} object, not a callable")
    return functools.partial(obj, **kwargs) if kwargs else obj


def check_reward_keywords(spec: str, fn: Callable, kwargs: dict) -> None:
    """A TypeError naming the keyword arguments `fn` (a reward function, or a class: its constructor's) does not
    take, before any image is scored (a function built with a misspelt argument failed only on its first call:
    after a whole epoch's sampling, or on a server, on every request)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): its first call says
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    taken = [name for name, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = [key for key in kwargs if key not in taken]
    if unknown:
        options = [name for name in taken if params[name].default is not inspect.Parameter.empty]
        raise TypeError(f"reward {spec!r} takes no keyword argument {', '.join(map(repr, unknown))}; it takes "
                        f"{', '.join(map(repr, options)) or 'none'}")


def component_name(spec: str) -> str:
    """Short name of a reward spec for logging: the registered name, the function name of
    'module:function' / 'file.py:function', or "remote" for an URL."""
    spec = spec.strip()
    if spec.startswith(("http://", "https://")):
        return "remote"
    if ":" in spec:
        return spec.rsplit(":", 1)[1]
    return spec
