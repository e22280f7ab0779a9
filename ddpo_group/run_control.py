"""Run control: stop requests from signals, seen by every process at the same point (docs/architecture.md).

SIGINT / SIGTERM ask the run to stop: it finishes the current phase (an evaluation stops between its
batches), writes a final checkpoint and stopped.json, and the CLI exits 128 + the signal. A second
signal exits at once (metrics.jsonl is written row by row, so nothing written is lost).

    control = RunControl(accelerator)
    with control:                        # the handlers are installed inside, the previous ones restored after
        ...
        if control.should_stop():        # True on every process once any process was asked to stop
            break
"""

import contextlib
import logging
import os
import signal

import torch

logger = logging.getLogger("ddpo_group")


class RunControl:
    """Stop requests of one run: `requested` / `signal` (this process), `should_stop()` (any process)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.requested = False
        self.signal = None
        self._previous = {}

    def request_stop(self, signum, frame=None):
        """The signal handler: the first signal asks for a stop, a second one exits now (128 + signum)."""
        if self.requested:
            logger.warning("second signal %d: exiting now, without a final checkpoint", signum)
            logging.shutdown()
            os._exit(128 + signum)
        self.requested = True
        self.signal = signum
        logger.warning("signal %d: finishing the current phase, then writing a final checkpoint", signum)

    def install(self):
        """Handle SIGINT and SIGTERM with `request_stop` (not possible outside the main thread: then no-op)."""
        self._previous = {}
        with contextlib.suppress(ValueError):  # not in the main thread
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self.request_stop)

    def restore(self):
        """The handlers that were there before `install`."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def __enter__(self):
        self.install()
        return self

    def __exit__(self, *exc):
        self.restore()
        return False

    def should_stop(self):
        """True on every process as soon as one process was asked to stop (a collective: every process calls it)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.gather(flag).sum().item() > 0)
