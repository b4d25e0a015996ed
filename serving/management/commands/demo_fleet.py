"""Create (or bring up to date) the demo fleet that ``make run`` serves."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction

from fleet.models import EngineInstance
from serving.models import RenderConfig, ServedModel


class Command(BaseCommand):
    help = "Create the demo served model, render config, engine instances and admin login."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--model-dir", required=True)
        parser.add_argument("--served-model-name", default="tiny")
        parser.add_argument("--max-model-len", type=int, default=2048)
        parser.add_argument("--render-host", default="127.0.0.1")
        parser.add_argument("--render-port", type=int, default=8100)
        parser.add_argument("--engine", action="append", default=[], help="engine base URL, repeatable")
        parser.add_argument("--engine-kind", choices=["vllm", "sim"], default="vllm")
        parser.add_argument("--admin-user", default="admin")
        parser.add_argument("--admin-password", default="")

    @transaction.atomic
    def handle(self, *args: Any, **opts: Any) -> None:
        model, _ = ServedModel.objects.update_or_create(
            name=opts["served_model_name"],
            defaults={"model_path": opts["model_dir"], "max_model_len": opts["max_model_len"]},
        )
        RenderConfig.objects.update_or_create(
            name="default", defaults={"host": opts["render_host"], "port": opts["render_port"], "enable": True}
        )
        names = []
        for n, url in enumerate(opts["engine"], start=1):
            name = f"union-{n}"
            names.append(name)
            EngineInstance.objects.update_or_create(
                name=name,
                defaults={
                    "url": url,
                    "role": EngineInstance.Role.UNION,
                    "served_model": model,
                    "kind": opts["engine_kind"],
                    "state": EngineInstance.State.ACTIVE,
                    "cap_token_generate": True,
                    # The demo's real engines run with --enable-scale-out: tokenizer and native API.
                    "cap_native_openai": opts["engine_kind"] == "vllm",
                    "cap_tokenizer": opts["engine_kind"] == "vllm",
                },
            )
        # The demo fleet is exactly what this run started; stale rows from another run would
        # send traffic to ports nobody listens on.
        removed, _ = EngineInstance.objects.exclude(name__in=names).delete()
        if opts["admin_password"]:
            User = get_user_model()
            user, _ = User.objects.get_or_create(username=opts["admin_user"])
            user.is_staff = user.is_superuser = True
            user.set_password(opts["admin_password"])
            user.save()
        self.stdout.write(f"demo fleet: model {model.name}, {len(names)} engine(s), removed {removed} stale row(s)")
