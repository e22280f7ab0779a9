"""The reference reward server: any registered reward (or plugin spec) over HTTP, the protocol of
``ddpo_group.rewards.remote``, served by uvicorn (the optional extra: ``pip install "ddpo-group[server]"``).

    python -m ddpo_group.rewards.server --serve aesthetic --port 8000 [--host 0.0.0.0]
        [--device cuda] [--kwargs '{"mlp_weights": "/path/to/sac+logos+ava1-l14-linearMSE.pth"}']
    ddpo-group serve aesthetic --port 8000 [...]                        # the same command

It prints "serving reward 'NAME' on http://HOST:PORT" once it listens (with --port 0 the OS picks a
free port) and logs one line per request to stderr (method, path, status, images, milliseconds). It
binds to 127.0.0.1 (this machine only) unless --host says otherwise, and unpickles nothing.

Paths: POST / or POST /NAME scores a batch (NAME: the served reward's short name, e.g. /aesthetic);
GET /, /health or /NAME answers the description {"reward": NAME, "protocol": 1, "paths": [...],
"limits": {...}}. Another path is 404 naming the served paths, another method 405.

Limits, each answered with a JSON {"error": ...} naming the flag:
  --max-body-mb (64)        a larger body is 413, refused from its Content-Length before it is read
  --max-images (256)        more images in one request: 413
  --max-pixels (2048*2048)  an image with more pixels (read from its PNG header, before decoding): 413
  --max-decoded-mb (1024)   a request whose images decode to more float32 bytes (B*3*H*W*4, from the PNG
                            headers, before decoding): 413; the images are decoded one by one into that
                            one tensor, so a request's memory is about this much plus its body
  --request-timeout (30 s)  the whole request (headers and body) must arrive within this many seconds
                            of the connection (or of the previous answer on a kept-alive connection),
                            else 408 and the connection is closed: a client sending a byte at a time
                            holds nothing for longer
  --max-connections (32)    open connections at once (uvicorn's limit_concurrency); past it 503
  --workers (1)             threads that decode and score requests (rewards block); the others wait
a body that is not Content-Type application/json is 415, one that is not the protocol's JSON 400 (an
object whose "images" and "prompts" are lists of strings and "metadata" a list of objects or null,
JSON nested too deeply included). A reward that raises, returns rewards that are not B finite numbers (NaN is
refused, never sent as JSON's missing NaN) or info JSON cannot hold (a set, an object; info's NaN is sent as null)
is 500 {"error": "reward 'NAME' ...", "reward_failed": true}, naming the reward (and the info key): the client
does not retry it. To serve other machines deliberately, bind an interface (--host 0.0.0.0) on a
trusted network only, or keep 127.0.0.1 and reach it through an SSH tunnel
(ssh -L 8000:127.0.0.1:8000 HOST): there is no authentication.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from PIL import Image

from ddpo_group.rewards.base import RewardError, is_group_wise
from ddpo_group.rewards.combine import validate_rewards
from ddpo_group.rewards.registry import component_name, get_reward
from ddpo_group.rewards.remote import PROTOCOL_VERSION, REWARD_FAILED, RequestTooLarge, decode_images, to_json

logger = logging.getLogger("ddpo_group.rewards.server")

INSTALL_HINT = 'the reward server needs uvicorn: pip install "ddpo-group[server]"'
_STARTED = "ddpo_group.request_started"  # scope key: loop time at which the request's deadline started


@dataclass(frozen=True)
class Limits:
    """What one request may cost the server; every field is a command-line flag (module docstring)."""

    max_body_mb: float = 64.0
    max_images: int = 256
    max_pixels: int = 2048 * 2048
    request_timeout: float = 30.0
    max_connections: int = 32
    workers: int = 1
    max_decoded_mb: float = 1024.0

    def __post_init__(self):
        for field in ("max_body_mb", "max_images", "max_pixels", "request_timeout", "max_connections", "workers",
                      "max_decoded_mb"):
            if not getattr(self, field) > 0:
                raise ValueError(f"--{field.replace('_', '-')} must be > 0, got {getattr(self, field)!r}")


class RewardApp:
    """The ASGI application: the reward protocol over one reward, within `limits` (module docstring).

    reward_fn(images, prompts, metadata) -> (rewards, info) runs in a pool of `limits.workers` threads,
    together with the JSON parsing and PNG decoding of its request.
    """

    def __init__(self, reward_fn, name: str, limits: Limits = Limits()):
        self.reward_fn, self.name, self.limits = reward_fn, name, limits
        self.score_paths = ["/", f"/{name}"]
        self.description = {
            "reward": name, "protocol": PROTOCOL_VERSION,
            "paths": {"score (POST)": self.score_paths, "describe (GET)": ["/", "/health", f"/{name}"]},
            "limits": asdict(limits),
            # a group-wise reward (rewards/base.py): its clients send one whole prompt group per request
            "group_wise": is_group_wise(reward_fn),
        }
        self.executor = concurrent.futures.ThreadPoolExecutor(limits.workers, thread_name_prefix="reward")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # lifespan is off; no websockets
            return
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        status, payload, images, headers = 500, {"error": "internal error"}, 0, []
        try:
            answer = await self._answer(scope, receive, loop)
            if answer is None:  # the client went away
                status = 499
                return
            status, payload, images, *more = answer
            headers = more[0] if more else []
        except Exception as exc:  # the server's own bug: answer it rather than drop the connection
            payload = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            if status != 499:
                await self._send(send, status, payload, headers)
            client = scope.get("client") or ("-", 0)
            logger.info("%s %s %d images=%d %.1f ms client=%s:%s", scope["method"], scope["path"], status, images,
                        (time.perf_counter() - start) * 1000, client[0], client[1])

    async def _send(self, send, status: int, payload: dict, headers) -> None:
        body = json.dumps(payload, default=to_json).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())] + headers
        if status >= 400:  # the rest of a refused body is not read: the connection cannot carry another request
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _answer(self, scope, receive, loop):
        """(status, payload, number of images[, extra headers]), or None when the client disconnected."""
        method, path = scope["method"], scope["path"]
        if method in ("GET", "HEAD"):
            if path in ("/", "/health", f"/{self.name}"):
                return 200, self.description, 0
            return 404, {"error": self._wrong_path(path)}, 0
        if method != "POST":
            return 405, {"error": f"method {method} is not served: POST scores a batch, GET describes the server"}, 0, \
                [(b"allow", b"GET, HEAD, POST")]
        if path not in self.score_paths:
            return 404, {"error": self._wrong_path(path)}, 0
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        content_type = headers.get("content-type", "")
        if content_type.split(";")[0].strip().lower() != "application/json":
            return 415, {"error": f"Content-Type must be application/json, got {content_type or 'none'!r}"}, 0
        max_bytes = int(self.limits.max_body_mb * 2**20)
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > max_bytes:
            return 413, {"error": f"body of {int(length)} bytes is over the server's limit --max-body-mb "
                                  f"{self.limits.max_body_mb:g} (MB)"}, 0
        deadline = scope.get(_STARTED, loop.time()) + self.limits.request_timeout
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                return 408, {"error": f"the request did not arrive within the server's limit --request-timeout "
                                      f"{self.limits.request_timeout:g} (s): {size} bytes of "
                                      f"{length or 'an unknown number of'} received"}, 0
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > max_bytes:
                return 413, {"error": f"body of more than {size} bytes is over the server's limit --max-body-mb "
                                      f"{self.limits.max_body_mb:g} (MB)"}, 0
            if not message.get("more_body", False):
                break
        return await loop.run_in_executor(self.executor, self._score, b"".join(chunks))

    def _wrong_path(self, path: str) -> str:
        return (f"no such path {path!r}: this server serves reward {self.name!r}, scored by POST "
                f"{' or '.join(self.score_paths)} (GET / or /health describes it)")

    def _score(self, body: bytes):
        """Runs in a worker thread: parse, decode, score. (status, payload, number of images)."""
        limits = self.limits
        try:
            try:
                request = json.loads(body)
            except RecursionError:
                raise ValueError("the JSON is nested too deeply") from None
            _check_request(request)
            if len(request["images"]) > limits.max_images:
                raise RequestTooLarge(f"{len(request['images'])} images in one request, over the server's limit "
                                      f"--max-images {limits.max_images}")
            images = decode_images(request["images"], max_pixels=limits.max_pixels,
                                   max_decoded_mb=limits.max_decoded_mb)
            prompts = request["prompts"]
            metadata = request.get("metadata") or [{} for _ in prompts]
            if not len(images) == len(prompts) == len(metadata):
                raise ValueError(f"got {len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata")
        except RequestTooLarge as exc:
            return 413, {"error": str(exc)}, 0
        except (ValueError, KeyError, TypeError, OSError, Image.DecompressionBombError) as exc:
            detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            return 400, {"error": f"bad request: {detail}"}, 0
        try:
            rewards, info = self.reward_fn(images, prompts, metadata)
            if isinstance(rewards, torch.Tensor):
                rewards = rewards.detach().cpu()
            # the local checks (one shape per batch, finite numbers): a NaN is refused here, never sent as bare NaN
            rewards = validate_rewards(rewards, self.name, prompts)
            return 200, {"rewards": rewards.tolist(), "info": self._plain_info(info)}, len(prompts)
        except Exception as exc:  # the reward's own failure: marked, so that the client does not retry it
            text = str(exc) if isinstance(exc, RewardError) else f"reward {self.name!r} raised {type(exc).__name__}: {exc}"
            return 500, {"error": text, REWARD_FAILED: True}, len(prompts)

    def _plain_info(self, info) -> dict:
        """`info` as JSON values: numpy / torch values as lists / numbers, non-finite floats as null (JSON has no NaN);
        RewardError naming the reward and the key of a value JSON cannot hold (a set, an object)."""
        if info is None:
            return {}
        if not isinstance(info, dict):
            raise RewardError(f"reward {self.name!r} returned info of type {type(info).__name__}; return a dict",
                              reward=self.name)
        plain = {}
        for key, value in info.items():
            try:
                plain[str(key)] = _plain(value)
            except TypeError as exc:
                raise RewardError(f"reward {self.name!r} returned info[{key!r}] holding {exc}, which JSON cannot carry; "
                                  "return numbers, strings, lists or dicts of them (numpy / torch values are converted)",
                                  reward=self.name) from None
        return plain

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _plain(value):
    """A JSON value (dicts, lists, str, int, finite float or None) equal to `value`; numpy / torch values converted,
    NaN and infinities as None. TypeError naming the type of a value with no JSON form."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    elif isinstance(value, (np.ndarray, np.generic)):
        value = value.tolist()
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise TypeError(f"a value of type {type(value).__name__}")


def _check_request(request) -> None:
    """ValueError naming the field unless `request` has the protocol's shape: {"images": [str], "prompts": [str],
    "metadata": [object] or null or absent} (remote.py's module docstring)."""
    if not isinstance(request, dict):
        raise ValueError(f"the body is a JSON {type(request).__name__}, not an object")
    for field, kind, name in (("images", str, "base64 PNG strings"), ("prompts", str, "strings"),
                              ("metadata", dict, "objects")):
        if field == "metadata" and request.get(field) is None:
            continue
        if field not in request:
            raise KeyError(field)
        value = request[field]
        if not isinstance(value, list):
            raise ValueError(f'"{field}" must be a list of {name}, got a JSON {_json_type(value)}')
        wrong = next((i for i, item in enumerate(value) if not isinstance(item, kind)), None)
        if wrong is not None:
            raise ValueError(f'"{field}" must be a list of {name}; item {wrong} is a JSON {_json_type(value[wrong])}')


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _deadline_protocol(request_timeout: float):
    """uvicorn's h11 protocol with a deadline on the request headers: a connection that has not sent a whole
    request head within `request_timeout` s of opening (or of its previous answer) is answered 408 and
    closed (closed silently when it sent nothing); the body's share of the deadline is kept by RewardApp."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineProtocol(H11Protocol):
        _timer = None

        def _arm(self):
            if self._timer is not None:
                self._timer.cancel()
            self._started, self._received = self.loop.time(), 0
            self._timer = self.loop.call_later(request_timeout, self._expired)

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data):
            self._received += len(data)
            super().data_received(data)

        def handle_events(self):
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle and self._timer is not None:  # a request head arrived: the app keeps its time
                self.cycle.scope[_STARTED] = self._started
                self._timer.cancel()
                self._timer = None

        def on_response_complete(self):
            self._arm()
            super().on_response_complete()

        def connection_lost(self, exc):
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            super().connection_lost(exc)

        def _expired(self):
            self._timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return
            if self._received:
                body = json.dumps({"error": f"the request head did not arrive within the server's limit "
                                            f"--request-timeout {request_timeout:g} (s)"}).encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
                client = self.client or ("-", 0)
                logger.info("- - 408 images=0 %.1f ms client=%s:%s (request head not received)",
                            request_timeout * 1000, client[0], client[1])
            self.transport.close()

    return DeadlineProtocol


class RewardServer:
    """A RewardApp served by uvicorn on a socket bound at construction (`url` is known at once).

        server = RewardServer(get_reward("jpeg_compressibility"), name="jpeg_compressibility", port=0)
        server.serve_forever()            # or: with server as url: ...  (served from a background thread)

    ImportError with the install line when uvicorn is missing.
    """

    def __init__(self, reward_fn, name: str, host: str = "127.0.0.1", port: int = 0, limits: Limits = Limits()):
        try:
            import uvicorn
        except ImportError as exc:
            raise ImportError(INSTALL_HINT) from exc
        self.app = RewardApp(reward_fn, name, limits)
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError:
            self.socket.close()
            raise
        self.socket.listen(min(limits.max_connections, socket.SOMAXCONN))
        bound_host, bound_port = self.socket.getsockname()[:2]
        self.server_address = (bound_host, bound_port)
        self.url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"
        config = uvicorn.Config(
            self.app, http=_deadline_protocol(limits.request_timeout), lifespan="off", log_config=None,
            access_log=False, limit_concurrency=limits.max_connections, timeout_keep_alive=5,
            timeout_graceful_shutdown=max(1, int(limits.request_timeout)), server_header=False,
        )
        self.server = uvicorn.Server(config)
        self._thread = None

    def serve_forever(self) -> None:
        """Serve until Ctrl-C / SIGTERM (in the main thread) or stop(); then release the socket and the workers."""
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self.socket.close()
            self.app.close()

    def start(self) -> str:
        """Serve in a daemon thread; returns the URL once uvicorn accepts connections."""
        self._thread = threading.Thread(target=self.serve_forever, name="reward-server", daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the reward server on {self.url} stopped while starting")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def make_server(reward_fn, host: str = "127.0.0.1", port: int = 0, name: str | None = None, **limits) -> RewardServer:
    """RewardServer for `reward_fn` (named `name`, default its function name); limits as keyword arguments
    (Limits' fields, e.g. max_body_mb=1, request_timeout=1.0)."""
    if name is None:
        name = getattr(reward_fn, "__name__", None) or getattr(getattr(reward_fn, "func", None), "__name__", None)
        name = name or type(reward_fn).__name__
    return RewardServer(reward_fn, name, host, port, Limits(**limits))


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535, got {text!r}")
    return port


def main(argv=None, prog: str = "reward server", help_command: str = "python -m ddpo_group.rewards.server --help") -> None:
    """The command (`ddpo-group serve`, `python -m ddpo_group.rewards.server`): `argv` the arguments after it (default
    sys.argv[1:]); `prog` and `help_command` name it in its usage and its flag errors."""
    defaults = Limits()
    from ddpo_group.cli.common import OneLineArgumentParser

    parser = OneLineArgumentParser(prog=prog, help_command=help_command,
                                   description="Serve a reward over HTTP to training runs elsewhere (POST / "
                                               "scores a batch; docs/reward_server.md). `ddpo-group serve REWARD "
                                               "...` takes the reward first, without --serve.")
    parser.add_argument("--serve", required=True, metavar="REWARD_NAME",
                        help="registered reward name, 'module:function' or 'file.py:function'")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8000, help="0 to 65535 (0: a free port, printed)")
    parser.add_argument("--device", default=None, help="device for model-based rewards, e.g. cuda")
    parser.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments for the reward")
    parser.add_argument("--max-body-mb", type=float, default=defaults.max_body_mb, help="largest request body (MB)")
    parser.add_argument("--max-images", type=int, default=defaults.max_images, help="most images in one request")
    parser.add_argument("--max-pixels", type=int, default=defaults.max_pixels, help="most pixels in one image")
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout,
                        help="seconds the whole request (headers and body) may take to arrive")
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help="open connections at once; past it requests are answered 503")
    parser.add_argument("--workers", type=int, default=defaults.workers,
                        help="threads that score requests (1: one request at a time)")
    parser.add_argument("--max-decoded-mb", type=float, default=defaults.max_decoded_mb,
                        help="most float32 megabytes the images of one request may decode to")
    args = parser.parse_args(argv)
    try:
        import uvicorn  # noqa: F401  checked before a reward model loads
    except ImportError:
        sys.exit(f"{prog}: error: {INSTALL_HINT}")
    try:
        limits = Limits(args.max_body_mb, args.max_images, args.max_pixels, args.request_timeout,
                        args.max_connections, args.workers, args.max_decoded_mb)
    except ValueError as err:
        sys.exit(f"{prog}: error: {err}")
    try:
        kwargs = json.loads(args.kwargs)
    except json.JSONDecodeError as err:
        sys.exit(f"{prog}: error: --kwargs {args.kwargs!r} is not JSON ({err.msg}); give an object, "
                 "e.g. --kwargs '{\"key\": 1}'")
    if not isinstance(kwargs, dict):
        sys.exit(f"{prog}: error: --kwargs {args.kwargs!r} must be a JSON object, e.g. --kwargs '{{\"key\": 1}}'")
    try:
        reward_fn = get_reward(args.serve, device=args.device, **kwargs)
        if hasattr(reward_fn, "check_ready"):
            reward_fn.check_ready()
    except (ValueError, TypeError, ImportError, OSError) as err:  # an unknown reward, bad kwargs, a missing model
        sys.exit(f"{prog}: error: --serve {args.serve!r}: {' '.join(str(err).split())}")
    try:
        server = RewardServer(reward_fn, component_name(args.serve), args.host, args.port, limits)
    except OSError as err:
        sys.exit(f"{prog}: error: cannot listen on --host {args.host} --port {args.port}: {err.strerror or err}")
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO, stream=sys.stderr)
    logging.getLogger("uvicorn").setLevel(logging.WARNING)
    print(f"serving reward {args.serve!r} on {server.url}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
