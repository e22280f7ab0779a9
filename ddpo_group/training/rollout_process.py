"""train.async_rollout_processes=1: the async rollout drawn by a process of its own (docs/async_rollout.md).

The trainer process (rank 0) spawns a rollout process (rank 1); the two form a gloo group of their own
(torch.distributed, beside the trainer's Accelerate state, which stays one process). Each epoch:

    rank 0 -> 1   broadcast: (epoch, size), then the trainable state of the sampling snapshot, flat float32
    rank 1        loads it into its copy of the model, samples the epoch and waits for its rewards (rollout.py,
                  the same generators as in the trainer's process: the same samples)
    rank 1 -> 0   send: the EpochBatch and the rollout's metrics (torch.save bytes)

A failure in the rollout process comes back as its message (a RuntimeError in the trainer naming the epoch); an
epoch of -1 ends the rollout process. The rollout process builds what sampling needs from the run's config as the
trainer does: the rewards, the prompts, the models (build_models).
"""

import datetime
import io
import socket

import torch
import torch.distributed as dist

STOP = -1


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def send_object(obj, dst):
    """Send a torch.save-able object to rank `dst` (its byte count, then the bytes)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst)
    dist.send(data, dst=dst)


def recv_object(src, map_location="cpu"):
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, src=src)
    from ddpo_group.training.batch import EpochBatch

    # weights_only: tensors, containers and the one class of ours the reply holds (no arbitrary unpickling)
    with torch.serialization.safe_globals([EpochBatch]):
        return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location=map_location, weights_only=True)


class RolloutProcess:
    """The trainer's end: the rollout process, the weights sent to it, an epoch's samples back."""

    def __init__(self, config, device, threads, timeout_s=600):
        import torch.multiprocessing as mp

        port = _free_port()
        self.device = device
        self.process = mp.get_context("spawn").Process(
            target=_worker, args=(config.to_dict(), port, threads, timeout_s), daemon=True, name="ddpo_rollout")
        self.process.start()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=timeout_s))

    def draw(self, params, epoch):
        """(EpochBatch on the trainer's device, the rollout's metrics) of `epoch`, sampled with `params`
        ({name: tensor}, the sampling snapshot's trainable parameters, in the module's order)."""
        flat = torch.cat([p.detach().float().cpu().flatten() for p in params.values()])
        dist.broadcast(torch.tensor([epoch, flat.numel()], dtype=torch.int64), src=0)
        dist.broadcast(flat, src=0)
        reply = recv_object(1, map_location=self.device)
        if "error" in reply:
            raise RuntimeError(f"the rollout process failed at epoch {epoch}: {reply['error']}")
        return reply["samples"], reply["metrics"]

    def close(self):
        if dist.is_initialized():
            dist.broadcast(torch.tensor([STOP, 0], dtype=torch.int64), src=0)
            self.process.join(timeout=60)
            dist.destroy_process_group()
        if self.process.is_alive():
            self.process.kill()


def _worker(config_dict, port, threads, timeout_s):
    """The rollout process: build the sampling side from the config, then draw the epochs rank 0 asks for."""
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))
    import ml_collections
    from accelerate import Accelerator

    from ddpo_group.data.prompts import load_config_prompts
    from ddpo_group.rewards import AsyncRewardRunner, build_reward_fn
    from ddpo_group.training.models import build_models
    from ddpo_group.training.rollout import sample_epoch

    config = ml_collections.ConfigDict(config_dict)
    failure, runner = None, None
    try:
        acc = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=config.mixed_precision)
        reward_fn = build_reward_fn(
            config.reward_fn or None, config.reward_weights.to_dict() or None, reward_workers=config.reward_workers,
            reward_kwargs=config.reward_kwargs.to_dict() or None, reward_aggregation=config.reward_aggregation,
            device=acc.device, reward_frames=config.reward_frames,
        )
        runner = AsyncRewardRunner(reward_fn, config.reward_workers)
        prompts = load_config_prompts(config, "prompt_fn")
        models = build_models(config, acc)
        params = [p for p in models.trainable_module.parameters() if p.requires_grad]
    except Exception as err:  # told to rank 0 at its first request
        failure = f"{type(err).__name__}: {err}"
    while True:
        header = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(header, src=0)
        epoch, size = int(header[0]), int(header[1])
        if epoch == STOP:
            break
        flat = torch.empty(size, dtype=torch.float32)
        dist.broadcast(flat, src=0)
        if failure is not None:
            send_object({"error": failure}, 0)
            continue
        try:
            with torch.no_grad():
                start = 0
                for p in params:
                    p.copy_(flat[start : start + p.numel()].view_as(p))
                    start += p.numel()
            metrics = {}
            samples = sample_epoch(models.policy, prompts, runner, config, acc, epoch, metrics)
            reply = {"samples": samples, "metrics": metrics}
        except Exception as err:
            reply = {"error": f"{type(err).__name__}: {err}"}
        send_object(reply, 0)
    if runner is not None:
        runner.shutdown()
    dist.destroy_process_group()
