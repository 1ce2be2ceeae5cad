"""A step that never ends is an error, not a silent hang (SGLang's --watchdog-timeout).

Under tensor parallelism a step waits in collectives for every rank: if a rank died or the ranks
parted, it would wait for ever. A thread watches each scheduler call (a step, a flush); one that
runs past the timeout is reported, naming the rank and the call, to whoever started the process,
with every thread's stack in the log, and the process exits, so the server stops with that
message instead of hanging.

That thread needs the GIL, and a call stuck in C code that holds it (a blocking device-to-host
copy waiting on a collective that never completes) keeps it from ever running: then a C thread of
faulthandler's, which the watchdog re-arms whenever it runs, dumps every stack and exits the
process once the watchdog has not run for twice the timeout.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

EXIT_WATCHDOG = 4


class StepWatchdog:
    def __init__(self, timeout_s: float, rank: int, report: Callable[[str], None] | None = None):
        """report(message): called with the reason before the process exits (the status pipe)."""
        self.timeout_s, self.rank, self.report = timeout_s, rank, report
        self._current: tuple[float, str] | None = None
        threading.Thread(target=self._run, name="step-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def watch(self, what: str):
        self._current = (time.monotonic(), what)
        try:
            yield
        finally:
            self._current = None

    def _run(self) -> None:
        armed = float("-inf")
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            if time.monotonic() - armed > self.timeout_s / 2:  # the dead man's switch, pushed back
                faulthandler.dump_traceback_later(2 * self.timeout_s, exit=True)
                armed = time.monotonic()
            current = self._current
            if current is not None and time.monotonic() - current[0] > self.timeout_s:
                message = (f"rank {self.rank}: {current[1]} did not finish within {self.timeout_s:g} s "
                           "(--watchdog-timeout): a collective is waiting for a rank that died or parted "
                           "from the others")
                logger.error(message)
                faulthandler.dump_traceback(all_threads=True)  # where it waits, into the log
                if self.report is not None:
                    with contextlib.suppress(Exception):
                        self.report(message)
                os._exit(EXIT_WATCHDOG)
