"""The catalog moved out of the ``serving`` package without touching the database.

Its app keeps the label ``serving``: the tables, migration history, content types (so staff
permissions) and admin URLs a running deployment has stay what they were. These tests prove it
from the migrations' side: rows written in the schema of the last migrations before the move are
found through ``catalog.models`` after migrating forward, and the models need no new migration.
"""

from __future__ import annotations

from io import StringIO

import pytest
from django.apps import apps
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from catalog.models import ModelRevision, RenderConfig, RenderStreamReport, ServedModel
from fleet.models import EngineInstance

# The leaf migrations of both apps when the catalog still lived in serving/.
BEFORE_THE_MOVE = [("serving", "0004_render_stream_report"), ("fleet", "0003_managed_process")]


@pytest.mark.django_db  # makemigrations checks the applied history too
def test_the_models_need_no_new_migration() -> None:
    out = StringIO()
    call_command("makemigrations", "--check", "--dry-run", stdout=out)  # SystemExit(1) on a change
    assert "No changes detected" in out.getvalue()


def test_the_tables_and_the_app_label_are_the_old_ones() -> None:
    assert apps.get_app_config("serving").name == "catalog"
    assert [m._meta.db_table for m in (ServedModel, ModelRevision, RenderConfig, RenderStreamReport)] == [
        "serving_servedmodel", "serving_modelrevision", "serving_renderconfig", "serving_renderstreamreport",
    ]


@pytest.mark.django_db(transaction=True)
def test_rows_written_before_the_move_are_found_after_migrating_forward() -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE_THE_MOVE)
    old = executor.loader.project_state(BEFORE_THE_MOVE).apps
    model = old.get_model("serving", "ServedModel").objects.create(name="tiny", model_path="/m/tiny")
    old.get_model("serving", "RenderConfig").objects.create(name="default", port=8123)
    old.get_model("fleet", "EngineInstance").objects.create(
        name="e1", url="http://127.0.0.1:8201", served_model_id=model.id,
    )

    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())

    assert ServedModel.objects.get().name == "tiny"
    assert RenderConfig.objects.get().port == 8123
    # One render config per model: the one in force became the existing model's (0010).
    assert RenderConfig.objects.get().served_model.name == "tiny"
    assert EngineInstance.objects.select_related("served_model").get(name="e1").served_model.name == "tiny"
