"""Fixtures of the fleet tests: a served model and engines in the database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from catalog.models import ServedModel
from fleet.models import EngineInstance
from fleet.services import instance_create
from motorsite.celery import app


@pytest.fixture
def served_model(db: None) -> ServedModel:
    return ServedModel.objects.create(name="tiny", model_path="/models/tiny")


@pytest.fixture
def engine_up(served_model: ServedModel) -> EngineInstance:
    return instance_create(actor="test", name="e1", url="http://e1.test:8201", served_model_id=served_model.id)


@pytest.fixture
def engine_draining(engine_up: EngineInstance) -> EngineInstance:
    assert engine_up.drain(actor="test")
    return engine_up


@pytest.fixture
def eager() -> Iterator[None]:
    """`.delay()` inside a task runs inline instead of reaching a broker."""
    app.conf.task_always_eager = True
    try:
        yield
    finally:
        app.conf.task_always_eager = False
