"""The compose deployment serves both models through their own tiers, and survives crashes.

    docker/up.sh 8000 && python3 -m toolchain exec docker/smoke.py 8000

Not part of make test (it needs the images and a running compose project, docker/up.sh). Every
request goes to the coordinator on 127.0.0.1:PORT with the official ``openai`` client:

1. Each model (``tiny``, ``tiny-b``) answers: its models list, a greedy chat completion equal to
   the same chat streamed, a completion, and a burst of concurrent chats.
2. Each model's requests reach only its own tiers: every sidecar and engine container's access
   log is read (``docker logs``) for the calls that came from the coordinator's address while
   one model was asked; the other model's sidecars and engines must have none, its own some.
3. Each sidecar runs with the derender fast path (``--middleware
   motorsite_render_asgi.DerenderFastPath``, ``motorsite/render_site`` on its ``PYTHONPATH``), and
   it is active in the container: streams of each model, derendered by its pool (the
   coordinator's ``/metrics`` counts them), add render calls to the pool's ``/metrics`` and no
   derender call, while a derender call with an ``Origin`` header, sent inside a container, is
   counted (so the counter is there and the calls left out are left out by the middleware).
4. A render sidecar of ``tiny``'s pool is SIGKILLed in the middle of a stream, the one that
   rendered the stream's prompt: the stream completes with exactly the text an undisturbed run
   gives, before Docker has the killed sidecar healthy again (it did not wait for the restart).
5. An engine (``engine-1``) is SIGKILLed: Docker restarts it, its healthcheck (one real greedy
   token) passes, and both models answer again.

A process is killed from the host, as a crash would (``docker kill`` would count as an
operator's stop, which restart policies leave stopped).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from openai import OpenAI

CACHE = Path(os.environ.get("MOTOR_CACHE_DIR", Path.home() / ".cache" / "motorsite")) / "docker"
PROJECT = os.environ.get("MOTOR_COMPOSE_PROJECT", "motorsite")
ENGINE = os.environ.get("MOTOR_SMOKE_ENGINE", "engine-1")
# Each model's tiers (docker/compose.yaml): its render pool first, then its engines.
TIERS = {
    "tiny": ["render", "render-member-2", "engine-1", "engine-2", "prefill-1", "decode-1"],
    "tiny-b": ["render-tiny-b", "render-tiny-b-member-2", "engine-tiny-b-1"],
}
# Each sidecar's port in its container (docker/compose.yaml; sidecars publish none on the host).
SIDECAR_PORTS = {"render": 8100, "render-member-2": 8101, "render-tiny-b": 8102, "render-tiny-b-member-2": 8103}
MIDDLEWARE = ["--middleware", "motorsite_render_asgi.DerenderFastPath"]
RENDER_SITE = "PYTHONPATH=/opt/motorsite/render_site"
CHAT_RENDER, CHAT_DERENDER = "/v1/chat/completions/render", "/v1/chat/completions/derender"
COMPLETIONS_RENDER, COMPLETIONS_DERENDER = "/v1/completions/render", "/v1/completions/derender"
PROMPT = [{"role": "user", "content": "Say hello."}]
# Long enough (no EOS; several seconds here) that the sidecar dies with most of the stream to come.
STREAM_TOKENS = 1600
# The first chunk: the coordinator runs ahead of the client (Docker's port proxy buffers the
# stream), so a later one, or docker CLI calls before the kill, let it finish first (a run here
# killed after 5 chunks, a few seconds of docker CLI calls on a loaded host, had the coordinator
# end the stream 0.1 s after the kill).
KILL_AFTER_CHUNKS = 1


def api_key() -> str:
    for line in (CACHE / "compose.env").read_text().splitlines():
        if line.startswith("MOTOR_DEMO_API_KEY="):
            return line.split("=", 1)[1]
    raise SystemExit(f"no MOTOR_DEMO_API_KEY in {CACHE / 'compose.env'}: run docker/up.sh first")


def ask(client: OpenAI, model: str) -> None:
    t0 = time.monotonic()
    chat = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=8, temperature=0.0)
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=model, messages=PROMPT, max_tokens=8, temperature=0.0, stream=True)
        if c.choices
    ]
    text = client.completions.create(model=model, prompt="Once upon", max_tokens=8, temperature=0.0)
    assert chat.model == model, chat.model
    assert chat.choices[0].message.content == "".join(pieces), (chat.choices[0].message.content, pieces)
    with ThreadPoolExecutor(4) as burst:  # concurrent calls: the pool spreads them by outstanding calls
        answers = list(burst.map(lambda i: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=8, temperature=0.0,
        ), range(4)))
    assert all(a.choices[0].message.content for a in answers)
    print(f"  {model}: chat={chat.choices[0].message.content!r} usage={chat.usage and chat.usage.completion_tokens} "
          f"stream chunks={len(pieces)} completion={text.choices[0].text!r} burst=4 "
          f"({time.monotonic() - t0:.1f}s)")


def docker(*args: str) -> str:
    return subprocess.run(["docker", *args], check=True, capture_output=True, text=True).stdout


def inspect(container: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(docker("inspect", container))[0]
    return found


def container_of(service: str) -> str:
    out = docker("ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}",
                 "--filter", f"label=com.docker.compose.service={service}").split()
    if len(out) != 1:
        raise SystemExit(f"expected one running {service} container, found {out}")
    return out[0]


def coordinator_address() -> str:
    [network] = inspect(container_of("coordinator"))["NetworkSettings"]["Networks"].values()
    return str(network["IPAddress"])


def calls_from(address: str, service: str, since: float, until: float) -> dict[str, int]:
    """POST paths the service's access log shows from ``address`` between the two times.

    uvicorn logs ``ADDR:PORT - "POST /path HTTP/1.1" 200``; a sidecar leaves derender and
    /health out of its log (tiers.UNLOGGED_PATHS), so a sidecar's count is its render calls.
    Healthchecks come from 127.0.0.1 and the Celery probes from the worker's address.
    """
    done = subprocess.run(["docker", "logs", "--since", f"{since:.3f}", "--until", f"{until:.3f}", container_of(service)],
                          check=True, capture_output=True, text=True)
    counts: dict[str, int] = {}
    for line in (done.stdout + done.stderr).splitlines():
        if f" {address}:" in line and '"POST ' in line:
            path = line.split('"POST ', 1)[1].split(" ", 1)[0]
            counts[path] = counts.get(path, 0) + 1
    return counts


def routed_to_its_own_tiers(client: OpenAI, model: str, address: str) -> None:
    since = time.time()
    ask(client, model)
    until = time.time() + 1.0
    time.sleep(1.5)  # the last lines reach the logs; the next model's window starts after this one's end
    seen = {service: calls_from(address, service, since, until) for tiers in TIERS.values() for service in tiers}
    own = {s: c for s, c in seen.items() if s in TIERS[model]}
    others = {s: c for s, c in seen.items() if s not in TIERS[model] and c}
    print(f"    calls from the coordinator: {own}")
    assert not others, f"{model}'s requests reached another model's tiers: {others}"
    assert any("/render" in p for s in TIERS[model][:2] for p in own[s]), f"no render call on {model}'s pool: {own}"
    assert any("/inference/v1/generate" in p for s in TIERS[model][2:] for p in own[s]), f"no generate on {model}'s engines: {own}"


def in_container(service: str, code: str) -> str:
    """What ``code`` prints, run by the service's own Python in its container."""
    return docker("exec", container_of(service), "python", "-c", code)


def sidecar_requests(service: str) -> dict[str, float]:
    """``http_requests_total`` of a sidecar's ``/metrics`` by handler (all methods and statuses)."""
    text = in_container(service, "import urllib.request as u; "
                        f"print(u.urlopen('http://127.0.0.1:{SIDECAR_PORTS[service]}/metrics', timeout=10).read().decode())")
    out: dict[str, float] = {}
    for handler, value in re.findall(r'^http_requests_total\{[^}]*handler="([^"]+)"[^}]*\} (\S+)$', text, re.M):
        out[handler] = out.get(handler, 0.0) + float(value)
    return out


def coordinator_series(port: int, family: str, model: str, *labels: str) -> float:
    """The sum of a coordinator ``/metrics`` family's series for ``model`` that carry ``labels``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    found = re.findall(rf'^{re.escape(family)}\{{([^}}]*)\}} (\S+)$', text, re.M)
    return sum(float(v) for names, v in found if f'model="{model}"' in names and all(x in names for x in labels))


def derender_fast_path(client: OpenAI, model: str, port: int) -> None:
    """The pool's sidecars run with the middleware, and leave the streams' derender calls uncounted."""
    pool = TIERS[model][:2]
    for service in pool:
        state = inspect(container_of(service))
        with open(f"/proc/{state['State']['Pid']}/cmdline", "rb") as f:  # the process itself, not the spec
            argv = f.read().decode().split("\0")
        at = argv.index(MIDDLEWARE[0]) if MIDDLEWARE[0] in argv else -1
        assert at >= 0 and argv[at:at + 2] == MIDDLEWARE, f"{service} runs without the middleware: {argv}"
        assert RENDER_SITE in state["Config"]["Env"], f"{service}'s environment: {state['Config']['Env']}"
    before = {s: sidecar_requests(s) for s in pool}
    derendered = coordinator_series(port, "motor_request_first_derender_seconds_count", model)
    rendered = coordinator_series(port, "motor_render_outcomes_total", model, 'source="render"', 'result="ok"')

    def streamed(i: int) -> int:  # chunks of a 32-token chat (i < 2) or completion stream
        if i < 2:
            return sum(1 for _ in client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Tell story {i}."}], max_tokens=32,
                temperature=0.0, stream=True, extra_body={"ignore_eos": True},
            ))
        return sum(1 for _ in client.completions.create(
            model=model, prompt="Once upon", max_tokens=32, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
        ))

    with ThreadPoolExecutor(3) as together:  # at once, so the pool spreads the calls over its members
        chunks = sum(together.map(streamed, range(3)))
    after = {s: sidecar_requests(s) for s in pool}
    delta = {s: {h: after[s].get(h, 0.0) - before[s].get(h, 0.0) for h in after[s]} for s in pool}
    coordinator_derenders = coordinator_series(port, "motor_request_first_derender_seconds_count", model) - derendered
    by_sidecar = coordinator_series(port, "motor_render_outcomes_total", model, 'source="render"', 'result="ok"') - rendered
    print(f"    {model}: 3 streams, {chunks} chunks; the coordinator rendered {by_sidecar:.0f} through the pool and "
          f"derendered {coordinator_derenders:.0f} prompts' first chunks; the pool's http_requests_total grew by "
          f"{ {s: {h: d for h, d in c.items() if d} for s, c in delta.items()} }")
    # Rendered by the pool, so derendered by it too (the local tokenizer derenders only what it rendered).
    assert by_sidecar >= 3 and coordinator_derenders >= 3, "the streams were not rendered and derendered by the pool"
    assert sum(delta[s].get(CHAT_RENDER, 0.0) for s in pool) >= 2, delta
    assert sum(delta[s].get(COMPLETIONS_RENDER, 0.0) for s in pool) >= 1, delta
    counted = {s: {h: v for h, v in delta[s].items() if h in (CHAT_DERENDER, COMPLETIONS_DERENDER) and v} for s in pool}
    assert not any(counted.values()), f"derender calls counted by the sidecars' metrics: {counted}"
    # A derender call with a browser's Origin takes the whole chain (CORS must see it): counted.
    for service in pool:
        counted_before = after[service].get(CHAT_DERENDER, 0.0)
        status = in_container(service, "import urllib.request as u, urllib.error as e\n"
                              f"r = u.Request('http://127.0.0.1:{SIDECAR_PORTS[service]}{CHAT_DERENDER}', data=b'{{}}', "
                              "headers={'Content-Type': 'application/json', 'Origin': 'http://example.test'})\n"
                              "try: print(u.urlopen(r, timeout=10).status)\n"
                              "except e.HTTPError as x: print(x.code)").strip()
        with_origin = sidecar_requests(service).get(CHAT_DERENDER, 0.0) - counted_before
        print(f"    a derender call with an Origin header in {service} (status {status}): counted {with_origin:.0f}")
        assert with_origin == 1.0, sidecar_requests(service)


def stream(client: OpenAI, model: str, on_chunk: Any = None) -> tuple[str, str | None, int, str]:
    text, finish, n, stream_id = [], None, 0, ""
    for n, chunk in enumerate(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=STREAM_TOKENS,
        temperature=0.0, stream=True, extra_body={"ignore_eos": True},
    ), start=1):
        stream_id = chunk.id
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        if on_chunk is not None:
            on_chunk(n)
    return "".join(text), finish, n, stream_id


def finished_at(stream_id: str, since: float) -> float:
    """When the coordinator logged the stream's end (its own clock, not the client's reading)."""
    done = subprocess.run(["docker", "logs", "-t", "--since", f"{since:.3f}", container_of("coordinator")],
                          check=True, capture_output=True, text=True)
    for line in (done.stdout + done.stderr).splitlines():
        if f"response request_id={stream_id} " in line:
            stamp = line.split(" ", 1)[0]  # RFC 3339 with nanoseconds, UTC
            day, clock = stamp.rstrip("Z").split("T")
            seconds = clock.split(".")
            whole = time.mktime(time.strptime(f"{day} {seconds[0]}", "%Y-%m-%d %H:%M:%S")) - time.timezone
            return whole + float("0." + (seconds[1] if len(seconds) > 1 else "0"))
    raise SystemExit(f"the coordinator logged no end of {stream_id}")


def sidecar_killed_mid_stream(client: OpenAI, address: str) -> None:
    model, pool = "tiny", TIERS["tiny"][:2]
    t0 = time.monotonic()
    reference, finish, chunks, _ = stream(client, model)
    print(f"  undisturbed {model} stream: {chunks} chunks, finish={finish} ({time.monotonic() - t0:.1f}s)")
    assert finish == "length"
    killed: dict[str, Any] = {}
    # Read before the stream (each docker CLI call takes up to seconds on a loaded host): the
    # members' log files and where they end now, so the kill waits only for the render line.
    members = {s: inspect(container_of(s)) for s in pool}
    offsets = {s: Path(state["LogPath"]).stat().st_size for s, state in members.items()}
    since = time.time()

    def rendered_it(service: str) -> bool:
        with open(members[service]["LogPath"], "rb") as log:
            log.seek(offsets[service])
            lines = [json.loads(line)["log"] for line in log.read().splitlines() if line.endswith(b"}")]
        return any(f" {address}:" in line and '"POST /v1/chat/completions/render ' in line for line in lines)

    def kill(n: int) -> None:
        if n != KILL_AFTER_CHUNKS:
            return
        deadline = time.monotonic() + 10.0  # the render call's log line is written
        while not (rendered := [s for s in pool if rendered_it(s)]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(rendered) == 1, f"the stream's render call on {rendered}"
        state = members[rendered[0]]
        killed.update(service=rendered[0], id=state["Id"], restarts=state["RestartCount"], at=time.monotonic(),
                      wall=time.time())
        os.kill(state["State"]["Pid"], signal.SIGKILL)
        print(f"  SIGKILL {rendered[0]} (rendered this stream's prompt; host pid {state['State']['Pid']}) after {n} chunks")

    text, finish, chunks, stream_id = stream(client, model, on_chunk=kill)
    ended = time.monotonic()
    state = inspect(killed["id"])
    health = state["State"].get("Health", {}).get("Status")
    # The coordinator was still generating and derendering it when the sidecar died.
    still_running = finished_at(stream_id, since) - killed["wall"]
    print(f"  the stream completed {ended - killed['at']:.1f}s after the kill (the coordinator ended it "
          f"{still_running:.1f}s after): {chunks} chunks, finish={finish}, text "
          f"{'equal to' if text == reference else 'DIFFERENT from'} the undisturbed run; "
          f"{killed['service']} then: {state['State']['Status']}/{health}, restarts {state['RestartCount']}")
    assert still_running > 0, "the stream had ended in the coordinator before the kill: nothing was proved"
    assert text == reference and finish == "length", (text[:200], reference[:200], finish)
    # It did not wait for the restart: the killed sidecar was not serving again yet.
    assert state["RestartCount"] == killed["restarts"] or health != "healthy", state["State"]
    back_healthy(killed["service"], killed["restarts"])


def back_healthy(service: str, restarts: int, timeout: float = 600.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        state = inspect(container_of(service))
        if state["RestartCount"] > restarts and state["State"].get("Health", {}).get("Status") == "healthy":
            print(f"  {service} restarted by Docker (restarts {state['RestartCount']}) and healthy again after "
                  f"{time.monotonic() - t0:.0f}s more")
            return
        time.sleep(2)
    raise SystemExit(f"{service} did not come back healthy in {timeout:.0f}s")


def engine_crash(service: str) -> None:
    state = inspect(container_of(service))
    print(f"SIGKILL {service} (host pid {state['State']['Pid']}, restarts so far {state['RestartCount']})")
    os.kill(state["State"]["Pid"], signal.SIGKILL)
    back_healthy(service, state["RestartCount"])


def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else int(os.environ.get("MOTOR_PORT", "8000"))
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key(), max_retries=0, timeout=120)
    address = coordinator_address()
    models = [m.id for m in client.models.list().data]
    print(f"through the coordinator on 127.0.0.1:{port} (container address {address}): models={models}")
    assert models == list(TIERS), models
    for model in TIERS:
        routed_to_its_own_tiers(client, model, address)
    print("the derender fast path in each sidecar container:")
    for model in TIERS:
        derender_fast_path(client, model, port)
    print("a sidecar of tiny's pool killed mid-stream:")
    sidecar_killed_mid_stream(client, address)
    engine_crash(ENGINE)
    print("through the coordinator again:")
    for model in TIERS:
        ask(client, model)
    print("ok")


if __name__ == "__main__":
    main()
