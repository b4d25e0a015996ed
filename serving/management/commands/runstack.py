"""``make run``: start the render sidecar, the demo engines and the coordinator; stop them on Ctrl-C."""

from __future__ import annotations

import os
import secrets
import sys
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from motorsite import stack
from motorsite.supervisor import Interrupted, PortInUse, Supervisor, SupervisorError, check_ports


def _required_env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise CommandError(f"{name} is not set: start this through `make run` (python3 -m toolchain exec ...)")
    return value


class Command(BaseCommand):
    help = "Run the whole stack on 127.0.0.1 until Ctrl-C or SIGTERM."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--engines", choices=["vllm", "sim"], default=os.environ.get("MOTOR_ENGINES", "vllm"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("MOTOR_PORT", "8000")))
        parser.add_argument("--render-port", type=int, default=int(os.environ.get("MOTOR_RENDER_PORT", "8100")))
        parser.add_argument(
            "--engine-ports",
            default=os.environ.get("MOTOR_ENGINE_PORTS", "8201,8202"),
            help="comma-separated, one engine per port",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        # Both keys reach ``demo_fleet`` through the environment (MOTOR_API_KEYS, MOTOR_DEMO_ADMIN_KEY),
        # which stores only their hashes as ApiKey records.
        api_key = os.environ.get("MOTOR_DEMO_API_KEY") or "sk-motor-" + secrets.token_urlsafe(18)
        admin_key = os.environ.get("MOTOR_DEMO_ADMIN_KEY") or "mk-admin-" + secrets.token_urlsafe(18)
        admin_password = os.environ.get("MOTOR_DEMO_ADMIN_PASSWORD") or secrets.token_urlsafe(9)
        cfg = stack.StackConfig(
            model_dir=_required_env("MOTOR_MODEL_DIR"),
            render_python=_required_env("MOTOR_RENDER_PYTHON"),
            engine_python=_required_env("MOTOR_ENGINE_PYTHON"),
            app_python=sys.executable,
            engines=opts["engines"],
            coordinator_port=opts["port"],
            render_port=opts["render_port"],
            engine_ports=tuple(int(p) for p in opts["engine_ports"].split(",") if p),
            database_url=os.environ.get("DATABASE_URL", ""),
            redis_url=settings.REDIS_URL,
            api_keys=(api_key,),
            admin_password=admin_password,
            extra_env={"MOTOR_DEMO_ADMIN_KEY": admin_key},
        )
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        specs = stack.build_specs(cfg)
        try:
            # Fail fast, naming the port, before anything is started or written.
            check_ports(specs)
        except PortInUse as exc:
            raise CommandError(str(exc)) from None
        stack.prepare_database(cfg)
        self.stdout.write(f"starting {len(specs)} processes ({cfg.engines} engines); logs in {cfg.log_dir}")
        supervisor = Supervisor(specs)
        try:
            supervisor.start()
        except (Interrupted, KeyboardInterrupt):
            supervisor.stop(check_ports_free=False)  # Ctrl-C while starting: a clean stop
            return
        except SupervisorError as exc:
            supervisor.stop(check_ports_free=False)
            raise CommandError(str(exc)) from None
        base = cfg.coordinator_url
        self.stdout.write(
            "\n".join(
                [
                    "",
                    "motorsite is running. Ctrl-C stops everything.",
                    f"  OpenAI API      {base}/v1   (Authorization: Bearer {api_key})",
                    f"  Django admin    {base}/admin/   (user admin, password {admin_password})",
                    f"  REST API        {base}/api/   (Authorization: Bearer {admin_key}; docs at {base}/api/docs)",
                    f"  render sidecar  http://127.0.0.1:{cfg.render_port}",
                    *[f"  engine          {u}" for u in cfg.engine_urls],
                    "",
                    "try:",
                    f"  curl -s {base}/v1/chat/completions -H 'Authorization: Bearer {api_key}' "
                    "-H 'Content-Type: application/json' "
                    f"-d '{{\"model\": \"{cfg.served_model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}], \"max_tokens\": 20}}'",
                    "",
                ]
            )
        )
        self.stdout.flush()
        code = supervisor.wait()
        if code:
            raise CommandError("a process died; see its log tail above")
