"""Why obfuscation keeps an instance out of traffic: the admin column, the API field, the dashboard row."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
from django.contrib.auth.models import User
from django.test import Client

from catalog.models import RenderConfig, ServedModel
from fleet import services
from fleet.models import EngineInstance
from fleet.presenters import ObfuscationStatus
from serving.obfuscation_keys import key_id_of
from serving.pipeline.obfuscation import keyring as obfuscation

KEY = "k" * 32
SETTING = "MOTOR_OBFUSCATION_KEY_TEST"


@pytest.fixture(autouse=True)
def no_loaded_keys() -> Iterator[None]:
    # load_error() is process state: neither inherit another test's nor leave ours behind.
    obfuscation.clear_mappings()
    yield
    obfuscation.clear_mappings()


@pytest.fixture
def key_id(settings: Any) -> str:
    setattr(settings, SETTING, KEY)
    return key_id_of(f"setting:{SETTING}")


@pytest.fixture
def fleet(served_model: ServedModel, key_id: str) -> dict[str, EngineInstance]:
    """One instance per case: plain weights, the configured key, some other key."""
    made = {}
    for name, kid in (("plain", ""), ("keyed", key_id), ("other", "0123456789ab")):
        made[name] = services.instance_create(
            actor="t", name=name, url=f"http://{name}.test:1", served_model_id=served_model.id, obfuscation_key_id=kid
        )
    return made


def _render(on: bool, key_id: str = "", ref: str = f"setting:{SETTING}") -> RenderConfig:
    return RenderConfig.objects.create(obfuscation=on, obfuscation_key_id=key_id, obfuscation_key_ref=ref)


def _reasons() -> dict[str, str | None]:
    status = ObfuscationStatus.current()
    return {i.name: status.excluded_reason(i) for i in EngineInstance.objects.all()}


def test_off_excludes_only_instances_with_obfuscated_weights(fleet: dict[str, EngineInstance]) -> None:
    _render(on=False)
    reasons = _reasons()
    assert reasons["plain"] is None
    assert "obfuscation is off" in (reasons["keyed"] or "")
    assert "obfuscation is off" in (reasons["other"] or "")


def test_on_with_a_valid_key_names_each_mismatch(fleet: dict[str, EngineInstance], key_id: str) -> None:
    _render(on=True, key_id=key_id)
    reasons = _reasons()
    assert reasons["keyed"] is None
    assert "plain weights" in (reasons["plain"] or "")
    assert "differs" in (reasons["other"] or "") and key_id in (reasons["other"] or "")


def test_a_missing_key_excludes_every_instance(fleet: dict[str, EngineInstance], key_id: str, settings: Any) -> None:
    delattr(settings, SETTING)
    _render(on=True, key_id=key_id)
    reasons = _reasons()
    assert "unavailable" in (reasons["keyed"] or "") and SETTING in (reasons["keyed"] or "")
    assert "plain weights" in (reasons["plain"] or "")  # its own reason first


def test_a_key_whose_id_is_not_the_configured_one_is_shown(fleet: dict[str, EngineInstance]) -> None:
    _render(on=True, key_id="0123456789ab")
    assert "has id" in (_reasons()["other"] or "")


def test_no_key_reference_is_shown(fleet: dict[str, EngineInstance], key_id: str) -> None:
    _render(on=True, key_id=key_id, ref="")
    assert "no obfuscation key reference" in (_reasons()["keyed"] or "")


def test_an_invalid_key_is_shown(fleet: dict[str, EngineInstance], key_id: str, settings: Any) -> None:
    setattr(settings, SETTING, "short")
    _render(on=True, key_id=key_id)
    assert "shorter than" in (_reasons()["keyed"] or "")


def test_the_api_carries_the_reason(client: Client, fleet: dict[str, EngineInstance], key_id: str) -> None:
    _render(on=True, key_id=key_id)
    client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {services.api_key_create(name='ops', scope='admin')[1]}"
    listed = {i["name"]: i["obfuscation_excluded_reason"] for i in client.get("/api/instances").json()}
    assert listed["keyed"] is None
    assert "plain weights" in listed["plain"]
    one = client.get(f"/api/instances/{fleet['other'].id}").json()
    assert "differs" in one["obfuscation_excluded_reason"]


@pytest.fixture
def staff_client(client: Client, db: None) -> Client:
    client.force_login(User.objects.create(username="admin", is_staff=True, is_superuser=True))
    return client


def test_the_admin_column_within_the_query_ceiling(
    staff_client: Client,
    fleet: dict[str, EngineInstance],
    key_id: str,
    served_model: ServedModel,
    django_assert_max_num_queries: Any,
) -> None:
    _render(on=True, key_id=key_id)
    for n in range(10):  # more rows must not mean more queries
        services.instance_create(actor="t", name=f"x{n}", url=f"http://x{n}.test:1", served_model_id=served_model.id)
    with django_assert_max_num_queries(12):
        response = staff_client.get("/admin/fleet/engineinstance/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "plain weights" in html and "differs from the render config" in html
    assert ">ok<" in html  # the keyed instance


def test_the_admin_column_is_a_dash_when_obfuscation_is_off(staff_client: Client, served_model: ServedModel) -> None:
    services.instance_create(actor="t", name="plain", url="http://plain.test:1", served_model_id=served_model.id)
    _render(on=False)
    cl = staff_client.get("/admin/fleet/engineinstance/").context["cl"]
    assert cl.model_admin.obfuscation(cl.result_list[0]) == "-"


def test_the_dashboard_row_shows_the_reason(
    staff_client: Client, fleet: dict[str, EngineInstance], key_id: str
) -> None:
    _render(on=True, key_id=key_id)
    html = staff_client.get("/admin/fleet/dashboard/").content.decode()
    assert '<tr class="instance sick" data-instance="plain"' in html
    assert '<tr class="instance" data-instance="keyed"' in html
    assert 'data-field="obfuscation"' in html and "plain weights" in html
