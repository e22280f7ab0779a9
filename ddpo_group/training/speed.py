"""Speed settings of the denoiser (issue 44, docs/performance.md): `compile` (torch.compile) and
`attention_backend` (diffusers' attention dispatcher).

`compile_denoiser(module)` compiles the module's `forward` in place (the instance's `forward` attribute, not a
wrapper module): the module stays the object the pipeline, DDP, the reference, the perf hooks and the checkpoint
code hold, its state_dict keeps its keys (no `_orig_mod.` prefix) and its forward hooks (perf.py's timing and FLOP
counting) run eagerly around the compiled call. Every caller of the denoiser (sampling, the old-log-prob pass, the
reference forward through `functional_call` or with the LoRA adapters disabled, the training forward) goes through
it; each grad mode / input shape / adapter state is its own graph (dynamic=False). A forward made under a
TorchDispatchMode (perf.py's FlopCounterMode, once per input shape) runs the eager forward: the FLOPs it counts
are the model's, not the compiled kernels'.

`set_attention_backend(module, name)` is diffusers' `ModelMixin.set_attention_backend`. It acts on the attention
processors that dispatch through diffusers' `attention_dispatch` (the transformers of FLUX, FLUX.2, Qwen-Image,
Wan, Z-Image, LTX-2, HunyuanVideo 1.5); SD 1.x / SDXL UNets (AttnProcessor2_0) and SD3's transformer
(JointAttnProcessor2_0) call torch's SDPA directly and have no backend to set: there a value other than "" is
refused with a one-line error. The field is named after diffusers' own call and takes its names unchanged, so that
diffusers' documentation of each backend is the field's; "" leaves the library's default untouched (diffusers'
DIFFUSERS_ATTN_BACKEND environment variable, else torch's SDPA choosing its kernel), as a run without the field had.
"""

import torch

from ddpo_group.config.registry import ConfigError, register_config_check

# The torch.compile backend of `compile_denoiser`. Tests compile with "aot_eager" (the same code path, AOTAutograd's
# graphs run by eager kernels: seconds instead of inductor's minutes per graph on a CPU).
COMPILE_BACKEND = "inductor"

# diffusers backends that run only on a CUDA device (SDPA's memory-efficient and cuDNN kernels, the flash-attn, Sage,
# AITER and xformers kernels); the others also run on the CPU ("native", "_native_math", "flex", and "_native_flash":
# torch's SDPA has a CPU flash kernel, measured equal to "native" on this CPU).
CUDA_ONLY_PREFIXES = ("flash", "_flash", "_native_efficient", "_native_cudnn", "sage", "_sage", "aiter", "xformers")
# What to install for a backend whose package is missing (diffusers' own message says which package; this is
# the field's fix).
INSTALL_HINTS = {"flash": "pip install flash-attn", "_flash_3": "FlashAttention 3 (build flash-attn's hopper/ "
                 "from source)", "sage": "pip install sageattention", "xformers": "pip install xformers",
                 "hub": "pip install kernels"}


def compile_denoiser(module, backend=None):
    """torch.compile `module.forward` in place (dynamic=False; backend: COMPILE_BACKEND). Returns the module.

    The instance's `forward` is a method bound to the module (not a closure over it), its eager forward is kept as
    a bound method too, and the compiled function is tagged with the module it was made for: a deep copy of the
    module (train.async_rollout's frozen sampler copies) rebinds both to the copy and compiles its own on its first
    call, so it computes with its own weights (a closure once made a copy run the original's)."""
    import types

    if is_compiled(module):
        return module
    module._ddpo_eager_forward = module.forward
    module._ddpo_compile_backend = backend or COMPILE_BACKEND
    module._ddpo_compiled_forward = None
    module.forward = types.MethodType(_compiled_forward, module)
    return module


def _compiled_forward(module, *args, **kwargs):
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    eager = module._ddpo_eager_forward
    if _get_current_dispatch_mode() is not None:  # perf.py's FlopCounterMode: count the model's own ops
        return eager(*args, **kwargs)
    entry = module._ddpo_compiled_forward
    if entry is None or entry[0] != id(module):  # first call, or a deep copy holding its original's function
        entry = module._ddpo_compiled_forward = (
            id(module), torch.compile(eager, dynamic=False, backend=module._ddpo_compile_backend))
    return entry[1](*args, **kwargs)


def is_compiled(module):
    """Whether `compile_denoiser` compiled this module's forward."""
    return getattr(module, "_ddpo_eager_forward", None) is not None


@register_config_check("model")
def check_compile(config, machine):
    """FSDP2 sharding refuses config.compile=True (its per-block hooks are not traced through here)."""
    if config.get("compile", False) and config.train.get("sharding", "none") == "fsdp2":
        raise ConfigError("config.compile=True with config.train.sharding='fsdp2' is not supported (FSDP2's "
                          "per-block hooks would run inside the compiled forward); set compile=False")


def _backend_names():
    from diffusers.models.attention_dispatch import AttentionBackendName

    return [member.value for member in AttentionBackendName]


@register_config_check("model")
def check_attention_backend(config, machine):
    """config.attention_backend: "" or one of diffusers' AttentionBackendName values, its package installed, a
    CUDA-only kernel only where a GPU is there."""
    name = config.get("attention_backend", "")
    if name == "":
        return
    names = _backend_names()
    if name not in names:
        raise ConfigError(f"config.attention_backend={name!r} is not a diffusers attention backend; use '' (the "
                          f"library's default) or one of {names}")
    needs_cuda = name.startswith(CUDA_ONLY_PREFIXES)
    if needs_cuda and machine is not None and machine.has_gpu is False:
        raise ConfigError(f"config.attention_backend={name!r} runs only on a CUDA GPU and this machine has none; "
                          "use attention_backend='' or 'native' (torch's SDPA) or '_native_math'")
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except RuntimeError as err:
        hint = next((fix for key, fix in INSTALL_HINTS.items() if key in name and key != "flash"), None)
        hint = hint or (INSTALL_HINTS["flash"] if name.startswith("flash") else "its package")
        raise ConfigError(f"config.attention_backend={name!r} is not installed here ({hint}); use "
                          "attention_backend='' (the library's default)") from err


def set_attention_backend(module, name, model=""):
    """diffusers' set_attention_backend(name) on the denoiser (nothing for ""). ConfigError naming the field when
    the module has no attention processor that dispatches through diffusers' backends (a UNet, SD3)."""
    if not name:
        return
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    processors = [m.processor for m in module.modules() if isinstance(m, (Attention, AttentionModuleMixin))]
    dispatching = [p for p in processors if p is not None and hasattr(p, "_attention_backend")]
    if not dispatching:
        kinds = sorted({type(p).__name__ for p in processors if p is not None}) or ["no attention"]
        raise ConfigError(
            f"config.attention_backend={name!r}: the {type(module).__name__} of config.pretrained.model={model!r} "
            f"calls torch's SDPA directly ({', '.join(kinds)}), diffusers' attention backends do not apply to it "
            "(they do to FLUX, FLUX.2, Qwen-Image, Wan, Z-Image, LTX-2, HunyuanVideo 1.5); set attention_backend=''")
    import logging

    from diffusers.utils import logging as diffusers_logging

    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    logger = diffusers_logging.get_logger("diffusers.models.modeling_utils")
    level, active = logger.level, _AttentionBackendRegistry._active_backend
    logger.setLevel(logging.ERROR)  # "Attention backends are an experimental feature": said once in the docs
    try:
        module.set_attention_backend(name)
    finally:
        logger.setLevel(level)
        # diffusers also makes it the process's default backend: only this module's processors (which now carry it)
        # are the setting's, any other model of the process keeps its default
        _AttentionBackendRegistry.set_active_backend(active)
