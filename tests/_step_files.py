"""The library files a call crosses: the files (relative to ``src/dobb``) of every Python function it
executes, traced with ``sys.setprofile`` (the room tests' count of a step's files)."""
from __future__ import annotations

import sys
from pathlib import Path

import dobb

SRC = Path(dobb.__file__).resolve().parent


def library_files(call) -> set[str]:
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(SRC):
                seen.add(path.relative_to(SRC).as_posix())

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen
