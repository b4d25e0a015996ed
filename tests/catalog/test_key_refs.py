"""``obfuscation_key_ref`` names an obfuscation key and nothing else: the admin, the REST API, the import
and the resolver refuse a reference to any other setting or file, and the admin shows no hash of one.

Finding: ``setting:SECRET_KEY`` (or ``file:/etc/...``) was accepted, and the admin then showed
"the key at setting:SECRET_KEY has id <hash>": an offline guessing oracle for any secret the
coordinator can read, and a file-existence probe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from catalog.key_refs import InvalidKeyRef, check_key_ref
from catalog.models import RenderConfig, ServedModel
from fleet import services as fleet_services
from serving.obfuscation_keys import KeyUnavailable, resolve_key
from serving.pipeline.obfuscation import keyring as obfuscation
from serving.pipeline.obfuscation.mapping import key_id

KEY = "an-obfuscation-key-0123456789"


@pytest.fixture
def key_dir(settings: Any, tmp_path: Path) -> Path:
    # The API's schema takes its pattern from the directory at import: import it under the real one.
    import catalog.api  # noqa: F401

    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "prod.key").write_text(KEY + "\n")
    (tmp_path / "outside").write_text(KEY)
    (keys / "escape.key").symlink_to(tmp_path / "outside")
    settings.MOTOR_OBFUSCATION_KEY_DIR = keys
    return keys


# References to what is not an obfuscation key; {dir} is the key directory.
OUTSIDE = [
    "setting:SECRET_KEY",
    "setting:DATABASES",
    "setting:MOTOR_API_KEYS",
    "setting:motor_obfuscation_key",  # not the exact prefix
    "setting:MOTOR_OBFUSCATION_KEYS",
    "file:/etc/passwd",
    "file:{dir}/../outside",
    "file:{dir}/escape.key",  # a link out of the directory
    "file:{dir}",
    "file:prod.key",  # relative: resolved against whatever the process's directory is
    "vault:x",
    "",
]


def test_it_takes_an_obfuscation_key_variable_or_a_file_under_the_key_dir(key_dir: Path, settings: Any) -> None:
    settings.MOTOR_OBFUSCATION_KEY = KEY
    settings.MOTOR_OBFUSCATION_KEY_PROD_2 = KEY
    assert check_key_ref("setting:MOTOR_OBFUSCATION_KEY") == ("setting", "MOTOR_OBFUSCATION_KEY")
    assert resolve_key("setting:MOTOR_OBFUSCATION_KEY_PROD_2") == KEY.encode()
    assert resolve_key(f"file:{key_dir}/prod.key") == KEY.encode()


@pytest.mark.parametrize("template", OUTSIDE)
def test_it_refuses_any_other_setting_or_file_before_reading_it(key_dir: Path, template: str) -> None:
    ref = template.format(dir=key_dir)
    with pytest.raises(InvalidKeyRef, match="names no obfuscation key"):
        check_key_ref(ref)
    with pytest.raises(KeyUnavailable, match="names no obfuscation key") as info:
        resolve_key(ref)
    assert "No such file" not in str(info.value) and "Permission" not in str(info.value)


@pytest.fixture
def staff_client(client: Client, db: None) -> Client:
    client.force_login(User.objects.create(username="admin", is_staff=True, is_superuser=True))
    return client


def _form(ref: str) -> dict[str, Any]:
    return {
        "name": "default", "enable": "on", "host": "127.0.0.1", "port": "8100", "timeout_ms": "5000",
        "renderer_num_workers": "4", "stream_interval": "1", "stream_interval_ms": "0", "obfuscation": "on", "obfuscation_key_ref": ref,
        "obfuscation_key_id": "0123456789abcdef", "image_name": "",
    }


def test_the_admin_form_refuses_a_reference_to_another_secret(staff_client: Client, key_dir: Path) -> None:
    response = staff_client.post("/admin/serving/renderconfig/add/", _form("setting:SECRET_KEY"))
    assert response.status_code == 200  # the form again, with the error
    errors = response.context["adminform"].form.errors
    assert "names no obfuscation key" in errors["obfuscation_key_ref"][0]
    assert not RenderConfig.objects.exists()
    ok = staff_client.post("/admin/serving/renderconfig/add/", _form(f"file:{key_dir}/prod.key"))
    assert ok.status_code == 302, ok.context["adminform"].form.errors if ok.context else ok
    assert RenderConfig.objects.get().obfuscation_key_ref == f"file:{key_dir}/prod.key"


def test_the_rest_api_refuses_a_reference_to_another_secret(client: Client, settings: Any, db: None) -> None:
    # The document's pattern names this deployment's key directory, fixed at start: no override here.
    keys = Path(settings.MOTOR_OBFUSCATION_KEY_DIR)
    _, admin_key = fleet_services.api_key_create(name="ops", scope="admin")
    client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {admin_key}"
    config = RenderConfig.objects.create(name="default")
    for ref in ("setting:SECRET_KEY", "file:/etc/passwd", f"file:{keys}/../secret_key"):
        published = client.post(
            f"/api/render-configs/{config.id}/publish", {"obfuscation_key_ref": ref}, content_type="application/json"
        )
        imported = client.post(
            "/api/render-configs/import", {"render_config": {"obfuscation_key_ref": ref}}, content_type="application/json"
        )
        for answer in (published, imported):
            # The schema's 422 names the field and the pattern (in /api/openapi.json too).
            assert answer.status_code == 422, answer.content
            assert "obfuscation_key_ref" in answer.content.decode() and "pattern" in answer.content.decode()
    config.refresh_from_db()
    assert config.obfuscation_key_ref == ""
    for ref in (f"file:{keys}/prod.key", "setting:MOTOR_OBFUSCATION_KEY_PROD"):
        ok = client.post(f"/api/render-configs/{config.id}/publish", {"obfuscation_key_ref": ref},
                         content_type="application/json")
        assert ok.status_code == 200, ok.content
        config.refresh_from_db()
        assert config.obfuscation_key_ref == ref


def test_the_services_refuse_a_link_out_of_the_key_directory(key_dir: Path, db: None) -> None:
    # Text that looks inside the directory, a file that is not: refused on the resolved path (the
    # API's 422 and the admin's form both come through here).
    from catalog import services
    from motorsite.core import InvalidError

    with pytest.raises(InvalidError, match="names no obfuscation key"):
        services.parse_render_config({"obfuscation_key_ref": f"file:{key_dir}/escape.key"})
    with pytest.raises(InvalidError, match="names no obfuscation key"):
        services.render_config_publish(changes={"obfuscation_key_ref": f"file:{key_dir}/escape.key"}, actor="t")
    assert services.parse_render_config({"obfuscation_key_ref": f"file:{key_dir}/prod.key"})


def test_the_admin_shows_no_hash_of_a_secret_a_stored_reference_names(
    staff_client: Client, key_dir: Path, settings: Any
) -> None:
    # A row written before the rule (or by SQL) that names SECRET_KEY: refused when resolved, and
    # nothing derived from the secret reaches the page.
    obfuscation.clear_mappings()
    RenderConfig.objects.create(obfuscation=True, obfuscation_key_ref="setting:SECRET_KEY", obfuscation_key_id="x")
    model = ServedModel.objects.create(name="tiny", model_path="/models/tiny")
    fleet_services.instance_create(
        actor="t", name="e1", url="http://e1.test:1", served_model_id=model.id, obfuscation_key_id="x"
    )
    secret_id = key_id(settings.SECRET_KEY.encode())
    for page in ("/admin/fleet/engineinstance/", "/admin/fleet/dashboard/"):
        html = staff_client.get(page).content.decode()
        assert "names no obfuscation key" in html
        assert secret_id not in html and "has id" not in html
    obfuscation.clear_mappings()
