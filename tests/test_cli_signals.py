"""`raystate serve`'s stop signals: counted by a handler that takes no lock, waited for by polling."""

from __future__ import annotations

import os
import signal
import threading
import time

from raystate.cli import _StopSignals

SIGNALS = 20


def test_signals_are_counted_while_waiting_and_handlers_restored():
    before = signal.getsignal(signal.SIGTERM)
    with _StopSignals() as signals:
        assert not signals.wait(1, timeout_s=0.1)  # none yet: the timeout ends the wait

        def send() -> None:
            # One at a time: a signal sent while the last one is still pending merges with it.
            for i in range(SIGNALS):
                os.kill(os.getpid(), signal.SIGTERM)
                deadline = time.monotonic() + 10
                while len(signals.received) <= i and time.monotonic() < deadline:
                    time.sleep(0.001)

        sender = threading.Thread(target=send)
        sender.start()
        # The main thread sits in wait() the whole time: every signal lands inside its polling loop.
        assert signals.wait(SIGNALS, timeout_s=30)
        sender.join()
        assert signals.received == [signal.SIGTERM] * SIGNALS
        assert not signals.wait(SIGNALS + 1, timeout_s=0.1)
    assert signal.getsignal(signal.SIGTERM) is before
