"""Remote rewards: score images on another machine over JSON / HTTP (the client and the protocol).

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

The reference server, hosting any registered reward or plugin spec, is ``ddpo_group.rewards.server``.
"""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.error
import urllib.request

import numpy as np
import torch
from PIL import Image

from ddpo_group.rewards.base import RewardError, to_uint8_images


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
            default=to_json,
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
