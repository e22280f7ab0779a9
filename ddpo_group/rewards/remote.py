"""Remote rewards: score images on another machine over JSON / HTTP (the client and the protocol).

Use `reward_fn="http://host:port"` (a path after the host is kept: "http://host:port/aesthetic").
Protocol (version 1), one POST per batch (Content-Type: application/json) to the URL:

    request   {"images":   [base64 of an 8-bit RGB PNG, one per image],
               "prompts":  [str, one per image],
               "metadata": [object, one per image (the prompt record's extra fields)]}
    response  200 {"rewards": [number, one per image], "info": {str: JSON value}}
              4xx / 5xx {"error": "message"}
              500 {"error": "reward 'NAME' ...", "reward_failed": true}: the reward itself failed (not retried)

and GET on the same URL: 200 {"reward": NAME, "protocol": 1, "group_wise": bool, ...} (the server's
description; a server that answers GET with 405 or 501 has none, and is still used). A server whose
reward is group-wise (rewards/base.py) says so, and the client is then group-wise too: each POST holds
one whole prompt group. Images are quantized to 8 bits
(round(255 x)) before PNG encoding; numpy / torch values in metadata are sent as lists / numbers.

The client asks for the description when the reward is built (before any sampling): an unreachable
URL is a RewardNotReadyError naming it, and the reward's component name (metrics reward/NAME,
eval/NAME) is the served reward's NAME. Each attempt has `timeout` seconds in all (connecting,
sending, and the whole answer: a server that trickles bytes is cut off at the deadline), and all
attempts together `total_timeout` seconds; connection errors, timeouts and 5xx answers are retried up
to `retries` more times, waiting `backoff * 2**attempt` seconds between attempts; a 4xx answer (a bad
request), an answer over `max_response_mb` or one that is not the protocol's JSON are not retried.
Every error is a RewardError whose message names the URL.

The reference server, hosting any registered reward or plugin spec, is ``ddpo_group.rewards.server``.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import socket
import threading
import time
import urllib.parse

import numpy as np
import torch
from PIL import Image

from ddpo_group.rewards.base import RewardError, RewardNotReadyError, to_uint8_images

PROTOCOL_VERSION = 1
# The key a server sets (true) in a 5xx answer when the reward itself failed (it raised, or returned what the
# protocol cannot carry): a fault of the reward, not of the transport, so the client does not retry it.
REWARD_FAILED = "reward_failed"
# The default limit on an answer's size (MB), the VLM judge's too: a reward's answer is numbers, a judge's a few KB
# of text; a server that sends hundreds of MB is broken, and reading it all would cost as much memory.
MAX_RESPONSE_MB = 16.0


def to_json(value):
    """numpy / torch values -> plain JSON values (json.dumps `default`)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def encode_images(images) -> list[str]:
    """(B, 3, H, W) in [0, 1] -> B base64 strings of 8-bit RGB PNGs."""
    encoded = []
    for image in to_uint8_images(images):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return encoded


class RequestTooLarge(ValueError):
    """A request over one of the server's limits (HTTP 413); the message names the limit."""


def decode_images(encoded: list[str], max_pixels: int | None = None, max_decoded_mb: float | None = None) -> torch.Tensor:
    """B base64 PNG strings -> float32 tensor (B, 3, H, W) in [0, 1] (pixel / 255).

    max_pixels: refuse (RequestTooLarge) an image whose header declares more pixels, before decoding it.
    max_decoded_mb: refuse a batch whose decoded tensor, B * 3 * H * W * 4 bytes (from the headers), is larger
    than this many MB (2**20 bytes).
    The images are decoded one at a time into that one preallocated float32 tensor, so decoding holds it and one
    image's 8-bit pixels at most, never a float copy per image (a 12 KB PNG may decode to 50 MB of float32).
    """
    opened = []
    for i, item in enumerate(encoded):
        image = Image.open(io.BytesIO(base64.b64decode(item)))
        width, height = image.size
        if max_pixels is not None and width * height > max_pixels:
            raise RequestTooLarge(
                f"image {i} has {width}x{height} = {width * height} pixels, over the server's limit "
                f"--max-pixels {max_pixels}"
            )
        opened.append(image)
    if len({image.size for image in opened}) > 1:
        raise ValueError(f"images have different sizes: {sorted({(h, w, 3) for w, h in (i.size for i in opened)})}")
    width, height = opened[0].size if opened else (0, 0)
    total = len(opened) * 3 * height * width * 4
    if max_decoded_mb is not None and total > max_decoded_mb * 2**20:
        raise RequestTooLarge(
            f"{len(opened)} images of {width}x{height} decode to {total / 2**20:.3g} MB of float32, over the server's "
            f"limit --max-decoded-mb {max_decoded_mb:g}; send fewer images per request"
        )
    out = torch.empty((len(opened), 3, height, width), dtype=torch.float32)
    for i in range(len(opened)):
        image, opened[i] = opened[i], None  # each decoded image is freed before the next one is decoded
        out[i].copy_(torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1))  # a writable array
        image.close()
    return out.div_(255)


class AnswerTooLarge(Exception):
    """An HTTP answer over a byte limit; `size` says how large ("N bytes", or "more than N bytes")."""

    def __init__(self, size: str):
        super().__init__(size)
        self.size = size


def bounded_exchange(conn, method: str, path: str, body: bytes | None, headers: dict, timeout: float,
                     max_bytes: int):
    """(response, body bytes) of one request on `conn` (an http.client connection, not yet used; closed here) that
    takes at most `timeout` s in all: a watchdog shuts the socket at the deadline, whatever stage (connecting,
    headers, a trickled body) the answer is in, and each read waits at most the time left. TimeoutError past the
    deadline; AnswerTooLarge when the answer declares or sends more than `max_bytes` (read no further);
    OSError / http.client.HTTPException for the rest. The remote reward client's and the VLM judge's one attempt."""
    expired = threading.Event()

    def cut_off():
        expired.set()
        if conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(timeout, cut_off)
    watchdog.daemon = True
    deadline = time.monotonic() + timeout
    watchdog.start()
    try:
        try:
            conn.request(method, path, body=body, headers=headers)
        except (BrokenPipeError, ConnectionResetError):
            if conn.sock is None:
                raise
            # the server refused the body before reading it all (413): its answer may be waiting
        response = conn.getresponse()
        length = response.getheader("Content-Length", "")
        if length.strip().isdigit() and int(length) > max_bytes:
            raise AnswerTooLarge(f"{int(length)} bytes")
        data = bytearray()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if conn.sock is not None:
                conn.sock.settimeout(remaining)
            chunk = response.read1(65536)
            if not chunk:
                break
            data += chunk
            if len(data) > max_bytes:
                raise AnswerTooLarge(f"more than {len(data)} bytes")
        if expired.is_set():
            raise TimeoutError
        return response, bytes(data)
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set() and not isinstance(exc, TimeoutError):
            raise TimeoutError from exc  # the watchdog's shutdown, seen as a reset or a short read
        raise
    finally:
        watchdog.cancel()
        conn.close()


class _Retry(Exception):
    """An attempt that failed in a way worth another attempt (no connection, a timeout, a 5xx answer)."""


def _error_detail(data: bytes) -> str:
    """The server's {"error": ...} message, or the start of the body as text."""
    try:
        answer = json.loads(data)
        if isinstance(answer, dict) and isinstance(answer.get("error"), str):
            return answer["error"][:500]
    except ValueError:
        pass
    return " ".join(data[:300].decode(errors="replace").split()) or "(empty body)"


def _reward_failed(data: bytes) -> bool:
    """Whether an error answer says the served reward itself failed (REWARD_FAILED), not the server or the network."""
    try:
        answer = json.loads(data)
    except ValueError:
        return False
    return isinstance(answer, dict) and answer.get(REWARD_FAILED) is True


class RemoteReward:
    """Client of a reward server (protocol in the module docstring).

    timeout: seconds one attempt may take in all; retries: further attempts after a connection error, a
    timeout or a 5xx answer; backoff: seconds before the first retry (doubled each time); total_timeout:
    seconds all attempts of one call may take together (None: attempts x timeout plus the waits);
    max_response_mb: a larger answer is refused; check: ask the server for its description now
    (RewardNotReadyError when it cannot be reached), which also names the reward (`served_name`).
    """

    # A batch that fails is not re-sent sample by sample to find the culprit (see CombinedReward).
    locate_errors = False

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5,
                 total_timeout: float | None = None, max_response_mb: float = MAX_RESPONSE_MB, check: bool = True):
        if not (timeout > 0 and retries >= 0 and backoff >= 0 and max_response_mb > 0
                and (total_timeout is None or total_timeout > 0)):
            raise ValueError(
                f"RemoteReward {url}: timeout, total_timeout and max_response_mb must be > 0, retries and backoff "
                f">= 0; got timeout={timeout}, total_timeout={total_timeout}, retries={retries}, backoff={backoff}, "
                f"max_response_mb={max_response_mb}"
            )
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"remote reward {url!r}: expected http://HOST:PORT[/PATH] or https://...")
        self.url = url
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        waits = sum(self.backoff * 2**k for k in range(self.retries))
        self.total_timeout = float(total_timeout) if total_timeout else self.timeout * (self.retries + 1) + waits
        self.max_response_bytes = int(max_response_mb * 2**20)
        self._connection = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._host, self._port = parts.hostname, parts.port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.description, self.served_name, self._checked = None, None, False
        self.group_wise = False  # set from the description: a served group-wise reward (check_ready)
        if check:
            self.check_ready()

    # one attempt ---------------------------------------------------------------------------------------------
    def _once(self, method: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        """(status, body) of one request that takes at most `timeout` s in all (`bounded_exchange`)."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        conn = self._connection(self._host, self._port, timeout=timeout)
        try:
            response, data = bounded_exchange(conn, method, self._path, body, headers, timeout,
                                              self.max_response_bytes)
        except AnswerTooLarge as exc:
            raise RewardError(self._too_large(exc.size), reward=self.url) from exc
        except TimeoutError as exc:
            raise _Retry(f"timed out after {timeout:.3g} s") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise _Retry(f"{type(exc).__name__}: {exc}") from exc
        return response.status, data

    def _too_large(self, size: str) -> str:
        return (f"remote reward {self.url}: the answer of {size} is over max_response_mb="
                f"{self.max_response_bytes / 2**20:g}; raise it in reward_kwargs for this URL if the answer is right")

    # attempts --------------------------------------------------------------------------------------------------
    def _attempts(self, method: str, body: bytes | None, accept=()) -> tuple[int, bytes]:
        """(status, body) of a 200 answer (or one of `accept`), retrying as the module docstring says."""
        end = time.monotonic() + self.total_timeout
        last_error, attempts = None, 0
        for attempt in range(self.retries + 1):
            if attempt > 0:
                time.sleep(max(0.0, min(self.backoff * 2 ** (attempt - 1), end - time.monotonic())))
            remaining = end - time.monotonic()
            if remaining <= 0:
                break
            attempts += 1
            try:
                status, data = self._once(method, body, min(self.timeout, remaining))
            except _Retry as exc:
                last_error = str(exc)
                continue
            if status == 200 or status in accept:
                return status, data
            last_error = f"HTTP {status}: {_error_detail(data)}"
            if status >= 500 and _reward_failed(data):
                raise RewardError(f"remote reward {self.url}: the served reward failed ({method} answered {last_error})",
                                  reward=self.url)
            if status < 500:
                raise RewardError(f"remote reward {self.url}: {method} answered {last_error}", reward=self.url)
        raise RewardError(
            f"remote reward {self.url}: no 200 answer after {attempts} attempt{'s' * (attempts != 1)} (timeout "
            f"{self.timeout:g} s each, total_timeout {self.total_timeout:g} s); last error: {last_error}",
            reward=self.url,
        )

    def _json(self, method: str, data: bytes):
        try:
            return json.loads(data)
        except ValueError as exc:
            raise RewardError(
                f"remote reward {self.url}: the answer to {method} is not JSON ({exc}): "
                f"{' '.join(data[:200].decode(errors='replace').split())!r}", reward=self.url,
            ) from exc

    # the reward ------------------------------------------------------------------------------------------------
    def check_ready(self) -> None:
        """Ask the server for its description (once): RewardNotReadyError naming the URL when it cannot be
        reached or speaks another protocol version; sets `description` and `served_name`."""
        if self._checked:
            return
        try:
            status, data = self._attempts("GET", None, accept=(405, 501))
            description = self._json("GET", data) if status == 200 else None
        except RewardError as exc:
            raise RewardNotReadyError(
                f"{exc}. Start the server (python -m ddpo_group.rewards.server --serve NAME --port PORT) or fix "
                "the URL in reward_fn / reward_weights", reward=self.url,
            ) from exc
        if isinstance(description, dict):
            protocol = description.get("protocol", PROTOCOL_VERSION)
            if protocol != PROTOCOL_VERSION:
                raise RewardNotReadyError(
                    f"remote reward {self.url}: the server speaks protocol {protocol!r}, this client "
                    f"{PROTOCOL_VERSION}; run the same version of ddpo-group on both sides", reward=self.url)
            name = description.get("reward")
            self.served_name = name if isinstance(name, str) and name.strip() else None
            # a served group-wise reward makes this client one: CombinedReward sends it whole prompt groups
            self.group_wise = description.get("group_wise") is True
        self.description, self._checked = description, True

    def __call__(self, images, prompts, metadata):
        body = json.dumps(
            {"images": encode_images(images), "prompts": list(prompts), "metadata": list(metadata)},
            default=to_json,
        ).encode()
        _, data = self._attempts("POST", body)
        answer = self._json("POST", data)
        if not isinstance(answer, dict) or not isinstance(answer.get("rewards"), list):
            raise RewardError(f"remote reward {self.url}: the answer has no 'rewards' list: {str(answer)[:200]}",
                              reward=self.url)
        info = answer.get("info") or {}
        if not isinstance(info, dict):
            raise RewardError(f"remote reward {self.url}: the answer's 'info' is not an object: {str(info)[:200]}",
                              reward=self.url)
        try:
            rewards = np.asarray(answer["rewards"])  # its values are checked by CombinedReward (validate_rewards)
        except (TypeError, ValueError) as exc:
            raise RewardError(f"remote reward {self.url}: the answer's 'rewards' are not a flat list: "
                              f"{str(answer['rewards'])[:200]}", reward=self.url) from exc
        return rewards, dict(info)
