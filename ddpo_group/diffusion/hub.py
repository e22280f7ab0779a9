"""The model hub, asked once with a deadline before a hub id is loaded (a diffusion model, a reward's CLIP model).

huggingface_hub waits on a connection that was accepted but never answered (a proxy or firewall that holds
connections open) and retries it for minutes, saying only its retry warnings. ``check_hub`` asks the hub's
endpoint (huggingface_hub's HF_ENDPOINT, through the proxies of the environment, as huggingface_hub does) once,
waiting at most DDPO_GROUP_HUB_TIMEOUT seconds (default 10): no answer in that time is a HubUnreachableError
whose one line says to set HF_HUB_OFFLINE=1 (the local cache only) or to fix the network. Any answer, whatever its
status, is a reachable hub; a network that refuses or has no route at once is left to huggingface_hub, whose error
comes at once. Nothing is asked when HF_HUB_OFFLINE is set, or for a name that is a local path.
"""

import math
import os
import socket
import urllib.error
import urllib.request

HUB_TIMEOUT_ENV = "DDPO_GROUP_HUB_TIMEOUT"
DEFAULT_HUB_TIMEOUT = 10.0


class HubUnreachableError(ValueError):
    """The hub accepted the connection (or none came) and did not answer within the deadline; names the fix."""


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set to a true value: only the local cache is read."""
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")


def hub_timeout() -> float:
    """Seconds `check_hub` waits: $DDPO_GROUP_HUB_TIMEOUT (a positive number), 10 when it is unset or empty;
    ValueError in one line naming the variable for any other value."""
    raw = os.environ.get(HUB_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_HUB_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{HUB_TIMEOUT_ENV}={raw!r} must be a positive number of seconds (the wait for the model hub, e.g. "
            f"{HUB_TIMEOUT_ENV}=30); unset it for the default {DEFAULT_HUB_TIMEOUT:g} s"
        )
    return value


def check_hub(name: str, what: str) -> None:
    """HubUnreachableError when hub id `name` (loaded for `what`, e.g. "config.pretrained.model") would be asked of a
    hub that does not answer within `hub_timeout()` s; returns at once offline or for a local path."""
    if hub_offline() or not isinstance(name, str) or os.path.exists(os.path.expanduser(name)):
        return
    from huggingface_hub import constants

    endpoint, timeout = constants.ENDPOINT, hub_timeout()
    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout):
            return
    except urllib.error.HTTPError:  # an answer, whatever it says
        return
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        if not isinstance(reason, (TimeoutError, socket.timeout)) and "timed out" not in str(reason):
            return  # refused, no route, no name: huggingface_hub fails at once and says so
    raise HubUnreachableError(
        f"{what}={name!r}: the model hub {endpoint} did not answer within {timeout:g} s (a proxy or firewall that "
        f"holds connections open?); set HF_HUB_OFFLINE=1 to load {name!r} from the local cache only, or fix the "
        f"network (HTTPS_PROXY, HF_ENDPOINT); {HUB_TIMEOUT_ENV} sets the wait"
    )
