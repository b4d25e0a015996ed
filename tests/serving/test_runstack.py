"""The launcher's graceful render sidecar restart (runstack's RenderRestarter), with tiny real
HTTP children standing in for the sidecar under a real Supervisor, and a fake clock."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

from fleet.services import read_control_version
from motorsite import stack
from motorsite.supervisor import ProcessSpec, Supervisor, free_port
from serving.management.commands.runstack import RenderRestarter
from serving.models import RenderConfig
from serving.services import render_config_publish
from tests.motorsite.test_supervisor import SERVER

pytestmark = pytest.mark.django_db


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_sidecar(cfg: stack.StackConfig) -> ProcessSpec:
    """What stack.render_spec would start, as a tiny HTTP server on ``cfg.render_port``."""
    port = cfg.render_port
    return ProcessSpec(
        name="render",
        argv=[sys.executable, "-c", SERVER, json.dumps({"port": port})],
        log_path=cfg.log_dir / f"render-{port}.log",
        ports=[("127.0.0.1", port)],
        ready_url=f"http://127.0.0.1:{port}/health",
        ready_timeout=10,
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def launched(tmp_path: Path) -> Iterator[tuple[Supervisor, RenderRestarter, Clock]]:
    cfg = stack.StackConfig(
        model_dir="/nonexistent", render_python=sys.executable, engine_python=sys.executable,
        render_port=free_port(), log_dir=tmp_path,
    )
    RenderConfig.objects.create(port=cfg.render_port, renderer_num_workers=4)
    clock = Clock()
    with Supervisor([fake_sidecar(cfg)]) as sup:
        yield sup, RenderRestarter(sup, cfg, drain_s=30, clock=clock, spec_for=fake_sidecar), clock
        pids = list(sup.pids.values())
    assert not any(alive(pid) for pid in pids)  # nothing leaked


def test_nothing_happens_without_the_flag(launched: tuple[Supervisor, RenderRestarter, Clock]) -> None:
    sup, restarter, clock = launched
    before = dict(sup.pids)
    restarter.tick()
    assert sup.pids == before


def test_a_workers_change_starts_a_replacement_first_then_retires_the_old_one(
    launched: tuple[Supervisor, RenderRestarter, Clock],
) -> None:
    sup, restarter, clock = launched
    old_port = RenderConfig.objects.get().port
    old_pid = sup.pids["render"]
    assert render_config_publish(changes={"renderer_num_workers": 2}, actor="test").restart_required
    version = read_control_version()

    restarter.tick()
    config = RenderConfig.objects.get()
    assert set(sup.pids) == {"render", "render-2"}  # both serve during the drain period
    assert config.port != old_port  # the old sidecar still holds its port: the new one got another
    assert sup.specs[0].ports != [("127.0.0.1", config.port)]
    assert read_control_version() > version  # coordinators switch within a poll interval
    assert config.restart_required  # owed until the old one is gone

    clock.now += 29
    restarter.tick()
    assert alive(old_pid)
    clock.now += 1
    restarter.tick()
    assert set(sup.pids) == {"render-2"}
    assert not alive(old_pid)
    assert not RenderConfig.objects.get().restart_required


def test_a_port_change_starts_the_replacement_on_the_operators_port(
    launched: tuple[Supervisor, RenderRestarter, Clock],
) -> None:
    sup, restarter, clock = launched
    new_port = free_port()
    render_config_publish(changes={"port": new_port}, actor="test")
    restarter.tick()
    assert RenderConfig.objects.get().port == new_port
    assert set(sup.pids) == {"render", "render-2"}
    clock.now += 30
    restarter.tick()
    assert set(sup.pids) == {"render-2"}
    assert not RenderConfig.objects.get().restart_required


def test_a_change_published_during_the_drain_gets_its_own_restart(
    launched: tuple[Supervisor, RenderRestarter, Clock],
) -> None:
    sup, restarter, clock = launched
    render_config_publish(changes={"renderer_num_workers": 2}, actor="test")
    restarter.tick()
    render_config_publish(changes={"renderer_num_workers": 3}, actor="test")
    clock.now += 30
    restarter.tick()  # retires the first sidecar, but the flag is for the newer config
    assert set(sup.pids) == {"render-2"}
    assert RenderConfig.objects.get().restart_required
    restarter.tick()
    assert set(sup.pids) == {"render-2", "render-3"}
    clock.now += 30
    restarter.tick()
    assert set(sup.pids) == {"render-3"}
    assert not RenderConfig.objects.get().restart_required


def test_a_replacement_that_fails_to_start_leaves_the_old_one_serving(
    launched: tuple[Supervisor, RenderRestarter, Clock], tmp_path: Path,
) -> None:
    sup, restarter, clock = launched

    def broken(cfg: stack.StackConfig) -> ProcessSpec:
        return ProcessSpec(
            name="render", argv=[sys.executable, "-c", "raise SystemExit(3)"], log_path=tmp_path / "broken.log",
            ready_url=f"http://127.0.0.1:{cfg.render_port}/health", ready_timeout=10,
        )

    restarter.spec_for = broken
    port = RenderConfig.objects.get().port
    render_config_publish(changes={"renderer_num_workers": 2}, actor="test")
    restarter.tick()
    assert set(sup.pids) == {"render"}
    config = RenderConfig.objects.get()
    assert config.port == port and config.restart_required
    restarter.tick()  # backs off instead of retrying every second
    assert set(sup.pids) == {"render"}


def test_the_supervisor_wait_loop_calls_tick(tmp_path: Path) -> None:
    cfg = stack.StackConfig(
        model_dir="/nonexistent", render_python=sys.executable, engine_python=sys.executable,
        render_port=free_port(), log_dir=tmp_path,
    )
    ticks: list[int] = []
    with Supervisor([fake_sidecar(cfg)]) as sup:
        pid = sup.pids["render"]

        def tick() -> None:
            ticks.append(1)
            if len(ticks) == 3:
                os.kill(pid, 9)  # wait() ends when a child dies

        assert sup.wait(tick=tick, tick_interval=0.01) == 1
    assert len(ticks) == 3
    assert not alive(pid)
