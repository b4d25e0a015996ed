"""Requests of this process that still need a render sidecar, counted per sidecar base URL.

Streaming derender is stateless on the sidecar, so only the coordinator knows that a stream
begun on a sidecar will call it again for every chunk: a pipeline holds the sidecar of the
snapshot it was built from for the request's whole life (``ServingPipeline``), even after the
snapshot moved on to a replacement. The launcher's graceful restart may retire the old sidecar
only once no request holds it; these counts are what each process reports for that
(``serving.stream_reports`` writes them to the database, off the request path).

Mutated on the event loop only; ``counts`` may be read from another thread (the reporter's).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable, Iterable


class SidecarHolds:
    """Live holds per render base URL; ``on_change`` is told (without arguments) after each change."""

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # counts() runs on the reporter's thread
        self.on_change = on_change

    def hold(self, base_url: str) -> Callable[[], None]:
        """Count one request on ``base_url``; returns its release, which counts down once only."""
        with self._lock:
            self._counts[base_url] += 1
        self._changed()
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            with self._lock:
                self._counts[base_url] -= 1
                if self._counts[base_url] <= 0:
                    del self._counts[base_url]
            self._changed()

        return release

    def hold_all(self, base_urls: Iterable[str]) -> Callable[[], None]:
        """``hold`` each of ``base_urls`` (a request on a pool may call any member); one release for all."""
        releases = [self.hold(url.rstrip("/")) for url in dict.fromkeys(base_urls)]

        def release() -> None:
            for r in releases:
                r()

        return release

    def counts(self) -> dict[str, int]:
        """Base URL -> live requests, only URLs with at least one."""
        with self._lock:
            return dict(self._counts)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()
