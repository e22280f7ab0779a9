"""Issue 43 (reliability, fourth round), the VLM judge's and FSDP2's items, numbered as in the issue.

5. the judge's `timeout` bounds a whole request (not each read), and a run whose reward_timeout fired ends while
   the judge's endpoint is still sending; scripts/evaluate.py bounds its rewards too.
6. a missing or damaged torch.distributed.checkpoint file (sharded/.metadata, *.distcp) on resume, and a sharded
   save that fails, stop the run with one line naming the file: failed.json written, the lock released, no
   finished.json left claiming success (two gloo CPU processes under torchrun).
11. the judge's reply is bounded in bytes (as the remote reward client's answer), and its options are checked when
   the reward is built.

The judge's endpoint here is a raw socket server on 127.0.0.1 (a thread per connection): GET /v1/models answers at
once, POST /v1/chat/completions runs a misbehaviour written here (a byte a second, a huge answer); each is bounded
in bytes and time and ends when the client hangs up.
"""

import json
import os
import shutil
import socket
import subprocess
import textwrap
import threading
import time

import pytest
import torch
from helpers import PYTHON, ROOT, free_port, subprocess_env

from ddpo_group.rewards import RewardError, get_reward

pytest.importorskip("openai")

MODELS_ANSWER = json.dumps({"object": "list", "data": [{"id": "judge", "object": "model", "created": 0,
                                                          "owned_by": "test"}]}).encode()
COMPLETION = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "judge", "choices": [
    {"index": 0, "finish_reason": "stop", "logprobs": None,
     "message": {"role": "assistant", "content": "Final Score: 4"}}]}).encode()


def head(length=None):
    line = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
    return line + (b"Content-Length: %d\r\n" % length if length is not None else b"") + b"\r\n"


class JudgeEndpoint:
    """A chat-completions endpoint on a raw socket: the models list at once, each completion by `answer(server,
    conn)`; `completions` counts the completion requests, `sent` the bytes written to them. Context manager
    yielding its API base URL."""

    def __init__(self, answer):
        self.answer, self.completions, self.sent = answer, 0, 0
        self.closed = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d/v1" % self.listener.getsockname()[1]

    def send(self, conn, data: bytes) -> bool:
        """Write `data`; False once the client hung up or the server is closed."""
        if self.closed.is_set():
            return False
        try:
            conn.sendall(data)
        except OSError:
            return False
        self.sent += len(data)
        return True

    def _handle(self, conn):
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            request_head, _, body = data.partition(b"\r\n\r\n")
            length = [int(line.split(b":")[1]) for line in request_head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")]
            while length and len(body) < length[0]:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                body += chunk
            if request_head.startswith(b"GET") and b"/models" in request_head.split(b"\r\n")[0]:
                conn.sendall(head(len(MODELS_ANSWER)) + MODELS_ANSWER)
                return
            self.completions += 1
            self.answer(self, conn)

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def __enter__(self):
        threading.Thread(target=self._serve, daemon=True).start()
        return self.url

    def __exit__(self, *exc_info):
        self.closed.set()
        self.listener.close()


def byte_a_second(seconds):
    """A whole valid answer (head and body) written one byte a second, for at most `seconds` bytes."""
    def answer(server, conn):
        for byte in (head(len(COMPLETION)) + COMPLETION)[:seconds]:
            if not server.send(conn, bytes([byte])):
                return
            time.sleep(1.0)
    return answer


def one_image():
    return torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))


# 5. the judge's timeout bounds the whole request ------------------------------------------------------------------
def test_5_a_judge_sending_a_byte_a_second_fails_at_its_timeout_in_one_line():
    endpoint = JudgeEndpoint(byte_a_second(60))
    with endpoint as url:
        reward = get_reward("vlm_judge", url=url, template="{prompt}", timeout=2, retries=0)
        reward.check_ready()
        start = time.monotonic()
        with pytest.raises(RewardError) as info:
            reward(one_image(), ["a fox"], [{}])
        elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed < 15, f"the call took {elapsed:.0f} s with timeout=2"
    assert "\n" not in message and url in message and "reward_kwargs.vlm_judge.timeout" in message
    assert endpoint.sent < 15  # it hung up long before the 60 bytes


def test_5_each_retry_has_its_own_whole_timeout():
    endpoint = JudgeEndpoint(byte_a_second(60))
    with endpoint as url:
        reward = get_reward("vlm_judge", url=url, template="{prompt}", timeout=1, retries=1)
        start = time.monotonic()
        with pytest.raises(RewardError, match="reward_kwargs.vlm_judge.timeout"):
            reward(one_image(), ["a fox"], [{}])
        elapsed = time.monotonic() - start
    assert endpoint.completions == 2 and elapsed < 15


REWARD_TIMEOUT_SCRIPT = textwrap.dedent("""
    import sys, torch
    from ddpo_group.rewards import build_reward_fn
    from ddpo_group.rewards.combine import AsyncRewardRunner

    reward_fn = build_reward_fn("vlm_judge", reward_kwargs={"vlm_judge": {
        "url": sys.argv[1], "template": "{prompt}", "timeout": 600, "retries": 0}})
    reward_fn.check_ready()
    runner = AsyncRewardRunner(reward_fn)  # as the trainer runs its rewards: waited for reward_timeout s
    future = runner.submit(torch.rand(2, 3, 8, 8), ["a fox", "a cat"], [{}, {}])
    try:
        runner.result(future, timeout=1.0)
    except Exception as err:
        sys.exit(f"error: {err}")
""")


def test_5_a_process_whose_reward_timeout_fired_exits_while_the_judge_still_sends():
    endpoint = JudgeEndpoint(byte_a_second(90))
    with endpoint as url:
        start = time.monotonic()
        result = subprocess.run([PYTHON, "-c", REWARD_TIMEOUT_SCRIPT, url], cwd=ROOT, env=subprocess_env(),
                                capture_output=True, text=True, timeout=80)
        elapsed = time.monotonic() - start
    assert result.returncode == 1 and "did not return within reward_timeout=1 s" in result.stderr, result.stderr
    # the endpoint sends its two answers for 90 s: the process ended long before they did
    assert endpoint.completions == 2 and elapsed < 40, f"the process took {elapsed:.0f} s to exit"


# 11. the judge's reply is bounded; its options are checked when it is built -----------------------------------
def test_11_a_reply_announced_over_the_limit_is_refused_in_one_line():
    def huge(server, conn):
        if server.send(conn, head(length=150 * 2**20)):
            for _ in range(150):
                if not server.send(conn, b" " * 2**20):
                    return

    endpoint = JudgeEndpoint(huge)
    with endpoint as url:
        reward = get_reward("vlm_judge", url=url, template="{prompt}", retries=0)
        with pytest.raises(RewardError) as info:
            reward(one_image(), ["a fox"], [{}])
    message = str(info.value)
    assert "\n" not in message and url in message and "157286400 bytes" in message and "16 MB" in message
    assert endpoint.sent < 32 * 2**20


def test_11_a_reply_without_length_is_cut_at_the_limit():
    def endless(server, conn):
        if server.send(conn, head()):
            for _ in range(150):  # 150 MB unless the client stops reading
                if not server.send(conn, b" " * 2**20):
                    return

    endpoint = JudgeEndpoint(endless)
    with endpoint as url:
        reward = get_reward("vlm_judge", url=url, template="{prompt}", retries=0)
        with pytest.raises(RewardError, match=r"more than \d+ bytes.* over the limit of 16 MB") as info:
            reward(one_image(), ["a fox"], [{}])
    assert "\n" not in str(info.value)
    assert endpoint.sent < 64 * 2**20


@pytest.mark.parametrize("field, value", [
    ("image_size", 0), ("image_size", -3), ("image_size", "big"), ("image_size", 2.5),
    ("timeout", 0), ("timeout", -1), ("timeout", "soon"), ("timeout", float("nan")),
    ("retries", -1), ("retries", 1.5), ("concurrency", 0), ("max_tokens", 0), ("top_logprobs", 21),
    ("score_scale", 0), ("score_min", "low"), ("max_unparsed_fraction", 2), ("url", "localhost:8000"),
    ("template", 3), ("yes_token", ""), ("api_key", None),
])
def test_11_a_bad_option_is_one_line_naming_its_field_when_the_reward_is_built(field, value):
    with pytest.raises(ValueError) as info:
        get_reward("vlm_judge", **{field: value})
    message = str(info.value)
    assert f"reward_kwargs.vlm_judge.{field}" in message and "\n" not in message


def test_11_score_min_above_score_max_is_refused():
    with pytest.raises(ValueError, match=r"reward_kwargs.vlm_judge.score_min"):
        get_reward("vlm_judge", score_min=5, score_max=1)


def test_11_good_options_are_accepted():
    reward = get_reward("vlm_judge", image_size=512, timeout=0.5, retries=0, concurrency=1, max_tokens=1,
                        top_logprobs=1, url="https://judge.example:8443/v1")
    assert reward.image_size == 512


HANGING_REWARD = textwrap.dedent("""
    import time

    import numpy as np


    def hang(images, prompts, metadata):
        time.sleep(120)  # a reward that does not return (bounded: the test's processes end by themselves)
        return np.zeros(len(prompts)), {}
""")


def test_5_evaluate_py_bounds_a_reward_that_never_returns(tmp_path):
    (tmp_path / "hanging.py").write_text(HANGING_REWARD)
    command = [PYTHON, os.path.join(ROOT, "scripts", "evaluate.py"), "--model", "tiny", "--reward",
               f"{tmp_path / 'hanging.py'}:hang", "--images-per-prompt", "1", "--num-steps", "1",
               "--reward-timeout", "2"]
    start = time.monotonic()
    result = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=100)
    elapsed = time.monotonic() - start
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("evaluate.py: error: ") and "did not return within reward_timeout=2 s" in lines[0]
    assert elapsed < 90  # the reward sleeps 120 s


def test_5_evaluate_py_has_a_reward_timeout_by_default():
    from helpers import load_script

    evaluate = load_script("scripts/evaluate.py")

    def timeout(flag, run):
        return evaluate.reward_timeout(evaluate.argparse.Namespace(reward_timeout=flag), run)

    assert timeout(None, {}) == 600.0  # the training config's documented default (config/base.py)
    assert timeout(None, {"reward_timeout": 30}) == 30.0  # the run's own
    assert timeout(None, {"reward_timeout": 0}) is None  # 0: the run had no limit
    assert timeout(5, {"reward_timeout": 30}) == 5.0 and timeout(0, {}) is None


# 6. a missing or damaged sharded checkpoint file, a sharded save that fails (two gloo processes, torchrun) -------
TORCHRUN = os.path.join(os.path.dirname(PYTHON), "torchrun")


def sharded_train(logdir, *flags, file_size_limit=None):
    """scripts/train.py sharded over two CPU processes (torchrun); `file_size_limit`: RLIMIT_FSIZE in bytes for them
    (a write past it fails with EFBIG, as on a full disk: Python ignores SIGXFSZ)."""
    def limit_file_size():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    command = [TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()), "scripts/train.py",
               "--config", "config/grpo.py:test", "--config.train.sharding=fsdp2", "--config.save_freq=1",
               "--config.sample.num_steps=2", "--config.reward_fn=jpeg_compressibility", "--config.log_images_every=0",
               "--config.eval_freq=0", "--config.run_name=r", f"--config.logdir={logdir}", *flags]
    return subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=limit_file_size if file_size_limit else None)


def error_lines(result):
    """The lines the ranks printed for their error (torchrun prefixes nothing to a rank's sys.exit message)."""
    return [line for line in (result.stderr + result.stdout).splitlines() if "ddpo-group-train: error:" in line]


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    """A finished sharded run of one epoch: checkpoints/checkpoint_1 with sharded/{.metadata,__0_0.distcp,__1_0.distcp}."""
    logdir = tmp_path_factory.mktemp("sharded")
    result = sharded_train(logdir, "--config.num_epochs=1")
    assert result.returncode == 0, result.stderr[-3000:]
    return logdir / "r"


@pytest.mark.slow
@pytest.mark.parametrize("damage, name", [
    ("delete", "__1_0.distcp"),
    ("truncate", "__0_0.distcp"),
    ("overwrite", "__1_0.distcp"),
    ("delete", ".metadata"),
    ("truncate", ".metadata"),
])
def test_6_a_missing_or_damaged_sharded_file_stops_the_resume_in_one_line_with_its_marks(
        sharded_checkpoint, tmp_path, damage, name):
    run = tmp_path / "r"
    shutil.copytree(sharded_checkpoint, run)
    path = run / "checkpoints" / "checkpoint_1" / "sharded" / name
    if damage == "delete":
        path.unlink()
    elif damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    else:
        with open(path, "r+b") as f:
            f.write(b"\xff" * 4096)  # its first shard's head overwritten
    before = sorted(p.name for p in (run / "checkpoints" / "checkpoint_1").rglob("*"))
    result = sharded_train(tmp_path, f"--config.resume_from={run / 'checkpoints' / 'checkpoint_1'}",
                           "--config.num_epochs=2")
    lines = error_lines(result)
    assert result.returncode != 0 and lines, result.stderr[-3000:]
    assert all(line.endswith(lines[0].split("ddpo-group-train: error: ")[1]) for line in lines)  # every rank: one line
    message = lines[0]
    assert str(path) in message and "earlier checkpoint_N" in message, message
    assert not [line for line in result.stderr.splitlines() if line.startswith("[rank") and "Traceback" in line]
    assert "CheckpointException" not in result.stderr
    failed = json.loads((run / "failed.json").read_text())
    assert failed["epoch"] == 1 and str(path) in failed["error"]
    assert not (run / "finished.json").exists() and not (run / ".lock").exists()
    assert sorted(p.name for p in (run / "checkpoints" / "checkpoint_1").rglob("*")) == before  # nothing removed


@pytest.mark.slow
def test_6_a_sharded_save_that_fails_stops_the_run_in_one_line_with_its_marks(tmp_path):
    # 2 MB per file: the model loads and the run writes its small files, the .distcp shards (8 MB) fail
    result = sharded_train(tmp_path, "--config.num_epochs=2", file_size_limit=2 * 2**20)
    run = tmp_path / "r"
    lines = error_lines(result)
    assert result.returncode != 0 and lines, result.stderr[-3000:]
    message = lines[0]
    assert not [line for line in result.stderr.splitlines() if line.startswith("[rank") and "Traceback" in line]
    assert f"could not write checkpoint {run / 'checkpoints' / 'checkpoint_1'}" in message, message
    assert "File too large" in message and "no earlier checkpoint exists" in message
    assert "CheckpointException" not in result.stderr
    failed = json.loads((run / "failed.json").read_text())
    assert failed["epoch"] == 0 and "could not write checkpoint" in failed["error"]  # the epoch that was running
    assert not (run / "finished.json").exists() and not (run / ".lock").exists()
    assert os.listdir(run / "checkpoints") == []  # the partial checkpoint is removed
