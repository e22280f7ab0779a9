"""Stop requests (ddpo_group/run_control.py): a signal asks for a stop, every process sees it, a second one exits."""

import os
import signal
import subprocess
import textwrap

from accelerate import Accelerator
from accelerate.state import AcceleratorState

from ddpo_group.run_control import RunControl
from helpers import PYTHON, ROOT, subprocess_env


def _accelerator():
    AcceleratorState._reset_state()
    return Accelerator(cpu=True)


def test_a_signal_asks_for_a_stop_and_the_previous_handlers_come_back():
    previous = signal.getsignal(signal.SIGTERM)
    control = RunControl(_accelerator())
    with control:
        assert not control.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert control.requested and control.signal == signal.SIGTERM
        assert control.should_stop()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_second_signal_exits_at_once_with_128_plus_the_signal():
    code = textwrap.dedent("""
        import os, signal, time
        from accelerate import Accelerator
        from ddpo_group.run_control import RunControl
        control = RunControl(Accelerator(cpu=True))
        control.install()
        os.kill(os.getpid(), signal.SIGTERM)
        print("first", control.requested, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("not reached", flush=True)
    """)
    result = subprocess.run([PYTHON, "-c", code], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert result.stdout.split() == ["first", "True"]
