"""``manage.py probe_lora``: run the LoRA probe once (``fleet.lora_probes``), as Celery beat does."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from fleet.lora_probes import probe_lora_adapters


class Command(BaseCommand):
    help = "Record which LoRA adapters each engine has loaded (its /v1/models), once."

    def handle(self, *args: Any, **opts: Any) -> None:
        summary = probe_lora_adapters()
        self.stdout.write(f"probed {summary.probed} engines; changed: {', '.join(summary.changed) or 'none'}")
        for name, error in summary.errors.items():
            self.stderr.write(f"{name}: {error}")
