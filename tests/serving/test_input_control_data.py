"""The control data behind request_checks: a key's priority policy and the model's vocabulary
size travel from the database through the snapshot to the request path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async

from catalog.models import ServedModel
from fleet.services import api_key_create
from serving import snapshots
from serving.snapshots import build_snapshot
from tests.serving.conftest import create_db_fleet
from tests.serving.fakes import MODEL


@pytest.mark.django_db
def test_the_snapshot_carries_the_recorded_vocab_size_else_the_config_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 321}}))
    ServedModel.objects.create(name="recorded", model_path="/nowhere", vocab_size=4096)
    ServedModel.objects.create(name="files", model_path=str(tmp_path))
    ServedModel.objects.create(name="unknown", model_path="/nowhere")
    models = build_snapshot(1).models
    assert (models["recorded"].vocab_size, models["files"].vocab_size, models["unknown"].vocab_size) == (4096, 321, None)


@pytest.mark.django_db(transaction=True)
async def test_only_a_key_that_allows_it_may_send_priority(
    v1: httpx.AsyncClient, upstreams: Any, mock_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    await sync_to_async(create_db_fleet)()
    monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: mock_client)
    _, plain = await sync_to_async(api_key_create)(name="plain", scope="client")
    _, trusted = await sync_to_async(api_key_create)(name="trusted", scope="client", allow_priority=True)
    snapshots.invalidate()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "priority": -3}
    try:
        refused = await v1.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {plain}"})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "priority"
        assert upstreams.calls == []
        ok = await v1.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {trusted}"})
        assert ok.status_code == 200
        assert upstreams.calls_of("render")[0].body["priority"] == -3
        # The policy is the request's, not the process's: the plain key is refused again after.
        again = await v1.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {plain}"})
        assert again.status_code == 400
    finally:
        snapshots.invalidate()


@pytest.mark.django_db
def test_demo_fleet_records_the_models_vocab_size() -> None:
    import os

    from django.core.management import call_command

    model_dir = os.environ["MOTOR_MODEL_DIR"]
    args = ["demo_fleet", "--model-dir", model_dir, "--engine", "http://127.0.0.1:1", "--engine-kind", "sim"]
    call_command(*args, stdout=open(os.devnull, "w"))
    expected = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    assert ServedModel.objects.get(name="tiny").vocab_size == expected
    assert build_snapshot().models["tiny"].vocab_size == expected
