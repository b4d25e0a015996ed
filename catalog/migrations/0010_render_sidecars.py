# A render config's capacity becomes a pool: each config's host/port is its first member.

import django.core.validators
import django.db.models.deletion
from django.db import migrations, models


def first_members(apps, schema_editor):
    RenderConfig = apps.get_model("serving", "RenderConfig")
    RenderSidecar = apps.get_model("serving", "RenderSidecar")
    for cfg in RenderConfig.objects.all():
        RenderSidecar.objects.get_or_create(
            render_config=cfg, host=cfg.host, port=cfg.port,
            defaults={"sidecar_version": cfg.sidecar_version, "health": cfg.health,
                      "last_probe_at": cfg.last_probe_at, "last_probe_error": cfg.last_probe_error},
        )


class Migration(migrations.Migration):

    dependencies = [
        ('serving', '0009_renderconfig_stream_interval_ms'),
    ]

    operations = [
        migrations.AddField(
            model_name='renderconfig',
            name='pool_size',
            field=models.PositiveIntegerField(default=1, help_text='Sidecars `make run` started for this config (MOTOR_RENDER_POOL_SIZE: on `port` and the ports after it); sidecars added by address are members too.', validators=[django.core.validators.MinValueValidator(1), django.core.validators.MaxValueValidator(16)]),
        ),
        migrations.CreateModel(
            name='RenderSidecar',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('host', models.CharField(default='127.0.0.1', max_length=200)),
                ('port', models.PositiveIntegerField()),
                ('sidecar_version', models.CharField(blank=True, max_length=50)),
                ('capabilities', models.JSONField(blank=True, default=dict, help_text='What the probe found: vLLM version, the render/derender routes served, token_in, derender, streaming_derender (the version floors), tokenizer_loaded.')),
                ('health', models.CharField(choices=[('unknown', 'unknown'), ('healthy', 'healthy'), ('failing', 'failing')], default='unknown', max_length=10)),
                ('consecutive_successes', models.PositiveIntegerField(default=0)),
                ('consecutive_failures', models.PositiveIntegerField(default=0)),
                ('last_probe_at', models.DateTimeField(blank=True, null=True)),
                ('last_probe_error', models.TextField(blank=True)),
                ('created', models.DateTimeField(auto_now_add=True)),
                ('render_config', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='sidecars', to='serving.renderconfig')),
            ],
            options={
                'ordering': ['id'],
                'constraints': [models.UniqueConstraint(fields=('render_config', 'host', 'port'), name='render_sidecar_address')],
            },
        ),
        migrations.RunPython(first_members, migrations.RunPython.noop),
    ]
