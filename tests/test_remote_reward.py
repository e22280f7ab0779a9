"""Remote reward client: JSON over HTTP against real local servers: the reference server (uvicorn), scripted
http.server servers (retries, status codes), and raw-socket servers that misbehave (trickle, huge, not JSON)."""

import base64
import io
import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import cheap, make_config, pil_jpeg_kb, read_dump, read_metrics

from ddpo_group.rewards import RewardError, RewardNotReadyError, build_reward_fn, get_reward
from ddpo_group.rewards.remote import RemoteReward
from ddpo_group.rewards.server import make_server

PROMPTS = ["a cat", "a dog"]


def images_and_pixels(seed=0, batch=2, size=16):
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(batch, size, size, 3), dtype=np.uint8)
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255, pixels


class running:
    """Context manager: serve an http.server `server` in a thread, shut it down on exit; yields its URL."""

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
    """A POST-only server (GET: http.server's 501, as a server without a description): its i-th POST gets
    answers[i] = (delay_s, status, payload); the bodies it received are in the returned list."""
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


class RawServer:
    """A misbehaving server on a raw socket: reads each request's head and Content-Length body, then
    `answer(conn)` writes whatever it likes; `requests` counts them, `sent` adds up the bytes it wrote
    before the client went away. Context manager yielding its URL."""

    def __init__(self, answer):
        self.answer, self.requests, self.sent = answer, 0, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self.listener.getsockname()[1]

    def send(self, conn, data: bytes) -> bool:
        """Write `data`; False once the client has closed the connection."""
        try:
            conn.sendall(data)
        except OSError:
            return False
        self.sent += len(data)
        return True

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
                while length and len(body) < length[0]:
                    body += conn.recv(65536)
                self.requests += 1
                self.answer(self, conn)

    def __enter__(self):
        threading.Thread(target=self._serve, daemon=True).start()
        return self.url

    def __exit__(self, *exc_info):
        self.listener.close()


def head(status=200, length=None, extra=b""):
    line = b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nConnection: close\r\n" % status
    return line + (b"Content-Length: %d\r\n" % length if length is not None else b"") + extra + b"\r\n"


# --- the protocol, against the reference server -------------------------------------------------------------

def test_remote_reward_equals_the_reward_run_on_the_server_and_is_named_after_it():
    images, pixels = images_and_pixels()
    server = make_server(get_reward("jpeg_incompressibility"), name="jpeg_incompressibility")
    with server as url:
        reward = build_reward_fn(url)
        total, components, _ = reward(images, PROMPTS, [{"data_source": "x"}, {"data_source": "y"}])
    np.testing.assert_array_equal(total, pil_jpeg_kb(pixels))  # PNG keeps the 8-bit pixels exactly
    assert reward.names == ["jpeg_incompressibility"]  # the served reward's name, not "remote"
    assert list(components) == ["jpeg_incompressibility"]


def test_protocol_carries_prompts_metadata_and_info():
    def echo(images, prompts, metadata):
        return [m["ground_truth"] for m in metadata], {"prompts": prompts, "height": images.shape[2]}

    images, _ = images_and_pixels(size=8)
    metadata = [{"ground_truth": 3}, {"ground_truth": np.float32(0.5)}]
    with make_server(echo) as url:
        reward = RemoteReward(url)
        rewards, info = reward(images, PROMPTS, metadata)
    np.testing.assert_array_equal(rewards, [3.0, 0.5])
    assert info == {"prompts": PROMPTS, "height": 8}
    assert reward.served_name == "echo" and reward.description["protocol"] == 1


def test_request_format_is_base64_png_prompts_metadata():
    server, requests = scripted_server([(0, 200, {"rewards": [1.0, 2.0], "info": {}})])
    images, pixels = images_and_pixels()
    with running(server) as url:
        reward = RemoteReward(url)
        reward(images, PROMPTS, [{"a": 1}, {"b": 2}])
    body = requests[0]
    assert body["prompts"] == PROMPTS and body["metadata"] == [{"a": 1}, {"b": 2}]
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(body["images"][1]))))
    np.testing.assert_array_equal(decoded, pixels[1])
    assert reward.served_name is None  # a server without a description (GET 501) is used all the same


def test_two_servers_of_the_same_reward_get_distinct_names():
    one, two = (make_server(get_reward("jpeg_compressibility"), name="jpeg_compressibility") for _ in range(2))
    with one as url_one, two as url_two:
        reward = build_reward_fn(None, {url_one: 1.0, url_two: 0.5, "jpeg_compressibility": 1.0})
        images, pixels = images_and_pixels()
        total, components, _ = reward(images, PROMPTS, None)
    assert reward.names == [f"jpeg_compressibility@{url_one.removeprefix('http://')}",
                            f"jpeg_compressibility@{url_two.removeprefix('http://')}", "jpeg_compressibility"]
    np.testing.assert_allclose(total, -2.5 * pil_jpeg_kb(pixels), rtol=1e-12)


# --- retries and status codes ---------------------------------------------------------------------------------

def test_timeout_is_retried_then_raises_reward_error():
    server, requests = scripted_server([(1.0, 200, {"rewards": [0.0, 0.0]})])
    with running(server) as url:
        reward = RemoteReward(url, timeout=0.2, retries=1, backoff=0.0)
        with pytest.raises(RewardError, match=r"no 200 answer after 2 attempts .*timed out") as error:
            reward(images_and_pixels()[0], PROMPTS, [{}, {}])
    assert len(requests) == 2
    assert url in str(error.value)


def test_total_timeout_ends_the_attempts():
    server, requests = scripted_server([(1.0, 200, {"rewards": [0.0, 0.0]})])
    with running(server) as url:
        reward = RemoteReward(url, timeout=0.3, retries=5, backoff=0.0, total_timeout=0.5)
        with pytest.raises(RewardError, match=r"no 200 answer after 2 attempts .*total_timeout 0.5 s"):
            reward(images_and_pixels()[0], PROMPTS, [{}, {}])
    assert len(requests) == 2  # 0.3 s, then the 0.2 s left: not the 6 attempts retries=5 would allow


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


def test_client_error_is_not_retried_and_names_the_url():
    server, requests = scripted_server([(0, 400, {"error": "bad request: no images"})])
    with running(server) as url:
        with pytest.raises(RewardError, match="HTTP 400: bad request: no images") as error:
            RemoteReward(url, retries=3, backoff=0.0)(images_and_pixels()[0], PROMPTS, [{}, {}])
    assert len(requests) == 1
    assert str(error.value).startswith(f"remote reward {url}: ")


def test_exception_on_the_server_reaches_the_client():
    def broken(images, prompts, metadata):
        raise ValueError("model exploded")

    with make_server(broken) as url:
        reward = build_reward_fn(url, reward_kwargs={url: {"retries": 0}})
        with pytest.raises(RewardError, match="HTTP 500: reward 'broken' raised ValueError: model exploded"):
            reward(images_and_pixels()[0], PROMPTS, None)


def test_a_served_rewards_own_failure_is_not_retried_and_the_client_says_what_the_server_said():
    calls = []

    def unserialisable_info(images, prompts, metadata):
        calls.append(len(prompts))
        return [1.0] * len(prompts), {"handle": object()}

    with make_server(unserialisable_info) as url:
        reward = RemoteReward(url, retries=3, backoff=0.0)
        with pytest.raises(RewardError) as error:
            reward(images_and_pixels()[0], PROMPTS, [{}, {}])
    message = str(error.value)
    assert calls == [2]  # one attempt: a reward's failure is not a transport failure
    assert "\n" not in message and message.startswith(f"remote reward {url}: the served reward failed")
    assert "reward 'unserialisable_info' returned info['handle'] holding a value of type object" in message


def test_wrong_number_of_remote_rewards_is_a_reward_error():
    server, _ = scripted_server([(0, 200, {"rewards": [1.0, 2.0, 3.0]})])
    with running(server) as url:
        with pytest.raises(RewardError, match=r"returned shape \(3,\) for a batch of 2"):
            build_reward_fn(url)(images_and_pixels()[0], PROMPTS, None)


def _closed_port_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return "http://127.0.0.1:%d" % sock.getsockname()[1]  # nothing listens there once closed


def test_unreachable_server_fails_after_retries():
    reward = RemoteReward(_closed_port_url(), timeout=1, retries=1, backoff=0.0, check=False)
    with pytest.raises(RewardError, match="no 200 answer after 2 attempts .*ConnectionRefusedError"):
        reward(images_and_pixels()[0], PROMPTS, [{}, {}])


def test_a_dead_url_fails_when_the_reward_is_built_naming_it():
    url = _closed_port_url()
    with pytest.raises(RewardNotReadyError) as error:
        build_reward_fn(url, reward_kwargs={url: {"retries": 0}})
    message = str(error.value)
    assert message.startswith(f"remote reward {url}: no 200 answer after 1 attempt ")
    assert "python -m ddpo_group.rewards.server" in message and "\n" not in message


def test_a_url_with_the_path_of_another_reward_fails_when_built():
    with make_server(get_reward("jpeg_compressibility"), name="jpeg_compressibility") as url:
        with pytest.raises(RewardNotReadyError, match=r"/aesthetic: GET answered HTTP 404: .*'jpeg_compressibility'"):
            RemoteReward(url + "/aesthetic", retries=0)
        assert RemoteReward(url + "/jpeg_compressibility").served_name == "jpeg_compressibility"


# --- the client's caps against misbehaving servers -----------------------------------------------------------

def test_a_trickled_answer_is_cut_off_at_the_attempt_deadline():
    body = json.dumps({"rewards": [1.0, 2.0]}).encode().ljust(2000)

    def trickle(server, conn):
        if server.send(conn, head(length=len(body))):
            for i in range(len(body)):  # a byte every 20 ms: 40 s for the whole answer
                if not server.send(conn, body[i : i + 1]):
                    return
                time.sleep(0.02)

    bad = RawServer(trickle)
    with bad as url:
        with pytest.raises(RewardError, match=r"no 200 answer after 1 attempt .*timed out after 0.5 s") as error:
            RemoteReward(url, timeout=0.5, retries=0, check=False)(images_and_pixels()[0], PROMPTS, [{}, {}])
    assert str(error.value).startswith(f"remote reward {url}: ")
    assert bad.sent < len(head(length=len(body))) + len(body)  # the client hung up before the end


def test_trickled_headers_are_cut_off_too():
    def trickle(server, conn):
        for byte in head(length=20) + b'{"rewards": [1, 2]}':
            if not server.send(conn, bytes([byte])):
                return
            time.sleep(0.02)

    bad = RawServer(trickle)
    with bad as url:
        with pytest.raises(RewardError, match="timed out after 0.5 s"):
            RemoteReward(url, timeout=0.5, retries=0, check=False)(images_and_pixels()[0], PROMPTS, [{}, {}])
    assert bad.sent < len(head(length=20)) + 20


def test_an_answer_announced_over_the_cap_is_refused_and_not_retried():
    def huge(server, conn):
        if server.send(conn, head(length=200 * 2**20)):
            server.send(conn, b" " * 2**20)

    bad = RawServer(huge)
    with bad as url:
        with pytest.raises(RewardError, match=r"answer of 209715200 bytes is over max_response_mb=1\b") as error:
            RemoteReward(url, retries=2, max_response_mb=1, check=False)(images_and_pixels()[0], PROMPTS, [{}, {}])
    assert str(error.value).startswith(f"remote reward {url}: ")
    assert bad.requests == 1


def test_an_answer_without_length_is_cut_at_the_cap():
    def endless(server, conn):
        if server.send(conn, head()):
            for _ in range(200):  # 200 MB unless the client stops reading
                if not server.send(conn, b" " * 2**20):
                    return

    bad = RawServer(endless)
    with bad as url:
        with pytest.raises(RewardError, match=r"answer of more than \d+ bytes is over max_response_mb=1\b"):
            RemoteReward(url, retries=0, max_response_mb=1, check=False)(images_and_pixels()[0], PROMPTS, [{}, {}])
    assert bad.sent < 100 * 2**20


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_an_answer_that_is_not_json_names_the_url(method):
    def html(server, conn):
        server.send(conn, head(length=15) + b"<html>oops</h1>")

    bad = RawServer(html)
    with bad as url:
        expected = RewardNotReadyError if method == "GET" else RewardError
        with pytest.raises(expected, match=rf"remote reward {url}: the answer to {method} is not JSON .*<html>oops"):
            reward = RemoteReward(url, retries=2, check=method == "GET")
            reward(images_and_pixels()[0], PROMPTS, [{}, {}])
    assert bad.requests == 1  # not retried


# --- a training run with a remote reward --------------------------------------------------------------------

def test_a_run_with_a_remote_reward_logs_the_reward_computed_locally(tmp_path):
    """The server scores with PIL's JPEG size (tests/helpers.py), the local run with the registered reward:
    the same seed gives the same samples, so every logged reward value must agree."""

    def neg_jpeg_kb(images, prompts, metadata):
        pixels = (images.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy()
        return -pil_jpeg_kb(pixels), {}

    (tmp_path / "eval.txt").write_text("a red circle\na blue square\n")
    overrides = cheap(debug_dump=True, eval_freq=1, eval_prompt_fn=str(tmp_path / "eval.txt"))
    with make_server(neg_jpeg_kb) as url:
        from ddpo_group.training.trainer import Trainer

        remote_dir = Trainer(make_config(tmp_path, run_name="remote", reward_fn=url, **overrides)).run()
    local_dir = Trainer(make_config(tmp_path, run_name="local", reward_fn="jpeg_compressibility", **overrides)).run()
    remote_rows, local_rows = read_metrics(remote_dir), read_metrics(local_dir)
    assert [row["epoch"] for row in remote_rows] == [row["epoch"] for row in local_rows] == [0, 1]  # 1: final eval
    for remote, local in zip(remote_rows, local_rows):
        assert not [key for key in remote if key.endswith("/remote")]
        assert remote["eval/neg_jpeg_kb"] == local["eval/jpeg_compressibility"]
        assert remote["eval/reward_mean"] == local["eval/reward_mean"]
    assert remote_rows[0]["reward/neg_jpeg_kb"] == local_rows[0]["reward/jpeg_compressibility"]
    assert remote_rows[0]["reward_mean"] == local_rows[0]["reward_mean"]
    assert read_dump(remote_dir)["rewards"] == read_dump(local_dir)["rewards"]
    assert len(set(read_dump(remote_dir)["rewards"])) > 1  # the samples differ: the check is not vacuous


def test_a_run_with_a_dead_url_stops_before_anything_is_written(tmp_path):
    from ddpo_group.training.trainer import Trainer

    url = _closed_port_url()
    config = make_config(tmp_path, reward_fn=url, **cheap())
    with pytest.raises(RewardNotReadyError, match=f"remote reward {url}: no 200 answer"):
        Trainer(config)
    assert not os.path.exists(os.path.join(str(tmp_path), "r"))
