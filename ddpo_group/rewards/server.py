"""The reference reward server: any registered reward (or plugin spec) over HTTP, the protocol of
``ddpo_group.rewards.remote``.

    python -m ddpo_group.rewards.server --serve aesthetic --port 8000 [--host 0.0.0.0]
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
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
from PIL import Image

from ddpo_group.rewards.registry import get_reward
from ddpo_group.rewards.remote import RequestTooLarge, decode_images, to_json

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
            body = json.dumps(payload, default=to_json).encode()
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
