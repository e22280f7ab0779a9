"""The reward server (uvicorn) against raw sockets: each of its limits, its description, its paths and its log;
the command line, with and without uvicorn installed. Deadlines of about a second keep these fast."""

import json
import logging
import select
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from helpers import pil_jpeg_kb, subprocess_env

from ddpo_group.rewards import get_reward
from ddpo_group.rewards.remote import RemoteReward, encode_images
from ddpo_group.rewards.server import make_server

PROMPTS = ["a cat", "a dog"]


def jpeg_server(**limits):
    return make_server(get_reward("jpeg_compressibility"), name="jpeg_compressibility", **limits)


def batch_body(batch=2, size=16, seed=0):
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(batch, size, size, 3), dtype=np.uint8)
    images = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255
    payload = {"images": encode_images(images), "prompts": ["p"] * batch, "metadata": [{}] * batch}
    return json.dumps(payload).encode(), pixels


def request(body=b"", method="POST", path="/", content_type="application/json", length=None, extra=""):
    length = len(body) if length is None else length
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n"
            f"{extra}\r\n").encode() + body


def connect(url, timeout=10.0):
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def read_answer(sock):
    """(status, JSON body) of the answer on `sock`, read to the end of its Content-Length; (None, None) when
    the server closed the connection without answering."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None, None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    length = [int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length")]
    while length and len(body) < length[0]:
        body += sock.recv(65536)
    return int(lines[0].split()[1]), json.loads(body) if body.startswith(b"{") else body.decode()


def exchange(url, data: bytes):
    with connect(url) as sock:
        sock.sendall(data)
        return read_answer(sock)


def trickle(url, data: bytes, start: int = 0, delay: float = 0.05):
    """Send data[:start] at once, then one byte every `delay` s until the server answers or hangs up.
    (status, body, bytes sent)."""
    with connect(url) as sock:
        sock.sendall(data[:start])
        sent = start
        while sent < len(data):
            if select.select([sock], [], [], delay)[0]:  # the server answered (or closed) before the end
                break
            try:
                sock.sendall(data[sent : sent + 1])
            except OSError:
                break
            sent += 1
        return (*read_answer(sock), sent)


# --- the protocol and the paths ------------------------------------------------------------------------------

def test_post_scores_the_batch():
    body, pixels = batch_body()
    with jpeg_server() as url:
        status, answer = exchange(url, request(body))
        status_named, answer_named = exchange(url, request(body, path="/jpeg_compressibility"))
    assert status == status_named == 200
    np.testing.assert_array_equal(answer["rewards"], -pil_jpeg_kb(pixels))
    assert answer_named["rewards"] == answer["rewards"]


def test_info_json_cannot_hold_is_a_json_500_naming_reward_and_key_and_nan_is_never_sent():
    def with_a_set(images, prompts, metadata):
        return [1.0] * len(prompts), {"ok": np.float32(0.5), "labels": {"a", "b"}}

    def with_nan(images, prompts, metadata):
        return [1.0] * len(prompts), {"score": [float("nan"), 2.0], "worst": float("-inf")}

    def nan_reward(images, prompts, metadata):
        return torch.tensor([0.5, float("nan")]), {}

    body, _ = batch_body()
    answers = []
    for reward in (with_a_set, with_nan, nan_reward):
        with make_server(reward) as url:
            with connect(url) as sock:
                sock.sendall(request(body))
                raw = sock.recv(1 << 20)
            answers.append((raw, exchange(url, request(body))))
    (raw_set, (status, answer)), (raw_nan, (status_nan, answer_nan)), (raw_bad, (status_bad, answer_bad)) = answers
    assert status == 500 and answer["reward_failed"] is True
    assert answer["error"].startswith("reward 'with_a_set' returned info['labels'] holding a value of type set")
    # info: NaN and infinities as JSON null; the body is strict JSON (no bare NaN / Infinity tokens)
    assert status_nan == 200 and answer_nan["info"] == {"score": [None, 2.0], "worst": None}
    assert b"NaN" not in raw_nan and b"Infinity" not in raw_nan
    # a NaN reward is refused naming the reward and the sample, as the training loop refuses it locally
    assert status_bad == 500 and answer_bad["reward_failed"] is True and b"NaN" not in raw_bad
    assert answer_bad["error"].startswith("reward 'nan_reward' returned nan for sample 1")


@pytest.mark.parametrize("path", ["/", "/health", "/jpeg_compressibility"])
def test_get_describes_the_served_reward_and_its_limits(path):
    with jpeg_server(max_images=7, request_timeout=1.5) as url:
        status, answer = exchange(url, request(method="GET", path=path))
    assert status == 200
    assert answer["reward"] == "jpeg_compressibility" and answer["protocol"] == 1
    assert answer["limits"]["max_images"] == 7 and answer["limits"]["request_timeout"] == 1.5


def test_a_post_to_the_path_of_another_reward_is_404_naming_the_served_one():
    body, _ = batch_body()
    with jpeg_server() as url:
        status, answer = exchange(url, request(body, path="/aesthetic"))
        get_status, _ = exchange(url, request(method="GET", path="/aesthetic"))
    assert status == get_status == 404
    assert "'/aesthetic'" in answer["error"] and "'jpeg_compressibility'" in answer["error"]
    assert "/jpeg_compressibility" in answer["error"].split("POST")[1]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_a_body_that_is_not_json_by_content_type_is_415(content_type):
    body, _ = batch_body()
    with jpeg_server() as url:
        status, answer = exchange(url, request(body, content_type=content_type))
    assert status == 415 and "Content-Type must be application/json" in answer["error"]


def test_json_with_a_charset_is_accepted_and_other_methods_are_405():
    body, _ = batch_body()
    with jpeg_server() as url:
        status, _ = exchange(url, request(body, content_type="application/json; charset=utf-8"))
        put_status, answer = exchange(url, request(body, method="PUT"))
    assert status == 200
    assert put_status == 405 and "POST scores a batch" in answer["error"]


def test_a_body_that_is_not_the_protocol_is_400():
    with jpeg_server() as url:
        not_json = exchange(url, request(b"{not json"))
        no_images = exchange(url, request(b'{"prompts": []}'))
    assert not_json[0] == no_images[0] == 400
    assert no_images[1]["error"] == "bad request: missing field 'images'"


# --- the limits --------------------------------------------------------------------------------------------------

def test_a_body_over_the_limit_is_refused_before_it_is_read():
    with jpeg_server(max_body_mb=0.01) as url:
        status, answer = exchange(url, request(length=200 * 2**20))  # announces 200 MB, sends nothing
    assert status == 413 and "--max-body-mb 0.01" in answer["error"]


def test_a_chunked_body_over_the_limit_is_refused_while_it_arrives():
    chunk = b"x" * 4096
    data = (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n" % (len(chunk), chunk) * 10)  # 40 kB, never finished
    with jpeg_server(max_body_mb=0.01) as url:
        status, answer = exchange(url, data)
    assert status == 413 and "--max-body-mb 0.01" in answer["error"]


def test_a_client_sending_the_head_a_byte_at_a_time_is_refused_at_the_deadline():
    data = request(*batch_body()[:1])
    with jpeg_server(request_timeout=1.0) as url:
        status, answer, sent = trickle(url, data)  # a byte every 50 ms: the head alone would take ~7 s
    assert status == 408 and "--request-timeout 1" in answer["error"]
    assert sent < data.index(b"\r\n\r\n")  # refused while the head was still arriving


def test_a_client_sending_the_body_a_byte_at_a_time_is_refused_at_the_deadline():
    data = request(*batch_body()[:1])
    body_start = data.index(b"\r\n\r\n") + 4
    with jpeg_server(request_timeout=1.0) as url:
        status, answer, sent = trickle(url, data, start=body_start)
    assert status == 408 and "--request-timeout 1" in answer["error"]
    assert body_start < sent < len(data)


def test_a_body_shorter_than_its_content_length_is_408():
    with jpeg_server(request_timeout=0.5) as url:
        status, answer = exchange(url, request(b'{"images": [', length=1000))
    assert status == 408 and "12 bytes of 1000 received" in answer["error"]


def test_a_slow_client_does_not_hold_the_worker():
    body, pixels = batch_body()
    results = []
    with jpeg_server(request_timeout=2.0, workers=1) as url:
        slow = threading.Thread(target=lambda: results.append(trickle(url, request(body))))
        slow.start()
        time.sleep(0.2)  # the slow client is connected and sending
        rewards, _ = RemoteReward(url, retries=0)(torch.from_numpy(pixels).permute(0, 3, 1, 2) / 255.0, PROMPTS, [{}, {}])
        assert slow.is_alive()  # scored while the slow client still holds its connection
        slow.join()
    np.testing.assert_array_equal(rewards, -pil_jpeg_kb(pixels))
    assert results[0][0] == 408


def test_connections_past_the_limit_get_503_and_an_idle_connection_is_closed_at_the_deadline():
    body, _ = batch_body()
    with jpeg_server(max_connections=2, request_timeout=1.0) as url:
        idle = connect(url)  # one open connection; the next request makes two: the limit
        status, _ = exchange(url, request(body))
        assert status == 503
        assert idle.recv(1) == b""  # the idle connection sent nothing: closed without an answer at the deadline
        idle.close()
        status_after, _ = exchange(url, request(body))
    assert status_after == 200


def test_too_many_images_and_too_many_pixels_are_413_naming_the_limit():
    body, _ = batch_body(batch=3, size=64)
    with jpeg_server(max_images=2) as url:
        status, answer = exchange(url, request(body))
    assert status == 413 and "--max-images 2" in answer["error"]
    with jpeg_server(max_pixels=1000) as url:
        status, answer = exchange(url, request(body))
    assert status == 413 and "64x64" in answer["error"] and "--max-pixels 1000" in answer["error"]


def test_one_log_line_per_request(caplog):
    body, _ = batch_body(batch=3)
    with caplog.at_level(logging.INFO, logger="ddpo_group.rewards.server"):
        with jpeg_server() as url:
            exchange(url, request(body, path="/jpeg_compressibility"))
            exchange(url, request(body, content_type="text/plain"))
            exchange(url, request(method="GET", path="/health"))
    lines = [r.getMessage() for r in caplog.records if r.name == "ddpo_group.rewards.server"]
    assert len(lines) == 3
    assert lines[0].startswith("POST /jpeg_compressibility 200 images=3 ") and " ms " in lines[0]
    assert lines[1].startswith("POST / 415 images=0 ")
    assert lines[2].startswith("GET /health 200 images=0 ")


# --- the command line --------------------------------------------------------------------------------------

def test_the_server_command_serves_a_registered_reward_and_logs_each_request():
    body, pixels = batch_body(seed=3)
    process = subprocess.Popen(
        [sys.executable, "-m", "ddpo_group.rewards.server", "--serve", "jpeg_compressibility", "--port", "0",
         "--request-timeout", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("serving reward 'jpeg_compressibility' on http://127.0.0.1:"), process.stderr.read()
        url = line.split(" on ")[1].strip()
        reward = RemoteReward(url, timeout=30)
        rewards, _ = reward(torch.from_numpy(pixels).permute(0, 3, 1, 2) / 255.0, PROMPTS, [{}, {}])
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    np.testing.assert_array_equal(rewards, -pil_jpeg_kb(pixels))
    assert reward.served_name == "jpeg_compressibility" and reward.description["limits"]["request_timeout"] == 2
    assert " GET / 200 images=0 " in stderr and " POST / 200 images=2 " in stderr


def test_without_uvicorn_the_core_trains_and_the_command_says_what_to_install():
    """uvicorn is blocked in a fresh interpreter (an import of it fails): the trainer, the CLI and the reward
    server module import, a reward builds, and --serve exits with one line naming the extra."""
    code = (
        "import sys; sys.modules['uvicorn'] = None\n"
        "import ddpo_group.training.trainer, ddpo_group.cli, ddpo_group.rewards.server as server\n"
        "from ddpo_group.rewards import build_reward_fn\n"
        "assert build_reward_fn('jpeg_compressibility').names == ['jpeg_compressibility']\n"
        "server.main(['--serve', 'jpeg_compressibility', '--port', '0'])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                            timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == 'reward server: error: the reward server needs uvicorn: pip install "ddpo-group[server]"'


@pytest.mark.parametrize("flag", ["--request-timeout", "--max-connections", "--workers"])
def test_a_limit_that_is_not_positive_is_one_line(flag, capsys):
    from ddpo_group.rewards.server import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--serve", "jpeg_compressibility", flag, "0"])
    assert str(exit_info.value) in (f"reward server: error: {flag} must be > 0, got {zero}" for zero in ("0", "0.0"))


@pytest.mark.parametrize("args, needle", [
    (["--port", "99999"], "argument --port: expected a port number from 0 to 65535, got '99999'"),
    (["--kwargs", '{"qualty": 5}'], "--serve 'jpeg_compressibility': reward 'jpeg_compressibility' takes no keyword "
                                    "argument 'qualty'; it takes none"),
])
def test_a_bad_port_or_a_misspelt_reward_argument_is_one_line_before_serving(args, needle):
    # the misspelt argument used to be served: every request then answered 500
    result = subprocess.run([sys.executable, "-m", "ddpo_group.rewards.server", "--serve", "jpeg_compressibility",
                             *args], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1 and needle in lines[0], result.stdout + result.stderr


# --- issue 34, items 10-11: the decoded size of a request is bounded, and its shape is checked ---------------------

PEAK_SCRIPT = r'''
import base64, io, json, resource
import numpy as np, torch
from PIL import Image
from ddpo_group.rewards.server import RewardApp

side, count = 1024, 8
buffer = io.BytesIO()
Image.fromarray(np.full((side, side, 3), 7, np.uint8)).save(buffer, format="PNG")  # a few KB, 3 MB of pixels
png = base64.b64encode(buffer.getvalue()).decode()
app = RewardApp(lambda images, prompts, metadata: (torch.zeros(len(prompts)), {}), "zero")
app._score(json.dumps({"images": [png], "prompts": ["p"]}).encode())  # the allocator's first costs, not counted
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
status = app._score(json.dumps({"images": [png] * count, "prompts": ["p"] * count}).encode())[0]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"status": status, "peak_bytes": (after - before) * 1024, "body": len(png) * count}))
'''


def test_decoding_a_request_holds_its_float32_tensor_and_little_more():
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, timeout=120,
                            env=subprocess_env())
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    tensor = 8 * 3 * 1024 * 1024 * 4  # the (8, 3, 1024, 1024) float32 images the reward is given: 96 MiB
    one_image = 3 * 1024 * 1024 * 4
    assert measured["status"] == 200
    assert measured["peak_bytes"] < tensor + 2 * one_image + measured["body"] * 4, measured


def test_a_request_that_decodes_to_more_than_the_limit_is_413_before_decoding():
    body, _ = batch_body(batch=3, size=64)  # 3 * 3 * 64 * 64 * 4 bytes = 0.14 MB of float32
    with jpeg_server(max_decoded_mb=0.1) as url:
        status, answer = exchange(url, request(body))
    assert status == 413 and "--max-decoded-mb 0.1" in answer["error"] and "3 images of 64x64" in answer["error"]
    with jpeg_server(max_decoded_mb=0.15) as url:
        assert exchange(url, request(body))[0] == 200


@pytest.mark.parametrize("payload,needle", [
    ({"images": [], "prompts": "ab"}, '"prompts" must be a list of strings, got a JSON string'),
    ({"images": [], "prompts": [1, 2]}, '"prompts" must be a list of strings; item 0 is a JSON number'),
    ({"images": "x", "prompts": []}, '"images" must be a list of base64 PNG strings, got a JSON string'),
    ({"images": [{"a": 1}], "prompts": ["p"]}, '"images" must be a list of base64 PNG strings; item 0 is a JSON object'),
    ({"images": [], "prompts": [], "metadata": "m"}, '"metadata" must be a list of objects, got a JSON string'),
    ({"images": [], "prompts": [], "metadata": [1]}, '"metadata" must be a list of objects; item 0 is a JSON number'),
])
def test_a_request_of_the_wrong_shape_is_400_naming_the_field(payload, needle):
    with jpeg_server() as url:
        status, answer = exchange(url, request(json.dumps(payload).encode()))
    assert status == 400 and needle in answer["error"], answer


def test_json_nested_too_deeply_is_400():
    with jpeg_server() as url:
        status, answer = exchange(url, request(b"[" * 100_000 + b"]" * 100_000))
        nested_field = exchange(url, request(b'{"images": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"))
    assert status == nested_field[0] == 400 and "nested too deeply" in answer["error"], answer
