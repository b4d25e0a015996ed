"""``make run``: start the render sidecar, the demo engines, Celery and the coordinator; stop them on Ctrl-C."""

from __future__ import annotations

import logging
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from fleet.lora_probes import probe_lora_adapters
from fleet.models import ManagedProcess
from motorsite import stack, tiers
from motorsite.launcher import records
from motorsite.launcher.render_restarter import RenderRestarter, with_render_config
from motorsite.supervisor import ChildEvent, Interrupted, PortInUse, Supervisor, SupervisorError, check_ports

logger = logging.getLogger(__name__)


def _required_env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise CommandError(f"{name} is not set: start this through `make run` (python3 -m toolchain exec ...)")
    return value


def _socket_dir(opts: dict[str, Any]) -> Path | None:
    """Where the sidecars' unix sockets go: ``--render-socket-dir``, else run/ under ``--var-dir``;
    "" for TCP. ``make run`` puts its sidecars on unix sockets because that costs less CPU per
    derender call (bench/sidecar_uds.py in bench/RESULTS.md)."""
    chosen = opts["render_socket_dir"]
    if chosen is None:
        # make run must start wherever it is cloned: a checkout so deep that a socket in var/run/
        # would pass the kernel's path limit serves its sidecars on TCP instead. A directory the
        # operator named still stops the start when it is too deep (private_socket_dir).
        default = Path(opts["var_dir"]) / "run"
        return default if stack.socket_dir_fits(default) else None
    return Path(chosen) if chosen else None


class Command(BaseCommand):
    help = "Run the whole stack on 127.0.0.1 until Ctrl-C or SIGTERM."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--engines", choices=["vllm", "sim"], default=os.environ.get("MOTOR_ENGINES", "vllm"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("MOTOR_PORT", "8000")))
        parser.add_argument(
            "--server",
            choices=stack.SERVERS,
            default=os.environ.get("MOTOR_SERVER", "daphne"),
            help="the coordinator's ASGI server (uvicorn: less CPU per stream, bench/hotpath.py)",
        )
        parser.add_argument("--render-port", type=int, default=int(os.environ.get("MOTOR_RENDER_PORT", "8100")))
        parser.add_argument(
            "--render-pool-size", type=int, default=int(os.environ.get("MOTOR_RENDER_POOL_SIZE", "1")),
            help="render sidecars to start, on --render-port and the ports after it (docs/render-pool.md)",
        )
        parser.add_argument(
            "--render-socket-dir",
            default=os.environ.get("MOTOR_RENDER_SOCKET_DIR"),
            help="the render sidecars listen on unix sockets in this directory (created 0700; vLLM's --uds) instead "
            "of on 127.0.0.1 (default: run/ under --var-dir; empty: TCP on --render-port and the ports after it)",
        )
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
            "--second-model",
            action="store_true",
            default=os.environ.get("MOTOR_SECOND_MODEL", "") not in ("", "0"),
            help="also serve the second small model (tiny-b: another tokenizer and chat template) with its own "
            "render sidecar and engine (docs/models.md)",
        )
        parser.add_argument(
            "--second-model-ports",
            default=os.environ.get("MOTOR_SECOND_MODEL_PORTS", ""),
            help="the second model's render sidecar port, then its engines' ports (comma-separated); empty: its "
            "sidecars on the ports after the first model's render pool, its engine on 8203. Its render pool "
            "is as large as the first model's (--render-pool-size), on the ports after its sidecar's",
        )
        parser.add_argument(
            "--lora",
            action="store_true",
            default=os.environ.get("MOTOR_LORA", "") not in ("", "0"),
            help=f"load tinymodel's LoRA adapter on the union engines and serve it as the model {LORA_NAME!r} "
            "(docs/models.md)",
        )
        parser.add_argument(
            "--var-dir",
            default=os.environ.get("MOTOR_VAR_DIR", str(stack.ROOT / "var")),
            help="logs (log/) and the Celery broker folders (celery/) of this run",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["server"] not in stack.SERVERS:  # from MOTOR_SERVER: argparse checks only what is typed
            raise CommandError(f"MOTOR_SERVER={opts['server']!r} is not one of {', '.join(stack.SERVERS)}")
        # Both keys reach ``demo_fleet`` through the environment (MOTOR_API_KEYS, MOTOR_DEMO_ADMIN_KEY),
        # which stores only their hashes as ApiKey records.
        api_key = os.environ.get("MOTOR_DEMO_API_KEY") or "sk-motor-" + secrets.token_urlsafe(18)
        admin_key = os.environ.get("MOTOR_DEMO_ADMIN_KEY") or "mk-admin-" + secrets.token_urlsafe(18)
        admin_password = os.environ.get("MOTOR_DEMO_ADMIN_PASSWORD") or secrets.token_urlsafe(12)
        cfg = stack.StackConfig(
            model_dir=_required_env("MOTOR_MODEL_DIR"),
            render_python=_required_env("MOTOR_RENDER_PYTHON"),
            engine_python=_required_env("MOTOR_ENGINE_PYTHON"),
            app_python=sys.executable,
            engines=opts["engines"],
            coordinator_port=opts["port"],
            server=opts["server"],
            render_port=opts["render_port"],
            render_member_ports=tuple(opts["render_port"] + i for i in range(1, max(1, opts["render_pool_size"]))),
            render_socket_dir=_socket_dir(opts),
            engine_ports=_ports(opts["engine_ports"]),
            prefill_ports=_ports(opts["prefill_ports"]),
            decode_ports=_ports(opts["decode_ports"]),
            log_dir=Path(opts["var_dir"]) / "log",
            log_max_bytes=settings.MOTOR_LOG_MAX_BYTES,
            log_backups=settings.MOTOR_LOG_BACKUPS,
            celery_dir=Path(opts["var_dir"]) / "celery",
            database_url=os.environ.get("DATABASE_URL", ""),
            redis_url=settings.REDIS_URL,
            api_keys=(api_key,),
            admin_password=admin_password,
            extra_env={"MOTOR_DEMO_ADMIN_KEY": admin_key},
            extra_models=_second_model(opts) if opts["second_model"] else (),
            lora_adapters=(stack.LoraAdapter(LORA_NAME, _required_env("MOTOR_LORA_DIR")),) if opts["lora"] else (),
        )
        if cfg.lora_adapters and cfg.engines != "vllm":
            raise CommandError("MOTOR_LORA needs real engines: the engine simulator loads no LoRA adapter")
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            specs = stack.build_specs(cfg)
        except (tiers.UnsupportedCPU, ValueError) as exc:
            raise CommandError(str(exc)) from None  # before anything starts: say what is missing or clashes
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
        records.processes_started(
            children=[(spec.name, supervisor.pids[spec.name], spec.ready_base_url or "") for spec in specs]
        )
        if cfg.lora_adapters:
            # Which engine holds which adapter, before beat's first LoRA probe: the adapter takes traffic now.
            probe_lora_adapters()
        base = cfg.coordinator_url
        self.stdout.write(
            "\n".join(
                [
                    "",
                    "motorsite is running. Ctrl-C stops everything.",
                    f"  OpenAI API      {base}/v1   (Authorization: Bearer {api_key})",
                    f"  Django admin    {base}/admin/   (user admin, password {admin_password})",
                    f"  REST API        {base}/api/   (Authorization: Bearer {admin_key}; docs at {base}/api/docs)",
                    *[f"  render sidecar  {stack.render_address(cfg, p)}" for p in (cfg.render_port, *cfg.render_member_ports)],
                    *[f"  engine          {u}" for u in cfg.engine_urls],
                    *[f"  LoRA adapter    {a.name} (model {a.name!r}, base {cfg.served_model_name!r})" for a in cfg.lora_adapters],
                    *[f"  model {m.name:<9} render {stack.render_address(cfg, m.render_port)}, engines "
                      + ", ".join(f"http://127.0.0.1:{p}" for p in m.engine_ports) for m in cfg.extra_models],
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
            # Every model's sidecar restarts gracefully: the default config's, and each extra model's own.
            restarters = [RenderRestarter(supervisor, cfg), *(
                RenderRestarter(supervisor, stack.model_config(cfg, model), model=model.name)
                for model in cfg.extra_models
            )]

            def tick() -> None:
                for restarter in restarters:
                    restarter.tick()

            code = supervisor.wait(tick=tick, tick_interval=1.0)
        finally:
            try:
                records.processes_stopped()
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
    records.process_changed(
        name=event.name, state=_EVENT_STATES[event.kind], pid=event.pid, restarts=event.restarts, reason=event.reason
    )


SECOND_MODEL_NAME = "tiny-b"
# tinymodel.lora's adapter as the engines load it (--lora-modules) and clients name it, with MOTOR_LORA=1.
LORA_NAME = "tiny-lora"


def _second_model(opts: dict[str, Any]) -> tuple[stack.ExtraModel, ...]:
    pool_size = max(1, opts["render_pool_size"])
    ports_text = opts["second_model_ports"] or f"{opts['render_port'] + pool_size},8203"
    ports = _ports(ports_text)
    if len(ports) < 2:
        raise CommandError(f"--second-model-ports needs the render port and at least one engine port, not {ports_text!r}")
    members = tuple(ports[0] + i for i in range(1, pool_size))
    return (stack.ExtraModel(SECOND_MODEL_NAME, _required_env("MOTOR_MODEL_B_DIR"), ports[0], ports[1:], members),)


def _ports(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise CommandError(f"ports must be comma-separated numbers, not {text!r}") from None
