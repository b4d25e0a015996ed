"""The front door's rules as a table (motorsite/front_door.py): a head in, a refusal or None out.

The servers themselves are driven in test_front_door.py; this pins each route's decision and
the shape of its answer without any I/O.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from motorsite.front_door import Head, Limits, Route, check_head
from serving.pipeline.snapshot import ClientKeyView, FleetSnapshot, RenderView

ROOT = Path(__file__).resolve().parents[2]
CLIENT = b"sk-motor-client"
REVOKED = b"sk-motor-revoked"
ADMIN = b"mk-admin-ops"
LIMITS = Limits(v1_max_body=1000, control_max_body=100)
SNAPSHOT = FleetSnapshot(
    version=1,
    models={},
    render=RenderView(enable=False, base_url="", timeout_s=1.0),
    client_keys={hashlib.sha256(CLIENT).hexdigest(): ClientKeyView("c")},
    client_keys_managed=True,
    admin_keys=frozenset({hashlib.sha256(ADMIN).hexdigest()}),
)


def head(
    path: str, *, key: bytes | None = None, length: int | None = 10, chunked: bool = False, method: str = "POST",
    api_key: bytes | None = None,
) -> Head:
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", b"Bearer " + key))
    if api_key is not None:
        headers.append((b"x-api-key", api_key))
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    if chunked:
        headers.append((b"transfer-encoding", b"chunked"))
    return Head.parse(method, path, headers)


@pytest.mark.parametrize(
    ("path", "route"),
    [
        ("/v1", Route.V1), ("/v1/chat/completions", Route.V1), ("/v1x", Route.SITE),
        ("/api/instances", Route.API), ("/apix", Route.SITE),
        ("/internal/metaserver/a.b.c.d", Route.METASERVER), ("/admin/login/", Route.SITE), ("/", Route.SITE),
    ],
)
def test_it_routes_by_path_as_the_application_does(path: str, route: Route) -> None:
    assert head(path).route is route


@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        # /v1: the edge's path and method, a client key of the snapshot, then the size.
        (head("/v1/embeddings", key=CLIENT), 404),
        (head("/v1/embeddings"), 404),
        (head("/v1/models", key=CLIENT), 405),
        (head("/v1/chat/completions", method="PUT"), 405),
        (head("/v1/chat/completions"), 401),
        (head("/v1/chat/completions", key=REVOKED), 401),
        (head("/v1/chat/completions", key=ADMIN), 401),  # admin keys never open /v1
        (head("/v1/chat/completions", key="sk-é".encode()), 401),
        (head("/v1/chat/completions", key=CLIENT), None),
        (head("/v1/chat/completions", key=CLIENT, length=1000), None),
        (head("/v1/chat/completions", key=CLIENT, length=1001), 413),
        (head("/v1/chat/completions", length=10**12), 401),  # the key first: no key learns no cap
        (head("/v1/chat/completions", key=CLIENT, length=None, chunked=True), None),  # counted while read
        # /api: an admin key; a client key is told it is one.
        (head("/api/instances"), 401),
        (head("/api/instances", key=CLIENT), 403),
        (head("/api/instances", key=ADMIN), None),
        (head("/api/instances", key=ADMIN, length=101), 413),
        # The metaserver: the route's MAC and registration, before the body.
        (head("/internal/metaserver/x.y.z.w"), 404),
        (head("/internal/metaserver/not-a-token"), 404),
        # No key before the admin's login: only the cap.
        (head("/admin/login/", length=100), None),
        (head("/admin/login/", length=101), 413),
        # No body, nothing to judge: the route's own authentication answers.
        (head("/v1/chat/completions", length=None), None),
        (head("/api/instances", length=0), None),
    ],
)
def test_it_judges_a_head_before_its_body(request_head: Head, status: int | None) -> None:
    answer = check_head(request_head, SNAPSHOT, LIMITS)
    assert (answer.status if answer else None) == status
    if answer is not None:
        assert (b"connection", b"close") in answer.headers
        assert answer.http11().startswith(b"HTTP/1.1 %d " % status)


def test_each_refusal_has_its_routes_error_shape() -> None:
    v1 = check_head(head("/v1/chat/completions"), SNAPSHOT, LIMITS)
    api = check_head(head("/api/instances"), SNAPSHOT, LIMITS)
    meta = check_head(head("/internal/metaserver/x.y.z.w"), SNAPSHOT, LIMITS)
    site = check_head(head("/admin/login/", length=101), SNAPSHOT, LIMITS)
    assert v1 and api and meta and site
    assert orjson.loads(v1.body)["error"]["type"] == "AuthenticationError"  # OpenAI's shape
    assert orjson.loads(api.body) == {"detail": "Unauthorized"}  # ninja's
    assert orjson.loads(meta.body)["error"]["type"] == "MetaserverError"  # serving.views_internal's
    assert site.content_type.startswith(b"text/plain")


@pytest.mark.parametrize(
    ("request_head", "status", "kind"),
    [
        (head("/v1/messages"), 401, "authentication_error"),
        (head("/v1/messages", method="PUT"), 405, "invalid_request_error"),
        (head("/v1/messages", key=CLIENT, length=1001), 413, "request_too_large"),
    ],
)
def test_on_v1_messages_each_refusal_has_anthropics_error_shape(request_head: Head, status: int, kind: str) -> None:
    answer = check_head(request_head, SNAPSHOT, LIMITS)
    assert answer is not None and answer.status == status
    body = orjson.loads(answer.body)
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}


@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        (head("/v1/messages", api_key=CLIENT), None),  # the anthropic client's default header
        (head("/v1/chat/completions", api_key=CLIENT), None),  # every /v1 route reads it
        (head("/v1/messages", api_key=REVOKED), 401),
        (head("/v1/messages", key=b"", api_key=CLIENT), None),  # an empty Bearer is no key
        (head("/v1/messages", key=REVOKED, api_key=CLIENT), 401),  # a Bearer key comes first
        (head("/v1/messages", key=CLIENT, api_key=REVOKED), None),
        (head("/api/instances", api_key=ADMIN), 401),  # the REST API reads Bearer alone
    ],
)
def test_x_api_key_is_a_client_key_when_no_bearer_token_is_sent(request_head: Head, status: int | None) -> None:
    answer = check_head(request_head, SNAPSHOT, LIMITS)
    assert (answer.status if answer else None) == status


def test_open_access_lifts_the_key_but_not_the_cap() -> None:
    open_limits = Limits(v1_max_body=1000, control_max_body=100, open_access=True)
    assert check_head(head("/v1/completions"), SNAPSHOT, open_limits) is None
    big = check_head(head("/v1/completions", length=1001), SNAPSHOT, open_limits)
    assert big is not None and big.status == 413


def test_env_keys_open_v1_until_a_client_record_exists() -> None:
    unmanaged = FleetSnapshot(version=1, models={}, render=SNAPSHOT.render)
    env = Limits(v1_max_body=1000, control_max_body=100, env_keys=("sk-env",))
    assert check_head(head("/v1/completions", key=b"sk-env"), unmanaged, env) is None
    assert check_head(head("/v1/completions", key=b"sk-env"), SNAPSHOT, env) is not None


@pytest.mark.parametrize(
    "env", [{"MOTOR_HEADER_TIMEOUT_MS": "0"}, {"MOTOR_HEADER_TIMEOUT_MS": "soon"}, {"MOTOR_CONTROL_MAX_BODY_BYTES": "-1"}]
)
def test_a_bad_front_door_setting_stops_the_start(tmp_path: Path, env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "motorsite.settings", "MOTOR_VAR_DIR": str(tmp_path), **env},
    )
    assert done.returncode != 0 and "ImproperlyConfigured" in done.stderr
    assert next(iter(env)) in done.stderr


def test_a_body_it_cannot_trust_the_length_of_is_counted() -> None:
    both = Head.parse("POST", "/v1/completions", [(b"content-length", b"5"), (b"transfer-encoding", b"chunked")])
    twice = Head.parse("POST", "/v1/completions", [(b"content-length", b"5"), (b"content-length", b"9")])
    garbled = Head.parse("POST", "/v1/completions", [(b"content-length", b"5x")])
    assert all(h.has_body and h.declared is None for h in (both, twice, garbled))


def test_the_first_authorization_header_counts_as_at_the_edge() -> None:
    two = [(b"authorization", b"Bearer nope"), (b"authorization", b"Bearer " + CLIENT), (b"content-length", b"5")]
    answer = check_head(Head.parse("POST", "/v1/completions", two), SNAPSHOT, LIMITS)
    assert answer is not None and answer.status == 401
