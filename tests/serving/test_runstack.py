"""The launcher's graceful render sidecar restart (motorsite.launcher.render_restarter), with tiny real
HTTP children standing in for the sidecar under a real Supervisor, and a fake clock.

What uses the old sidecar is what coordinator processes report in ``RenderStreamReport`` rows;
the tests write those rows through the same service the reporter thread uses (this test
process stands in for a live coordinator process). The stream kept alive across a restart
through real processes is in tests/integration/test_render_restart_real.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest

from catalog.models import RenderConfig, RenderSidecar, RenderStreamReport, ServedModel
from catalog.services import render_config_publish, render_streams_report
from motorsite import stack
from motorsite.core import read_control_version
from motorsite.launcher.render_restarter import RENDER_RETRY_S, RenderRestarter, with_render_config
from motorsite.supervisor import ProcessSpec, Supervisor, free_port
from serving import stream_reports
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
        yield sup, RenderRestarter(sup, cfg, drain_s=30, settle_s=3, clock=clock, spec_for=fake_sidecar), clock
        pids = list(sup.pids.values())
    assert not any(alive(pid) for pid in pids)  # nothing leaked


def test_nothing_happens_without_the_flag(launched: tuple[Supervisor, RenderRestarter, Clock]) -> None:
    sup, restarter, clock = launched
    before = dict(sup.pids)
    restarter.tick()
    assert sup.pids == before


def report(counts: dict[str, int], *, pid: int | None = None, host: str = stream_reports.HOST) -> None:
    """What a coordinator process's reporter thread writes (this process: alive)."""
    render_streams_report(host=host, pid=pid or os.getpid(), counts=counts)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


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

    clock.now += 2.9
    restarter.tick()  # nothing reported, but a stream begun just before the switch may not be yet
    assert alive(old_pid)
    clock.now += 0.1
    restarter.tick()
    assert set(sup.pids) == {"render-2"}
    assert not alive(old_pid)
    assert not RenderConfig.objects.get().restart_required


def test_it_keeps_the_old_sidecar_while_a_stream_is_reported_on_it_and_retires_it_at_zero(
    launched: tuple[Supervisor, RenderRestarter, Clock],
) -> None:
    sup, restarter, clock = launched
    old_url = RenderConfig.objects.get().base_url
    old_pid = sup.pids["render"]
    report({old_url: 1})  # a stream began on the old sidecar and is still derendering there
    render_config_publish(changes={"renderer_num_workers": 2}, actor="test")
    restarter.tick()
    new_url = RenderConfig.objects.get().base_url
    for _ in range(5):
        clock.now += 5
        restarter.tick()
    assert alive(old_pid) and set(sup.pids) == {"render", "render-2"}  # 25s: the stream lives on
    report({old_url: 0, new_url: 7})  # it ended; new streams use the replacement only
    clock.now += 1
    restarter.tick()
    assert set(sup.pids) == {"render-2"} and not alive(old_pid)  # retired at zero, before the cap
    assert not RenderConfig.objects.get().restart_required


def test_it_retires_the_old_sidecar_at_the_cap_even_with_a_stream_on_it(
    launched: tuple[Supervisor, RenderRestarter, Clock],
) -> None:
    sup, restarter, clock = launched
    old_url = RenderConfig.objects.get().base_url
    report({old_url: 2})
    render_config_publish(changes={"renderer_num_workers": 2}, actor="test")
    restarter.tick()
    clock.now += 29.9
    restarter.tick()
    assert set(sup.pids) == {"render", "render-2"}
    clock.now += 0.1
    restarter.tick()
    assert set(sup.pids) == {"render-2"}  # MOTOR_RENDER_DRAIN_S is the cap
    assert not RenderConfig.objects.get().restart_required


def test_it_counts_a_stream_addressed_as_localhost(launched: tuple[Supervisor, RenderRestarter, Clock]) -> None:
    sup, restarter, clock = launched
    port = RenderConfig.objects.get().port
    report({f"http://localhost:{port}": 1})
    render_config_publish(changes={"renderer_num_workers": 2}, actor="test")
    restarter.tick()
    clock.now += 10
    restarter.tick()
    assert set(sup.pids) == {"render", "render-2"}


def test_it_ignores_dead_processes_other_machines_and_other_sidecars(
    launched: tuple[Supervisor, RenderRestarter, Clock],
) -> None:
    sup, restarter, clock = launched
    old_url = RenderConfig.objects.get().base_url
    report({old_url: 3}, pid=dead_pid())  # a coordinator that died mid-stream
    report({old_url: 4}, host="another-machine")  # its 127.0.0.1 is another sidecar
    report({"http://127.0.0.1:1": 5})  # a sidecar that is not being replaced
    render_config_publish(changes={"renderer_num_workers": 2}, actor="test")
    restarter.tick()
    clock.now += 3
    restarter.tick()
    assert set(sup.pids) == {"render-2"}
    assert not RenderStreamReport.objects.filter(counts__has_key=old_url, host=stream_reports.HOST).exists()


def test_a_count_it_cannot_read_keeps_the_old_sidecar_until_the_cap(
    launched: tuple[Supervisor, RenderRestarter, Clock],
) -> None:
    sup, restarter, clock = launched

    def unavailable(base_urls: tuple[str, ...]) -> int:
        raise RuntimeError("database is locked")

    restarter.live_requests = unavailable
    render_config_publish(changes={"renderer_num_workers": 2}, actor="test")
    restarter.tick()
    clock.now += 20
    restarter.tick()
    assert set(sup.pids) == {"render", "render-2"}  # unknown is not zero
    clock.now += 10
    restarter.tick()
    assert set(sup.pids) == {"render-2"}


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
    attempts: list[int] = []  # one entry per replacement the restarter tried to start

    def broken(cfg: stack.StackConfig) -> ProcessSpec:
        attempts.append(cfg.render_port)
        return ProcessSpec(
            name="render", argv=[sys.executable, "-c", "raise SystemExit(3)"], log_path=tmp_path / "broken.log",
            ready_url=f"http://127.0.0.1:{cfg.render_port}/health", ready_timeout=10,
        )

    restarter.spec_for = broken
    port = RenderConfig.objects.get().port
    render_config_publish(changes={"renderer_num_workers": 2}, actor="test")
    restarter.tick()
    assert set(sup.pids) == {"render"} and len(attempts) == 1
    config = RenderConfig.objects.get()
    assert config.port == port and config.restart_required
    clock.now += 1
    restarter.tick()  # the next second's tick backs off instead of retrying
    assert len(attempts) == 1
    clock.now += RENDER_RETRY_S
    restarter.tick()  # the back-off is over: one more attempt, which fails the same way
    assert set(sup.pids) == {"render"} and len(attempts) == 2


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


def test_make_run_starts_the_sidecar_with_the_render_configs_workers(tmp_path: Path) -> None:
    cfg = stack.StackConfig(model_dir="/m", render_python="py", engine_python="py", log_dir=tmp_path)
    assert with_render_config(cfg) is cfg  # no config yet: the launcher's default (4)
    RenderConfig.objects.create(renderer_num_workers=2)
    argv = stack.render_spec(with_render_config(cfg)).argv
    assert argv[argv.index("--renderer-num-workers") + 1] == "2"


def test_a_pool_is_replaced_one_sidecar_at_a_time(tmp_path: Path) -> None:
    cfg = stack.StackConfig(
        model_dir="/nonexistent", render_python=sys.executable, engine_python=sys.executable,
        render_port=free_port(), render_member_ports=(free_port(),), log_dir=tmp_path,
    )
    config = RenderConfig.objects.create(port=cfg.render_port, renderer_num_workers=4)
    for port in (cfg.render_port, *cfg.render_member_ports):
        RenderSidecar.objects.create(render_config=config, port=port)
    member_spec = replace(fake_sidecar(replace(cfg, render_port=cfg.render_member_ports[0])), name="render-member-2")
    clock = Clock()
    with Supervisor([fake_sidecar(cfg), member_spec]) as sup:
        restarter = RenderRestarter(sup, cfg, drain_s=30, settle_s=3, clock=clock, spec_for=fake_sidecar)
        first_pid, member_pid = sup.pids["render"], sup.pids["render-member-2"]
        render_config_publish(changes={"renderer_num_workers": 2}, actor="test")

        restarter.tick()  # the first sidecar's replacement; the other member is untouched meanwhile
        assert set(sup.pids) == {"render", "render-member-2", "render-2"}
        clock.now += 3
        restarter.tick()  # the first one retired
        assert set(sup.pids) == {"render-member-2", "render-2"} and not alive(first_pid)
        assert RenderConfig.objects.get().restart_required  # owed until the whole pool serves the change

        restarter.tick()  # now the second member's replacement
        assert set(sup.pids) == {"render-member-2", "render-2", "render-3"}
        ports = sorted(RenderSidecar.objects.values_list("port", flat=True))
        assert cfg.render_member_ports[0] not in ports and len(ports) == 2  # its row moved to the replacement
        clock.now += 3
        restarter.tick()
        assert set(sup.pids) == {"render-2", "render-3"} and not alive(member_pid)
        assert not RenderConfig.objects.get().restart_required
        restarter.tick()  # nothing more owed
        assert set(sup.pids) == {"render-2", "render-3"}
        pids = list(sup.pids.values())
    assert not any(alive(pid) for pid in pids)


def test_an_extra_models_own_sidecar_gets_the_same_graceful_restart(tmp_path: Path) -> None:
    cfg = stack.StackConfig(
        model_dir="/nonexistent", render_python=sys.executable, engine_python=sys.executable,
        render_port=free_port(), log_dir=tmp_path,
    )
    first = ServedModel.objects.create(name="tiny", model_path="/m/tiny")
    second = ServedModel.objects.create(name="tiny-b", model_path="/m/tiny-b")
    RenderConfig.objects.create(port=cfg.render_port, served_model=first)
    own_port = free_port()
    RenderConfig.objects.create(name="tiny-b", port=own_port, served_model=second, renderer_num_workers=4)
    mcfg = replace(cfg, render_port=own_port, served_model_name="tiny-b")
    clock = Clock()
    with Supervisor([fake_sidecar(cfg), replace(fake_sidecar(mcfg), name="render-tiny-b")]) as sup:
        default = RenderRestarter(sup, cfg, drain_s=30, settle_s=3, clock=clock, spec_for=fake_sidecar)
        own = RenderRestarter(sup, mcfg, drain_s=30, settle_s=3, clock=clock, spec_for=fake_sidecar, model="tiny-b")
        old_pid = sup.pids["render-tiny-b"]
        assert render_config_publish(changes={"renderer_num_workers": 2}, actor="test", name="tiny-b").restart_required
        default.tick()
        assert set(sup.pids) == {"render", "render-tiny-b"}  # not the first model's to restart
        own.tick()
        assert set(sup.pids) == {"render", "render-tiny-b", "render-tiny-b-2"}  # the replacement serves first
        config = RenderConfig.objects.get(name="tiny-b")
        assert config.port != own_port and config.restart_required
        clock.now += 3.0
        own.tick()
        assert set(sup.pids) == {"render", "render-tiny-b-2"} and not alive(old_pid)
        assert not RenderConfig.objects.get(name="tiny-b").restart_required
        assert RenderConfig.objects.get(served_model=first).port == cfg.render_port  # untouched
        pids = list(sup.pids.values())
    assert not any(alive(pid) for pid in pids)


UNIX_SERVER = """
import http.server, socketserver, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200); self.send_header("content-length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args): pass
socketserver.UnixStreamServer(sys.argv[1], Handler).serve_forever()
"""


def fake_unix_sidecar(cfg: stack.StackConfig) -> ProcessSpec:
    """What stack.render_spec would start with ``render_socket_dir``: a tiny HTTP server on its socket."""
    spec = stack.render_spec(cfg)
    return replace(spec, argv=[sys.executable, "-c", UNIX_SERVER, spec.unix_sockets[0]], env={},
                   log_path=cfg.log_dir / f"render-{cfg.render_port}.log", ready_timeout=10)


def test_a_pool_on_unix_sockets_is_replaced_on_sockets_of_its_own(tmp_path: Path) -> None:
    cfg = stack.StackConfig(
        model_dir="/nonexistent", render_python=sys.executable, engine_python=sys.executable,
        render_port=free_port(), render_member_ports=(free_port(),), log_dir=tmp_path, render_socket_dir=tmp_path / "run",
    )
    first, member = (f"unix:{tmp_path.resolve()}/run/render-{p}.sock" for p in (cfg.render_port, *cfg.render_member_ports))
    config = RenderConfig.objects.create(host=first, port=cfg.render_port, renderer_num_workers=4)
    for host in (first, member):
        RenderSidecar.objects.create(render_config=config, host=host, port=0)
    specs = [replace(s, argv=fake_unix_sidecar(replace(cfg, render_port=p)).argv, env={}, ready_timeout=10)
             for s, p in zip(stack.render_specs(cfg), (cfg.render_port, *cfg.render_member_ports), strict=True)]
    clock = Clock()
    with Supervisor(specs) as sup:
        restarter = RenderRestarter(sup, cfg, drain_s=30, settle_s=3, clock=clock, spec_for=fake_unix_sidecar)
        render_config_publish(changes={"renderer_num_workers": 2}, actor="test")
        restarter.tick()  # the first sidecar's replacement, on a socket of its own, ready over it
        config = RenderConfig.objects.get()
        assert config.port != cfg.render_port and config.host == f"unix:{tmp_path.resolve()}/run/render-{config.port}.sock"
        assert sorted(RenderSidecar.objects.values_list("host", "port")) == sorted([(config.host, 0), (member, 0)])
        report({config.base_url: 0, stack.render_base_url(cfg, cfg.render_port): 1})  # a stream on the old one
        clock.now += 3
        restarter.tick()
        assert set(sup.pids) == {"render", "render-member-2", "render-2"}  # kept: the stream is on it
        report({})
        restarter.tick()
        restarter.tick()  # the member's replacement
        clock.now += 3
        restarter.tick()
        assert set(sup.pids) == {"render-2", "render-3"} and not RenderConfig.objects.get().restart_required
        hosts = {h for h, _ in RenderSidecar.objects.values_list("host", "port")}
        assert member not in hosts and len(hosts) == 2 and all(h.startswith(f"unix:{tmp_path.resolve()}/run/") for h in hosts)
        pids = list(sup.pids.values())
    assert not any(alive(pid) for pid in pids)


def test_make_run_puts_its_sidecars_on_sockets_in_a_private_directory_unless_told_not_to(tmp_path: Path) -> None:
    from motorsite.launcher.management.commands.runstack import _socket_dir

    assert _socket_dir({"render_socket_dir": None, "var_dir": str(tmp_path)}) == tmp_path / "run"
    assert _socket_dir({"render_socket_dir": "", "var_dir": str(tmp_path)}) is None  # MOTOR_RENDER_SOCKET_DIR=
    # A checkout too deep for a socket path serves on TCP by default; a directory named still must fit.
    deep = tmp_path / ("d" * 100)
    assert _socket_dir({"render_socket_dir": None, "var_dir": str(deep)}) is None
    assert _socket_dir({"render_socket_dir": str(deep / "run"), "var_dir": str(tmp_path)}) == deep / "run"
    cfg = stack.StackConfig(model_dir="/m", render_python="python", engine_python="python", render_port=8100,
                            render_member_ports=(8101,), log_dir=tmp_path, render_socket_dir=tmp_path / "run")
    first, second = stack.render_specs(cfg)
    assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700
    sock = f"{tmp_path.resolve()}/run/render-8100.sock"
    assert first.argv[first.argv.index("--uds") + 1] == sock and "--port" not in first.argv and "--host" not in first.argv
    assert (first.ports, first.unix_sockets, first.ready_base_url) == ([], [sock], "http+unix://" + sock.replace("/", "%2F"))
    assert second.unix_sockets == [f"{tmp_path.resolve()}/run/render-8101.sock"]
    with pytest.raises(ValueError, match="too long a directory"):
        stack.render_specs(replace(cfg, render_socket_dir=tmp_path / ("d" * 100)))
