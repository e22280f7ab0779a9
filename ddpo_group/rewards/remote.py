"""Remote rewards: score images on another machine over JSON / HTTP.

Use `reward_fn="http://host:port"` (any path after the host is kept). Protocol, one POST
per batch (Content-Type: application/json):

    request   {"images":   [base64 of an 8-bit RGB PNG, one per image],
               "prompts":  [str, one per image],
               "metadata": [object, one per image (the prompt record's extra fields)]}
    response  200 {"rewards": [number, one per image], "info": {str: JSON value}}
              4xx / 5xx {"error": "message"}

Images are quantized to 8 bits (round(255 x)) before PNG encoding; numpy / torch values
in metadata are sent as lists / numbers. The client gives each attempt `timeout`
seconds and retries connection errors, timeouts and 5xx answers up to `retries` more
times, waiting `backoff * 2**attempt` seconds between attempts; a 4xx answer (a bad
request) is not retried. When all attempts fail it raises RewardError with the last cause.

Reference server, hosting any registered reward (or plugin spec):

    python -m ddpo_group.rewards.remote --serve aesthetic --port 8000 [--host 0.0.0.0]
        [--device cuda] [--kwargs '{"mlp_weights": "/path/to/sac+logos+ava1-l14-linearMSE.pth"}']

It prints "serving reward 'NAME' on http://HOST:PORT" once it listens (with --port 0 the
OS picks a free port) and scores one request at a time. It binds to 127.0.0.1 (this machine
only) unless --host says otherwise, and unpickles nothing. Limits, each answered with an
error naming it: --max-body-mb (64, HTTP 413 before the body is read), --max-images (256 per
request, 413), --max-pixels (2048 x 2048 per image, read from the PNG header, 413),
--read-timeout (30 s for the body to arrive, else 408); a body without Content-Length gets 411.
To serve other machines deliberately, bind an interface (--host 0.0.0.0) on a trusted network
only, or keep 127.0.0.1 and reach it through an SSH tunnel (ssh -L 8000:127.0.0.1:8000 HOST):
there is no authentication.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
from PIL import Image

from ddpo_group.rewards.builtin import to_uint8_images
from ddpo_group.rewards.registry import RewardError


def _to_json(value):
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


def decode_images(encoded: list[str], max_pixels: int | None = None) -> torch.Tensor:
    """B base64 PNG strings -> float32 tensor (B, 3, H, W) in [0, 1] (pixel / 255).

    max_pixels: refuse (RequestTooLarge) an image whose header declares more pixels, before decoding it.
    """
    arrays = []
    for i, item in enumerate(encoded):
        image = Image.open(io.BytesIO(base64.b64decode(item)))
        width, height = image.size
        if max_pixels is not None and width * height > max_pixels:
            raise RequestTooLarge(
                f"image {i} has {width}x{height} = {width * height} pixels, over the server's limit "
                f"--max-pixels {max_pixels}"
            )
        arrays.append(np.asarray(image.convert("RGB")))
    if len({array.shape for array in arrays}) > 1:
        raise ValueError(f"images have different sizes: {sorted({a.shape for a in arrays})}")
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255


class RemoteReward:
    """Client of a reward server (protocol in the module docstring)."""

    # A batch that fails is not re-sent sample by sample to find the culprit (see CombinedReward).
    locate_errors = False

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5):
        if timeout <= 0 or retries < 0 or backoff < 0:
            raise ValueError(
                f"RemoteReward: timeout must be > 0, retries and backoff >= 0; got timeout={timeout}, "
                f"retries={retries}, backoff={backoff}"
            )
        self.url = url
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff

    def _post(self, body: bytes) -> dict:
        request = urllib.request.Request(
            self.url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.loads(response.read())

    def __call__(self, images, prompts, metadata):
        body = json.dumps(
            {"images": encode_images(images), "prompts": list(prompts), "metadata": list(metadata)},
            default=_to_json,
        ).encode()
        last_error = None
        for attempt in range(self.retries + 1):
            if attempt > 0:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                answer = self._post(body)
                break
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:500]
                last_error = f"HTTP {exc.code} from {self.url}: {detail}"
                if exc.code < 500:
                    raise RewardError(f"remote reward {self.url}: {last_error}", reward=self.url) from exc
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
                    last_error = f"timed out after {self.timeout} s"
                else:
                    last_error = f"{type(exc).__name__}: {reason}"
        else:
            raise RewardError(
                f"remote reward {self.url}: no answer after {self.retries + 1} attempts "
                f"(timeout {self.timeout} s each); last error: {last_error}",
                reward=self.url,
            )
        if not isinstance(answer, dict) or "rewards" not in answer:
            raise RewardError(f"remote reward {self.url}: answer has no 'rewards' field: {str(answer)[:200]}",
                              reward=self.url)
        return np.asarray(answer["rewards"], dtype=np.float64), dict(answer.get("info") or {})


DEFAULT_MAX_BODY_MB = 64.0
DEFAULT_MAX_IMAGES = 256
DEFAULT_MAX_PIXELS = 2048 * 2048
DEFAULT_READ_TIMEOUT = 30.0


def make_server(reward_fn, host: str = "127.0.0.1", port: int = 0, max_body_mb: float = DEFAULT_MAX_BODY_MB,
                max_images: int = DEFAULT_MAX_IMAGES, max_pixels: int = DEFAULT_MAX_PIXELS,
                read_timeout: float = DEFAULT_READ_TIMEOUT) -> ThreadingHTTPServer:
    """HTTP server answering the protocol above with `reward_fn`; call serve_forever() on it.

    `server.server_address` holds the bound (host, port). Requests are scored one at a time.
    Limits, each answered with a JSON error naming it: a body over max_body_mb MB is refused (413)
    before it is read, a body without Content-Length gets 411, one that does not arrive within
    read_timeout seconds 408; more than max_images images or an image of more than max_pixels
    pixels (read from its header, before decoding) 413. Nothing is unpickled.
    """
    max_body_bytes = int(max_body_mb * 2**20)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        timeout = read_timeout  # socket timeout: a client that sends less than it announced is answered 408

        def _answer(self, code: int, payload: dict) -> None:
            body = json.dumps(payload, default=_to_json).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if code >= 400:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def _read_body(self) -> bytes | None:
            """The request body, or None after answering 411 / 413 / 408."""
            length = self.headers.get("Content-Length")
            if length is None or not length.strip().isdigit():
                self._answer(411, {"error": "a Content-Length header (a number of bytes) is required"})
                return None
            length = int(length)
            if length > max_body_bytes:
                self._answer(413, {"error": f"body of {length} bytes is over the server's limit --max-body-mb "
                                            f"{max_body_bytes / 2**20:g} (MB)"})
                return None
            try:
                body = self.rfile.read(length)
            except (TimeoutError, OSError):
                body = b""
            if len(body) < length:
                self._answer(408, {"error": f"received {len(body)} of the {length} bytes announced by Content-Length "
                                            f"within {read_timeout:g} s"})
                return None
            return body

        def do_POST(self):
            body = self._read_body()
            if body is None:
                self.close_connection = True
                return
            try:
                request = json.loads(body)
                if len(request["images"]) > max_images:
                    raise RequestTooLarge(
                        f"{len(request['images'])} images in one request, over the server's limit --max-images {max_images}"
                    )
                images = decode_images(request["images"], max_pixels=max_pixels)
                prompts = list(request["prompts"])
                metadata = list(request.get("metadata") or [{} for _ in prompts])
                if not len(images) == len(prompts) == len(metadata):
                    raise ValueError(
                        f"got {len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata"
                    )
            except RequestTooLarge as exc:
                self._answer(413, {"error": str(exc)})
                return
            except (ValueError, KeyError, TypeError, OSError, Image.DecompressionBombError) as exc:
                self._answer(400, {"error": f"bad request: {exc}"})
                return
            try:
                with lock:
                    rewards, info = reward_fn(images, prompts, metadata)
                rewards = np.asarray(torch.as_tensor(rewards).detach().cpu(), dtype=np.float64)
                self._answer(200, {"rewards": rewards.tolist(), "info": info or {}})
            except Exception as exc:
                self._answer(500, {"error": f"{type(exc).__name__}: {exc}"})

        def log_message(self, format, *args):  # keep the reward server's stderr quiet
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main(argv=None) -> None:
    from ddpo_group.rewards.registry import get_reward

    parser = argparse.ArgumentParser(description="Serve a registered reward over HTTP (see module docstring).")
    parser.add_argument("--serve", required=True, metavar="REWARD_NAME",
                        help="registered reward name, 'module:function' or 'file.py:function'")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default=None, help="device for model-based rewards, e.g. cuda")
    parser.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments for the reward")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_MB, help="largest request body (MB)")
    parser.add_argument("--max-images", type=int, default=DEFAULT_MAX_IMAGES, help="most images in one request")
    parser.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, help="most pixels in one image")
    parser.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT,
                        help="seconds a request body may take to arrive")
    args = parser.parse_args(argv)
    try:
        kwargs = json.loads(args.kwargs)
    except json.JSONDecodeError as err:
        sys.exit(f"reward server: error: --kwargs {args.kwargs!r} is not JSON ({err.msg}); give an object, "
                 "e.g. --kwargs '{\"key\": 1}'")
    if not isinstance(kwargs, dict):
        sys.exit(f"reward server: error: --kwargs {args.kwargs!r} must be a JSON object, e.g. --kwargs '{{\"key\": 1}}'")
    try:
        reward_fn = get_reward(args.serve, device=args.device, **kwargs)
        if hasattr(reward_fn, "check_ready"):
            reward_fn.check_ready()
    except (ValueError, TypeError, ImportError, OSError) as err:  # an unknown reward, bad kwargs, a missing model
        sys.exit(f"reward server: error: --serve {args.serve!r}: {' '.join(str(err).split())}")
    server = make_server(reward_fn, args.host, args.port, max_body_mb=args.max_body_mb, max_images=args.max_images,
                         max_pixels=args.max_pixels, read_timeout=args.read_timeout)
    host, port = server.server_address[:2]
    print(f"serving reward {args.serve!r} on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
