"""Progress of the long stages, the one place bars are made: a tqdm bar on a terminal, plain log lines elsewhere.

A bar redrawn with carriage returns is noise in a log file or a CI job, and silence there is worse: a job that looks
hung gets killed. So when stderr is not a terminal, or with `--no-progress`, the same counts, rate and time left go
out as one line every `interval_s()` seconds (`DSPARK_HF_PROGRESS_INTERVAL`, default 10), the first once the stage
has run that long (a stage shorter than that stays quiet), and one more when it ends:
  cache: 1,234/5,000 tok (312.0 tok/s, 12 s left)
  cache: 5,000/5,000 tok in 16 s (312.0 tok/s)
A stage without counts (loading a model) says what it does once it has taken `NOTICE_S` seconds, and how long it
took when it ends (`timed`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from tqdm.auto import tqdm
from tqdm.std import tqdm as plain_tqdm

INTERVAL_ENV = "DSPARK_HF_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0
NOTICE_S = 5.0  # a stage without counts is announced once it has taken this long


def interval_s() -> float:
    """Seconds between two log lines: `DSPARK_HF_PROGRESS_INTERVAL` (tests make it short), else 10."""
    try:
        return max(float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S)), 0.0)
    except ValueError:
        return DEFAULT_INTERVAL_S


def add_progress_argument(parser) -> None:
    """`--no-progress`, the same flag and meaning for every command with a long stage."""
    parser.add_argument("--no-progress", action="store_true",
                        help=f"log a line every {interval_s():g} s instead of a bar ({INTERVAL_ENV} sets the interval)")


def interactive() -> bool:
    """Whether stderr is a terminal a bar can redraw itself on."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def progress(iterable=None, *, total=None, desc: str, unit: str = "it", enabled: bool = True, initial: int = 0,
             silent: bool = False):
    """A tqdm object counting `desc` in `unit`s: a bar when `enabled` and stderr is a terminal, else log lines.

    `silent` (a process that is not the main one) counts without showing anything."""
    if silent:
        return plain_tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, disable=True)
    if enabled and interactive():
        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, dynamic_ncols=True)
    every = interval_s()
    return LogLines(iterable, total=total, desc=desc, unit=unit, initial=initial, file=sys.stderr, leave=False,
                    mininterval=every, delay=every, miniters=1)


class LogLines(plain_tqdm):
    """tqdm's counting and timing, written as one plain line per display instead of a redrawn bar."""

    def display(self, msg=None, pos=None) -> bool:
        if msg == "":  # tqdm clearing the bar on close: there is nothing to clear
            return False
        self.fp.write(log_line(self.format_dict, done=getattr(self, "_closing", False)) + "\n")
        self.fp.flush()
        return True

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs) -> None:
        super().set_postfix(ordered_dict, refresh=False, **kwargs)  # shown with the next line, not as one more

    def set_postfix_str(self, s="", refresh=True) -> None:
        super().set_postfix_str(s, refresh=False)

    def close(self) -> None:
        """One last line with the total time, if the stage ran long enough to have shown any."""
        if not self.disable and getattr(self, "last_print_t", self.start_t) >= self.start_t + self.delay:
            self._closing = True
            self.display()
        super().close()


def log_line(stats: dict, done: bool = False) -> str:
    """`desc: n/total unit (rate unit/s, time left)` from tqdm's `format_dict`; at the end, the time taken."""
    n, total, unit, elapsed = stats["n"], stats["total"], stats["unit"], stats["elapsed"]
    rate = (n - stats.get("initial", 0)) / elapsed if elapsed > 0 else None
    count = f"{n:,}/{total:,}" if total is not None else f"{n:,}"
    rate_text = f"{rate:,.1f} {unit}/s" if rate else f"? {unit}/s"
    if done:
        finished = total is None or n >= total
        timing = f" {'in' if finished else 'stopped after'} {duration(elapsed)} ({rate_text})"
    elif total is not None and rate:
        timing = f" ({rate_text}, {duration((total - n) / rate)} left)"
    else:
        timing = f" ({rate_text})"
    postfix = f", {stats['postfix']}" if stats.get("postfix") else ""
    return f"{stats['prefix'] or 'progress'}: {count} {unit}{timing}{postfix}"


def duration(seconds: float) -> str:
    """0.4 s, 12 s, 3 min 20 s, 1 h 05 min."""
    if seconds < 10:
        return f"{max(seconds, 0.0):.1f} s"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def close_all() -> None:
    """Close every bar still open (a stage Ctrl-C left), so its last line comes before the command's own."""
    for bar in list(plain_tqdm._instances):
        bar.close()


@contextlib.contextmanager
def timed(what: str, notice_s: float | None = None):
    """For a stage without counts (loading a model): `what ...` once it has taken `notice_s` seconds (NOTICE_S), and
    `what ... done in 15 s` when it ends; a quick stage says nothing (NOTICE_S, or the log interval when shorter)."""
    started = time.perf_counter()
    announced = threading.Event()

    def announce():
        announced.set()
        print(f"{what} ...", file=sys.stderr, flush=True)

    timer = threading.Timer(min(NOTICE_S, interval_s()) if notice_s is None else notice_s, announce)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
    if announced.is_set():  # not after an error or Ctrl-C: the stage did not get done
        print(f"{what} ... done in {duration(time.perf_counter() - started)}", file=sys.stderr, flush=True)


__all__ = ["INTERVAL_ENV", "LogLines", "add_progress_argument", "close_all", "duration", "interactive", "interval_s",
           "log_line", "progress", "timed"]
