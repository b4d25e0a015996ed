"""Instances keep the model name their engine reports and how the served model's record differs from it."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("fleet", "0005_apikey_allow_priority")]

    operations = [
        migrations.AddField(
            model_name="engineinstance",
            name="reported_name",
            field=models.CharField(
                blank=True, help_text="The model name the engine serves (its /v1/models card).", max_length=200
            ),
        ),
        migrations.AddField(
            model_name="engineinstance",
            name="model_mismatch",
            field=models.CharField(
                blank=True,
                help_text="How the served model's record (name, model_path) differs from what the engine reports.",
                max_length=500,
            ),
        ),
    ]
