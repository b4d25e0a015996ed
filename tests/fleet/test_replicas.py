"""The coordinator directory (``fleet.replicas``): where Trigger callbacks of another replica are forwarded."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from fleet import replicas
from fleet.models import CoordinatorAddress

pytestmark = pytest.mark.django_db(transaction=True)


def test_it_finds_an_advertised_process_and_no_other() -> None:
    replicas.advertise(owner="a1", url="http://10.0.0.1:8000")
    replicas.advertise(owner="b1", url="http://10.0.0.2:8000")
    assert replicas.address_of("a1") == "http://10.0.0.1:8000"
    assert replicas.address_of("b1") == "http://10.0.0.2:8000"
    assert replicas.address_of("nobody") is None


def test_a_process_restarted_at_an_address_takes_it_over() -> None:
    replicas.advertise(owner="old", url="http://10.0.0.1:8000")
    replicas.advertise(owner="new", url="http://10.0.0.1:8000")
    assert replicas.address_of("old") is None  # its requests died with it: nothing to route to
    assert replicas.address_of("new") == "http://10.0.0.1:8000"


def test_an_entry_not_renewed_goes_stale_and_is_deleted_by_the_next_write() -> None:
    replicas.advertise(owner="quiet", url="http://10.0.0.1:8000")
    CoordinatorAddress.objects.filter(owner="quiet").update(
        seen=timezone.now() - timedelta(seconds=replicas.STALE_S + 1)
    )
    assert replicas.address_of("quiet") is None
    replicas.advertise(owner="other", url="http://10.0.0.2:8000")
    assert list(CoordinatorAddress.objects.values_list("owner", flat=True)) == ["other"]


async def test_the_directory_asks_the_database_once_per_owner() -> None:
    from asgiref.sync import sync_to_async

    await sync_to_async(replicas.advertise)(owner="a1", url="http://10.0.0.1:8000")
    directory = replicas.ReplicaDirectory()
    assert await directory.address_of("a1") == "http://10.0.0.1:8000"
    await sync_to_async(CoordinatorAddress.objects.all().delete)()
    # Cached: an owner's address never changes while it lives (its id is fresh per process).
    assert await directory.address_of("a1") == "http://10.0.0.1:8000"
    assert await directory.address_of("nobody") is None
