"""Ctrl-C at once: a command ends within about a second of Ctrl-C, even inside one long call into native code.

Python turns SIGINT into KeyboardInterrupt only between bytecodes, so one long native call holds Ctrl-C back for as
long as it runs: the backward pass of a training step (4.8 s for the SmolLM2 drafter on two busy CPU cores), a big
matmul, a shard written and fsynced, or the interpreter joining a worker thread at exit (a server request, up to
--request-timeout). Chunking each of them would never bound them all (one layer of a 70B target on a CPU is one
call). So while a command runs, the byte that the C-level signal handler writes at once (`signal.set_wakeup_fd`)
wakes a watchdog thread; the main thread gets GRACE_S to turn Ctrl-C into KeyboardInterrupt and finish the usual way
(the resume hint, exit status 130); a process still alive then is ended by the watchdog with the same hint and
status, as kill -9 would end it. Every stage resumes after kill -9: shards, checkpoints and the tokenization cache
are written under temporary names and renamed, regenerated conversations are whole lines (a torn last line is cut).

The interpreter's own exit is the other long wait: tearing down torch, a loaded target and `datasets` takes 1-2 s
after the last line of the command has run. A command that was interrupted has nothing left to save, so it leaves
with `end_process` (the atexit handlers, then `os._exit`) instead.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time

GRACE_S = 1.0  # how long the main thread may take to stop by itself once Ctrl-C arrived
EXIT_STATUS = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C
_STOP = b"\0"  # not a signal number: tells the watchdog the command ended


class CtrlC:
    """`with CtrlC(hint_line): run()`; on KeyboardInterrupt the caller prints the hint with `announce()` (once, whoever
    gets there first). Inactive where a wakeup fd cannot be set (not the main thread) or is already someone else's."""

    def __init__(self, hint_line: str):
        self.hint_line = hint_line
        self.lock = threading.Lock()
        self.announced = False
        self.armed = False
        self.interrupted = threading.Event()
        self.read_fd = self.write_fd = -1
        self.thread: threading.Thread | None = None

    def __enter__(self) -> "CtrlC":
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        try:
            previous = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread, which alone receives signals
            self._close_fds()
            return self
        if previous != -1:  # someone else's (an event loop): leave it theirs
            signal.set_wakeup_fd(previous)
            self._close_fds()
            return self
        self.armed = True
        self.thread = threading.Thread(target=self._watch, name="dspark-hf-ctrl-c", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if not self.armed or exc_type is KeyboardInterrupt or self.interrupted.is_set():
            return  # interrupted: the watchdog stays armed until the process has ended
        signal.set_wakeup_fd(-1)
        os.write(self.write_fd, _STOP)
        self.thread.join(timeout=1.0)
        self._close_fds()
        self.armed = False

    def announce(self) -> None:
        """Print the hint line, once."""
        with self.lock:
            if not self.announced:
                self.announced = True
                print(self.hint_line, file=sys.stderr, flush=True)

    def _watch(self) -> None:
        while True:
            data = os.read(self.read_fd, 64)
            if not data or _STOP in data:
                return
            if signal.SIGINT in data:
                break
        self.interrupted.set()
        time.sleep(GRACE_S)  # a daemon thread: a process that ends by itself meanwhile does not wait for it
        self._end_now()

    def _end_now(self) -> None:
        """The main thread did not stop in time: say how to resume and end the process as kill -9 would."""
        with self.lock:
            if not self.announced:
                self.announced = True
                on_a_bar = getattr(sys.stderr, "isatty", lambda: False)()  # a bar's line has no newline yet
                sys.stderr.write(("\n" if on_a_bar else "") + self.hint_line + "\n")
            _flush()
            os._exit(EXIT_STATUS)

    def _close_fds(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            if fd >= 0:
                os.close(fd)
        self.read_fd = self.write_fd = -1


def end_process(status: int = EXIT_STATUS) -> None:
    """Leave now: the atexit handlers (loggers flushed, worker processes ended), then `os._exit`, without the module
    teardown and thread joins of a normal exit (1-2 s with torch, a target and `datasets` loaded)."""
    atexit._run_exitfuncs()
    _flush()
    os._exit(status)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a full disk: nothing more to say
            pass


__all__ = ["EXIT_STATUS", "GRACE_S", "CtrlC", "end_process"]
