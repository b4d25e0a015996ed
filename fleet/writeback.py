"""Writes breaker transitions decided on the request path back to the database, off that path.

``submit_breaker_transition`` only appends to a bounded in-process queue and returns; one
daemon thread per process drains the queue through ``fleet.services.breaker_record``. When the
queue is full (the database is slow or down) the transition is dropped with a log line: the
in-memory breaker is the authority for routing, the database copy is for operators, and a
later transition of the same instance overwrites it anyway.

Each transition carries the operator epoch its breaker had adopted, and is written only while
the database still holds that epoch (compare-and-set in ``BreakerState.record``): one that an
operator's reset or force-open overtook on its way here is dropped, never written over it.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from datetime import datetime, timezone

logger = logging.getLogger(__name__)

QUEUE_SIZE = 1024  # transitions are rare (a breaker opens after several failures); 1024 is a storm


@dataclass(frozen=True, slots=True)
class BreakerTransition:
    instance_id: int
    new_state: str
    reason: str
    consecutive_failures: int
    open_until: float | None  # wall-clock epoch seconds, or None
    open_seconds: float
    epoch: int  # the operator epoch the deciding breaker had adopted


class BreakerWriteBack:
    """A bounded queue and the one thread that empties it."""

    def __init__(self, maxsize: int = QUEUE_SIZE) -> None:
        self._queue: queue.Queue[BreakerTransition | None] = queue.Queue(maxsize=maxsize)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.dropped = 0

    def submit(self, item: BreakerTransition) -> bool:
        """Queue ``item`` without blocking; False (and a log line) if the queue is full."""
        self._ensure_thread()
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            logger.warning(
                "breaker write-back queue full, dropped instance=%s state=%s dropped_total=%d",
                item.instance_id, item.new_state, self.dropped,
            )
            return False
        return True

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="breaker-writeback", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self.write(item)
            except Exception:  # one bad write must not kill the thread for the process
                logger.exception("breaker write-back failed instance=%s", item.instance_id if item else None)
            finally:
                if self._queue.empty():
                    # Transitions are rare: hold no connection between bursts (a DB restart, test teardown).
                    from django.db import connection

                    connection.close()
                self._queue.task_done()

    @staticmethod
    def write(item: BreakerTransition) -> None:
        from django.db import close_old_connections

        from fleet.services import breaker_record

        close_old_connections()  # a long-lived thread must not hold a connection the DB closed
        open_until = (
            datetime.fromtimestamp(item.open_until, tz=timezone.utc) if item.open_until is not None else None
        )
        breaker_record(
            instance_id=item.instance_id, new_state=item.new_state, reason=item.reason,
            consecutive_failures=item.consecutive_failures, open_until=open_until, open_seconds=item.open_seconds,
            epoch=item.epoch,
        )

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued so far is written (tests, shutdown); False on timeout."""
        done = threading.Event()

        def wait() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        return done.wait(timeout)

    def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(5.0)
        self._thread = None


_writeback = BreakerWriteBack()


def submit_breaker_transition(
    instance_id: int,
    new_state: str,
    reason: str,
    consecutive_failures: int,
    open_until: float | datetime | None,
    open_seconds: float,
    *,
    epoch: int,
) -> bool:
    """Record a breaker transition for the admin; never blocks. ``open_until`` is epoch seconds or a datetime."""
    if isinstance(open_until, datetime):
        open_until = open_until.timestamp()
    return _writeback.submit(
        BreakerTransition(instance_id, new_state, reason, consecutive_failures, open_until, open_seconds, epoch)
    )


def flush(timeout: float = 5.0) -> bool:
    return _writeback.flush(timeout)


