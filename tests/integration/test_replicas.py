"""Two coordinator processes on one PostgreSQL and one Redis, proving what they share.

The session's real render sidecar (``tiers``: nothing here restarts it), simulated engines (two union engines that decode slowly and never stop
early, so a stream holds its lease while the test looks, and publish their KV cache events; a
push prefill/decode pair for Trigger, registered per test) and two Daphne coordinators, A and B, on one database and Redis db
12 (this file's own: flushed before and after). Each test drives one replica with the official
``openai`` client and shows the other honouring it: admission leases and the global token
budget, the tokens-per-minute window, breaker state counted by both and operator overrides,
control-plane changes after a poll, placement by KV cache events of traffic the other replica
served, and a Trigger callback delivered to the replica that did not
start the request. Each replica's metaserver base URL names the *other* replica (what a load
balancer in front may do), so every Trigger callback arrives at the wrong one and is routed.
Replica A runs with ``MOTOR_TRACING=true`` and exports its spans over OTLP/HTTP to a receiver in
the test process (``tests/otlp.py``); each replica names itself (``MOTOR_REPLICA``) in ``/metrics``.

Every test ends by asserting that nothing leaked: no admission lease or queue in Redis, no
tokens in flight on either replica (``/metrics``), every process still running; the fixture
asserts no process outlives the module.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from motorsite import stack
from motorsite import tiers as tier_commands
from motorsite.launched import metric_samples
from motorsite.processes import ProcessSpec
from motorsite.supervisor import Supervisor, free_port, together
from tests import prerequisites
from tests.otlp import Receiver

REDIS_URL = f"redis://127.0.0.1:{prerequisites.REDIS_PORT}/12"
ADMIN_KEY = "sk-admin-" + uuid.uuid4().hex[:12]
CLIENT_KEY = "sk-client-" + uuid.uuid4().hex[:12]
TPM_KEY = "sk-tpm-" + uuid.uuid4().hex[:12]
TPM_LIMIT = 120
GLOBAL_BUDGET = 400
PSQL = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-qc"]
# The admission, rate-limit and breaker keys (serving.runtime's prefixes).
LEASES = "motor:admission:leases"


@dataclass(frozen=True)
class Replica:
    name: str
    url: str
    log: Path

    def openai(self, key: str = CLIENT_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=30)

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.url + "/api", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def requests_to(self, instance: str) -> float:
        return metric_samples(self.metrics(), "motor_engine_requests_total").get(f'instance="{instance}"', 0.0)

    def callbacks_forwarded(self, result: str) -> float:
        return metric_samples(self.metrics(), "motor_trigger_callbacks_total")[f'result="{result}"']

    def inflight(self) -> float:
        return sum(metric_samples(self.metrics(), "motor_engine_in_flight_tokens").values())

    def fleet_version(self) -> int:
        return int(httpx.get(self.url + "/healthz", timeout=5).json()["fleet_version"])


@dataclass
class Cluster:
    a: Replica
    b: Replica
    redis: redis.Redis
    supervisor: Supervisor
    sim: dict[str, str]  # P/D simulators' URLs by role
    engines: dict[str, str]  # union engines' URLs by instance name
    served_model_id: int
    traces: Receiver  # what replica A exports over OTLP/HTTP (MOTOR_TRACING)

    def instances(self) -> dict[str, dict[str, Any]]:
        with self.a.api() as api:
            return {i["name"]: i for i in api.get("/instances").raise_for_status().json()}

    def synced(self, through: Replica) -> None:
        """Wait until both replicas serve the control version a change through ``through`` made."""
        with through.api() as api:
            version = int(api.get("/fleet/status").raise_for_status().json()["control_version"])
        until(lambda: self.a.fleet_version() >= version and self.b.fleet_version() >= version, "both replicas polled")


def until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not in {timeout} s: {what}")
        time.sleep(0.05)


def chat(client: openai.OpenAI, max_tokens: int, content: str = "hello") -> Any:
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0.0
    )


def status_of(call: Callable[[], Any]) -> int:
    try:
        call()
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


def _sim(cfg: stack.StackConfig, name: str, port: int, *extra: str) -> ProcessSpec:
    return ProcessSpec(
        name=name,
        argv=[*stack._sim_argv(cfg, port), *extra],
        env={"PYTHONPATH": str(stack.ROOT), "PYTHONUNBUFFERED": "1"},
        log_path=cfg.log_dir / f"{name}.log",
        ports=[(stack.HOST, port)],
        ready_post=tier_commands.engine_ready_request(cfg.served_model_name),
        ready_base_url=f"http://{stack.HOST}:{port}",
        ready_timeout=30.0,
    )


@pytest.fixture(scope="module")
def cluster(tiers: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if not (prerequisites.postgres_answers() and prerequisites.redis_answers()):
        pytest.skip("PostgreSQL or Redis is not running on 127.0.0.1")
    db = f"motorsite_replicas_{uuid.uuid4().hex[:8]}"
    tmp = tmp_path_factory.mktemp("replicas")
    subprocess.run([*PSQL, f"CREATE DATABASE {db}"], check=True)
    r = redis.Redis.from_url(REDIS_URL)
    r.flushdb()
    port_a, port_b = free_port(), free_port()
    url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    cfg = replace(
        tiers,
        engines="sim",
        engine_ports=(free_port(), free_port()),
        coordinator_port=port_a,
        database_url=f"postgresql://postgres@127.0.0.1:5432/{db}",
        redis_url=REDIS_URL,
        api_keys=(CLIENT_KEY,),
        log_dir=tiers.log_dir / "replicas",
        celery=False,
        restart=None,
        extra_env={
            "MOTOR_DEMO_ADMIN_KEY": ADMIN_KEY,
            # Both replicas sign Trigger routes with one key, as pods sharing a Secret do.
            "SECRET_KEY": "replicas-" + uuid.uuid4().hex + uuid.uuid4().hex,  # 50+ characters, as the settings demand
            "MOTOR_GLOBAL_TOKEN_BUDGET": str(GLOBAL_BUDGET),
            "MOTOR_ADMISSION_WAIT_MS": "300",
            "MOTOR_BREAKER_THRESHOLD": "2",
            "MOTOR_BREAKER_OPEN_S": "60",
        },
    )
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    sims = {"prefill": f"http://127.0.0.1:{free_port()}", "decode": f"http://127.0.0.1:{free_port()}"}
    specs: list[ProcessSpec] = []
    # Slow and endless: 10 ms a token and no early EOS, so a 300-token stream is open ~3 s.
    slow = ("--tpot-ms", "10", "--eos-probability", "0")
    # Both union engines publish their KV cache events (vLLM's ZMQ format) on endpoints they bind.
    kv_events = {f"union-{n}": f"ipc://{tmp}/kv-{n}.ipc" for n in (1, 2)}
    specs += [
        _sim(cfg, f"engine-{n}", port, *slow, "--kv-events-endpoint", kv_events[f"union-{n}"])
        for n, port in enumerate(cfg.engine_ports, 1)
    ]
    for role, url in sims.items():
        specs.append(_sim(cfg, f"push-{role}", int(url.rsplit(":", 1)[1]), "--role", role, "--kv-transfer", "push",
                          "--kv-connector", "MooncakeLayerwiseConnector", "--eos-probability", "0"))
    stack.prepare_database(cfg)
    subprocess.run(
        [cfg.app_python, str(stack.ROOT / "manage.py"), "shell", "-c",
         "from fleet.services import api_key_ensure\n"
         "from fleet.models import EngineInstance\n"
         "from motorsite.core import bump_control_version\n"
         f"api_key_ensure(name='tpm', scope='client', key='{TPM_KEY}', tokens_per_minute={TPM_LIMIT})\n"
         f"for name, endpoint in {sorted(kv_events.items())!r}:\n"
         "    EngineInstance.objects.filter(name=name).update(kv_events_endpoint=endpoint)\n"
         "bump_control_version()\n"],
        check=True, env={**os.environ, **stack.coordinator_env(cfg)}, cwd=stack.ROOT,
    )
    # Replica A traces its requests to a receiver in this process, batched every 100 ms.
    traces = Receiver()
    tracing = {"MOTOR_TRACING": "true", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": traces.endpoint,
               "OTEL_BSP_SCHEDULE_DELAY": "100"}
    coordinators = []
    for name, port, own, other in (("a", port_a, url_a, url_b), ("b", port_b, url_b, url_a)):
        spec = stack.coordinator_spec(replace(cfg, coordinator_port=port))
        env = {**spec.env, "MOTOR_METASERVER_BASE_URL": other, "MOTOR_METASERVER_OWNER_URL": own,
               "MOTOR_REPLICA": f"coordinator-{name}", **(tracing if name == "a" else {})}
        coordinators.append(dataclasses.replace(spec, name=f"coordinator-{name}", env=env, log_path=cfg.log_dir / f"coordinator-{name}.log"))
    # The engines start together, then both replicas together once every engine is ready.
    supervisor = Supervisor([*together(specs), *together(coordinators)])
    try:
        supervisor.start()
        pids = supervisor.pids
        a = Replica("a", url_a, cfg.log_dir / "coordinator-a.log")
        b = Replica("b", url_b, cfg.log_dir / "coordinator-b.log")
        with a.api() as api:
            model_id = api.get("/instances").raise_for_status().json()[0]["served_model_id"]
        engines = {f"union-{n}": url for n, url in enumerate(cfg.engine_urls, 1)}
        yield Cluster(a, b, r, supervisor, sims, engines, model_id, traces)
    finally:
        supervisor.stop()
        traces.close()
        subprocess.run([*PSQL, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"], check=False)
        r.flushdb()
        r.close()
    assert [name for name, pid in pids.items() if _group_alive(pid)] == [], "a process outlived the module"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def c(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster; afterwards nothing is held, queued or in flight, and every process runs."""
    yield cluster
    until(lambda: cluster.redis.zcard(LEASES) == 0, "every admission lease released in Redis")
    assert int(cluster.redis.get("motor:admission:total") or 0) == 0
    assert cluster.redis.hlen("motor:admission:lease_tokens") == 0
    queues = [k.decode() for k in cluster.redis.scan_iter("motor:admission:*queue*")]
    assert [k for k in queues if cluster.redis.zcard(k)] == [], "a request is still queued"
    until(lambda: cluster.a.inflight() == 0 and cluster.b.inflight() == 0, "no tokens in flight on either replica")
    cluster.supervisor.check_children()


def test_it_shares_admission_leases_and_the_global_budget(c: Cluster) -> None:
    stream = c.a.openai().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hold"}], max_tokens=300, stream=True
    )
    try:
        next(iter(stream))
        # A's stream holds prompt + 300 of the 400 tokens; the lease is in Redis for B to see.
        assert c.redis.zcard(LEASES) == 1
        assert c.a.inflight() > 300 and c.b.inflight() == 0
        with pytest.raises(openai.APIStatusError) as refused:
            chat(c.b.openai(), max_tokens=150)
        # B waited its 300 ms for room in the shared budget, then said so (503 past the deadline).
        assert refused.value.status_code == 503, refused.value.body
        assert "no engine capacity" in str(refused.value.message)
    finally:
        stream.close()
    # A's disconnect gives its tokens back to every replica.
    until(lambda: c.redis.zcard(LEASES) == 0, "A's lease released")
    assert chat(c.b.openai(), max_tokens=150).usage.completion_tokens == 150  # 150 > 400 - 310


def test_it_holds_the_tokens_per_minute_limit_across_replicas(c: Cluster) -> None:
    first = chat(c.a.openai(TPM_KEY), max_tokens=30)
    prompt = first.usage.prompt_tokens
    left = TPM_LIMIT - (prompt + 30) - prompt  # room for one more request's output
    assert left > 1
    # One token over what is left: refused by B although B never served this key before.
    with pytest.raises(openai.RateLimitError) as over:
        chat(c.b.openai(TPM_KEY), max_tokens=left + 1)
    assert over.value.response.headers.get("retry-after")
    # Exactly what is left: accepted, on either replica; then the window is full for both.
    assert chat(c.b.openai(TPM_KEY), max_tokens=left).usage.completion_tokens == left
    assert status_of(lambda: chat(c.a.openai(TPM_KEY), max_tokens=1)) == 429
    # The window lives in Redis and expires on its own (nothing to release, nothing kept forever
    # but the prefix's one clock hash, serving/pipeline/redis_clock.py).
    windows = [k for k in c.redis.scan_iter("motor:tpm:*") if k != b"motor:tpm:clock"]
    assert windows and all(0 < c.redis.pttl(k) <= 61_000 for k in windows)
    assert set(c.redis.hkeys("motor:tpm:clock")) == {b"now", b"wall"}


def _register(c: Cluster, name: str, url: str, **fields: Any) -> int:
    with c.a.api() as api:
        body = {"name": name, "url": url, "served_model_id": c.served_model_id, "kind": "sim", **fields}
        created = api.post("/instances", json=body)
        assert created.status_code == 201, created.text
        return int(created.json()["id"])


def _set_state(c: Cluster, through: Replica, action: str, *names: str) -> None:
    ids = {n: i["id"] for n, i in c.instances().items()}
    with through.api() as api:
        for name in names:
            api.post(f"/instances/{ids[name]}/{action}").raise_for_status()
    c.synced(through)


def _delete(c: Cluster, through: Replica, instance_id: int) -> None:
    with through.api() as api:
        assert api.delete(f"/instances/{instance_id}").status_code == 204
    c.synced(through)


def test_it_serves_a_control_plane_change_from_the_other_replica(c: Cluster) -> None:
    _set_state(c, c.a, "drain", "union-1")
    try:
        before = (c.b.requests_to("union-1"), c.b.requests_to("union-2"))
        for _ in range(4):
            chat(c.b.openai(), max_tokens=2)
        # B took A's drain: nothing new to union-1, everything to union-2.
        assert (c.b.requests_to("union-1"), c.b.requests_to("union-2")) == (before[0], before[1] + 4)
    finally:
        _set_state(c, c.b, "undrain", "union-1")
    # And A took B's undrain: union-1 serves A's requests again.
    before_a = c.a.requests_to("union-1")
    _set_state(c, c.a, "drain", "union-2")
    try:
        chat(c.a.openai(), max_tokens=2)
        assert c.a.requests_to("union-1") == before_a + 1
    finally:
        _set_state(c, c.a, "undrain", "union-2")


def test_it_shares_breaker_state_and_operator_overrides(c: Cluster) -> None:
    def reaches_dead(replica: Replica) -> bool:
        """Whether one request through ``replica`` reached the dead engine (and failed there)."""
        def errors() -> float:
            return metric_samples(replica.metrics(), "motor_engine_errors_total").get('instance="dead-1"', 0.0)

        before = errors()
        assert status_of(lambda: chat(replica.openai(), max_tokens=2)) >= 500
        return errors() > before

    # A union instance where nothing listens, the only one taking requests.
    dead = _register(c, "dead-1", f"http://127.0.0.1:{free_port()}")
    _set_state(c, c.a, "drain", "union-1", "union-2")
    try:
        # One engine fault on each replica: with a threshold of 2, neither alone would trip it.
        assert reaches_dead(c.a)
        assert c.redis.hget(f"motor:breaker:{dead}", "state") in (None, b"closed")
        assert reaches_dead(c.b)
        until(lambda: c.redis.hget(f"motor:breaker:{dead}", "state") == b"open", "the shared breaker opened")
        # A keeps away from it now without faults of its own past its cached entry's refresh
        # (re-read within a second, so at most one more call reaches the engine meanwhile).
        until(lambda: not reaches_dead(c.a), "A keeps away from the instance B's fault opened")
        assert not reaches_dead(c.a) and not reaches_dead(c.a)
        until(lambda: c.instances()["dead-1"]["breaker_state"] == "open", "the flip written back for the admin")
        # The operator's reset through B wins over what both counted: A tries the engine again.
        with c.b.api() as api:
            api.post(f"/instances/{dead}/breaker/reset").raise_for_status()
        c.synced(c.b)
        assert reaches_dead(c.a)
    finally:
        _set_state(c, c.a, "undrain", "union-1", "union-2")
        _delete(c, c.a, dead)
    # Forcing a healthy instance open through A keeps B away from it: with union-2 drained, B has
    # nothing left to send to; once B's operator resets it, B serves from it again.
    union_1 = c.instances()["union-1"]["id"]
    with c.a.api() as api:
        api.post(f"/instances/{union_1}/breaker/open").raise_for_status()
    _set_state(c, c.a, "drain", "union-2")
    try:
        before = c.b.requests_to("union-1")
        assert status_of(lambda: chat(c.b.openai(), max_tokens=2)) == 503
        assert c.b.requests_to("union-1") == before
        with c.b.api() as api:
            api.post(f"/instances/{union_1}/breaker/reset").raise_for_status()
        c.synced(c.b)
        chat(c.b.openai(), max_tokens=2)
        assert c.b.requests_to("union-1") == before + 1
    finally:
        with c.b.api() as api:
            api.post(f"/instances/{union_1}/breaker/reset").raise_for_status()
        _set_state(c, c.b, "undrain", "union-2")


def test_it_routes_a_trigger_callback_to_the_replica_that_started_the_request(c: Cluster) -> None:
    push = {"kv_connector": "MooncakeLayerwiseConnector", "kv_transfer": "push"}
    ids = [_register(c, f"push-{role}-1", url, role=role, **push) for role, url in c.sim.items()]
    _set_state(c, c.a, "drain", "union-1", "union-2")
    try:
        for owner, other in ((c.a, c.b), (c.b, c.a)):
            forwarded_before = other.log.read_text().count("metaserver forwarded a callback to " + owner.url)
            accepted_before = other.callbacks_forwarded("accepted")
            decode_before = owner.requests_to("push-decode-1")
            out = chat(owner.openai(), max_tokens=8, content="trigger across replicas")
            assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
            chunks = list(owner.openai().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "streamed"}], max_tokens=5, stream=True,
                stream_options={"include_usage": True},
            ))
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
            # The decode engine called the other replica; it checked the token and forwarded it.
            assert owner.requests_to("push-decode-1") >= decode_before + 2
            assert other.log.read_text().count("metaserver forwarded a callback to " + owner.url) == forwarded_before + 2
            # ...and counted both, by the owner's answer, where Prometheus sums it by replica.
            assert other.callbacks_forwarded("accepted") == accepted_before + 2
            assert other.callbacks_forwarded("unreachable") == other.callbacks_forwarded("refused") == 0
    finally:
        _set_state(c, c.a, "undrain", "union-1", "union-2")
        for instance_id in ids:
            _delete(c, c.a, instance_id)


def _spans_of(c: Cluster, request_id: str) -> list[Any]:
    return [span for _, span in c.traces.spans() if c.traces.attributes(span).get("motor.request_id") == request_id]


def test_a_traced_replica_exports_each_phase_of_a_request_over_otlp(c: Cluster) -> None:
    # Union, then Trigger (both P/D legs), through A with tracing on; B traces nothing.
    push = {"kv_connector": "MooncakeLayerwiseConnector", "kv_transfer": "push"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "traced"}], "max_tokens": 4, "stream": True}
    headers = {"Authorization": f"Bearer {CLIENT_KEY}"}
    union = httpx.post(c.a.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert union.status_code == 200
    union_id = union.headers["x-request-id"]
    until(lambda: "request" in {s.name for s in _spans_of(c, union_id)}, "the union request's trace exported", 15.0)
    spans = _spans_of(c, union_id)
    assert {s.name for s in spans} == {"request", "render", "queue_wait", "placement", "first_chunk", "first_derender"}
    [root] = [s for s in spans if s.name == "request"]
    assert all(s.trace_id == root.trace_id and (s is root or s.parent_span_id == root.span_id) for s in spans)
    assert {r["service.instance.id"] for r, _ in c.traces.spans()} == {"coordinator-a"}

    ids = [_register(c, f"push-{role}-1", url, role=role, **push) for role, url in c.sim.items()]
    _set_state(c, c.a, "drain", "union-1", "union-2")
    try:
        trigger = httpx.post(c.a.url + "/v1/chat/completions", json={**body, "stream": False}, headers=headers, timeout=30)
        assert trigger.status_code == 200
        trigger_id = trigger.headers["x-request-id"]
        until(lambda: "request" in {s.name for s in _spans_of(c, trigger_id)}, "the trigger request's trace exported", 15.0)
        legs = sorted(c.traces.attributes(s)["motor.leg"] for s in _spans_of(c, trigger_id) if s.name == "first_chunk")
        assert legs == ["decode", "prefill"]
        [root] = [s for s in _spans_of(c, trigger_id) if s.name == "request"]
        assert c.traces.attributes(root)["motor.topology"] == "trigger"
    finally:
        _set_state(c, c.a, "undrain", "union-1", "union-2")
        for instance_id in ids:
            _delete(c, c.a, instance_id)


def test_each_replica_names_itself_in_its_metrics(c: Cluster) -> None:
    for replica in (c.a, c.b):
        [labels] = metric_samples(replica.metrics(), "motor_coordinator_info")
        assert f'replica="coordinator-{replica.name}"' in labels and 'pid="' in labels and 'host="' in labels
    pid_a, pid_b = (metric_samples(r.metrics(), "motor_coordinator_info") for r in (c.a, c.b))
    assert pid_a.keys() != pid_b.keys()


def _seed(url: str, ids: list[int]) -> None:
    """A request straight to one engine (traffic no coordinator placed)."""
    body = {"request_id": f"seed-{uuid.uuid4().hex}", "token_ids": ids, "sampling_params": {"max_tokens": 1}}
    httpx.post(url + "/inference/v1/generate", json=body, timeout=30).raise_for_status()


def _kv_batches(replica: Replica, instance: str) -> float:
    return metric_samples(replica.metrics(), "motor_kv_event_batches_total").get(f'instance="{instance}"', 0.0)


def test_it_places_by_the_kv_cache_events_both_replicas_receive(c: Cluster) -> None:
    # The first request on each replica starts its subscriptions; a ZMQ PUB drops what it sends
    # before a subscription arrives, so seed union-2 until both replicas index its events.
    for replica in (c.a, c.b):
        chat(replica.openai(), max_tokens=1)
    seeds = iter(range(10, 3000))

    def subscribed() -> bool:
        _seed(c.engines["union-2"], [next(seeds)] * 128)
        return _kv_batches(c.a, "union-2") > 0 and _kv_batches(c.b, "union-2") > 0

    until(subscribed, "both replicas subscribed to union-2's KV events")
    # A serves a two-block prompt while union-1 is drained, so union-2 caches it; B never saw it.
    prompt = [(17 * n) % 3000 + 10 for n in range(256)]
    _set_state(c, c.a, "drain", "union-1")
    try:
        batches_b = _kv_batches(c.b, "union-2")
        c.a.openai().completions.create(model="tiny", prompt=prompt, max_tokens=2)
        until(lambda: _kv_batches(c.b, "union-2") > batches_b, "B received union-2's BlockStored")
    finally:
        _set_state(c, c.a, "undrain", "union-1")
    # Idle instances tie and the tie goes to union-1: only union-2's events tell B otherwise.
    before = (c.b.requests_to("union-1"), c.b.requests_to("union-2"))
    hits = httpx.get(c.engines["union-2"] + "/sim/stats", timeout=5).json()["cache"]["hit_tokens"]
    c.b.openai().completions.create(model="tiny", prompt=[*prompt, 5, 6], max_tokens=2)
    assert (c.b.requests_to("union-1"), c.b.requests_to("union-2")) == (before[0], before[1] + 1)
    assert httpx.get(c.engines["union-2"] + "/sim/stats", timeout=5).json()["cache"]["hit_tokens"] - hits == 256
    # And the tie really goes to union-1: a prompt neither engine caches lands there.
    c.b.openai().completions.create(model="tiny", prompt=[(31 * n) % 3000 + 10 for n in range(256)], max_tokens=2)
    assert c.b.requests_to("union-1") == before[0] + 1
