"""``manage.py ascend_args NAME...``: print the vllm-ascend command of each named engine instance."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from fleet import services
from fleet.models import EngineInstance
from motorsite.core import InvalidError


class Command(BaseCommand):
    help = (
        "Print the vllm-ascend launch command and --kv-transfer-config JSON of engine instances, "
        "or every DFX problem that stops one from launching (exit status 1)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("names", nargs="*", help="Instance names (default: every Ascend instance).")

    def handle(self, *args: Any, names: list[str], **options: Any) -> None:
        rows = EngineInstance.objects.select_related("served_model").order_by("name")
        if names:
            instances = list(rows.filter(name__in=names))
            missing = sorted(set(names) - {i.name for i in instances})
            if missing:
                raise CommandError(f"No engine instance named {', '.join(missing)}.")
        else:
            instances = [i for i in rows if i.is_ascend]
            if not instances:
                raise CommandError("No Ascend engine instance (hardware generation A2, A3, ...) is registered.")
        failed = []
        for instance in instances:
            self.stdout.write(f"# {instance.name} ({instance.role}, {instance.get_hardware_kind_display()})")
            try:
                launch = services.instance_ascend_launch(instance=instance)
            except InvalidError as exc:
                failed.append(instance.name)
                self.stdout.write(f"cannot launch: {exc}\n")
                continue
            self.stdout.write(launch.command_line())
            if launch.kv_transfer_config is not None:
                self.stdout.write("# --kv-transfer-config:")
                self.stdout.write(json.dumps(launch.kv_transfer_config, indent=2))
            self.stdout.write("")
        if failed:
            raise CommandError(f"{len(failed)} instance(s) cannot be launched: {', '.join(failed)}.")
