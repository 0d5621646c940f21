"""dobb_bench.training.stop: a first SIGINT/SIGTERM inside the loop is recorded (honoured between
steps), a second one, or one outside the loop, raises KeyboardInterrupt; the previous handlers
come back."""
import os
import signal

import pytest

from dobb_bench.training.stop import StopRequest


def test_first_signal_is_recorded_second_raises_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequest()
    saved = stop.install()
    try:
        assert stop.active and signal.getsignal(signal.SIGTERM) is stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal == signal.SIGTERM  # recorded, the loop stops at the next step boundary
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        stop.restore(saved)
    assert not stop.active and signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(KeyboardInterrupt):  # outside the loop: at once
        stop(signal.SIGINT, None)
