"""The coordinator directory: each process's own address, for routing Trigger callbacks between replicas.

A Trigger callback that reaches another replica than the one that started its request is
forwarded to the owner (``serving.pipeline.topologies.metaserver``). The address it is forwarded
to comes from here, written by the owner process itself into the control plane's database,
never from the callback's URL: a caller who could sign a token (a leaked key) still cannot make
a replica post to an address of their choosing.

Writes: one when a process hands out its first callback URL, then at most one a minute while it
keeps doing so. Reads: one query the first time a replica sees an owner it does not know; the
answer is cached for the life of the process (an owner id is fresh per process start and its
address never changes), so the callback path makes no query in steady state.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.db import transaction
from django.utils import timezone

from fleet.models import CoordinatorAddress

# An entry not renewed for this long is a process that stopped handing out callbacks (or died):
# ignored, and deleted by the next write. Several times the metaserver's ADVERTISE_EVERY_S.
STALE_S = 10 * 60
# Bounds the per-process cache of owners seen; past it the cache starts over.
CACHE_SIZE = 4096


def advertise(*, owner: str, url: str) -> None:
    """Record that coordinator process ``owner`` is reached at ``url`` (now)."""
    now = timezone.now()
    with transaction.atomic():
        # Another owner at the same address is this address's previous process (it restarted):
        # its requests are gone, and its callbacks must not be routed here.
        CoordinatorAddress.objects.filter(url=url).exclude(owner=owner).delete()
        CoordinatorAddress.objects.filter(seen__lt=now - timedelta(seconds=STALE_S)).delete()
        CoordinatorAddress.objects.update_or_create(
            owner=owner, defaults={"url": url, "host": socket.gethostname(), "pid": os.getpid(), "seen": now}
        )


def address_of(owner: str) -> str | None:
    """The address a live coordinator process advertised under ``owner``, or None."""
    cutoff = timezone.now() - timedelta(seconds=STALE_S)
    return CoordinatorAddress.objects.filter(owner=owner, seen__gte=cutoff).values_list("url", flat=True).first()


class ReplicaDirectory:
    """The metaserver's ``ReplicaDirectory`` on the database: queries in a worker thread, answers cached."""

    def __init__(self) -> None:
        self._known: dict[str, str] = {}

    async def advertise(self, owner: str, url: str) -> None:
        await sync_to_async(advertise, thread_sensitive=False)(owner=owner, url=url)

    async def address_of(self, owner: str) -> str | None:
        if (url := self._known.get(owner)) is not None:
            return url
        url = await sync_to_async(address_of, thread_sensitive=False)(owner)
        if url is not None:
            if len(self._known) >= CACHE_SIZE:
                self._known.clear()
            self._known[owner] = url
        return url
