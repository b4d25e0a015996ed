"""A render sidecar's address as ``unix:/path/to.sock``: the rule and its sentences, the REST API,
the admin form, the render config's own address, demo_fleet's members on sockets, and the URL the
snapshot gives the data plane."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from django.core.management import call_command
from django.test import Client

from catalog import services as catalog_services
from catalog.models import RenderConfig, RenderSidecar
from catalog.sidecar_addresses import address_error, base_url
from fleet import services
from motorsite import unix_http
from motorsite.core import InvalidError
from serving.pipeline.http11 import unix_base_url
from serving.snapshots import build_snapshot

SOCKET = "/run/motorsite/render-8100.sock"


@pytest.mark.parametrize(("host", "port", "error"), [
    ("127.0.0.1", 8100, None),
    ("render-0.render", 8100, None),
    (f"unix:{SOCKET}", None, None),
    (f"unix:{SOCKET}", 0, None),
    ("127.0.0.1", None, ("port", "a TCP address needs a port (1-65535) beside host '127.0.0.1'")),
    (f"unix:{SOCKET}", 8100, ("port", f"a unix socket has no port: leave port out for 'unix:{SOCKET}'")),
    ("unix:run/r.sock", None, ("host", "a unix socket's path must be absolute: unix:/path/to.sock, not 'unix:run/r.sock'")),
    ("unix:", None, ("host", "a unix socket's path must be absolute: unix:/path/to.sock, not 'unix:'")),
    ("unix:/run/r\n.sock", None, ("host", "a unix socket's path may not hold control characters")),
    ("unix:/" + "a" * 107, None, ("host", "a unix socket's path is at most 107 bytes (Linux's sun_path); this one is 108")),
    ("http+unix://%2Frun%2Fr.sock", None,
     ("host", "'http+unix://%2Frun%2Fr.sock' is a URL; give a host name and a port, or a unix socket as unix:/path/to.sock")),
    ("http://127.0.0.1", 8100, ("host", "'http://127.0.0.1' is a URL; give a host name and a port, or a unix socket as unix:/path/to.sock")),
])
def test_an_address_is_a_host_and_port_or_an_absolute_socket_path(host: str, port: int | None, error: Any) -> None:
    assert address_error(host, port) == error


def test_the_longest_socket_path_linux_takes_is_an_address() -> None:
    assert address_error("unix:/" + "a" * 106, None) is None


def test_the_catalog_the_launcher_and_the_data_plane_write_one_url_for_a_socket() -> None:
    path = "/run/motorsite/Render 1.sock"
    expected = "http+unix://" + quote(path, safe="")
    assert base_url(f"unix:{path}", 0) == unix_base_url(path) == unix_http.base_url(path) == expected
    assert unix_http.socket_path(expected + "/v1/x") == path
    assert unix_http.socket_path("http://127.0.0.1:8100") is None
    assert base_url("10.0.0.5", 8123) == "http://10.0.0.5:8123"


@pytest.fixture
def api(client: Client, db: None) -> Client:
    client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {services.api_key_create(name='ops', scope='admin')[1]}"
    return client


@pytest.mark.django_db
def test_the_api_adds_a_member_on_a_unix_socket_and_refuses_what_is_no_address(api: Client) -> None:
    config = RenderConfig.objects.create()
    RenderSidecar.objects.create(render_config=config, host="127.0.0.1", port=8100)
    base = f"/api/render-configs/{config.id}/sidecars"

    def post(body: dict[str, Any]) -> Any:
        return api.post(base, data=body, content_type="application/json")

    added = post({"host": f"unix:{SOCKET}"})
    assert added.status_code == 201, added.content
    assert {k: added.json()[k] for k in ("host", "port", "address", "base_url")} == {
        "host": f"unix:{SOCKET}", "port": 0, "address": f"unix:{SOCKET}",
        "base_url": "http+unix://%2Frun%2Fmotorsite%2Frender-8100.sock",
    }
    assert post({"host": f"unix:{SOCKET}"}).json() == {
        "detail": f"The pool of render config 'default' has unix:{SOCKET} already."}
    refused = {
        "unix:run/r.sock": "A unix socket's path must be absolute: unix:/path/to.sock, not 'unix:run/r.sock'.",
        "127.0.0.1": "A TCP address needs a port (1-65535) beside host '127.0.0.1'.",
    }
    for host, detail in refused.items():
        answer = post({"host": host})
        assert (answer.status_code, answer.json()) == (422, {"detail": detail})
    answer = post({"host": f"unix:{SOCKET}x", "port": 8100})
    assert (answer.status_code, answer.json()) == (422, {"detail": f"A unix socket has no port: leave port out for 'unix:{SOCKET}x'."})
    assert [m.base_url for m in build_snapshot().render.members] == [
        "http://127.0.0.1:8100", "http+unix://%2Frun%2Fmotorsite%2Frender-8100.sock"]


@pytest.mark.django_db
def test_the_admin_form_takes_a_socket_without_a_port_and_says_what_is_wrong(admin_client: Client) -> None:
    config = RenderConfig.objects.create()
    form = {"render_config": config.id, "host": f"unix:{SOCKET}", "port": ""}
    assert admin_client.post("/admin/serving/rendersidecar/add/", form).status_code == 302
    assert RenderSidecar.objects.get().address == f"unix:{SOCKET}"
    page = admin_client.post("/admin/serving/rendersidecar/add/", {**form, "host": "unix:relative.sock"})
    assert page.status_code == 200
    assert "a unix socket&#x27;s path must be absolute" in page.content.decode()
    listing = admin_client.get("/admin/serving/rendersidecar/").content.decode()
    assert f"unix:{SOCKET}" in listing and "http+unix" not in listing


@pytest.mark.django_db
def test_a_render_configs_own_address_may_be_a_socket_and_is_checked() -> None:
    catalog_services.render_config_publish(changes={"host": f"unix:{SOCKET}", "port": 8100}, actor="t")
    config = RenderConfig.objects.get()
    assert (config.address, config.base_url) == (f"unix:{SOCKET}", "http+unix://%2Frun%2Fmotorsite%2Frender-8100.sock")
    with pytest.raises(InvalidError, match="must be absolute"):
        catalog_services.render_config_publish(changes={"host": "unix:render.sock"}, actor="t")


@pytest.mark.django_db
def test_demo_fleet_puts_the_sidecars_it_started_on_their_sockets(tmp_path: Path) -> None:
    def run(*args: str) -> list[str]:
        call_command("demo_fleet", "--model-dir", str(tmp_path), "--render-port", "8100", "--render-member-port", "8101",
                     "--engine-kind", "sim", *args, stdout=io.StringIO())
        return [m.address for m in RenderConfig.objects.get().sidecars.all()]

    assert run() == ["127.0.0.1:8100", "127.0.0.1:8101"]
    sockets = tmp_path / "run"
    # A run on sockets replaces the TCP members a run before it left (nobody listens there now).
    assert run("--render-socket-dir", str(sockets)) == [f"unix:{sockets}/render-8100.sock", f"unix:{sockets}/render-8101.sock"]
    config = RenderConfig.objects.get()
    assert (config.host, config.port) == (f"unix:{sockets}/render-8100.sock", 8100)
    assert run() == ["127.0.0.1:8100", "127.0.0.1:8101"]  # and back: the sockets' members go
