"""``make run``: start the render sidecar, the demo engines and the coordinator; stop them on Ctrl-C."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import sys
import time
from typing import Any, Callable

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from motorsite import stack
from motorsite.supervisor import (
    Interrupted,
    PortInUse,
    ProcessSpec,
    Supervisor,
    SupervisorError,
    check_ports,
    free_port,
)
from serving import services
from serving.models import RenderConfig

logger = logging.getLogger(__name__)

# How long a replaced sidecar keeps running after coordinators were pointed away from it: a
# stream keeps the sidecar it began with for its whole life (its pipeline holds the snapshot),
# so its derender calls must still find that one. Streams longer than this lose derender.
RENDER_DRAIN_S = float(os.environ.get("MOTOR_RENDER_DRAIN_S", "30"))
# After a failed restart the running sidecar keeps serving; try again this much later.
RENDER_RETRY_S = 60.0


class RenderRestarter:
    """Restarts the managed render sidecar gracefully when a published config needs it.

    Called every second from the supervisor's wait loop (``tick``). When the render config's
    ``restart_required`` is set: start a replacement first (on the config's port if the operator
    moved it, else on a free port, since the old one still holds the current port), point the
    config at it (bumping the control version, so coordinators switch within a poll interval),
    keep the old one for ``drain_s`` while streams that began on it finish, then stop it and
    clear the flag if the config is still what the replacement was started for. Requests that
    find no sidecar in between (the operator's new port before the replacement is up) fall
    back to the local tokenizer as on any render outage.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        cfg: stack.StackConfig,
        *,
        drain_s: float = RENDER_DRAIN_S,
        clock: Callable[[], float] = time.monotonic,
        spec_for: Callable[[stack.StackConfig], ProcessSpec] = stack.render_spec,
    ) -> None:
        self.supervisor = supervisor
        self.cfg = cfg
        self.drain_s = drain_s
        self.clock = clock
        self.spec_for = spec_for
        self.current = "render"  # the supervisor's name for the sidecar coordinators use
        self.port = cfg.render_port
        self.generation = 1
        # (old child's name, stop it at, config id, the config the replacement was started for)
        self.retiring: tuple[str, float, int, dict[str, Any]] | None = None
        self.retry_at = 0.0

    def tick(self) -> None:
        try:
            self._tick()
        except Interrupted:
            raise  # the supervisor stops everything
        except Exception:
            # Never take the stack down over a restart: the running sidecar keeps serving.
            logger.exception("render sidecar restart failed; retrying in %.0fs", RENDER_RETRY_S)
            self.retry_at = self.clock() + RENDER_RETRY_S

    def _tick(self) -> None:
        if self.retiring is not None:
            old, stop_at, config_id, expected = self.retiring
            if self.clock() < stop_at:
                return
            self.supervisor.retire(old)
            self.retiring = None
            services.render_sidecar_restarted(config_id=config_id, expected=expected, actor="launcher")
            return
        if self.clock() < self.retry_at:
            return
        # The same row the coordinators' snapshot uses (serving.snapshots.build_snapshot).
        config = RenderConfig.objects.order_by("id").first()
        if config is None or not config.restart_required:
            return
        if config.host not in (stack.HOST, "localhost"):
            logger.warning("render config points at %s, not a sidecar this launcher manages; not restarting", config.host)
            self.retry_at = self.clock() + RENDER_RETRY_S
            return
        expected = {k: getattr(config, k) for k in RenderConfig.RESTART_KEYS}
        port = config.port if config.port != self.port else free_port()
        self.generation += 1
        name = f"render-{self.generation}"
        spec = dataclasses.replace(
            self.spec_for(dataclasses.replace(self.cfg, render_port=port, render_workers=config.renderer_num_workers)),
            name=name,
        )
        logger.info("render config %s needs a restart: starting %s on port %d", config.name, name, port)
        self.supervisor.add(spec)  # blocks until ready; the old sidecar serves meanwhile
        if port != config.port:
            if not services.render_sidecar_moved(config_id=config.pk, expected=expected, port=port, actor="launcher"):
                self.supervisor.retire(name)  # changed again while starting: begin anew next tick
                return
            expected["port"] = port
        self.retiring = (self.current, self.clock() + self.drain_s, config.pk, expected)
        self.current, self.port = name, port


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
        code = supervisor.wait(tick=RenderRestarter(supervisor, cfg).tick, tick_interval=1.0)
        if code:
            raise CommandError("a process died; see its log tail above")
