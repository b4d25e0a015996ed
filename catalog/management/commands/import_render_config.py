"""``manage.py import_render_config FILE.json``: validate and publish a render config."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from catalog.services import render_config_import
from motorsite.core import ServiceError


class Command(BaseCommand):
    help = "Import the RFC's render_config from a JSON file; unknown keys are an error."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file")

    def handle(self, *args: Any, **opts: Any) -> None:
        try:
            with open(opts["file"], encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise CommandError(f"Cannot read {opts['file']}: {exc}") from None
        try:
            result = render_config_import(data=data, actor="import_render_config")
        except ServiceError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            f"render config {result.config.name!r} published; changed: {', '.join(result.changed) or 'nothing'}"
        )
        if result.restart_required:
            self.stdout.write("the render sidecar must be restarted for this change to take effect")
