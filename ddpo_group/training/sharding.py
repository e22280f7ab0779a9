"""FSDP2 sharding of the trained model, its frozen copies and its optimizer (``train.sharding="fsdp2"``,
docs/sharding.md).

torch's composable ``fully_shard`` shards each block the model's family names (``DiffusionPolicy.shard_blocks``:
the UNet's down / mid / up blocks, a transformer's blocks) as its own unit, then the root, as torchtitan's
``parallelize_*`` functions do. Each of N processes then holds 1/N of every parameter (a ``DTensor`` sharded on
dim 0), of its gradient and of the AdamW state built on it; a block's full weights exist only while it runs
(all-gathered before its forward / backward, freed after). Gradients are reduce-scattered and averaged over
the processes, the same mean DDP takes.

Mixed precision is FSDP2's ``MixedPrecisionPolicy``: parameters stay float32 (the optimizer's master weights),
the blocks compute in ``param_dtype`` (bf16 under ``mixed_precision="bf16"``), gradients are reduced in
float32. ``train.sharding_cpu_offload`` keeps the shards (and so the optimizer state) in CPU memory.

One code path on every device: the CPU with the gloo backend runs the same sharding as the GPUs (the tests do,
with two processes). The module also holds what works on shards: the global gradient norm over all the
processes' shards (``clip_grad_norm``), the bytes a process holds (``local_bytes``), the sharded checkpoint
(``ShardedState``, written by ``torch.distributed.checkpoint``) and the export of the full weights.
"""

import copy
import io
import json
import os
import zipfile

import torch
import torch.distributed as dist

from ddpo_group.config.registry import ConfigError, register_config_check

SHARDINGS = ("none", "fsdp2")
# the directory of a checkpoint that holds the torch.distributed.checkpoint files (*.distcp, .metadata)
SHARDED_DIR = "sharded"
SHARDED_META = "sharding.json"
# torch.distributed.checkpoint's index of a checkpoint's shards, in SHARDED_DIR
DCP_METADATA = ".metadata"


class ShardedCheckpointError(RuntimeError):
    """A torch.distributed.checkpoint save or load that failed, as an ordinary exception in one line (the first
    failing rank's error): torch's CheckpointException derives from BaseException, so every ``except Exception``
    (the run's failure handling, the CLI's one-line errors) would let it through. ``errno``: that error's (a full
    disk), or None."""

    def __init__(self, err: BaseException):
        failures = getattr(err, "failures", None) or {}
        if failures:
            rank = min(failures)
            cause = failures[rank][0]
            text = f"{type(cause).__name__} on rank {rank}: {' '.join(str(cause).split())[:300]}"
        else:
            cause, text = err, (str(err).splitlines() or [type(err).__name__])[0]
        super().__init__(text)
        self.errno = getattr(cause, "errno", None)


def unreadable_sharded_file(checkpoint):
    """(path, reason) of the first file of checkpoint/sharded/ that cannot be read, or None: .metadata missing or
    not readable, a .distcp file it names missing, shorter than its items, or an item that is not a whole zip
    archive whose members pass their CRC check (torch.save's format: nothing is unpickled). Only asked after
    loading the checkpoint failed: torch's own errors name no file for a damaged one."""
    from torch.distributed.checkpoint import FileSystemReader

    root = os.path.join(checkpoint, SHARDED_DIR)
    metadata_path = os.path.join(root, DCP_METADATA)
    if not os.path.exists(metadata_path):
        return metadata_path, "no such file"
    try:
        storage = FileSystemReader(root).read_metadata().storage_data
    except Exception as err:  # a truncated or overwritten pickle: any failure to read is the answer
        return metadata_path, " ".join(str(err).split())[:200] or type(err).__name__
    items = {}
    for info in storage.values():
        items.setdefault(info.relative_path, []).append(info)
    for name in sorted(items):
        path = os.path.join(root, name)
        if not os.path.exists(path):
            return path, "no such file"
        size = os.path.getsize(path)
        end = max(info.offset + info.length for info in items[name])
        if size < end:
            return path, f"{size} bytes, its shards need {end}"
        with open(path, "rb") as f:
            for info in sorted(items[name], key=lambda info: info.offset):
                if info.transform_descriptors:  # a compressed item: no zip archive to check
                    continue
                f.seek(info.offset)
                try:
                    with zipfile.ZipFile(io.BytesIO(f.read(info.length))) as archive:
                        damaged = archive.testzip()
                except (zipfile.BadZipFile, OSError, ValueError) as err:
                    return path, f"the shard at byte {info.offset} is not readable ({err})"
                if damaged:
                    return path, f"the shard at byte {info.offset} fails its CRC check"
    return None


def check_sharding_config(config, family_blocks):
    """One-line ConfigError naming the field for a sharding setting this run cannot honour.

    family_blocks: the policy's ``shard_blocks`` (None or empty: the family knows no block structure)."""
    t = config.train
    sharding = t.get("sharding", "none")
    if sharding not in SHARDINGS:
        raise ConfigError(f"config.train.sharding={sharding!r} is not one of {list(SHARDINGS)}")
    if sharding == "none":
        if t.get("sharding_cpu_offload", False):
            raise ConfigError("config.train.sharding_cpu_offload=True needs train.sharding='fsdp2'")
        return
    if not family_blocks:
        raise ConfigError(
            f"config.train.sharding='fsdp2': config.pretrained.model={config.pretrained.model!r} has no block "
            "structure known to its family (DiffusionPolicy.shard_blocks); set train.sharding='none'"
        )
    if config.mixed_precision == "fp16":
        raise ConfigError(
            "config.mixed_precision='fp16' with train.sharding='fsdp2': FSDP2 here computes in bf16 or float32 "
            "(fp16 would need a loss scaler aware of the shards); set mixed_precision='bf16'"
        )
    if t.use_8bit_adam:
        raise ConfigError(
            "config.train.use_8bit_adam=True with train.sharding='fsdp2': bitsandbytes' 8-bit AdamW does not "
            "take sharded (DTensor) parameters; set train.use_8bit_adam=False"
        )


@register_config_check("model")
def check_sharding(config, machine):
    """`check_sharding_config` before any model loads, with the family's blocks (the family by the model's name)."""
    blocks = ()
    if config.train.get("sharding", "none") == "fsdp2":
        from ddpo_group.diffusion.policy import family_for_model

        blocks = family_for_model(config.pretrained.model).shard_blocks
    check_sharding_config(config, blocks)


def compute_dtype(config):
    """The dtype the sharded blocks compute in: bf16 under mixed_precision='bf16', else float32 (None)."""
    return torch.bfloat16 if config.mixed_precision == "bf16" else None


def _device_mesh(device):
    """A 1-D mesh over every process; one process started without a launcher gets a process group of one (an
    in-memory store), so that the same sharded code path runs there too."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(device.type, (dist.get_world_size(),))


def block_units(module, block_names):
    """The submodules sharded as their own units, in order: each element of a ModuleList named in
    `block_names`, or the named module itself. ConfigError when a name is missing from the module."""
    units = []
    for name in block_names:
        block = getattr(module, name, None)
        if block is None and hasattr(module, "base_model"):  # a peft-wrapped model
            block = getattr(module.base_model.model, name, None)
        if block is None:
            raise ConfigError(
                f"config.train.sharding='fsdp2': the {type(module).__name__} has no {name!r} blocks its family "
                "names for sharding; set train.sharding='none'"
            )
        units.extend(block if isinstance(block, torch.nn.ModuleList) else [block])
    return units


def shard_module(module, block_names, device, param_dtype=None, cpu_offload=False):
    """Apply FSDP2 in place: each block unit, then the root (which holds what no block holds: embeddings,
    norms, the output projection). The module keeps its class's behaviour (``fully_shard`` makes it an
    ``FSDPModule`` subclass) and its parameters become DTensors sharded on dim 0 over every process.

    param_dtype: the compute dtype of the blocks (None: the parameters' own, float32); gradients reduce in
    float32 and the root's output is cast to float32. Returns the module."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = _device_mesh(device)
    # the blocks hand their outputs on in the compute dtype; only the root's output is cast to float32
    block_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    root_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, output_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    # reshard_after_forward=True for the root too (FSDP2 otherwise keeps the root's weights gathered after a
    # forward, for the backward): after a sampling or evaluation pass under no_grad the module's parameters are
    # its shards again, so that the optimizer, the mixup and the checkpoint always see the DTensors.
    for unit in block_units(module, block_names):
        fully_shard(unit, mesh=mesh, mp_policy=block_policy, offload_policy=offload, reshard_after_forward=True)
    fully_shard(module, mesh=mesh, mp_policy=root_policy, offload_policy=offload, reshard_after_forward=True)
    return module


def is_sharded(module):
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def frozen_copy(module):
    """An unsharded deep copy of `module` with no gradients, to be sharded beside it (the reference policy,
    the forward objectives' old model); made before `module` is sharded."""
    if is_sharded(module):
        raise ValueError("frozen_copy needs the module before it is sharded")
    duplicate = copy.deepcopy(module)
    duplicate.requires_grad_(False)
    return duplicate


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@torch.no_grad()
def clip_grad_norm(params, max_norm):
    """Scale the gradients so that their global L2 norm is at most `max_norm`; returns the norm before.

        ||g|| = sqrt(sum over processes p of sum over local shards s of ||g_{p,s}||^2)

    Each process sums the squares of its own shards in float32, one all_reduce adds the processes' sums (a
    DTensor's shard holds 1/N of the tensor; a replicated tensor, e.g. with one process, counts once).
    The scale min(1, max_norm / (||g|| + 1e-6)) multiplies every shard, as torch.nn.utils.clip_grad_norm_."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    first = _local(grads[0])
    total = torch.zeros((), dtype=torch.float32, device=first.device)
    for grad in grads:
        total += _local(grad).float().pow(2).sum()
    if dist.is_available() and dist.is_initialized() and any(hasattr(g, "to_local") for g in grads):
        dist.all_reduce(total)
    norm = total.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        _local(grad).mul_(scale.to(_local(grad).dtype))
    return norm


def local_bytes(module, optimizer=None):
    """Bytes this process holds of `module`'s parameters, their gradients and the optimizer's state, counted
    from the local shards: {"params", "grads", "optimizer"}."""
    params = [p for p in module.parameters()]
    counts = {
        "params": sum(_local(p).numel() * _local(p).element_size() for p in params),
        "grads": sum(_local(p.grad).numel() * _local(p.grad).element_size() for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    counts["optimizer"] += _local(value).numel() * _local(value).element_size()
    return counts


def full_state_dict(module):
    """The full (unsharded) state dict on the CPU of the main process ({} on the others); every process calls."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(module, options=options)


def unsharded_class(module):
    """The model's own class behind FSDP2's dynamic ``FSDP<Class>`` subclass."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def save_full_weights(module, state_dict, directory):
    """diffusers' ``save_pretrained`` layout from a full state dict: config.json (the model's own class name)
    and diffusion_pytorch_model.safetensors, so that ``<ModelClass>.from_pretrained(directory)`` loads it."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    config = json.loads(module.to_json_string()) if hasattr(module, "to_json_string") else {}
    config["_class_name"] = unsharded_class(module).__name__
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    tensors = {name: value.contiguous() for name, value in state_dict.items()}
    save_file(tensors, os.path.join(directory, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})


class ShardedState:
    """The sharded part of a checkpoint, as a ``torch.distributed.checkpoint`` Stateful: the trained module
    with its optimizer state, and the sharded frozen copies ({name: module}). Every process writes and reads
    its own shards; a checkpoint written with N processes loads into M (DCP re-shards on load)."""

    def __init__(self, module, optimizer, copies=None, exporter=None):
        self.module, self.optimizer, self.copies = module, optimizer, dict(copies or {})
        self.exporter = exporter

    def export(self, directory):
        """The trained weights gathered in full (every process takes part) and written by the main process with
        ``exporter(full_state_dict, directory)`` (the family's layout)."""
        if self.exporter is None:
            return
        state = full_state_dict(self.module)
        if dist.get_rank() == 0:
            self.exporter(state, directory)

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model_state, optimizer_state = get_state_dict(self.module, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        for name, module in self.copies.items():
            state[name] = get_model_state_dict(module)
        return state

    def load_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        for name, module in self.copies.items():
            set_model_state_dict(module, state[name])

    def save(self, directory):
        """Every process writes its shards into directory/sharded/, rank 0 sharding.json; ShardedCheckpointError
        (one line) when a rank failed to write."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.save({"train": self}, checkpoint_id=os.path.join(directory, SHARDED_DIR))
        except CheckpointException as err:
            raise ShardedCheckpointError(err) from err
        if dist.get_rank() == 0:
            with open(os.path.join(directory, SHARDED_META), "w") as f:
                json.dump({"num_processes": dist.get_world_size(), "copies": sorted(self.copies)}, f)

    def load(self, directory):
        """Load the shards of checkpoint `directory`; ValueError in one line when it holds no sharded state
        or other frozen copies, ShardedCheckpointError (one line) when a rank failed to read its shards
        (``unreadable_sharded_file`` names the file)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        meta_path = os.path.join(directory, SHARDED_META)
        if not os.path.exists(meta_path):
            raise ValueError(
                f"{directory} holds no sharded state ({SHARDED_META}): it was written with train.sharding='none'; "
                "resume it with train.sharding='none'"
            )
        with open(meta_path) as f:
            meta = json.load(f)
        if meta["copies"] != sorted(self.copies):
            raise ValueError(
                f"{directory} was written with the frozen copies {meta['copies']}, this run keeps "
                f"{sorted(self.copies)}: resume with the same train.use_reference_model / train.objective"
            )
        try:
            dcp.load({"train": self}, checkpoint_id=os.path.join(directory, SHARDED_DIR))
        except CheckpointException as err:
            raise ShardedCheckpointError(err) from err
        return meta
