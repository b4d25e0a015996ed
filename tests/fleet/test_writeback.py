"""The breaker write-back: never blocks the caller, drops when full, records flips off the request path."""

from __future__ import annotations

import time

import pytest

from fleet import writeback
from fleet.models import BreakerFlip, BreakerState, EngineInstance


@pytest.mark.django_db(transaction=True)
def test_a_submitted_transition_is_recorded(engine_up: EngineInstance) -> None:
    assert writeback.submit_breaker_transition(engine_up.id, "open", "3 failures", 3, time.time() + 5, 5.0, epoch=0)
    assert writeback.flush(10)
    breaker = BreakerState.objects.get(instance=engine_up)
    assert (breaker.state, breaker.consecutive_failures, breaker.epoch) == ("open", 3, 0)
    assert BreakerFlip.objects.get(instance=engine_up).reason == "3 failures"


def test_a_full_queue_drops_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    wb = writeback.BreakerWriteBack(maxsize=1)
    wb._ensure_thread = lambda: None  # type: ignore[method-assign]  # no consumer: the queue stays full
    item = writeback.BreakerTransition(1, "open", "x", 1, None, 1.0, epoch=0)
    assert wb.submit(item)
    assert not wb.submit(item)
    assert wb.dropped == 1 and "queue full" in caplog.text
