"""StopSignals: a signal is recorded, not raised where the main thread happens to be; the
second one exits at once with 128 + its number."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cluster.cli.stop_signals import StartInterrupted, StopSignals

REPO = Path(__file__).resolve().parents[3]


def test_a_signal_is_recorded_and_checked_later() -> None:
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    signals = StopSignals()
    try:
        signals.install()
        signals.check()  # nothing yet
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
        assert signals.wait(5.0)
        with pytest.raises(StartInterrupted):
            signals.check()
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def test_a_second_signal_exits_at_once() -> None:
    code = textwrap.dedent(
        """
        import os, signal, time
        from cluster.cli.stop_signals import StopSignals
        s = StopSignals()
        s.install()
        os.kill(os.getpid(), signal.SIGINT)
        assert s.wait(5.0)
        print("recorded", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.stdout == "recorded\n" and done.returncode == 128 + signal.SIGINT, done
