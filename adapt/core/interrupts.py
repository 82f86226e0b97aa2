"""Ctrl-C and SIGTERM as exceptions with their shell exit codes, and short sections they cannot split.

SIGTERM raises ``Terminated`` (a ``KeyboardInterrupt``, so every clean-up path that handles Ctrl-C
handles it too) and exits 143; Ctrl-C exits 130.  Inside ``deferred_interrupts()`` a signal is only
noted and raised when the section ends, so a report set or a checkpoint rename is never half done.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM."""


def exit_code_of_interrupt(err: KeyboardInterrupt) -> int:
    return EXIT_TERMINATED if isinstance(err, Terminated) else EXIT_INTERRUPTED


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While active, SIGTERM raises ``Terminated`` in the main thread (elsewhere handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block is done, then raise the first one that arrived."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        raise Terminated() if received[0] == signal.SIGTERM else KeyboardInterrupt()
