"""Probe logic: thresholds (table-driven), versions and capabilities, drift from real model files."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.test import Client

from catalog.fingerprints import fingerprint_model_dir
from catalog.models import RenderConfig, ServedModel
from fleet import probes
from fleet.models import EngineInstance, InstanceEvent, ProbeResult
from fleet.probes import Thresholds, TierReport, drift_reasons, next_health, parse_version, render_capabilities
from fleet.services import instance_create, read_control_version
from serving.snapshots import build_snapshot

T = Thresholds(rise=2, fall=3)


@pytest.mark.parametrize(
    ("health", "succ", "fail", "ok", "expected"),
    [
        # one failure, or two, never flips a healthy instance
        ("healthy", 5, 0, False, ("healthy", 0, 1)),
        ("healthy", 0, 1, False, ("healthy", 0, 2)),
        ("healthy", 0, 2, False, ("failing", 0, 3)),
        ("failing", 0, 7, False, ("failing", 0, 8)),
        # a success between failures resets the failure run
        ("healthy", 0, 2, True, ("healthy", 1, 0)),
        # recovery needs `rise` successes in a row
        ("failing", 0, 3, True, ("failing", 1, 0)),
        ("failing", 1, 0, True, ("healthy", 2, 0)),
        # unknown decides only after a full run either way
        ("unknown", 0, 0, True, ("unknown", 1, 0)),
        ("unknown", 1, 0, True, ("healthy", 2, 0)),
        ("unknown", 0, 2, False, ("failing", 0, 3)),
        ("unknown", 0, 1, False, ("unknown", 0, 2)),
    ],
)
def test_it_applies_consecutive_thresholds(health: str, succ: int, fail: int, ok: bool, expected: tuple[str, int, int]) -> None:
    step = next_health(health, succ, fail, ok, T)
    assert (step.health, step.successes, step.failures) == expected


@pytest.mark.parametrize(
    ("text", "version", "caps"),
    [
        ("0.33.0", (0, 33, 0), (True, True, True)),
        ("0.32.0+cpu", (0, 32, 0), (True, True, True)),
        ("0.27.0rc1", (0, 27, 0), (True, True, True)),
        ("0.26.9", (0, 26, 9), (True, True, False)),
        ("0.24.0", (0, 24, 0), (True, True, False)),
        ("0.23.1", (0, 23, 1), (True, False, False)),
        ("0.11.1.dev3+g0abc", (0, 11, 1), (False, False, False)),
        ("1.0", (1, 0, 0), (True, True, True)),
        ("", None, (False, False, False)),
        ("garbage", None, (False, False, False)),
    ],
)
def test_it_negotiates_render_capabilities_from_the_version(text: str, version: tuple[int, int, int] | None, caps: tuple[bool, bool, bool]) -> None:
    assert parse_version(text) == version
    c = render_capabilities(text)
    assert (c.token_in, c.derender, c.streaming_derender) == caps


FP = {"config": "a" * 64, "tokenizer": "b" * 64, "chat_template": "c" * 64, "generation_config": "d" * 64}


def _tier(**kw: object) -> TierReport:
    base: dict[str, object] = {"served_names": ("tiny",), "root": "/m/tiny", "max_model_len": 2048, "version": "0.32.0", "fingerprint": dict(FP)}
    base.update(kw)
    return TierReport(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        (_tier(), []),
        (_tier(root="/elsewhere/tiny"), []),  # same files at another path: not drift
        (_tier(root="/elsewhere", fingerprint=None), ["root"]),  # no files to read: the path decides
        (_tier(served_names=("other",)), ["serves"]),
        (_tier(max_model_len=4096), ["max_model_len"]),
        (_tier(version="0.22.0"), ["older than 0.23"]),
        (_tier(version="?"), ["unreadable"]),
        (_tier(fingerprint={**FP, "chat_template": "e" * 64}), ["chat_template differs"]),
        (_tier(fingerprint={**FP, "tokenizer": ""}), ["tokenizer differs (missing"]),
    ],
)
def test_it_finds_what_differs(engine: TierReport, expected: list[str]) -> None:
    reasons = drift_reasons("tiny", _tier(), engine)
    assert len(reasons) == len(expected)
    for reason, fragment in zip(reasons, expected, strict=True):
        assert fragment in reason


# -- against the database and real model files -----------------------------------------------


@pytest.fixture
def model_dir() -> Path:
    path = os.environ.get("MOTOR_MODEL_DIR")
    if not path:
        pytest.fail("MOTOR_MODEL_DIR is not set; run through `python3 -m toolchain exec`", pytrace=False)
    return Path(path)


@pytest.fixture
def other_template_dir(model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the built model whose chat template differs by one line."""
    target = tmp_path / "tiny-other-template"
    shutil.copytree(model_dir, target, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    cfg_path = target / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    jinja = target / "chat_template.jinja"
    if jinja.exists():  # the template lives in its own file: edit it there
        jinja.write_text(jinja.read_text() + "\n{# revised #}")
    else:
        cfg["chat_template"] = cfg["chat_template"] + "{# revised #}"
        cfg_path.write_text(json.dumps(cfg))
    return target


@pytest.fixture
def fleet(db: None, model_dir: Path) -> list[EngineInstance]:
    model = ServedModel.objects.create(name="tiny", model_path=str(model_dir), max_model_len=2048)
    RenderConfig.objects.create(name="default", host="render.test", port=8100)
    return [
        instance_create(actor="test", name=f"e{n}", url=f"http://e{n}.test:8201", served_model_id=model.id, model_dir=str(model_dir))
        for n in (1, 2)
    ]


Handler = Callable[[httpx.Request], httpx.Response]


def tiers_answering(
    *, render_version: str = "0.33.0", roots: dict[str, str] | None = None, fail: set[str] = frozenset(),  # type: ignore[assignment]
    names: dict[str, str] | None = None,
) -> httpx.Client:
    """A client whose transport answers like the render sidecar and engines, per host."""
    roots = roots or {}
    names = names or {}

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host.split(".")[0]
        if host in fail:
            raise httpx.ConnectError("refused", request=request)
        path = request.url.path
        if path == "/version":
            return httpx.Response(200, json={"version": render_version if host == "render" else "0.32.0"})
        if path == "/v1/models":
            root = roots.get(host, os.environ["MOTOR_MODEL_DIR"])
            card = {"id": names.get(host, "tiny"), "object": "model", "root": root, "max_model_len": 2048, "parent": None}
            # A LoRA adapter card first, as vLLM lists them with --enable-lora: never the model's name.
            lora = {"id": "sql-lora", "object": "model", "root": "/adapters/sql", "parent": card["id"]}
            return httpx.Response(200, json={"object": "list", "data": [lora, card]})
        if path in ("/inference/v1/generate", "/v1/chat/completions/render"):
            return httpx.Response(200, json={"choices": [{"index": 0, "token_ids": [5]}]})
        return httpx.Response(404, json={"detail": "Not Found"})

    # The probes' own client is httpx (fleet/probes.py): only the tiers' answers are canned here.
    return httpx.Client(transport=httpx.MockTransport(handler))


def test_it_flags_and_quarantines_an_engine_whose_chat_template_differs(fleet: list[EngineInstance], other_template_dir: Path, model_dir: Path) -> None:
    e1, e2 = fleet
    assert fingerprint_model_dir(other_template_dir)["chat_template"] != fingerprint_model_dir(model_dir)["chat_template"]
    EngineInstance.objects.filter(id=e2.id).update(model_dir=str(other_template_dir))
    version_before = read_control_version()
    summary = probes.probe_versions(client=tiers_answering(roots={"e2": str(other_template_dir)}))
    assert summary.drifted == ["e2"] and summary.quarantined == ["e2"]
    e1.refresh_from_db()
    e2.refresh_from_db()
    assert not e1.version_drift and e1.state == "active"
    assert e2.version_drift and e2.state == "quarantined"
    assert "chat_template differs" in e2.drift_reason
    # Only the template differs: the tokenizer and configs hash the same.
    assert e2.reported_fingerprint == {**fingerprint_model_dir(model_dir), "chat_template": e2.reported_fingerprint["chat_template"]}
    assert e2.reported_version == "0.32.0" and e2.reported_root == str(other_template_dir)
    # The engine also loads another directory than the served model's model_path: shown too.
    assert list(InstanceEvent.objects.filter(instance=e2).values_list("kind", "new")) == [
        ("state", "quarantined"), ("drift", "true"), ("model", "true"),
    ]
    assert read_control_version() > version_before
    assert ProbeResult.objects.filter(kind="version", instance=e2, ok=False).count() == 1
    # A second probe writes no new drift history (only a change of state does).
    probes.probe_versions(client=tiers_answering(roots={"e2": str(other_template_dir)}))
    assert InstanceEvent.objects.filter(instance=e2, kind="drift").count() == 1


def test_it_only_flags_when_quarantine_is_off(fleet: list[EngineInstance], other_template_dir: Path, settings: object) -> None:
    settings.MOTOR_QUARANTINE_ON_DRIFT = False  # type: ignore[attr-defined]
    e2 = fleet[1]
    EngineInstance.objects.filter(id=e2.id).update(model_dir=str(other_template_dir))
    summary = probes.probe_versions(client=tiers_answering())
    e2.refresh_from_db()
    assert summary.drifted == ["e2"] and summary.quarantined == []
    assert e2.version_drift and e2.state == "active"


def test_it_does_not_flag_an_identical_copy(fleet: list[EngineInstance], model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    EngineInstance.objects.filter(id=fleet[1].id).update(model_dir=str(copy))
    summary = probes.probe_versions(client=tiers_answering(roots={"e2": str(copy)}))
    assert summary.drifted == [] and not EngineInstance.objects.filter(version_drift=True).exists()


def test_it_turns_streaming_derender_off_for_an_old_sidecar(fleet: list[EngineInstance]) -> None:
    summary = probes.probe_versions(client=tiers_answering(render_version="0.26.0"))
    assert summary.streaming_derender is False
    cfg = RenderConfig.objects.get()
    assert cfg.sidecar_version == "0.26.0" and cfg.streaming_derender is False
    assert build_snapshot().render.streaming_derender is False
    probes.probe_versions(client=tiers_answering(render_version="0.33.0"))
    assert build_snapshot().render.streaming_derender is True


def test_it_fails_an_engine_only_after_three_failed_generates(fleet: list[EngineInstance]) -> None:
    e1 = fleet[0]
    down = tiers_answering(fail={"e1"})
    for expected in ("unknown", "unknown", "failing", "failing"):
        probes.probe_engine_health(e1.id, client=down)
        e1.refresh_from_db()
        assert e1.health == expected
    assert e1.consecutive_failures == 4 and e1.last_probe_ok is False and "refused" in e1.last_probe_error
    assert build_snapshot().instances[0].healthy is False
    up = tiers_answering()
    probes.probe_engine_health(e1.id, client=up)
    e1.refresh_from_db()
    assert e1.health == "failing"  # one success is not a recovery
    probes.probe_engine_health(e1.id, client=up)
    e1.refresh_from_db()
    assert e1.health == "healthy"
    # History: only the two flips, though six probes ran.
    assert list(InstanceEvent.objects.filter(instance=e1, kind="health").values_list("old", "new")) == [
        ("failing", "healthy"), ("unknown", "failing"),
    ]
    assert ProbeResult.objects.filter(instance=e1, kind="health").count() == 6


def test_it_judges_the_render_sidecar_by_a_real_render(fleet: list[EngineInstance]) -> None:
    down = tiers_answering(fail={"render"})
    for _ in range(3):
        probes.probe_render_health(client=down)
    assert RenderConfig.objects.get().health == "failing"
    probes.probe_render_health(client=tiers_answering())
    assert RenderConfig.objects.get().health == "failing"
    probes.probe_render_health(client=tiers_answering())
    cfg = RenderConfig.objects.get()
    assert cfg.health == "healthy" and cfg.last_probe_error == ""
    assert ProbeResult.objects.filter(instance=None, kind="health").count() == 5


def test_the_version_probe_records_the_vocab_size_from_the_model_files(fleet: list[EngineInstance], model_dir: Path) -> None:
    model = ServedModel.objects.get(name="tiny")
    assert model.vocab_size is None
    version_before = read_control_version()
    probes.probe_versions(client=tiers_answering())
    model.refresh_from_db()
    assert model.vocab_size == json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert read_control_version() > version_before  # the snapshot carries it
    version_after = read_control_version()
    probes.probe_versions(client=tiers_answering())
    assert read_control_version() == version_after  # unchanged size: no bump
    ServedModel.objects.filter(id=model.id).update(model_path="/nonexistent/tiny")
    probes.probe_versions(client=tiers_answering())
    model.refresh_from_db()
    assert model.vocab_size is not None  # unreadable files keep the recorded size


# -- the served model's record, from what the engines report --------------------------------------


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        (_tier(name="tiny"), []),
        (_tier(name="tiny", root="/elsewhere"), ["loads '/elsewhere'"]),
        (_tier(name="qwen", served_names=("qwen",)), ["serves 'qwen'"]),
        (_tier(name="qwen", served_names=("qwen",), root="/m/qwen"), ["serves 'qwen'", "loads '/m/qwen'"]),
        (_tier(name="", served_names=(), root=""), []),  # nothing reported: nothing to compare
    ],
)
def test_it_finds_how_the_served_model_record_differs(engine: TierReport, expected: list[str]) -> None:
    reasons = probes.record_mismatch("tiny", "/m/tiny", engine)
    assert len(reasons) == len(expected)
    for reason, fragment in zip(reasons, expected, strict=True):
        assert fragment in reason


def test_it_reads_the_model_card_and_not_an_adapter() -> None:
    models = {"data": [{"id": "sql-lora", "root": "/adapters/sql", "parent": "qwen"}, {"id": "qwen", "root": "/m/qwen", "parent": None}]}
    report = TierReport.from_answers("tiny", models, {"version": "0.32.0"}, None)
    assert (report.name, report.root) == ("qwen", "/m/qwen")


def test_it_records_what_the_engines_report_and_shows_a_mismatch(fleet: list[EngineInstance], model_dir: Path, tmp_path: Path) -> None:
    e1, e2 = fleet
    probes.probe_versions(client=tiers_answering())
    e1.refresh_from_db()
    assert (e1.reported_name, e1.reported_root, e1.model_mismatch) == ("tiny", str(model_dir), "")
    assert not InstanceEvent.objects.filter(kind="model").exists()
    # The operator typed another path (a copy of the same files) than the engines load: each
    # engine shows it, once however often it is probed.
    copy = tmp_path / "typed-by-hand"
    shutil.copytree(model_dir, copy, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    ServedModel.objects.update(model_path=str(copy))
    for _ in range(2):
        probes.probe_versions(client=tiers_answering())
    e2.refresh_from_db()
    assert e2.model_mismatch == f"the engine loads {str(model_dir)!r}, the served model's model_path is {str(copy)!r}"
    events = InstanceEvent.objects.filter(instance=e2, kind="model")
    assert list(events.values_list("old", "new", "actor")) == [("false", "true", "probe")]
    assert str(copy) in events.get().reason
    # A path mismatch is not drift: the files hash the same, nothing is quarantined.
    assert e2.state == "active" and not e2.version_drift


def test_it_compares_the_render_sidecars_model_with_the_records_like_an_engines(
    fleet: list[EngineInstance], model_dir: Path, client: Client, admin_user: Any
) -> None:
    probes.probe_versions(client=tiers_answering())
    assert RenderConfig.objects.get().model_mismatch == ""
    # The sidecar serves another name and loads another directory than the record says.
    probes.probe_versions(client=tiers_answering(names={"render": "tiny-v2"}, roots={"render": "/models/v2"}))
    mismatch = RenderConfig.objects.get().model_mismatch
    assert mismatch == (
        "the engine serves 'tiny-v2', the served model is named 'tiny'; "
        f"the engine loads '/models/v2', the served model's model_path is {str(model_dir)!r}"
    )
    # The engines still match: the sidecar's mismatch is its own.
    assert not EngineInstance.objects.exclude(model_mismatch="").exists()
    # Shown where an operator looks: the REST API and the admin's render config list.
    from fleet.services import api_key_create

    key = api_key_create(name="ops", scope="admin")[1]
    answer = client.get("/api/render-configs", HTTP_AUTHORIZATION=f"Bearer {key}").json()
    assert [c["model_mismatch"] for c in answer] == [mismatch]
    client.force_login(admin_user)
    page = client.get("/admin/serving/renderconfig/").content.decode()
    assert "⚠ the engine serves &#x27;tiny-v2&#x27;" in page
    # An unreachable sidecar says nothing new; a matching one clears it.
    probes.probe_versions(client=tiers_answering(fail={"render"}))
    assert RenderConfig.objects.get().model_mismatch == mismatch
    probes.probe_versions(client=tiers_answering())
    assert RenderConfig.objects.get().model_mismatch == ""


def test_it_adopts_the_name_and_path_an_engine_reports(fleet: list[EngineInstance], model_dir: Path) -> None:
    from fleet.services import served_model_adopt_reported

    ServedModel.objects.update(name="typo", model_path="/typed/by/hand")
    probes.probe_versions(client=tiers_answering())
    assert EngineInstance.objects.exclude(model_mismatch="").count() == 2
    version_before = read_control_version()
    model = served_model_adopt_reported(instance_id=fleet[0].id, actor="admin:ops")
    assert (model.name, model.model_path) == ("tiny", str(model_dir))
    assert ServedModel.objects.get().name == "tiny"
    assert not EngineInstance.objects.exclude(model_mismatch="").exists()
    assert read_control_version() > version_before
    assert build_snapshot().instances[0].model == "tiny"  # traffic for "tiny" reaches the engines again
    event = InstanceEvent.objects.filter(instance=fleet[1], kind="model").first()
    assert event is not None and event.actor == "admin:ops" and "adopted from e1" in event.reason
    # The next probe finds nothing to say.
    probes.probe_versions(client=tiers_answering())
    assert InstanceEvent.objects.filter(kind="model", actor="probe").count() == 2  # the two mismatches before


def test_it_refuses_to_adopt_when_engines_disagree_or_nothing_was_reported(fleet: list[EngineInstance], tmp_path: Path) -> None:
    from fleet.services import ConflictError, InvalidError, served_model_adopt_reported

    with pytest.raises(InvalidError, match="not reported a model yet"):
        served_model_adopt_reported(instance_id=fleet[0].id, actor="test")
    probes.probe_versions(client=tiers_answering(names={"e2": "other"}))
    with pytest.raises(ConflictError, match="report other models: e2"):
        served_model_adopt_reported(instance_id=fleet[0].id, actor="test")
    assert ServedModel.objects.get().model_path != "" and not InstanceEvent.objects.filter(actor="test").exists()
