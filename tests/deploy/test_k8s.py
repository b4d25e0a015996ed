"""deploy/k8s/ validates offline against the Kubernetes OpenAPI schemas and runs what make run runs.

Schemas: kubernetes-validate 1.37.0 (it ships them), strict mode, so an unknown or misspelt
field fails as well as a wrong type; a kind with no schema fails too instead of being skipped.
"""

from __future__ import annotations

import ast
import os
import re
import secrets
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

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33"
KUSTOMIZATION = yaml.safe_load((K8S / "kustomization.yaml").read_text())


def resources() -> list[tuple[str, dict[str, Any]]]:
    return [
        (name, doc)
        for name in KUSTOMIZATION["resources"]
        for doc in yaml.safe_load_all((K8S / name).read_text())
        if doc
    ]


def one(kind: str, name: str) -> dict[str, Any]:
    [found] = [doc for _, doc in resources() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    return found


def containers(deployment: str) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in one("Deployment", deployment)["spec"]["template"]["spec"]["containers"]}


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


def test_the_render_sidecar_shares_the_coordinators_pod_and_runs_make_runs_arguments() -> None:
    pod = containers("motorsite-coordinator")
    assert set(pod) == {"coordinator", "render"}
    argv, env = tiers.render_sidecar_command(
        python="python", model_dir="/model", served_model_name="tiny", port=8100, workers=4, max_model_len=2048,
    )
    # Same pod, same network: the sidecar binds 127.0.0.1 exactly as under make run.
    assert pod["render"]["args"] == argv[3:]
    assert {e["name"]: e["value"] for e in pod["render"]["env"]} == env
    assert pod["coordinator"]["command"] == ["python", "-m", "daphne", "-b", "0.0.0.0", "-p", "8000", "motorsite.asgi:application"]


def test_probes_are_real_requests() -> None:
    pod = containers("motorsite-coordinator")
    for probe in ("readinessProbe", "livenessProbe"):
        assert pod["coordinator"][probe]["httpGet"]["path"] == "/healthz"
    script = " ".join(pod["render"]["readinessProbe"]["exec"]["command"][2:])
    path, body = tiers.render_ready_request("tiny")
    assert f"'http://127.0.0.1:8100{path}'" in script
    match = re.search(r"json\.dumps\((\{.*\})\)\.encode", script)
    assert match and ast.literal_eval(match.group(1)) == body
    assert pod["render"]["livenessProbe"]["httpGet"] == {"path": "/health", "port": 8100}
    worker = containers("motorsite-celery-worker")["worker"]
    assert "inspect ping" in " ".join(worker["livenessProbe"]["exec"]["command"])


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
    for deployment in ("motorsite-coordinator", "motorsite-celery-worker", "motorsite-celery-beat"):
        for container in containers(deployment).values():
            if container["name"] == "render":
                continue  # the sidecar needs no keys
            refs = container["envFrom"]
            assert {"configMapRef": {"name": "motorsite-config"}} in refs and {"secretRef": {"name": "motorsite-keys"}} in refs


def test_the_hpa_scales_coordinators_on_a_metric_they_export() -> None:
    hpa = one("HorizontalPodAutoscaler", "motorsite-coordinator")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "motorsite-coordinator"}
    [metric] = hpa["metrics"]
    assert metric["pods"]["metric"]["name"] == metric_names.ADMISSION_WAITING.name


def test_the_sidecar_image_is_set_from_the_render_config() -> None:
    pod = containers("motorsite-coordinator")
    assert pod["render"]["image"] == "motorsite-render"
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
    "container", ["migrate", "coordinator"], ids=["init container (migrate)", "coordinator (daphne)"]
)
def test_a_pod_started_with_the_shipped_secret_refuses_to_start(container: str, tmp_path: Path) -> None:
    # The container's own command, binding 127.0.0.1 on a free port instead of the pod's 0.0.0.0:8000.
    pod = one("Deployment", "motorsite-coordinator")["spec"]["template"]["spec"]
    if container == "migrate":
        [init] = pod["initContainers"]
        argv = init["command"]
    else:
        argv = containers("motorsite-coordinator")["coordinator"]["command"]
        argv = [a if a != "0.0.0.0" else "127.0.0.1" for a in argv]
        argv[argv.index("-p") + 1] = str(free_port())
    argv = [sys.executable, *argv[1:]]
    done = subprocess.run(argv, env=pod_env(shipped_secret(), tmp_path), cwd=stack.ROOT, capture_output=True,
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
