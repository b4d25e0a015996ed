"""Hardware generation becomes an enumerated field (it was free text), and instances get a KV port.

Free-text values are mapped to a generation; every value that changed other than by case gets an
``InstanceEvent`` (kind ``hardware``) so an operator can see what was guessed and correct it.
"""

from __future__ import annotations

import django.core.validators
from django.db import migrations, models

# Spellings seen in free text, by generation. A bare "npu"/"ascend" is taken as A2: that is
# what vllm-ascend itself assumes when its build names no SoC (vllm_ascend/utils.py,
# _init_ascend_device_type, 0.23.0.post1).
_SPELLINGS = {
    "cpu": ("cpu", "x86", "x86_64", "arm", "aarch64"),
    "cuda": ("cuda", "gpu", "nvidia"),
    "A2": ("a2", "910b", "ascend910b", "atlas a2", "npu", "ascend", "npu-a2", "ascend-a2"),
    "A3": ("a3", "910c", "910_93", "ascend910_93", "atlas a3", "npu-a3", "ascend-a3"),
    "A5": ("a5", "npu-a5", "ascend-a5"),
    "310P": ("310p", "ascend310p", "npu-310p"),
}
_LOOKUP = {spelling: generation for generation, spellings in _SPELLINGS.items() for spelling in spellings}


def generation_of(text: str) -> str:
    """The generation a free-text hardware value names; unknown text is taken as CPU."""
    return _LOOKUP.get(text.strip().lower(), "cpu")


def forwards(apps, schema_editor) -> None:  # type: ignore[no-untyped-def]
    EngineInstance = apps.get_model("fleet", "EngineInstance")
    InstanceEvent = apps.get_model("fleet", "InstanceEvent")
    for instance in EngineInstance.objects.all():
        old = instance.hardware_kind
        new = generation_of(old)
        if new == old:
            continue
        EngineInstance.objects.filter(id=instance.id).update(hardware_kind=new)
        if old.strip().lower() != new.lower():
            InstanceEvent.objects.create(
                instance_id=instance.id, kind="hardware", old=old[:30], new=new, actor="migration",
                reason=f"free-text hardware {old!r} read as {new}; correct it if that is wrong",
            )


class Migration(migrations.Migration):
    dependencies = [("fleet", "0003_managed_process")]

    operations = [
        migrations.RunPython(forwards, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="engineinstance",
            name="hardware_kind",
            field=models.CharField(
                choices=[
                    ("cpu", "CPU"), ("cuda", "NVIDIA GPU (CUDA)"), ("A2", "Ascend A2 (Atlas 800I/800T A2, 910B)"),
                    ("A3", "Ascend A3 (Atlas A3 SuperPoD, 910C)"), ("A5", "Ascend A5"), ("310P", "Ascend 310P"),
                ],
                default="cpu",
                help_text="P and D of one served model must be of the same generation.",
                max_length=10,
                verbose_name="hardware generation",
            ),
        ),
        migrations.AddField(
            model_name="engineinstance",
            name="kv_port",
            field=models.PositiveIntegerField(
                blank=True, null=True, verbose_name="KV port",
                validators=[django.core.validators.MinValueValidator(1), django.core.validators.MaxValueValidator(65535)],
                help_text="Base of the KV connector's handshake ports (Mooncake kv_port); the engine holds "
                "kv_port .. kv_port + DP×TP − 1 on its host.",
            ),
        ),
    ]
