"""One process of tests/test_sharding.py's two-process run (torchrun --nproc_per_node 2, gloo on the CPU).

For each tiny model named on the command line, every process builds the same random-weight model (same seed),
rank 0 keeps an unsharded copy, and the model is sharded with ddpo_group.training.sharding. Every process samples the
same global batch of B trajectories with the sharded model; process r trains on rows [r B/N, (r+1) B/N) and
rank 0's copy on all B rows, with the same loss (minus advantage-weighted log-probs of the re-scored steps:
the mean over the process's rows, so FSDP's average over processes is the mean over all B rows), the same
clipping and AdamW. After the steps rank 0 compares the gathered weights with its copy, and the sharded
reference after a mixup with alpha * theta + (1 - alpha) * theta_0 computed from the unsharded weights.
Results: a JSON file per rank (argv[1] + f".{rank}.json").
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

from ddpo_group.training import sharding
from ddpo_group.diffusion.base import configure_from_sample
from ddpo_group.diffusion.policy import load_policy
from ddpo_group.training.reference import ReferencePolicy

STEPS, LR, MAX_NORM, ALPHA, BATCH, NUM_STEPS = 2, 1e-3, 0.05, 0.3, 4, 2


def sample_settings(model):
    return {"max_sequence_length": 16} if model != "tiny" else {}


def run(model, use_lora=False):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    policy = load_policy(model, torch_dtype=torch.float32)
    configure_from_sample(policy, sample_settings(model))
    module = policy.prepare(torch.device("cpu"), torch.float32, use_lora, lora_rank=4)
    initial = {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}
    full = copy.deepcopy(module) if rank == 0 else None
    reference_copy = sharding.frozen_copy(module)
    sharding.shard_module(reference_copy, policy.shard_blocks, torch.device("cpu"))
    sharding.shard_module(module, policy.shard_blocks, torch.device("cpu"))
    reference = ReferencePolicy(module, use_lora, mixup_alpha=ALPHA, update_freq=0, copy=True,
                                sharded_copy=reference_copy)
    policy.trainable_module = module

    guidance, eta = (4.5 if model != "tiny" else 3.0), 1.0
    generator = torch.Generator().manual_seed(1)
    prompts = [f"prompt {i}" for i in range(BATCH)]
    trajectories = policy.sample(prompts, NUM_STEPS, guidance, eta, generator=generator)
    advantages = torch.linspace(-1.0, 1.0, BATCH)
    local_rows = torch.arange(rank * BATCH // world, (rank + 1) * BATCH // world)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)

    def loss_of(model_, rows, step):
        log_prob, _, _ = policy.step_log_prob(model_, trajectories, rows, torch.full((len(rows),), step), guidance, eta)
        return -(advantages[rows] * log_prob.float()).mean()

    norms = []
    for step in range(STEPS):
        loss_of(module, local_rows, step % NUM_STEPS).backward()
        norms.append(float(sharding.clip_grad_norm(params, MAX_NORM)))
        optimizer.step()
        if step == STEPS - 1:
            held = sharding.local_bytes(module, optimizer)  # before zero_grad: the gradients are held
        optimizer.zero_grad(set_to_none=True)
    reference.mixup()
    sharded_weights = {name: p.full_tensor() for name, p in module.named_parameters() if p.requires_grad}
    sharded_reference = {name: p.full_tensor() for name, p in reference_copy.named_parameters() if name in initial}
    result = {"model": model, "lora": use_lora, "bytes": held, "norms": norms}
    # the export of the gathered weights in the family's layout (as the final checkpoint writes it)
    export_dir = f"{sys.argv[1]}_export_{model}_{int(use_lora)}"
    subfolder = "unet" if model == "tiny" else "transformer"

    def exporter(state_dict, directory):
        if use_lora:
            policy.save_trainable(module, directory, True, state_dict=state_dict)
        else:
            sharding.save_full_weights(module, state_dict, os.path.join(directory, subfolder))

    sharding.ShardedState(module, optimizer, exporter=exporter).export(export_dir)
    if rank == 0:
        full_params = [p for p in full.parameters() if p.requires_grad]
        full_optimizer = torch.optim.AdamW(full_params, lr=LR)
        full_norms = []
        for step in range(STEPS):
            loss_of(full, torch.arange(BATCH), step % NUM_STEPS).backward()
            full_norms.append(float(torch.nn.utils.clip_grad_norm_(full_params, MAX_NORM)))
            full_optimizer.step()
            if step == STEPS - 1:
                result["full_bytes"] = sharding.local_bytes(full, full_optimizer)
            full_optimizer.zero_grad(set_to_none=True)
        weights = {name: p.detach() for name, p in full.named_parameters()}
        result["full_norms"] = full_norms
        result["max_abs_weight_diff"] = max(
            float((sharded_weights[n] - weights[n].detach()).abs().max()) for n in initial)
        # over every trained coordinate: the share that differs by more than 2e-5, and the difference of the two
        # updates relative to the update (L2)
        diffs = torch.cat([(sharded_weights[n] - weights[n].detach()).flatten() for n in initial])
        updates = torch.cat([(weights[n].detach() - initial[n]).flatten() for n in initial])
        result["weight_diff_share"] = float((diffs.abs() > 2e-5).double().mean())
        result["relative_update_diff"] = float(diffs.norm() / updates.norm())
        result["max_abs_weight_change"] = max(
            float((weights[n].detach() - initial[n]).abs().max()) for n in initial)
        # the mixup against the formula on the trained weights it mixed (the sharded run's, gathered)
        result["max_abs_reference_diff"] = max(
            float((sharded_reference[n] - (ALPHA * sharded_weights[n] + (1 - ALPHA) * initial[n])).abs().max())
            for n in initial)
        result["num_trained_tensors"] = len(initial)
        if use_lora:  # the exported adapters, loaded by the family into a fresh LoRA model
            torch.manual_seed(0)
            fresh = load_policy(model, torch_dtype=torch.float32)
            configure_from_sample(fresh, sample_settings(model))
            loaded = fresh.prepare(torch.device("cpu"), torch.float32, True, lora_rank=4)
            fresh.load_trainable(loaded, export_dir, True)
        else:  # the exported full weights, loaded by diffusers' from_pretrained
            loaded = type(full).from_pretrained(os.path.join(export_dir, subfolder))
        exported = dict(loaded.named_parameters())
        result["export_max_abs_diff"] = max(float((exported[n].detach() - sharded_weights[n]).abs().max()) for n in initial)
    return result


def main():
    dist.init_process_group("gloo")
    results = []
    for spec in sys.argv[2:]:
        model, _, lora = spec.partition(":")
        results.append(run(model, use_lora=lora == "lora"))
    with open(f"{sys.argv[1]}.{dist.get_rank()}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
