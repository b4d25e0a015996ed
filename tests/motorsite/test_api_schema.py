"""The REST API's OpenAPI document against the API itself: schemathesis with every check finds nothing.

This is ``schemathesis run --checks all`` over ``/api/openapi.json``, run in-process through the
same engine the CLI drives (every phase: examples, coverage, fuzzing, stateful) over HTTP to
pytest-django's live server, with a real admin key over a database holding a small fleet, and
with the repository's ``schemathesis.toml`` (the fleet-rule 422s it allows, and why).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from catalog.models import RenderConfig, ServedModel
from fleet import services
from fleet.models import ProbeResult

ROOT = Path(__file__).resolve().parents[2]
# Bounded so the whole run stays well under a minute on a shared 2-core machine.
MAX_EXAMPLES = 10


@pytest.fixture
def small_fleet(db: None) -> None:
    """Two served models, a union engine with a probe, a P/D pair and a render config."""
    tiny = ServedModel.objects.create(name="tiny", model_path="/models/tiny")
    other = ServedModel.objects.create(name="other", model_path="/models/other")
    union = services.instance_create(actor="t", name="e1", url="http://e1.test:8201", served_model_id=tiny.id)
    ProbeResult.objects.create(instance=union, kind="health", ok=True, latency_ms=3.0, detail={"status": 200})
    for role in ("prefill", "decode"):
        services.instance_create(
            actor="t", name=f"{role[0]}1", url=f"http://{role[0]}1.test:1", role=role,
            served_model_id=other.id, kv_connector="NixlConnector",
        )
    RenderConfig.objects.create(name="default", host="127.0.0.1", port=8100)


def test_it_documents_the_shared_errors_on_every_operation(client: Any, db: None) -> None:
    doc = client.get("/api/openapi.json").json()
    unprocessable = doc["components"]["schemas"]["Unprocessable"]["properties"]["detail"]["anyOf"]
    assert {"items": {"$ref": "#/components/schemas/FieldError"}, "type": "array"} in unprocessable
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert {"401", "403"} <= set(responses), (method, path)
            if operation.get("parameters") or operation.get("requestBody"):
                ref = responses["422"]["content"]["application/json"]["schema"]["$ref"]
                assert ref == "#/components/schemas/Unprocessable", (method, path)
            if operation.get("requestBody"):
                assert "400" in responses, (method, path)


def _response_text(recorder: Any, case_id: str) -> str:
    interaction = recorder.interactions.get(case_id)
    if interaction is None or interaction.response is None:
        return "(no response)"
    return f"{interaction.response.status_code} {interaction.response.content.decode(errors='replace')[:300]}"


def _outcome(events: Any) -> tuple[list[str], set[int]]:
    """One line per failed check (operation, check, title, request, response), and every status seen.

    Engine errors count as failures: a check that could not run proves nothing.
    """
    from schemathesis.engine import Status
    from schemathesis.engine import events as ev

    found: set[str] = set()
    statuses: set[int] = set()
    for event in events:
        if isinstance(event, (ev.ScenarioFinished, ev.FuzzScenarioFinished)):
            recorder = event.recorder
            statuses |= {i.response.status_code for i in recorder.interactions.values() if i.response is not None}
            for case_id, checks in recorder.checks.items():
                case = recorder.cases[case_id].value
                for check in checks:
                    if check.status is Status.FAILURE and check.failure_info is not None:
                        failure = check.failure_info.failure
                        found.add(
                            f"{case.method} {case.path}: {check.name}: {failure.title}: {failure.message} "
                            f"body={case.body!r} path={case.path_parameters} query={case.query} "
                            f"-> {_response_text(recorder, case_id)}"
                        )
        elif isinstance(event, ev.NonFatalError):
            found.add(f"{event.label}: error: {event.info.format()}")
        elif isinstance(event, ev.FatalError):
            found.add(f"fatal: {event.exception!r}")
    return sorted(found), statuses


# About 90 s of one core on a quiet machine (its coverage phase most of it); under `make test`'s
# two sessions on a loaded 2-core machine it ran past 300 s once (pytest.ini's hang guard), so it
# gets a guard of its own. Nothing here is timed: the bound only stops a hang.
@pytest.mark.timeout(900)
def test_it_finds_nothing_with_every_check(small_fleet: None, live_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import schemathesis
    from schemathesis.config import SchemathesisConfig
    from schemathesis.config._cache import CacheConfig
    from schemathesis.engine import from_schema

    monkeypatch.setattr(services, "probes_enqueue", lambda instance_ids: len(instance_ids))  # no broker here
    _, key = services.api_key_create(name="fuzz", scope="admin")

    config = SchemathesisConfig.from_path(ROOT / "schemathesis.toml")
    config.update(seed=12, max_failures=None)
    config.cache = CacheConfig(enabled=False)  # each run from nothing: no replay of an earlier run's cases
    project = config.projects.override
    # Connection: close, so that no keep-alive connection outlives the live server's database
    # (a request thread closing it after teardown raises in that thread).
    project.update(headers={"Authorization": f"Bearer {key}", "Connection": "close"})
    project.checks.update(included_check_names=["all"])
    project.generation.update(max_examples=MAX_EXAMPLES, database="none")
    schema = schemathesis.openapi.from_url(f"{live_server.url}/api/openapi.json", config=config)

    failures, statuses = _outcome(from_schema(schema).execute())
    assert failures == []
    # It really reached the handlers: successes, refused keys, conflicts and both 422 shapes' sources.
    assert {200, 201, 204, 401, 404, 409, 422} <= statuses, statuses
