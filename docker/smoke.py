"""The compose deployment answers the official client, and a crashed engine container comes back.

    docker/up.sh 8000 && python3 -m toolchain exec docker/smoke.py 8000

Not part of make test (it needs the images and a running compose project, docker/up.sh). It
talks to the coordinator on 127.0.0.1:PORT only. Then it SIGKILLs one engine's process from the
host, as a crash would (``docker kill`` would count as an operator's stop, which restart
policies leave stopped), waits for Docker to restart the container and its healthcheck (one real
greedy token) to pass, and asks the coordinator again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from openai import OpenAI

CACHE = Path(os.environ.get("MOTOR_CACHE_DIR", Path.home() / ".cache" / "motorsite")) / "docker"
PROJECT = os.environ.get("MOTOR_COMPOSE_PROJECT", "motorsite")
ENGINE = os.environ.get("MOTOR_SMOKE_ENGINE", "engine-1")


def api_key() -> str:
    for line in (CACHE / "compose.env").read_text().splitlines():
        if line.startswith("MOTOR_DEMO_API_KEY="):
            return line.split("=", 1)[1]
    raise SystemExit(f"no MOTOR_DEMO_API_KEY in {CACHE / 'compose.env'}: run docker/up.sh first")


def ask(client: OpenAI) -> None:
    t0 = time.monotonic()
    models = [m.id for m in client.models.list().data]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0.0
    )
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0.0,
            stream=True,
        )
        if c.choices
    ]
    text = client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0.0)
    assert chat.choices[0].message.content == "".join(pieces), (chat.choices[0].message.content, pieces)
    print(f"  models={models} chat={chat.choices[0].message.content!r} usage={chat.usage.completion_tokens} "
          f"stream chunks={len(pieces)} completion={text.choices[0].text!r} ({time.monotonic() - t0:.1f}s)")


def inspect(container: str) -> dict:
    out = subprocess.run(["docker", "inspect", container], check=True, capture_output=True, text=True).stdout
    return json.loads(out)[0]


def container_of(service: str) -> str:
    out = subprocess.run(
        ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}",
         "--filter", f"label=com.docker.compose.service={service}"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    if len(out) != 1:
        raise SystemExit(f"expected one running {service} container, found {out}")
    return out[0]


def crash_and_wait(service: str, timeout: float = 600.0) -> None:
    cid = container_of(service)
    before = inspect(cid)
    pid, restarts = before["State"]["Pid"], before["RestartCount"]
    print(f"SIGKILL {service} (container {cid[:12]}, host pid {pid}, restarts so far {restarts})")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    seen_down = False
    while time.monotonic() - t0 < timeout:
        state = inspect(cid)
        health = state["State"].get("Health", {}).get("Status")
        seen_down = seen_down or state["RestartCount"] > restarts
        if seen_down and state["State"]["Running"] and health == "healthy":
            print(f"  {service} restarted by Docker (restarts {state['RestartCount']}, new pid "
                  f"{state['State']['Pid']}) and healthy again after {time.monotonic() - t0:.0f}s")
            return
        time.sleep(2)
    raise SystemExit(f"{service} did not come back healthy in {timeout:.0f}s")


def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else int(os.environ.get("MOTOR_PORT", "8000"))
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key(), max_retries=0, timeout=120)
    print(f"through the coordinator on 127.0.0.1:{port}:")
    ask(client)
    crash_and_wait(ENGINE)
    print("through the coordinator again:")
    ask(client)
    print("ok")


if __name__ == "__main__":
    main()
