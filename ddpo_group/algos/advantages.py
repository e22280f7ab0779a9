"""Advantage estimators on (B, T) trajectories, registered by name.

A batch holds B trajectories of T denoising steps; `mask` (B, T) is 1 on steps that
exist (the LLM "response mask"). Every estimator returns `(advantages, returns)`, both
(B, T), zero on masked steps, computed without autograd.

Public functions (docs/design.md §3, §9):

    compute_grpo_advantages(rewards, prompt_ids, mask, norm_by_std=True, eps=1e-6)
    compute_gae_advantages(token_level_rewards, values, mask, gamma=1.0, lam=0.95)
    compute_rloo_advantages(rewards, prompt_ids, mask)
    token_level_rewards_from_outcome(rewards, mask)

Registry. `register_adv_est(name, ...)` registers an estimator; `get_adv_estimator(name)`
returns it. What the trainer must provide is a property of the registered function, set by
the decorator: `needs_values` (critic values V(x_t); the trainer then builds and trains a
critic), `needs_outcome_advantages` (the grpo advantages of the same batch, combined over
reward components as `reward_aggregation` says; passed as the option `outcome_advantages`),
`uses_tracker` (a per-prompt history: the trainer keeps one `PerPromptStatTracker` per reward
stream, checkpoints it, and passes it as the option `tracker` with the option `prompts`),
`defines_endpoints` (it reports Group-PPO segment endpoints in the option `info`, so
`train.timestep_selection="endpoints"` can train at them) and `needs_step_rewards` (the reward of each step's
decoded one-step prediction, r[i, k] = R(decode(x0_hat(x_k))) at every step k, (B, T), passed as the option
`step_rewards`; the trainer computes them with the anchor machinery of critic_designs.py from the x0_hat that
sampling keeps). Every registered estimator has the same keyword-only interface, so the
trainer calls any of them the same way:

    estimator = get_adv_estimator(name)
    advantages, returns = estimator(
        rewards=...,              # (B,) outcome rewards, or None
        prompt_ids=...,           # (B,) group keys (int64 tensor, array or list), or None
        mask=...,                 # (B, T), required
        token_level_rewards=...,  # (B, T), or None (built from `rewards` when needed)
        values=...,               # (B, T) critic values V(x_t), or None
        config=...,               # object or mapping with optional options, or None
        **options,                # explicit options; they override `config`
    )

Options are read as: explicit keyword > attribute (or key) of `config` > default.
The options of the built-in estimators are `norm_by_std` (True) and `eps` (1e-6) for
grpo, `gamma` (1.0) and `lam` (0.95) for gae; rloo has none. An estimator ignores the
inputs it does not need and raises ValueError naming an input it needs but did not get.

A new estimator is one function:

    @register_adv_est("my_estimator")
    def my_estimator(*, rewards=None, prompt_ids=None, mask, token_level_rewards=None,
                     values=None, config=None, **options):
        ...
        return advantages, returns

`estimator_option(name, options, config, default)` reads an option with the precedence
above. Registration checks that the function accepts these keywords (or **kwargs). Importing
this module registers only grpo, gae and rloo. "group_ppo" lives in
`ddpo_group.algos.grouping`, "step_gain" in `ddpo_group.algos.step_gain` and "ddpo" (the per-prompt tracker) in
`ddpo_group.algos.stat_tracking`;
`get_adv_estimator` imports those modules on first use of a name it does not know, so the
registry stays free of import-time side effects.

Inputs may be float32 or float64; results have the floating dtype of the reward input
(promoted with `values` for gae). Shapes must match exactly: nothing is broadcast.
"""

import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ddpo_group.config.registry import check_choice, register_config_check

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "ESTIMATOR_KEYWORDS",
    "register_adv_est",
    "get_adv_estimator",
    "registered_adv_estimators",
    "estimator_option",
    "compute_grpo_advantages",
    "compute_gae_advantages",
    "compute_rloo_advantages",
    "group_normalize_step_advantages",
    "token_level_rewards_from_outcome",
]

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATOR_REGISTRY: dict[str, AdvantageEstimator] = {}

# The keywords every registered estimator accepts.
ESTIMATOR_KEYWORDS = ("rewards", "prompt_ids", "mask", "token_level_rewards", "values", "config")

# Modules that register estimators of their own, imported on first lookup of an unknown name.
_LAZY_ESTIMATOR_MODULES = ("ddpo_group.algos.grouping", "ddpo_group.algos.step_gain", "ddpo_group.algos.stat_tracking")


def register_adv_est(
    name: str,
    needs_values: bool = False,
    needs_outcome_advantages: bool = False,
    uses_tracker: bool = False,
    defines_endpoints: bool = False,
    needs_step_rewards: bool = False,
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: register an advantage estimator under `name`, with what it needs (module docstring).

    The function must accept the keywords of ESTIMATOR_KEYWORDS (or **kwargs) and
    return `(advantages (B, T), returns (B, T))`. Registering a different function under
    a name already taken raises ValueError; re-registering the same function (same module
    and qualified name, e.g. after a module reload) replaces it.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_adv_est: name must be a non-empty string, got {name!r}")

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        parameters = inspect.signature(fn).parameters
        takes_var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        missing = [k for k in ESTIMATOR_KEYWORDS if k not in parameters]
        if missing and not takes_var_keyword:
            raise ValueError(
                f"register_adv_est({name!r}): {fn.__qualname__} must accept the keywords "
                f"{list(ESTIMATOR_KEYWORDS)} (or **kwargs); missing {missing}"
            )
        previous = ADV_ESTIMATOR_REGISTRY.get(name)
        if previous is not None and (previous.__module__, previous.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(
                f"register_adv_est: advantage estimator {name!r} is already registered "
                f"({previous.__module__}.{previous.__qualname__}); choose another name"
            )
        fn.needs_values = bool(needs_values)
        fn.needs_outcome_advantages = bool(needs_outcome_advantages)
        fn.uses_tracker = bool(uses_tracker)
        fn.defines_endpoints = bool(defines_endpoints)
        fn.needs_step_rewards = bool(needs_step_rewards)
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def registered_adv_estimators() -> list[str]:
    """Sorted names of the registered advantage estimators (lazy modules included)."""
    _import_lazy_modules()
    return sorted(ADV_ESTIMATOR_REGISTRY)


def get_adv_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under `name`; unknown name -> ValueError listing the known ones."""
    if name not in ADV_ESTIMATOR_REGISTRY:
        _import_lazy_modules()
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(
            f"Unknown advantage estimator {name!r}; registered estimators: {sorted(ADV_ESTIMATOR_REGISTRY)}"
        )
    return ADV_ESTIMATOR_REGISTRY[name]


def _import_lazy_modules() -> None:
    for module_name in _LAZY_ESTIMATOR_MODULES:
        try:
            importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:  # the module exists but one of its imports is missing
                raise


def estimator_option(name: str, options: Mapping[str, Any], config: Any, default: Any) -> Any:
    """An estimator option: explicit keyword in `options` > attribute / key of `config` > default."""
    if name in options:
        return options[name]
    if isinstance(config, Mapping):
        return config.get(name, default)
    if config is not None:
        return getattr(config, name, default)
    return default


_option = estimator_option  # the name ddpo_group.algos.grouping imports


def _float_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = None
    for tensor in tensors:
        if tensor.dtype.is_floating_point:
            dtype = tensor.dtype if dtype is None else torch.promote_types(dtype, tensor.dtype)
    return dtype if dtype is not None else torch.get_default_dtype()


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{name} must be a tensor or array of numbers, got {type(value).__name__}") from error


def _check_mask(mask: Any, name: str = "mask") -> torch.Tensor:
    mask = _as_tensor(mask, name)
    if mask.dim() != 2:
        raise ValueError(f"{name} must have shape (B, T), got {tuple(mask.shape)}")
    if mask.shape[0] == 0 or mask.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(mask.shape)}); need at least one trajectory and one step")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name} must hold only 0 and 1 (or False/True)")
    return mask


def _check_rewards(rewards: Any, batch_size: int, name: str = "rewards") -> torch.Tensor:
    rewards = _as_tensor(rewards, name)
    if rewards.dim() != 1 or rewards.shape[0] != batch_size:
        raise ValueError(f"{name} must have shape (B,) = ({batch_size},) to match mask, got {tuple(rewards.shape)}")
    if rewards.dtype.is_floating_point and not bool(torch.isfinite(rewards).all()):
        raise ValueError(f"{name} contains NaN or inf; every reward must be finite")
    return rewards


def _check_same_shape(tensor: Any, mask: torch.Tensor, name: str) -> torch.Tensor:
    tensor = _as_tensor(tensor, name)
    if tensor.shape != mask.shape:
        raise ValueError(f"{name} must have the shape of mask {tuple(mask.shape)}, got {tuple(tensor.shape)}")
    if tensor.dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{name} contains NaN or inf")
    return tensor


def _group_index(prompt_ids: Any, batch_size: int, device: torch.device) -> torch.Tensor:
    """(B,) int64 group number of each trajectory, from any (B,) sequence of hashable keys."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1 or prompt_ids.shape[0] != batch_size:
            raise ValueError(
                f"prompt_ids must have shape (B,) = ({batch_size},) to match mask, got {tuple(prompt_ids.shape)}"
            )
        _, inverse = torch.unique(prompt_ids, return_inverse=True)
        return inverse.to(device=device, dtype=torch.long)
    if hasattr(prompt_ids, "tolist"):  # numpy arrays
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, str) or not isinstance(prompt_ids, Sequence):
        raise ValueError(
            f"prompt_ids must be a (B,) tensor, array or list of group keys, got {type(prompt_ids).__name__}"
        )
    if len(prompt_ids) != batch_size:
        raise ValueError(f"prompt_ids must have length B = {batch_size} to match mask, got {len(prompt_ids)}")
    numbers: dict[Any, int] = {}
    try:
        inverse = [numbers.setdefault(key, len(numbers)) for key in prompt_ids]
    except TypeError as error:
        raise ValueError("prompt_ids must hold hashable keys (ints or strings)") from error
    return torch.tensor(inverse, dtype=torch.long, device=device)


def _group_mean_std(rewards: torch.Tensor, inverse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group (count, mean, population std), each (G,), in float64.

    float64: rewards up to the float32 range (3.4e38) have a representable variance (float32
    overflows at about 1e19 and would make every advantage 0).
    """
    rewards = rewards.to(torch.float64)
    num_groups = int(inverse.max()) + 1
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device)
    counts = zeros.index_add(0, inverse, torch.ones_like(rewards))
    means = zeros.index_add(0, inverse, rewards) / counts
    # corrected two-pass mean: the first mean's rounding error (~1e-14 at |r| ~ 100) would be divided by
    # std + eps ~ 1e-6 for (near-)equal rewards, leaving a group's advantages summing to ~1e-8, not to 0;
    # with the residual's mean added, equal rewards are centred to exactly 0
    means = means + zeros.index_add(0, inverse, rewards - means[inverse]) / counts
    variances = zeros.index_add(0, inverse, (rewards - means[inverse]) ** 2) / counts
    return counts, means, variances.sqrt()


def token_level_rewards_from_outcome(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each outcome reward at its trajectory's last valid step.

    token_level_rewards[i, t] = R_i if t is the last t with mask[i, t] = 1, else 0.

    Args:
        rewards: (B,) outcome rewards.
        mask: (B, T) 1 on steps that exist; every row needs at least one valid step
            (otherwise its reward would be dropped).

    Returns:
        (B, T) tensor of rewards' float dtype.
    """
    mask = _check_mask(mask)
    rewards = _check_rewards(rewards, mask.shape[0])
    valid = mask != 0
    if not bool(valid.any(dim=1).all()):
        empty_rows = torch.nonzero(~valid.any(dim=1)).flatten().tolist()
        raise ValueError(f"mask rows {empty_rows} have no valid step: their rewards would be dropped")
    dtype = _float_dtype(rewards)
    steps = torch.arange(mask.shape[1], device=mask.device)
    last_step = torch.where(valid, steps, -1).max(dim=1).values
    token_level_rewards = torch.zeros(mask.shape, dtype=dtype, device=rewards.device)
    token_level_rewards[torch.arange(mask.shape[0], device=rewards.device), last_step] = rewards.to(dtype)
    return token_level_rewards


@torch.no_grad()
def group_normalize_step_advantages(
    advantages: torch.Tensor,
    prompt_ids: Any,
    mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-prompt baseline of per-step advantages: GRPO's normalisation, applied step by step.

    For each step t and each group g of equal `prompt_ids`, over the trajectories i of g with
    mask[i, t] = 1:  A'[i, t] = (A[i, t] - mean_g,t) / (std_g,t + eps)   (norm_by_std=True)
                     A'[i, t] =  A[i, t] - mean_g,t                      (norm_by_std=False)
    std is the population std (ddof = 0). As in ``compute_grpo_advantages`` a group with one valid
    trajectory at step t gets mean 0 and std 1 there. A' = 0 where mask is 0.

    With critic-free advantages (A[i, t] = R_i) this is exactly the GRPO advantage; with GAE
    advantages A[i, t] ~ R_i - V(x_t) it subtracts what the whole group shares (the prompt's
    difficulty) and keeps what the critic explains about each trajectory's own state.

    Args:
        advantages: (B, T) float.
        prompt_ids: (B,) group keys (int64 tensor, numpy array or list of hashables).
        mask: (B, T) 1 on valid steps.

    Returns:
        (B, T) tensor with the dtype of ``advantages``.
    """
    mask = _check_mask(mask)
    advantages = _check_same_shape(advantages, mask, "advantages")
    dtype = _float_dtype(advantages)
    inverse = _group_index(prompt_ids, mask.shape[0], advantages.device)
    num_groups = int(inverse.max()) + 1
    valid = (mask != 0).to(torch.float64)
    adv = advantages.to(torch.float64) * valid
    zeros = torch.zeros(num_groups, mask.shape[1], dtype=torch.float64, device=advantages.device)
    counts = zeros.index_add(0, inverse, valid)
    means = zeros.index_add(0, inverse, adv) / counts.clamp(min=1)
    variances = zeros.index_add(0, inverse, (adv - means[inverse]) ** 2 * valid) / counts.clamp(min=1)
    single = counts <= 1
    means = torch.where(single, torch.zeros_like(means), means)
    stds = torch.where(single, torch.ones_like(variances), variances.sqrt())
    out = adv - means[inverse]
    if norm_by_std:
        out = out / (stds[inverse] + eps)
    return (out * valid).to(dtype)


@torch.no_grad()
def compute_grpo_advantages(
    rewards: torch.Tensor,
    prompt_ids: torch.Tensor,
    mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages, normalised within groups of equal `prompt_ids`.

    For each group g:  A_i = (R_i - mean_g) / (std_g + eps)   (norm_by_std=True, GRPO)
                       A_i =  R_i - mean_g                      (norm_by_std=False, Dr.GRPO)
    std_g is the population std (ddof = 0). A group of one gets mean 0 and std 1, so its
    advantage is R_i / (1 + eps) (or R_i): there is no other sample to compare with.
    A group whose rewards are all equal gets advantage 0.
    Broadcast over steps: A[i, t] = A_i * mask[i, t]; returns = advantages.

    Args:
        rewards: (B,) outcome rewards, finite.
        prompt_ids: (B,) group keys (int64 tensor, numpy array or list of hashables).
        mask: (B, T) 1 on valid steps.
        norm_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
        eps: added to the std.

    Returns:
        (advantages (B, T), returns (B, T)), the same tensor values, rewards' float dtype.
    """
    mask = _check_mask(mask)
    rewards = _check_rewards(rewards, mask.shape[0])
    dtype = _float_dtype(rewards)
    rewards = rewards.to(dtype)
    inverse = _group_index(prompt_ids, mask.shape[0], rewards.device)

    counts, means, stds = _group_mean_std(rewards, inverse)
    single = counts == 1
    means = torch.where(single, torch.zeros_like(means), means)
    stds = torch.where(single, torch.ones_like(stds), stds)

    advantages = rewards.to(torch.float64) - means[inverse]
    if norm_by_std:
        advantages = advantages / (stds[inverse] + eps)
    advantages = advantages.to(dtype)[:, None] * mask.to(dtype)
    return advantages, advantages.clone()


@torch.no_grad()
def compute_rloo_advantages(
    rewards: torch.Tensor,
    prompt_ids: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (REINFORCE leave-one-out) advantages.

    For a group g of n >= 2 trajectories:
        A_i = R_i - (1 / (n - 1)) * sum_{j in g, j != i} R_j = n / (n - 1) * (R_i - mean_g).
    A group of one has no other member to form a baseline; its baseline is 0, so
    A_i = R_i (the same choice as GRPO's "group of one: mean 0, std 1", and verl's rloo).
    Broadcast over steps: A[i, t] = A_i * mask[i, t]; returns = advantages.

    Args:
        rewards: (B,) outcome rewards, finite.
        prompt_ids: (B,) group keys.
        mask: (B, T) 1 on valid steps.

    Returns:
        (advantages (B, T), returns (B, T)), rewards' float dtype.
    """
    mask = _check_mask(mask)
    rewards = _check_rewards(rewards, mask.shape[0])
    dtype = _float_dtype(rewards)
    rewards = rewards.to(dtype)
    inverse = _group_index(prompt_ids, mask.shape[0], rewards.device)

    counts, means, _ = _group_mean_std(rewards, inverse)
    n = counts[inverse]
    r64 = rewards.to(torch.float64)
    leave_one_out = (n * means[inverse] - r64) / (n - 1).clamp(min=1)
    baseline = torch.where(n > 1, leave_one_out, torch.zeros_like(r64))
    advantages = (r64 - baseline).to(dtype)[:, None] * mask.to(dtype)
    return advantages, advantages.clone()


@torch.no_grad()
def compute_gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over denoising steps, then whitening.

    Reverse recursion over t = T-1 .. 0, starting from nextvalue = 0 and lastgaelam = 0
    (values past the last step are 0):
        delta_t      = r_t + gamma * nextvalue - V_t
        A_t          = delta_t + gamma * lam * lastgaelam
        on a valid step (mask 1):  nextvalue <- V_t,  lastgaelam <- A_t
        on a masked step (mask 0): nextvalue and lastgaelam carry through unchanged
    returns = A + V (before whitening). Then A is whitened over the valid steps of the
    whole batch: A <- (A - mean) / sqrt(var + 1e-8), var unbiased (n - 1); with a single
    valid step var is taken as 0. Advantages and returns are 0 on masked steps.

    Args:
        token_level_rewards: (B, T) per-step rewards; must be 0 on masked steps (a reward
            there would be ignored). See token_level_rewards_from_outcome.
        values: (B, T) critic values V(x_t, t, c).
        mask: (B, T) 1 on valid steps; at least one valid step in the batch.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        (advantages (B, T) whitened, returns (B, T)), float dtype of the inputs (promoted).
    """
    mask = _check_mask(mask)
    token_level_rewards = _check_same_shape(token_level_rewards, mask, "token_level_rewards")
    values = _check_same_shape(values, mask, "values")
    dtype = _float_dtype(token_level_rewards, values)
    rewards = token_level_rewards.to(dtype)
    values = values.to(dtype)
    mask = mask.to(dtype=dtype, device=rewards.device)
    if bool((rewards * (1 - mask) != 0).any()):
        raise ValueError("token_level_rewards is nonzero on masked steps (mask 0); put rewards on valid steps only")
    num_valid = int(mask.sum())
    if num_valid == 0:
        raise ValueError("mask has no valid step; GAE needs at least one")

    batch_size, num_steps = mask.shape
    nextvalues = torch.zeros(batch_size, dtype=dtype, device=rewards.device)
    lastgaelam = torch.zeros(batch_size, dtype=dtype, device=rewards.device)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(num_steps)):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        gaelam = delta + gamma * lam * lastgaelam
        m = mask[:, t]
        nextvalues = m * values[:, t] + (1 - m) * nextvalues
        lastgaelam = m * gaelam + (1 - m) * lastgaelam
        advantages[:, t] = lastgaelam

    returns = (advantages + values) * mask
    mean = (advantages * mask).sum() / num_valid
    var = ((advantages - mean) ** 2 * mask).sum() / (num_valid - 1) if num_valid > 1 else advantages.new_zeros(())
    advantages = (advantages - mean) / torch.sqrt(var + 1e-8) * mask
    return advantages, returns


def _require(value: Any, name: str, estimator: str) -> Any:
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs `{name}`; got None")
    return value


def _outcome_rewards(rewards, token_level_rewards, mask):
    """`rewards`, or the row sums of `token_level_rewards` when `rewards` is None."""
    if rewards is None and token_level_rewards is not None:
        return _check_same_shape(token_level_rewards, _check_mask(mask), "token_level_rewards").sum(dim=-1)
    return rewards


@register_adv_est("grpo")
def grpo_estimator(
    *,
    rewards=None,
    prompt_ids=None,
    mask,
    token_level_rewards=None,
    values=None,
    config=None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Registry adapter of compute_grpo_advantages (options: norm_by_std, eps).

    Uses `rewards`, or the row sums of `token_level_rewards` when `rewards` is None.
    """
    return compute_grpo_advantages(
        _require(_outcome_rewards(rewards, token_level_rewards, mask), "rewards", "grpo"),
        _require(prompt_ids, "prompt_ids", "grpo"),
        mask,
        norm_by_std=bool(estimator_option("norm_by_std", options, config, True)),
        eps=float(estimator_option("eps", options, config, 1e-6)),
    )


@register_adv_est("rloo")
def rloo_estimator(
    *,
    rewards=None,
    prompt_ids=None,
    mask,
    token_level_rewards=None,
    values=None,
    config=None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Registry adapter of compute_rloo_advantages (no options)."""
    return compute_rloo_advantages(
        _require(_outcome_rewards(rewards, token_level_rewards, mask), "rewards", "rloo"), _require(prompt_ids, "prompt_ids", "rloo"), mask
    )


@register_adv_est("gae", needs_values=True)
def gae_estimator(
    *,
    rewards=None,
    prompt_ids=None,
    mask,
    token_level_rewards=None,
    values=None,
    config=None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Registry adapter of compute_gae_advantages (options: gamma, lam).

    Uses `token_level_rewards`, or builds them from `rewards` at the last valid step.
    """
    if token_level_rewards is None:
        token_level_rewards = token_level_rewards_from_outcome(_require(rewards, "rewards", "gae"), mask)
    gamma = float(estimator_option("gamma", options, config, 1.0))
    lam = float(estimator_option("lam", options, config, 0.95))
    if not (math.isfinite(gamma) and math.isfinite(lam)):
        raise ValueError(f"gae: gamma and lam must be finite numbers, got gamma={gamma}, lam={lam}")
    return compute_gae_advantages(token_level_rewards, _require(values, "values", "gae"), mask, gamma=gamma, lam=lam)


@register_config_check("algorithm")
def check_adv_estimator(config, machine):
    """config.algorithm.adv_estimator is a registered estimator (a plugin's too: config.plugins is imported first)."""
    check_choice(config.algorithm.adv_estimator, registered_adv_estimators(), "algorithm.adv_estimator")
