"""Remote reward: JSON over HTTP against real local servers (timeouts, retries, reference server)."""

import io
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import pil_jpeg_kb

from ddpo_group.rewards import RewardError, build_reward_fn, get_reward
from ddpo_group.rewards.remote import RemoteReward
from ddpo_group.rewards.server import make_server

PROMPTS = ["a cat", "a dog"]


def images_and_pixels(seed=0, batch=2, size=16):
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(batch, size, size, 3), dtype=np.uint8)
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255, pixels


class running:
    """Context manager: serve `server` in a thread, shut it down on exit; yields its URL."""

    def __init__(self, server):
        self.server = server

    def __enter__(self):
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc_info):
        self.server.shutdown()
        self.server.server_close()


def scripted_server(answers):
    """Server whose i-th POST gets answers[i] = (delay_s, status, payload); counts requests."""
    requests = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            delay, status, payload = answers[min(len(requests), len(answers)) - 1]
            time.sleep(delay)
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                pass

        def log_message(self, format, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    return server, requests


def test_remote_reward_equals_the_reward_run_on_the_server():
    images, pixels = images_and_pixels()
    with running(make_server(get_reward("jpeg_incompressibility"), "127.0.0.1", 0)) as url:
        reward = build_reward_fn(url)
        total, components, _ = reward(images, PROMPTS, [{"data_source": "x"}, {"data_source": "y"}])
    np.testing.assert_array_equal(total, pil_jpeg_kb(pixels))  # PNG keeps the 8-bit pixels exactly
    assert reward.names == ["remote"]


def test_protocol_carries_prompts_metadata_and_info():
    def echo(images, prompts, metadata):
        return [m["ground_truth"] for m in metadata], {"prompts": prompts, "height": images.shape[2]}

    images, _ = images_and_pixels(size=8)
    metadata = [{"ground_truth": 3}, {"ground_truth": np.float32(0.5)}]
    with running(make_server(echo, "127.0.0.1", 0)) as url:
        rewards, info = RemoteReward(url)(images, PROMPTS, metadata)
    np.testing.assert_array_equal(rewards, [3.0, 0.5])
    assert info == {"prompts": PROMPTS, "height": 8}


def test_request_format_is_base64_png_prompts_metadata():
    server, requests = scripted_server([(0, 200, {"rewards": [1.0, 2.0], "info": {}})])
    images, pixels = images_and_pixels()
    with running(server) as url:
        RemoteReward(url)(images, PROMPTS, [{"a": 1}, {"b": 2}])
    import base64

    body = requests[0]
    assert body["prompts"] == PROMPTS and body["metadata"] == [{"a": 1}, {"b": 2}]
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(body["images"][1]))))
    np.testing.assert_array_equal(decoded, pixels[1])


def test_timeout_is_retried_then_raises_reward_error():
    server, requests = scripted_server([(1.0, 200, {"rewards": [0.0, 0.0]})])
    with running(server) as url:
        reward = RemoteReward(url, timeout=0.2, retries=1, backoff=0.0)
        with pytest.raises(RewardError, match=r"no answer after 2 attempts .*timed out") as error:
            reward(images_and_pixels()[0], PROMPTS, [{}, {}])
    assert len(requests) == 2
    assert url in str(error.value)


def test_retry_after_server_error_succeeds():
    server, requests = scripted_server([
        (0, 503, {"error": "warming up"}),
        (0, 200, {"rewards": [0.25, 0.75], "info": {"model": "m"}}),
    ])
    with running(server) as url:
        rewards, info = RemoteReward(url, timeout=5, retries=2, backoff=0.01)(images_and_pixels()[0], PROMPTS, [{}, {}])
    assert len(requests) == 2
    np.testing.assert_array_equal(rewards, [0.25, 0.75])
    assert info == {"model": "m"}


def test_retry_after_a_timeout_succeeds():
    server, requests = scripted_server([(1.0, 200, {"rewards": [9.0, 9.0]}), (0, 200, {"rewards": [1.0, 2.0]})])
    with running(server) as url:
        rewards, _ = RemoteReward(url, timeout=0.3, retries=1, backoff=0.0)(images_and_pixels()[0], PROMPTS, [{}, {}])
    np.testing.assert_array_equal(rewards, [1.0, 2.0])
    assert len(requests) == 2


def test_client_error_is_not_retried():
    server, requests = scripted_server([(0, 400, {"error": "bad request: no images"})])
    with running(server) as url:
        with pytest.raises(RewardError, match="HTTP 400 .*no images"):
            RemoteReward(url, retries=3, backoff=0.0)(images_and_pixels()[0], PROMPTS, [{}, {}])
    assert len(requests) == 1


def test_exception_on_the_server_reaches_the_client():
    def broken(images, prompts, metadata):
        raise ValueError("model exploded")

    with running(make_server(broken, "127.0.0.1", 0)) as url:
        reward = build_reward_fn(url, reward_kwargs={url: {"retries": 0}})
        with pytest.raises(RewardError, match="HTTP 500 .*model exploded"):
            reward(images_and_pixels()[0], PROMPTS, None)


def test_wrong_number_of_remote_rewards_is_a_reward_error():
    server, _ = scripted_server([(0, 200, {"rewards": [1.0, 2.0, 3.0]})])
    with running(server) as url:
        with pytest.raises(RewardError, match=r"returned shape \(3,\) for a batch of 2"):
            build_reward_fn(url)(images_and_pixels()[0], PROMPTS, None)


def test_unreachable_server_fails_after_retries():
    server, _ = scripted_server([(0, 200, {"rewards": []})])
    host, port = server.server_address[:2]
    server.server_close()  # nothing listens on this port any more
    with pytest.raises(RewardError, match="no answer after 2 attempts"):
        RemoteReward(f"http://{host}:{port}", timeout=1, retries=1, backoff=0.0)(images_and_pixels()[0], PROMPTS, [{}, {}])


def test_reference_server_command_serves_a_registered_reward():
    images, pixels = images_and_pixels(seed=3)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    process = subprocess.Popen(
        [sys.executable, "-m", "ddpo_group.rewards.server", "--serve", "jpeg_compressibility", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("serving reward 'jpeg_compressibility' on http://127.0.0.1:"), process.stderr.read()
        url = line.split(" on ")[1].strip()
        rewards, _ = RemoteReward(url, timeout=30)(images, PROMPTS, [{}, {}])
    finally:
        process.terminate()
        process.wait(timeout=10)
    np.testing.assert_array_equal(rewards, -pil_jpeg_kb(pixels))


def _raw_post(url, head_and_body: bytes, timeout=10.0):
    """Send raw bytes to the server; (status, JSON error) of its answer."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head_and_body)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _request(body: bytes, length=None):
    length = len(body) if length is None else length
    return (f"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
            .encode() + body)


def test_a_body_over_the_limit_is_refused_before_it_is_read():
    with running(make_server(get_reward("jpeg_compressibility"), "127.0.0.1", 0, max_body_mb=0.01)) as url:
        status, answer = _raw_post(url, _request(b"", length=200 * 2**20))  # announces 200 MB, sends nothing
    assert status == 413 and "--max-body-mb" in answer["error"]


def test_a_false_content_length_is_answered_within_the_read_timeout():
    with running(make_server(get_reward("jpeg_compressibility"), "127.0.0.1", 0, read_timeout=0.5)) as url:
        start = time.monotonic()
        status, answer = _raw_post(url, _request(b'{"images": [', length=1000))
        assert time.monotonic() - start < 5
    assert status == 408 and "Content-Length" in answer["error"]


def test_a_missing_content_length_gets_411():
    with running(make_server(get_reward("jpeg_compressibility"), "127.0.0.1", 0)) as url:
        status, _ = _raw_post(url, b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n{}")
    assert status == 411


def test_too_many_images_and_too_many_pixels_are_413_naming_the_limit():
    from ddpo_group.rewards.remote import encode_images

    images, _ = images_and_pixels(batch=3, size=64)
    payload = {"images": encode_images(images), "prompts": ["a"] * 3, "metadata": [{}] * 3}
    body = json.dumps(payload).encode()
    server = make_server(get_reward("jpeg_compressibility"), "127.0.0.1", 0, max_images=2)
    with running(server) as url:
        status, answer = _raw_post(url, _request(body))
    assert status == 413 and "--max-images 2" in answer["error"]
    server = make_server(get_reward("jpeg_compressibility"), "127.0.0.1", 0, max_pixels=1000)
    with running(server) as url:
        status, answer = _raw_post(url, _request(body))
    assert status == 413 and "64x64" in answer["error"] and "--max-pixels 1000" in answer["error"]
