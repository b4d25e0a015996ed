"""``make run``: start the render sidecar, the demo engines and the coordinator; stop them on Ctrl-C."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Callable

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from fleet import launcher
from fleet.models import ManagedProcess
from motorsite import stack, tiers
from motorsite.supervisor import (
    ChildEvent,
    Interrupted,
    PortInUse,
    ProcessSpec,
    Supervisor,
    SupervisorError,
    check_ports,
    free_port,
)
from serving import services, stream_reports
from serving.models import RenderConfig

logger = logging.getLogger(__name__)

# The longest a replaced sidecar keeps running after coordinators were pointed away from it. A
# stream keeps the sidecar it began with for its whole life (its pipeline holds the snapshot),
# so its derender calls must still find that one: the old sidecar is retired as soon as no
# coordinator process reports a request on it, or at this cap, whichever comes first. Streams
# still running at the cap lose derender (an error frame, then [DONE]).
RENDER_DRAIN_S = float(os.environ.get("MOTOR_RENDER_DRAIN_S", "30"))
# How long after the switch a zero count is not yet believed: a coordinator adopts the new
# snapshot within MOTOR_SNAPSHOT_POLL_MS (250 ms) and writes a changed count within
# stream_reports.REPORT_DELAY_S (1 s), so a stream begun just before the switch is in the
# database by then.
RENDER_SETTLE_S = 3.0
# After a failed restart the running sidecar keeps serving; try again this much later.
RENDER_RETRY_S = 60.0


def live_requests_on(base_urls: tuple[str, ...]) -> int:
    """What the coordinator processes on this machine report on the sidecar at ``base_urls``."""
    return services.render_live_streams(base_urls=base_urls, host=stream_reports.HOST)


@dataclasses.dataclass
class Retiring:
    """A replaced sidecar waiting for its last request (or the cap) before it is stopped."""

    name: str  # the supervisor's name for it
    base_urls: tuple[str, ...]  # how coordinators addressed it (the counts are keyed by these)
    switched_at: float  # when coordinators were pointed away from it (the restarter's clock)
    config_id: int
    expected: dict[str, Any]  # the config the replacement was started for
    live: int | None = None  # the last count read, for logging changes only


class RenderRestarter:
    """Restarts the managed render sidecar gracefully when a published config needs it.

    Called every second from the supervisor's wait loop (``tick``). When the render config's
    ``restart_required`` is set: start a replacement first (on the config's port if the operator
    moved it, else on a free port, since the old one still holds the current port), point the
    config at it (bumping the control version, so coordinators switch within a poll interval),
    keep the old one while requests that began on it still run, then stop it and clear the flag
    if the config is still what the replacement was started for. The sidecar keeps no state per
    stream, so what uses it is what the coordinator processes report (``live_requests``, from
    ``serving.stream_reports``): the old one is stopped once that is zero (read no earlier than
    ``settle_s`` after the switch) or at ``drain_s``, the cap. Requests that find no sidecar in
    between (the operator's new port before the replacement is up) fall back to the local
    tokenizer as on any render outage.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        cfg: stack.StackConfig,
        *,
        drain_s: float = RENDER_DRAIN_S,
        settle_s: float = RENDER_SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
        spec_for: Callable[[stack.StackConfig], ProcessSpec] = stack.render_spec,
        live_requests: Callable[[tuple[str, ...]], int] = live_requests_on,
    ) -> None:
        self.supervisor = supervisor
        self.cfg = cfg
        self.drain_s = drain_s
        self.settle_s = settle_s
        self.clock = clock
        self.spec_for = spec_for
        self.live_requests = live_requests
        self.current = "render"  # the supervisor's name for the sidecar coordinators use
        self.port = cfg.render_port
        self.generation = 1
        self.retiring: Retiring | None = None
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
            self._drain(self.retiring)
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
        # Either host spelling reaches the sidecar this launcher started on 127.0.0.1.
        old_urls = tuple(f"http://{host}:{self.port}" for host in (stack.HOST, "localhost"))
        self.retiring = Retiring(self.current, old_urls, self.clock(), config.pk, expected)
        self.current, self.port = name, port

    def _drain(self, r: Retiring) -> None:
        """Stop the old sidecar once nothing uses it or the cap is reached; else wait."""
        elapsed = self.clock() - r.switched_at
        if elapsed < self.drain_s:
            if elapsed < self.settle_s:
                return  # a request begun just before the switch may not be reported yet
            try:
                live = self.live_requests(r.base_urls)
            except Exception:
                # Unknown is not zero: keep the old sidecar until the next read or the cap.
                logger.warning("render sidecar %s: live request count unavailable; keeping it", r.name, exc_info=True)
                return
            if live > 0:
                if live != r.live:
                    logger.info("render sidecar %s drains: %d request(s) still on it (cap in %.0fs)",
                                r.name, live, self.drain_s - elapsed)
                r.live = live
                return
            why = "no request uses it any more"
        else:
            why = f"the {self.drain_s:g}s drain cap was reached ({r.live or 0} request(s) were still on it)"
        logger.info("render sidecar %s retired after %.1fs: %s", r.name, elapsed, why)
        self.supervisor.retire(r.name)
        self.retiring = None
        services.render_sidecar_restarted(config_id=r.config_id, expected=r.expected, actor="launcher")


def with_render_config(cfg: stack.StackConfig) -> stack.StackConfig:
    """``cfg`` with the sidecar settings the render config holds (its thread pool today).

    The pool size is part of the config an operator edits, and changing it is one of the changes
    that restart the sidecar; the first start must use it too, not the launcher's default.
    """
    config = RenderConfig.objects.order_by("id").first()
    if config is None or config.renderer_num_workers == cfg.render_workers:
        return cfg
    return dataclasses.replace(cfg, render_workers=config.renderer_num_workers)


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
        parser.add_argument(
            "--prefill-ports",
            default=os.environ.get("MOTOR_PREFILL_PORTS", "8211"),
            help="comma-separated prefill engines for the Handoff topology; empty for none",
        )
        parser.add_argument(
            "--decode-ports",
            default=os.environ.get("MOTOR_DECODE_PORTS", "8221"),
            help="comma-separated decode engines for the Handoff topology; empty for none",
        )
        parser.add_argument(
            "--var-dir",
            default=os.environ.get("MOTOR_VAR_DIR", str(stack.ROOT / "var")),
            help="logs (log/) and the Celery broker folders (celery/) of this run",
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
            engine_ports=_ports(opts["engine_ports"]),
            prefill_ports=_ports(opts["prefill_ports"]),
            decode_ports=_ports(opts["decode_ports"]),
            log_dir=Path(opts["var_dir"]) / "log",
            celery_dir=Path(opts["var_dir"]) / "celery",
            database_url=os.environ.get("DATABASE_URL", ""),
            redis_url=settings.REDIS_URL,
            api_keys=(api_key,),
            admin_password=admin_password,
            extra_env={"MOTOR_DEMO_ADMIN_KEY": admin_key},
        )
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            specs = stack.build_specs(cfg)
        except tiers.UnsupportedCPU as exc:
            raise CommandError(str(exc)) from None  # before anything starts: say what is missing
        try:
            # Fail fast, naming the port, before anything is started or written.
            check_ports(specs)
        except PortInUse as exc:
            raise CommandError(str(exc)) from None
        stack.prepare_database(cfg)
        configured = with_render_config(cfg)
        if configured != cfg:
            cfg, specs = configured, stack.build_specs(configured)
        self.stdout.write(f"starting {len(specs)} processes ({cfg.engines} engines); logs in {cfg.log_dir}")
        supervisor = Supervisor(specs, on_event=record_event)
        try:
            supervisor.start()
        except (Interrupted, KeyboardInterrupt):
            supervisor.stop(check_ports_free=False)  # Ctrl-C while starting: a clean stop
            return
        except SupervisorError as exc:
            supervisor.stop(check_ports_free=False)
            raise CommandError(str(exc)) from None
        launcher.processes_started(
            children=[(spec.name, supervisor.pids[spec.name], spec.ready_base_url or "") for spec in specs]
        )
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
        try:
            code = supervisor.wait(tick=RenderRestarter(supervisor, cfg).tick, tick_interval=1.0)
        finally:
            try:
                launcher.processes_stopped()
            except Exception:
                logger.exception("could not record the stop of the stack")
        if code:
            raise CommandError("the coordinator died; see its log tail above")


# What the supervisor's child states mean for the ManagedProcess rows the admin shows.
_EVENT_STATES = {
    "exited": ManagedProcess.State.BACKOFF,
    "gave_up": ManagedProcess.State.FAILED,
    "ready": ManagedProcess.State.RUNNING,
}


def record_event(event: ChildEvent) -> None:
    """The supervisor's observer: each exit, recovery and crash-loop verdict goes to the database."""
    launcher.process_changed(
        name=event.name, state=_EVENT_STATES[event.kind], pid=event.pid, restarts=event.restarts, reason=event.reason
    )


def _ports(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise CommandError(f"ports must be comma-separated numbers, not {text!r}") from None
