"""Tests for motorsite.supervisor with tiny real child processes on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from motorsite.processes import describe_exit
from motorsite.supervisor import (
    ChildDied,
    ChildEvent,
    ChildState,
    Interrupted,
    PortInUse,
    ProcessSpec,
    ReadinessTimeout,
    RestartPolicy,
    Supervisor,
    SupervisorState,
    free_port,
    together,
    wait_port_free,
)
from motorsite.tiers import ENGINE_SITE_DIR

REPO_ROOT = Path(__file__).resolve().parents[2]

# A configurable HTTP child. Options (one JSON argument): port; delay before binding;
# require_url that must answer 2xx at startup (else exit 2); post_only (GET answers 405);
# ready_file that must exist before anything answers 200; die_file whose appearance makes the
# server print a line and exit 4 (removing the file first with die_once).
SERVER = r"""
import http.server, json, os, sys, threading, time, urllib.request
opts = json.loads(sys.argv[1])
if opts.get("require_url"):
    try:
        urllib.request.urlopen(opts["require_url"], timeout=2)
    except Exception as exc:
        print("upstream not ready:", exc, flush=True)
        sys.exit(2)
    print("upstream ready", flush=True)
time.sleep(opts.get("delay", 0))

class Handler(http.server.BaseHTTPRequestHandler):
    def answer(self, status):
        if opts.get("ready_file") and not os.path.exists(opts["ready_file"]):
            status = 503
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def do_GET(self):
        self.answer(405 if opts.get("post_only") else 200)
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.answer(200)
    def log_message(self, *args):
        pass

def watch_die_file():
    while not os.path.exists(opts["die_file"]):
        time.sleep(0.02)
    print("dying on request", flush=True)
    if opts.get("die_once"):
        os.remove(opts["die_file"])  # the restarted server lives on
    os._exit(4)

if opts.get("die_file"):
    threading.Thread(target=watch_die_file, daemon=True).start()
server = http.server.HTTPServer(("127.0.0.1", opts["port"]), Handler)
print("serving on", opts["port"], flush=True)
server.serve_forever()
"""

# A wrapper (like a shell script or vLLM's API server) whose grandchildren do the work: a server
# and a sleeper that ignores SIGTERM. It publishes their pids before the server reports ready.
WRAPPER = r"""
import json, os, subprocess, sys
opts = json.loads(sys.argv[1])
sleeper = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
server = subprocess.Popen([sys.executable, "-c", opts["server_script"],
    json.dumps({"port": opts["port"], "ready_file": opts["pids_file"]})])
tmp = opts["pids_file"] + ".tmp"
with open(tmp, "w") as f:
    json.dump([sleeper.pid, server.pid], f)
os.replace(tmp, opts["pids_file"])
server.wait()
"""

# Runs a Supervisor as a foreground launcher would, printing the children's pids once started.
LAUNCHER = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from motorsite.supervisor import ProcessSpec, Supervisor
specs = []
for kw in json.loads(sys.argv[2]):
    kw["log_path"] = Path(kw["log_path"])
    kw["ports"] = [tuple(p) for p in kw["ports"]]
    specs.append(ProcessSpec(**kw))
sup = Supervisor(specs)
sup.start()
print(json.dumps(sup.pids), flush=True)
sys.exit(sup.wait())
"""


def server_spec(name: str, tmp_path: Path, **opts: Any) -> ProcessSpec:
    port = free_port()
    post_only = opts.setdefault("post_only", False)
    readiness: dict[str, Any]
    if post_only:
        readiness = {
            "ready_post": ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
            "ready_base_url": f"http://127.0.0.1:{port}",
        }
    else:
        readiness = {"ready_url": f"http://127.0.0.1:{port}/health"}
    return ProcessSpec(
        name=name,
        argv=[sys.executable, "-c", SERVER, json.dumps({"port": port, **opts})],
        log_path=tmp_path / f"{name}.log",
        ports=[("127.0.0.1", port)],
        ready_timeout=10,
        **readiness,
    )


def wrapper_spec(name: str, tmp_path: Path) -> ProcessSpec:
    port = free_port()
    opts = {"port": port, "pids_file": str(tmp_path / f"{name}.pids"), "server_script": SERVER}
    return ProcessSpec(
        name=name,
        argv=[sys.executable, "-c", WRAPPER, json.dumps(opts)],
        log_path=tmp_path / f"{name}.log",
        ports=[("127.0.0.1", port)],
        ready_url=f"http://127.0.0.1:{port}/health",
        ready_timeout=10,
        # The sleeper ignores SIGTERM: a short stop_timeout exercises the SIGKILL escalation.
        stop_timeout=0.5,
    )


def grandchild_pids(tmp_path: Path, name: str) -> list[int]:
    pids: list[int] = json.loads((tmp_path / f"{name}.pids").read_text())
    return pids


def gone(pid: int) -> bool:
    """Whether `pid` no longer runs; a zombie counts as gone (PID 1 may never reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(")") + 2] == "Z"


def port(spec: ProcessSpec) -> int:
    return spec.ports[0][1]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_it_starts_processes_in_order_once_each_is_ready(tmp_path: Path) -> None:
    # The engine exits at startup unless the sidecar already answers, and answers only POST:
    # both are ready only if the supervisor waited for the sidecar and POSTed to the engine.
    sidecar = server_spec("sidecar", tmp_path, delay=0.3)
    engine = server_spec("engine", tmp_path, require_url=sidecar.ready_url, post_only=True)
    flag = str(tmp_path / "worker-ready")
    # No HTTP port, like a Celery worker: ready when a command says so.
    worker = ProcessSpec(
        name="worker",
        argv=[
            sys.executable,
            "-c",
            f"import time; time.sleep(0.2); open({flag!r}, 'w'); time.sleep(600)",
        ],
        log_path=tmp_path / "worker.log",
        ready_argv=[sys.executable, "-c", f"import os; assert os.path.exists({flag!r})"],
        ready_timeout=10,
    )
    supervisor = Supervisor([sidecar, engine, worker])

    with supervisor:
        assert supervisor.state is SupervisorState.RUNNING
        assert list(supervisor.pids) == ["sidecar", "engine", "worker"]
        supervisor.check_children()
        assert "upstream ready" in (tmp_path / "engine.log").read_text()

    assert supervisor.state is SupervisorState.STOPPED
    assert all(gone(pid) for pid in supervisor.pids.values())
    assert wait_port_free("127.0.0.1", port(sidecar), 0)
    assert wait_port_free("127.0.0.1", port(engine), 0)


def flag_writer(name: str, tmp_path: Path, flag: Path, *, exit_code: int | None = None) -> ProcessSpec:
    """A portless child that writes ``flag`` at once (then lives, or exits with ``exit_code``)."""
    then = "time.sleep(600)" if exit_code is None else f"sys.exit({exit_code})"
    return ProcessSpec(
        name=name,
        argv=[sys.executable, "-c", f"import sys, time; open({str(flag)!r}, 'w'); {then}"],
        log_path=tmp_path / f"{name}.log",
        ready_argv=["test", "-f", str(flag)],
        ready_timeout=10,
    )


def test_it_starts_a_group_together_and_the_next_spec_once_the_whole_group_is_ready(tmp_path: Path) -> None:
    # The sidecar answers 503 until the helper has written its file: it can become ready only if
    # the helper started without waiting for it. The coordinator exits at startup unless the
    # sidecar already answers 200: it must wait for the whole group.
    flag = tmp_path / "helper-ran"
    sidecar = server_spec("sidecar", tmp_path, ready_file=str(flag), delay=0.3)
    helper = flag_writer("helper", tmp_path, flag)
    coordinator = server_spec("coordinator", tmp_path, require_url=sidecar.ready_url)
    supervisor = Supervisor([*together([sidecar, helper]), coordinator])

    with supervisor:
        assert list(supervisor.pids) == ["sidecar", "helper", "coordinator"]
        supervisor.check_children()
        assert "upstream ready" in (tmp_path / "coordinator.log").read_text()

    assert all(gone(pid) for pid in supervisor.pids.values())
    assert wait_port_free("127.0.0.1", port(sidecar), 0)


def test_it_fails_the_start_when_a_group_member_dies_while_another_is_awaited(tmp_path: Path) -> None:
    never = tmp_path / "never-written"
    sidecar = server_spec("sidecar", tmp_path, ready_file=str(never))  # never ready
    doomed = flag_writer("doomed", tmp_path, tmp_path / "doomed-ran", exit_code=3)
    supervisor = Supervisor(together([sidecar, doomed]))

    with pytest.raises(ChildDied) as died:
        supervisor.start()

    assert died.value.name == "doomed" and died.value.returncode == 3
    assert supervisor.state is SupervisorState.STOPPED
    assert all(gone(pid) for pid in supervisor.pids.values())
    assert wait_port_free("127.0.0.1", port(sidecar), 5)


def test_a_child_added_while_running_that_exits_at_once_fails_the_add_not_its_ready_timeout(tmp_path: Path) -> None:
    sidecar = server_spec("sidecar", tmp_path)
    never = tmp_path / "never-written"
    # Never ready (its flag is not the one it writes), and gone at once: only its exit can end the wait.
    doomed = replace(flag_writer("doomed", tmp_path, tmp_path / "doomed-ran", exit_code=3),
                     ready_argv=["test", "-f", str(never)], ready_timeout=120)
    with Supervisor([sidecar]) as supervisor:
        with pytest.raises(ChildDied) as died:
            supervisor.add(doomed)
        assert died.value.name == "doomed" and died.value.returncode == 3
        assert set(supervisor.pids) == {"sidecar"}  # the running child is untouched


def test_it_fails_fast_naming_the_port_in_use(tmp_path: Path, busy_port: int) -> None:
    marker = tmp_path / "first-started"
    first = ProcessSpec(
        name="sidecar",
        argv=[sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        log_path=tmp_path / "sidecar.log",
        ready_url="http://127.0.0.1:1/health",
    )
    second = ProcessSpec(
        name="coordinator",
        argv=[sys.executable, "-c", "pass"],
        log_path=tmp_path / "coordinator.log",
        ports=[("127.0.0.1", busy_port)],
        ready_url=f"http://127.0.0.1:{busy_port}/health",
    )
    supervisor = Supervisor([first, second])

    with pytest.raises(PortInUse, match=rf"127\.0\.0\.1:{busy_port}.*'coordinator'") as excinfo:
        supervisor.start()

    assert (excinfo.value.name, excinfo.value.port) == ("coordinator", busy_port)
    assert supervisor.pids == {}
    assert not marker.exists()
    assert supervisor.state is SupervisorState.STOPPED


def test_it_reports_a_child_that_dies_during_start_with_its_log_tail(tmp_path: Path) -> None:
    sidecar = server_spec("sidecar", tmp_path)
    crasher = ProcessSpec(
        name="engine",
        argv=[
            sys.executable,
            "-c",
            "import sys\nfor i in range(60): print('line', i)\n"
            "sys.exit('boom: cannot load model')",
        ],
        log_path=tmp_path / "engine.log",
        ready_url=f"http://127.0.0.1:{free_port()}/health",
        ready_timeout=10,
    )
    supervisor = Supervisor([sidecar, crasher])

    with pytest.raises(ChildDied) as excinfo:
        supervisor.start()

    died = excinfo.value
    assert (died.name, died.returncode) == ("engine", 1)
    tail = died.log_tail.splitlines()
    assert tail[-1] == "boom: cannot load model"
    assert "line 59" in tail
    assert "line 0" not in tail  # Only the tail, not the whole log.
    assert "'engine'" in str(died)
    # The sidecar started before the crash is stopped, not orphaned.
    assert gone(supervisor.pids["sidecar"])
    assert wait_port_free("127.0.0.1", port(sidecar), 5)


def test_it_reports_a_child_that_never_becomes_ready(tmp_path: Path) -> None:
    never = ProcessSpec(
        name="engine",
        argv=[
            sys.executable,
            "-c",
            "import time; print('loading weights', flush=True); time.sleep(600)",
        ],
        log_path=tmp_path / "engine.log",
        ready_url=f"http://127.0.0.1:{free_port()}/health",
        ready_timeout=0.5,
    )
    supervisor = Supervisor([never])

    with pytest.raises(ReadinessTimeout) as excinfo:
        supervisor.start()

    assert excinfo.value.name == "engine"
    assert "ConnectError" in excinfo.value.last_error
    assert "loading weights" in excinfo.value.log_tail
    assert gone(supervisor.pids["engine"])


def test_it_kills_whole_process_groups_including_grandchildren(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = wrapper_spec("engine", tmp_path)
    supervisor = Supervisor([engine])
    supervisor.start()
    sleeper, server = grandchild_pids(tmp_path, "engine")
    assert not gone(sleeper) and not gone(server)

    with caplog.at_level(logging.WARNING, logger="motorsite.supervisor"):
        supervisor.stop()

    assert gone(supervisor.pids["engine"])
    assert gone(server)
    assert gone(sleeper)  # It ignored SIGTERM, so this also proves the SIGKILL escalation.
    assert "engine did not stop within 0.5s; sending SIGKILL" in caplog.text
    assert wait_port_free("127.0.0.1", port(engine), 0)


def test_it_returns_1_from_wait_and_names_the_child_that_died(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    die_file = tmp_path / "die"
    sidecar = server_spec("sidecar", tmp_path)
    engine = server_spec("engine", tmp_path, die_file=str(die_file))
    supervisor = Supervisor([sidecar, engine])
    supervisor.start()

    die_file.touch()
    with caplog.at_level(logging.ERROR, logger="motorsite.supervisor"):
        code = supervisor.wait()

    assert code == 1
    assert supervisor.died is not None
    assert (supervisor.died.name, supervisor.died.returncode) == ("engine", 4)
    assert "'engine' exited with code 4" in caplog.text
    assert "dying on request" in caplog.text
    assert supervisor.state is SupervisorState.STOPPED
    assert gone(supervisor.pids["sidecar"])
    assert wait_port_free("127.0.0.1", port(sidecar), 0)


def test_it_raises_interrupted_when_a_signal_arrives_during_start(tmp_path: Path) -> None:
    # The child interrupts its own supervisor (this process) and then never becomes ready.
    interrupter = ProcessSpec(
        name="engine",
        argv=[
            sys.executable,
            "-c",
            "import os, signal, time; os.kill(os.getppid(), signal.SIGINT); time.sleep(600)",
        ],
        log_path=tmp_path / "engine.log",
        ready_url=f"http://127.0.0.1:{free_port()}/health",
        ready_timeout=10,
    )
    handler_before = signal.getsignal(signal.SIGINT)
    supervisor = Supervisor([interrupter])

    with pytest.raises(Interrupted, match="SIGINT"):
        supervisor.start()

    assert gone(supervisor.pids["engine"])
    assert signal.getsignal(signal.SIGINT) is handler_before


def test_ctrl_c_still_interrupts_after_supervisors_stopped_out_of_start_order(tmp_path: Path) -> None:
    # As the integration tests do: a rig's supervisor started while another lives, the first one
    # stopped first. The second's stop put back the first one's handler, a stopped supervisor's.
    def sleeper(name: str) -> ProcessSpec:
        return ProcessSpec(name=name, argv=[sys.executable, "-c", "import time; time.sleep(600)"],
                           log_path=tmp_path / f"{name}.log", ready_argv=["true"])

    handler_before = signal.getsignal(signal.SIGINT)
    first, second = Supervisor([sleeper("first")]), Supervisor([sleeper("second")])
    first.start()
    second.start()
    first.stop()
    second.stop()
    try:
        with pytest.raises(KeyboardInterrupt):  # pytest's Ctrl-C: its fixtures tear down
            signal.raise_signal(signal.SIGINT)
            time.sleep(5)  # a handler that swallowed it returns here
    finally:
        signal.signal(signal.SIGINT, handler_before)


def test_it_stops_every_child_when_the_supervisor_gets_sigterm(tmp_path: Path) -> None:
    sidecar = server_spec("sidecar", tmp_path)
    engine = wrapper_spec("engine", tmp_path)
    specs = [
        {
            "name": spec.name,
            "argv": spec.argv,
            "log_path": str(spec.log_path),
            "ports": spec.ports,
            "ready_url": spec.ready_url,
            "ready_timeout": spec.ready_timeout,
            "stop_timeout": spec.stop_timeout,
        }
        for spec in (sidecar, engine)
    ]
    argv = [sys.executable, "-c", LAUNCHER, str(REPO_ROOT), json.dumps(specs)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as launcher:
        try:
            assert launcher.stdout is not None
            pids: dict[str, int] = json.loads(launcher.stdout.readline())
            everything = [*pids.values(), *grandchild_pids(tmp_path, "engine")]
            assert len(everything) == 4 and not any(gone(pid) for pid in everything)

            launcher.send_signal(signal.SIGTERM)
            assert launcher.wait(timeout=15) == 0
        finally:
            if launcher.poll() is None:
                launcher.kill()

    assert all(gone(pid) for pid in everything)
    assert wait_port_free("127.0.0.1", port(sidecar), 0)
    assert wait_port_free("127.0.0.1", port(engine), 0)


FAST_RESTARTS = RestartPolicy(backoff_initial_s=0.05, backoff_max_s=0.2, crash_loop_exits=3, crash_loop_window_s=60)


def restartable(spec: ProcessSpec, policy: RestartPolicy = FAST_RESTARTS) -> ProcessSpec:
    return replace(spec, restart=policy)


def supervise_until(supervisor: Supervisor, done: Callable[[], bool], timeout: float = 20.0) -> int:
    """Run wait() until ``done()`` holds (then SIGTERM ourselves, as Ctrl-C would) or ``timeout``."""
    deadline = time.monotonic() + timeout

    def tick() -> None:
        if done() or time.monotonic() > deadline:
            os.kill(os.getpid(), signal.SIGTERM)

    return supervisor.wait(tick=tick, tick_interval=0.02)


def test_it_restarts_a_child_that_exits_and_keeps_the_others_running(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    die_file = tmp_path / "die"
    sidecar = restartable(server_spec("sidecar", tmp_path, die_file=str(die_file), die_once=True))
    coordinator = server_spec("coordinator", tmp_path)
    events: list[ChildEvent] = []
    supervisor = Supervisor([sidecar, coordinator], on_event=events.append)
    supervisor.start()
    first_pid, coordinator_pid = supervisor.pids["sidecar"], supervisor.pids["coordinator"]

    die_file.touch()
    with caplog.at_level(logging.INFO, logger="motorsite.supervisor"):
        code = supervise_until(supervisor, lambda: any(e.kind == "ready" for e in events))

    assert code == 0  # stopped by our SIGTERM, not by the sidecar's death
    assert [(e.name, e.kind) for e in events] == [("sidecar", "exited"), ("sidecar", "ready")]
    exited, ready = events
    assert (exited.pid, exited.reason, exited.restarts) == (first_pid, "exited with code 4", 1)
    assert "dying on request" in exited.log_tail
    assert ready.pid != first_pid and ready.restarts == 1
    assert "sidecar exited with code 4; restarting it in 0.05s (restart 1)" in caplog.text
    assert "sidecar ready again" in caplog.text
    # The coordinator was never touched, and everything is gone after the stop.
    assert supervisor.pids["coordinator"] == coordinator_pid
    assert gone(ready.pid) and gone(coordinator_pid)
    assert wait_port_free("127.0.0.1", port(sidecar), 0)


def test_it_gives_up_on_a_crash_looping_child_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    die_file = tmp_path / "die"  # never removed: every restart dies at once
    engine = restartable(server_spec("engine", tmp_path, die_file=str(die_file)))
    sidecar = restartable(server_spec("sidecar", tmp_path))
    events: list[ChildEvent] = []
    supervisor = Supervisor([sidecar, engine], on_event=events.append)
    supervisor.start()

    die_file.touch()
    with caplog.at_level(logging.ERROR, logger="motorsite.supervisor"):
        code = supervise_until(supervisor, lambda: any(e.kind == "gave_up" for e in events))

    assert code == 0
    kinds = [(e.name, e.kind) for e in events]
    # Three exits within the window (FAST_RESTARTS): two restarts, then the verdict.
    assert kinds == [("engine", "exited"), ("engine", "exited"), ("engine", "gave_up")]
    assert "engine exited with code 4; crash loop (3 exits within 60s): not restarting it" in caplog.text
    assert "dying on request" in events[-1].log_tail
    states = {s.name: s.state for s in supervisor.status()}
    # Read after stop: the verdicts stand, and the sidecar was running all along.
    assert states == {"sidecar": ChildState.RUNNING, "engine": ChildState.FAILED}
    assert [e.kind for e in events if e.name == "sidecar"] == []


def test_it_restarts_a_child_that_never_becomes_ready_again_until_it_gives_up(tmp_path: Path) -> None:
    # Ready at start, then the readiness file disappears: restarts run but never pass readiness.
    ready_file = tmp_path / "ready"
    ready_file.touch()
    die_file = tmp_path / "die"
    spec = replace(
        server_spec("engine", tmp_path, ready_file=str(ready_file), die_file=str(die_file), die_once=True),
        ready_timeout=0.5,
        restart=RestartPolicy(backoff_initial_s=0.05, backoff_max_s=0.05, crash_loop_exits=2, crash_loop_window_s=60),
    )
    events: list[ChildEvent] = []
    supervisor = Supervisor([spec], on_event=events.append)
    supervisor.start()
    ready_file.unlink()
    die_file.touch()

    assert supervise_until(supervisor, lambda: any(e.kind == "gave_up" for e in events)) == 0

    assert [e.kind for e in events] == ["exited", "gave_up"]
    assert events[-1].reason.startswith("not ready 0.5s after restart (last check: 503 from")
    assert all(gone(pid) for pid in (events[0].pid, events[1].pid))


def test_it_stops_everything_when_a_child_without_a_restart_policy_dies_while_others_restart(
    tmp_path: Path,
) -> None:
    die_file = tmp_path / "die"
    engine = restartable(server_spec("engine", tmp_path))
    coordinator = server_spec("coordinator", tmp_path, die_file=str(die_file))
    supervisor = Supervisor([engine, coordinator])
    supervisor.start()

    die_file.touch()
    assert supervisor.wait() == 1

    assert supervisor.died is not None and supervisor.died.name == "coordinator"
    assert gone(supervisor.pids["engine"])


def test_it_names_a_grandchild_killed_by_a_fatal_signal_when_the_leader_exits_normally(tmp_path: Path) -> None:
    # Like vLLM's API server when its engine core dies: the leader exits 0 and only the log knows.
    script = (
        "import subprocess, sys, time\n"
        "time.sleep(0.3)\n"
        "core = subprocess.run([sys.executable, '-X', 'faulthandler', '-c',"
        " 'import os, signal; os.kill(os.getpid(), signal.SIGILL)'])\n"
        "print('engine core returned', core.returncode, flush=True)\n"
    )
    spec = ProcessSpec(
        name="engine-1", argv=[sys.executable, "-c", script], log_path=tmp_path / "engine-1.log", ready_argv=["true"]
    )
    supervisor = Supervisor([spec])
    supervisor.start()

    assert supervisor.wait() == 1

    died = supervisor.died
    assert died is not None and died.returncode == 0
    assert "Fatal Python error: Illegal instruction" in died.log_tail
    assert died.reason == "a process of its group was killed by SIGILL (then the process exited with code 0)"
    assert str(died).startswith("'engine-1' a process of its group was killed by SIGILL")


@pytest.mark.parametrize(
    ("returncode", "tail", "reason"),
    [
        (4, "", "exited with code 4"),
        (-9, "", "killed by SIGKILL"),
        (-11, "Fatal Python error: Segmentation fault\n", "killed by SIGSEGV"),
        (
            0,
            "Fatal Python error: Illegal instruction\n\nThread 0x1 (most recent call first):\n",
            "a process of its group was killed by SIGILL (then the process exited with code 0)",
        ),
        (
            0,
            "motorsite: subprocess EngineCore_DP0 (pid 77) killed by SIGILL\nEngineDeadError\n",
            "engine core killed by SIGILL (then the process exited with code 0)",
        ),
        (
            1,
            "motorsite: subprocess Worker-1 (pid 5) exited with code 3\n",
            "subprocess Worker-1 exited with code 3 (then the process exited with code 1)",
        ),
    ],
)
def test_it_describes_how_a_child_ended(returncode: int, tail: str, reason: str) -> None:
    assert describe_exit(returncode, tail) == reason


@pytest.mark.parametrize(("signum", "fate"), [(signal.SIGKILL, "SIGKILL"), (signal.SIGILL, "SIGILL")])
def test_it_reports_the_engine_cores_fate_through_the_engine_site(tmp_path: Path, signum: int, fate: str) -> None:
    # vLLM's shape: the API server spawns "EngineCore_DP0", sees it die, and exits with code 0.
    script = (
        "import multiprocessing as mp, os, sys, time\n"
        "def core(signum):\n"
        "    time.sleep(0.2)\n"
        "    os.kill(os.getpid(), signum)\n"
        "if __name__ == '__main__':\n"
        f"    p = mp.get_context('spawn').Process(target=core, args=({int(signum)},), name='EngineCore_DP0')\n"
        "    p.start(); p.join()\n"
        "    print('engine core exited unexpectedly', flush=True)\n"
    )
    (tmp_path / "api_server.py").write_text(script)
    spec = ProcessSpec(
        name="engine-1",
        argv=[sys.executable, str(tmp_path / "api_server.py")],
        env={"PYTHONPATH": str(ENGINE_SITE_DIR)},
        log_path=tmp_path / "engine-1.log",
        ready_argv=["true"],
    )
    supervisor = Supervisor([spec])
    supervisor.start()

    assert supervisor.wait() == 1

    died = supervisor.died
    assert died is not None and died.returncode == 0
    assert died.reason == f"engine core killed by {fate} (then the process exited with code 0)"
    assert f"'engine-1' engine core killed by {fate}" in str(died)


def test_it_kills_what_a_dead_leader_left_behind_quickly_before_restarting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # As when vLLM's API server is SIGKILLed: its engine core lives on and ignores SIGTERM.
    engine = restartable(replace(wrapper_spec("engine", tmp_path), stop_timeout=3))
    events: list[ChildEvent] = []
    supervisor = Supervisor([engine], on_event=events.append)
    supervisor.start()
    sleeper, server = grandchild_pids(tmp_path, "engine")
    (tmp_path / "engine.pids").unlink()  # the restarted wrapper writes its own

    os.kill(supervisor.pids["engine"], signal.SIGKILL)
    with caplog.at_level(logging.WARNING, logger="motorsite.supervisor"):
        assert supervise_until(supervisor, lambda: any(e.kind == "ready" for e in events)) == 0

    assert [e.kind for e in events] == ["exited", "ready"]
    assert events[0].reason == "killed by SIGKILL"
    assert gone(sleeper) and gone(server)
    # The orphan got ORPHAN_GRACE, not the spec's 3 s stop timeout, before SIGKILL.
    assert "engine did not stop within 1s; sending SIGKILL" in caplog.text
