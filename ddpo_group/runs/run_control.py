"""Run control: stop requests from signals, seen by every process at the same point (docs/architecture.md).

SIGINT / SIGTERM ask the run to stop: it finishes the current phase (an evaluation stops between its
batches), writes a final checkpoint and stopped.json, and the CLI exits 128 + the signal. A second
signal, SAME_REQUEST_S or more after the first, exits at once (metrics.jsonl is written row by row, so nothing
written is lost); signals closer to the first are copies of the same request.

Copies arrive from launchers. `accelerate launch` before 1.16 neither forwards a signal nor waits for its child;
from 1.16 it sends its child SIGTERM when it is itself stopped (Ctrl-C reaches both: SIGINT, then the launcher's
SIGTERM milliseconds later) and kills it 5 s later. So the training process asks Linux for SIGTERM when its parent
exits (PR_SET_PDEATHSIG): a launcher stopped alone stops its training run the same way, instead of leaving it
running without a parent (the CLI asks first thing, so a launcher stopped while the models load ends its process
too). That SIGTERM (the process has a new parent by then) and the launcher's forwarded copy are never taken as the
second signal, so a signal sent to the whole process group still asks for one stop (docs/reliability.md says how
to keep the final checkpoint under a launcher that kills).

    control = RunControl(accelerator)
    with control:                        # the handlers are installed inside, the previous ones restored after
        ...
        if control.should_stop():        # True on every process once any process was asked to stop
            break
"""

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time

import torch

logger = logging.getLogger("ddpo_group")


class RunControl:
    """Stop requests of one run: `requested` / `signal` (this process), `should_stop()` (any process)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    SAME_REQUEST_S = 2.0  # a signal this soon after the first is a copy of it (a launcher's, the terminal's group)

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.requested = False
        self.signal = None
        self._previous = {}
        self._parent = None  # the launcher's pid, when its exit is to stop the run (stop_when_parent_exits)
        self._orphaned = False  # the parent's exit has been seen (its SIGTERM counts as no one's second signal)
        self._first_at = None  # time.monotonic() of the first stop request

    def request_stop(self, signum, frame=None):
        """The signal handler: the first signal asks for a stop, a second one exits now (128 + signum); the
        SIGTERM of the launcher's exit, and any signal within SAME_REQUEST_S of the first, ask for the same stop."""
        if self._parent is not None and not self._orphaned and os.getppid() != self._parent:
            self._orphaned = True
            if self.requested:
                logger.warning("the launcher exited: still finishing the current phase, then the final checkpoint")
                return
            logger.warning("the launcher (parent process) exited: stopping this run as for a signal")
        elif self.requested:
            if time.monotonic() - self._first_at < self.SAME_REQUEST_S:
                return  # the same request again (a launcher forwarding it, or the terminal's whole group)
            logger.warning("second signal %d: exiting now, without a final checkpoint", signum)
            logging.shutdown()
            os._exit(128 + signum)
        self.requested = True
        self.signal = signum
        self._first_at = time.monotonic()
        logger.warning("signal %d: finishing the current phase, then writing a final checkpoint", signum)

    def install(self):
        """Handle SIGINT and SIGTERM with `request_stop` (not possible outside the main thread: then no-op)."""
        self._previous = {}
        with contextlib.suppress(ValueError):  # not in the main thread
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self.request_stop)
            if self._previous and end_with_launcher():
                self._parent = os.getppid()

    def restore(self):
        """The handlers that were there before `install`."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        if self._parent is not None:
            stop_when_parent_exits(0)  # 0: no signal any more
            self._parent = None

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


def end_with_launcher() -> bool:
    """In a process started by a launcher: SIGTERM when the launcher exits (before RunControl is installed, while
    models load, that ends the process; after, it stops the run). The CLI calls it first thing. True when set."""
    return launched_by_a_launcher() and stop_when_parent_exits()


def launched_by_a_launcher() -> bool:
    """True in a process started by `accelerate launch` (ACCELERATE_USE_CPU is set for its child) or torchrun."""
    return "ACCELERATE_USE_CPU" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def stop_when_parent_exits(signum: int = signal.SIGTERM) -> bool:
    """Ask Linux to send this process `signum` when its parent exits (prctl PR_SET_PDEATHSIG; 0 clears it);
    False where that is not available.

    Only for a process whose parent is a launcher: a run started from a shell under nohup must outlive the shell.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(signum), 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False
