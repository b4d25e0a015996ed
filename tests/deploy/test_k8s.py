"""deploy/k8s/ validates offline against the Kubernetes OpenAPI schemas and runs what make run runs.

Schemas: kubernetes-validate 1.37.0 (it ships them), strict mode, so an unknown or misspelt
field fails as well as a wrong type; a kind with no schema fails too instead of being skipped.
Two models, each with a render pool (a StatefulSet of sidecars behind a headless Service, each
replica a member by its own name) and engines of its own; a Job registers them.
deploy/k8s-render-in-pod/ (kustomize overlay) moves the sidecars into the coordinator pods: it is
built with ``kubectl kustomize`` where kubectl is installed, and its output held to make run's.
"""

from __future__ import annotations

import ast
import copy
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from catalog.management.commands.render_image import DEFAULT_RENDER_IMAGE
from motorsite import stack, tiers
from motorsite.supervisor import free_port
from serving.pipeline import metric_names
from tests.deploy.fleet_script import commands_by_model, fleet_commands, render_pool, run_fleet_script, values

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
IN_POD = K8S.parent / "k8s-render-in-pod"
KUBECTL = shutil.which("kubectl")
KUBERNETES_VERSION = "1.33"
KUSTOMIZATION = yaml.safe_load((K8S / "kustomization.yaml").read_text())


# Parsed once (about 40 ms of YAML a parse, and the tests below look documents up ~60 times).
_RESOURCES = [
    (name, doc)
    for name in KUSTOMIZATION["resources"]
    for doc in yaml.safe_load_all((K8S / name).read_text())
    if doc
]


def resources() -> list[tuple[str, dict[str, Any]]]:
    """Every manifest kustomize lists, a fresh copy each call (a test may change what it gets)."""
    return copy.deepcopy(_RESOURCES)


def one(kind: str, name: str) -> dict[str, Any]:
    [found] = [doc for _, doc in resources() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    return found


def containers(deployment: str, kind: str = "Deployment") -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in one(kind, deployment)["spec"]["template"]["spec"]["containers"]}


def test_kustomize_lists_every_manifest() -> None:
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(KUSTOMIZATION["resources"]) == on_disk


@pytest.mark.parametrize(("filename", "resource"), resources(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_each_manifest_validates_against_the_kubernetes_schemas(filename: str, resource: dict[str, Any]) -> None:
    # Raises ValidationError on a bad field and SchemaNotFoundError on an unknown kind/apiVersion.
    assert kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_a_broken_manifest_is_refused() -> None:
    # The validator is really strict: what the test above relies on.
    service = one("Service", "motorsite")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({**service, "spec": {**service["spec"], "portz": []}}, KUBERNETES_VERSION, strict=True)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate({**service, "kind": "Servise"}, KUBERNETES_VERSION, strict=True)


# Each model's tiers: (model, model dir, render pool StatefulSet, its port, engines StatefulSet, their port).
MODELS = [
    ("tiny", "/model", "motorsite-render-tiny", 8100, "motorsite-engine-tiny", 8201),
    ("tiny-b", "/model-b", "motorsite-render-tiny-b", 8102, "motorsite-engine-tiny-b", 8203),
]
MODEL_IDS = [m[0] for m in MODELS]


def bound_to_all(argv: list[str]) -> list[str]:
    """make run's argv as a pod of its own runs it: the pod's network is its own, so 0.0.0.0."""
    return [("0.0.0.0" if i and argv[i - 1] == "--host" else a) for i, a in enumerate(argv)]


def members(statefulset: str, port: int) -> list[str]:
    """Each replica at its stable name behind the headless Service: POD.SERVICE:PORT."""
    replicas = one("StatefulSet", statefulset)["spec"]["replicas"]
    return [f"{statefulset}-{i}.{statefulset}:{port}" for i in range(replicas)]


def job_script() -> str:
    script: str = containers("motorsite-fleet", "Job")["fleet"]["command"][-1]
    return script


@pytest.mark.parametrize(("model", "model_dir", "pool", "port", "engines", "engine_port"), MODELS, ids=MODEL_IDS)
def test_each_models_render_pool_is_a_statefulset_of_sidecars_running_make_runs_arguments(
    model: str, model_dir: str, pool: str, port: int, engines: str, engine_port: int,
) -> None:
    statefulset = one("StatefulSet", pool)["spec"]
    [sidecar] = statefulset["template"]["spec"]["containers"]
    argv, env = tiers.render_sidecar_command(
        python="python", model_dir=model_dir, served_model_name=model, port=port, workers=4, max_model_len=2048,
    )
    assert sidecar["args"] == bound_to_all(argv[3:])
    env["PYTHONPATH"] = "/opt/motorsite/render_site"  # where the render image has the render site
    assert {e["name"]: e["value"] for e in sidecar["env"]} == env
    assert statefulset["replicas"] == 2  # a pool of two, scaled apart from the coordinators
    # A headless Service: each replica keeps a DNS name of its own (a member of the pool each).
    service = one("Service", pool)["spec"]
    assert service["clusterIP"] == "None" and statefulset["serviceName"] == pool
    labels = statefulset["template"]["metadata"]["labels"]
    assert service["selector"] == statefulset["selector"]["matchLabels"] == labels
    assert labels["motorsite/model"] == model


@pytest.mark.parametrize(("model", "model_dir", "pool", "port", "engines", "engine_port"), MODELS, ids=MODEL_IDS)
def test_each_models_engines_run_make_runs_arguments(
    model: str, model_dir: str, pool: str, port: int, engines: str, engine_port: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tiers, "check_engine_cpu", lambda: None)
    [engine] = containers(engines, "StatefulSet").values()
    # No pinning: a pod asks the scheduler for its core (resources), not taskset.
    argv, env = tiers.vllm_engine_command(
        python="python", model_dir=model_dir, served_model_name=model, port=engine_port, mode="scale-out", core=None,
    )
    assert engine["args"] == bound_to_all(argv[3:])
    env["PYTHONPATH"] = "/opt/motorsite/engine_site"  # where the engine image has the engine site
    assert {e["name"]: e["value"] for e in engine["env"]} == env
    service = one("Service", engines)["spec"]
    assert service["clusterIP"] == "None" and one("StatefulSet", engines)["spec"]["serviceName"] == engines


def test_probes_are_real_requests() -> None:
    pod = containers("motorsite-coordinator")
    assert set(pod) == {"coordinator"}  # the render pools are StatefulSets of their own
    for probe in ("readinessProbe", "livenessProbe"):
        assert pod["coordinator"][probe]["httpGet"]["path"] == "/healthz"
    for model, _, pool, port, engines, engine_port in MODELS:
        for name, (path, body), at in ((pool, tiers.render_ready_request(model), port),
                                        (engines, tiers.engine_ready_request(model), engine_port)):
            [container] = containers(name, "StatefulSet").values()
            script = " ".join(container["readinessProbe"]["exec"]["command"][2:])
            assert f"'http://127.0.0.1:{at}{path}'" in script, name
            match = re.search(r"json\.dumps\((\{.*\})\)\.encode", script)
            assert match and ast.literal_eval(match.group(1)) == body, name
            assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": at}
    worker = containers("motorsite-celery-worker")["worker"]
    assert "inspect ping" in " ".join(worker["livenessProbe"]["exec"]["command"])


def test_the_fleet_job_registers_each_pool_member_and_engine_by_its_own_name() -> None:
    commands = commands_by_model(job_script())
    for model, model_dir, pool, port, engines, engine_port in MODELS:
        argv = commands[model]
        first, *others = members(pool, port)
        assert render_pool(argv) == ([first], others)
        assert values(argv, "--engine") == [f"http://{m}" for m in members(engines, engine_port)]
        assert values(argv, "--model-dir") == [model_dir]


def test_the_fleet_jobs_script_registers_both_pools(tmp_path: Path) -> None:
    # The Job's own script, run here on SQLite with the models this host built.
    pools, engines, _ = run_fleet_script(job_script(), pod_env(GENERATED, tmp_path), tmp_path / "db.sqlite3")
    assert pools == [(model, f"{pool}-{i}.{pool}", port) for model, _, pool, port, _, _ in MODELS for i in range(2)]
    assert engines == sorted(
        (model, f"http://{m}") for model, _, _, _, statefulset, port in MODELS for m in members(statefulset, port)
    )


# -- the alternative: each coordinator pod runs its own pools (deploy/k8s-render-in-pod) -------------


def kustomize(directory: Path) -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip("no kubectl: its kustomize builds the overlay")
    done = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.mark.parametrize("directory", [K8S, IN_POD], ids=["deploy/k8s", "deploy/k8s-render-in-pod"])
def test_each_kustomization_builds_and_validates(directory: Path) -> None:
    docs = kustomize(directory)
    for doc in docs:
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION
    images = {c["image"] for d in docs if "template" in d.get("spec", {}) for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"motorsite-coordinator:latest", "motorsite-engine:0.32.0", DEFAULT_RENDER_IMAGE}


def test_render_in_pod_runs_make_runs_two_pools_in_every_coordinator_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = kustomize(IN_POD)
    names = {d["metadata"]["name"] for d in docs}
    assert not {n for n in names if n.startswith("motorsite-render")}, names  # the pools' StatefulSets are gone
    [pod] = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "motorsite-coordinator"]
    [job] = [d for d in docs if d["kind"] == "Job"]
    monkeypatch.setattr(stack.os, "cpu_count", lambda: 2)
    cfg = stack.StackConfig(
        model_dir="/model", render_python="python", engine_python="python", app_python="python",
        render_member_ports=(8101,), extra_models=(stack.ExtraModel("tiny-b", "/model-b", 8102, (), render_member_ports=(8103,)),),
    )
    sidecars = [s for s in stack.build_specs(cfg) if s.name.startswith("render")]
    in_pod = {c["name"]: c for c in pod["containers"]}
    assert set(in_pod) == {"coordinator"} | {s.name for s in sidecars}
    for spec in sidecars:
        # Same pod, same network: each sidecar binds 127.0.0.1 exactly as under make run.
        assert in_pod[spec.name]["args"] == spec.argv[3:], spec.name
        # The render image has the render site where make run's sidecar finds it in the tree.
        assert {e["name"]: e["value"] for e in in_pod[spec.name]["env"]} == {
            **spec.env, "PYTHONPATH": "/opt/motorsite/render_site"}
        script = " ".join(in_pod[spec.name]["readinessProbe"]["exec"]["command"][2:])
        assert spec.ready_post and f"'{spec.ready_base_url}{spec.ready_post[0]}'" in script
        match = re.search(r"json\.dumps\((\{.*\})\)\.encode", script)
        assert match and ast.literal_eval(match.group(1)) == spec.ready_post[1], spec.name
    # The Job registers the members at 127.0.0.1 (demo_fleet's default host), as make run does.
    commands = fleet_commands(job["spec"]["template"]["spec"]["containers"][0]["command"][-1])
    for argv, (first, *others) in zip(commands, ((8100, 8101), (8102, 8103)), strict=True):
        assert values(argv, "--render-host") == [] and values(argv, "--render-port") == [str(first)]
        assert values(argv, "--render-member-port") == [str(p) for p in others]


def blank_values(argv: list[str], *flags: str) -> list[str]:
    return ["-" if i and argv[i - 1] in flags else a for i, a in enumerate(argv)]


def test_celery_runs_make_runs_commands() -> None:
    cfg = stack.StackConfig(model_dir="/model", render_python="python", engine_python="python", app_python="python")
    specs = {s.name: s for s in stack.celery_specs(cfg)}
    worker = containers("motorsite-celery-worker")["worker"]["command"]
    beat = containers("motorsite-celery-beat")["beat"]["command"]
    for got, spec in ((worker, specs["celery-worker"]), (beat, specs["celery-beat"])):
        # Where the node name and the schedule file live differs by place; every other argument is make run's.
        assert blank_values(got, "--hostname", "--schedule") == blank_values(spec.argv, "--hostname", "--schedule")
    assert one("Deployment", "motorsite-celery-beat")["spec"]["replicas"] == 1


def test_keys_are_in_the_secret_and_settings_in_the_configmap() -> None:
    secret = one("Secret", "motorsite-keys")["stringData"]
    config = one("ConfigMap", "motorsite-config")["data"]
    assert {"SECRET_KEY", "MOTOR_API_KEYS", "MOTOR_DEMO_ADMIN_KEY", "DATABASE_URL"} <= set(secret)
    assert not set(secret) & set(config)
    app = list(containers("motorsite-fleet", "Job").values())
    for deployment in ("motorsite-coordinator", "motorsite-celery-worker", "motorsite-celery-beat"):
        app += containers(deployment).values()
    for container in app:
        refs = container["envFrom"]
        assert {"configMapRef": {"name": "motorsite-config"}} in refs and {"secretRef": {"name": "motorsite-keys"}} in refs
    for _, _, pool, _, engines, _ in MODELS:  # sidecars and engines need no keys
        for container in [*containers(pool, "StatefulSet").values(), *containers(engines, "StatefulSet").values()]:
            assert "envFrom" not in container


def test_the_hpa_scales_coordinators_on_a_metric_they_export() -> None:
    hpa = one("HorizontalPodAutoscaler", "motorsite-coordinator")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "motorsite-coordinator"}
    [metric] = hpa["metrics"]
    assert metric["pods"]["metric"]["name"] == metric_names.ADMISSION_WAITING.name


def test_the_sidecar_image_is_set_from_the_render_config() -> None:
    for _, _, pool, _, _, _ in MODELS:
        assert containers(pool, "StatefulSet")["render"]["image"] == "motorsite-render"
    [image] = [i for i in KUSTOMIZATION["images"] if i["name"] == "motorsite-render"]
    assert f"{image['newName']}:{image['newTag']}" == DEFAULT_RENDER_IMAGE


def test_each_coordinator_pod_names_its_replica_by_its_own_name() -> None:
    env = {e["name"]: e for e in containers("motorsite-coordinator")["coordinator"]["env"]}
    assert env["MOTOR_REPLICA"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


# -- the shipped Secret starts nothing -----------------------------------------------------------

# What the Secret's comments tell an operator to generate, one per key.
GENERATED = {
    "SECRET_KEY": secrets.token_urlsafe(50),
    "DATABASE_URL": f"postgresql://motorsite:{secrets.token_urlsafe(16)}@postgres:5432/motorsite",
    "MOTOR_API_KEYS": "sk-" + secrets.token_urlsafe(32),
    "MOTOR_DEMO_ADMIN_KEY": "mk-" + secrets.token_urlsafe(32),
}


def pod_env(secret: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The environment ``envFrom`` gives a coordinator container, run from this checkout instead of /app."""
    config = one("ConfigMap", "motorsite-config")["data"]
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("MOTOR_", "SECRET_KEY", "DATABASE_URL", "REDIS_URL"))}
    # No Redis named redis here: the settings only need to load, and must refuse before anything connects.
    return {**inherited, **config, **secret, "PYTHONPATH": str(stack.ROOT), "MOTOR_VAR_DIR": str(tmp_path),
            "MOTOR_CELERY_DIR": str(tmp_path / "celery")}


def shipped_secret() -> dict[str, str]:
    return dict(one("Secret", "motorsite-keys")["stringData"])


def test_the_secret_names_every_key_it_is_generated_for() -> None:
    assert set(shipped_secret()) == set(GENERATED)


@pytest.mark.parametrize(
    "container", ["migrate", "coordinator", "fleet"], ids=["init container (migrate)", "coordinator (daphne)", "fleet job"]
)
def test_a_pod_started_with_the_shipped_secret_refuses_to_start(container: str, tmp_path: Path) -> None:
    # The container's own command, binding 127.0.0.1 on a free port instead of the pod's 0.0.0.0:8000.
    pod = one("Deployment", "motorsite-coordinator")["spec"]["template"]["spec"]
    env = pod_env(shipped_secret(), tmp_path)
    if container == "migrate":
        [init] = pod["initContainers"]
        argv = [sys.executable, *init["command"][1:]]
    elif container == "fleet":  # its shell script, with this interpreter as its `python`
        argv = containers("motorsite-fleet", "Job")["fleet"]["command"]
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    else:
        argv = containers("motorsite-coordinator")["coordinator"]["command"]
        argv = [a if a != "0.0.0.0" else "127.0.0.1" for a in argv]
        argv[argv.index("-p") + 1] = str(free_port())
        argv = [sys.executable, *argv[1:]]
    done = subprocess.run(argv, env=env, cwd=stack.ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "ImproperlyConfigured: SECRET_KEY is a placeholder" in done.stderr, done.stderr[-2000:]
    assert "secrets.token_urlsafe(50)" in done.stderr  # says how to make a real one
    assert not (tmp_path / "secret_key").exists()


def load_settings(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "import django; django.setup()"], env=env, cwd=stack.ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_each_placeholder_of_the_secret_is_refused_on_its_own(name: str, tmp_path: Path) -> None:
    # Every other value generated as the comments say: this placeholder alone stops the start.
    secret = {**GENERATED, name: shipped_secret()[name]}
    done = load_settings(pod_env(secret, tmp_path))
    assert done.returncode != 0
    assert f"ImproperlyConfigured: {name}" in done.stderr, done.stderr[-2000:]
    assert "placeholder" in done.stderr and "generate one with python3 -c" in done.stderr


def test_the_secret_filled_in_as_its_comments_say_starts(tmp_path: Path) -> None:
    done = load_settings(pod_env(GENERATED, tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
