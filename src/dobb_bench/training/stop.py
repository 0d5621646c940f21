"""Stopping a single-process training loop between steps (Ctrl-C, SIGTERM) so that it resumes exactly."""
from __future__ import annotations

import signal
import threading

__all__ = ["StopRequest", "STOP"]


class StopRequest:
    """Ctrl-C (SIGINT) or SIGTERM while a single-process loop runs: honoured between steps, where
    model, optimizer, scheduler and RNG are whole, so the checkpoint written then resumes exactly.
    A second signal, or one outside the loop, raises ``KeyboardInterrupt`` at once."""

    def __init__(self):
        self.active, self.signal = False, None

    def __call__(self, signum, frame):
        if self.active and self.signal is None:
            self.signal = signum
            return
        raise KeyboardInterrupt

    def install(self) -> list:
        """Handlers for SIGINT/SIGTERM; returns what to restore. Not under torchrun (ranks would
        stop at different steps and hang in a collective) nor off the main thread (Python allows
        handlers only there). A SIGINT ignored by the parent (``compare``'s children: the parent
        stops them) stays ignored."""
        self.signal = None
        if threading.current_thread() is not threading.main_thread():
            return []
        saved = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                saved.append((sig, signal.signal(sig, self)))
        self.active = bool(saved)
        return saved

    def restore(self, saved: list) -> None:
        self.active = False
        for sig, handler in saved:
            signal.signal(sig, handler)


STOP = StopRequest()
