"""What the probes' answers mean: pure functions, no I/O and no database.

The consecutive-success / consecutive-failure rule (``next_health``), what one tier reports
(``TierReport``), what makes an engine drift from its reference (``drift_reasons``) and how a
served model's record differs from what its engines load (``record_mismatch``). ``fleet.probes``
does the I/O around them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from catalog.models import Health
from catalog.render_versions import TOKEN_IN_MIN, parse_version


@dataclass(frozen=True, slots=True)
class Thresholds:
    """How many probes in a row change a verdict (HAProxy's rise and fall)."""

    rise: int = 2  # successes in a row before unknown/failing becomes healthy
    fall: int = 3  # failures in a row before unknown/healthy becomes failing


@dataclass(frozen=True, slots=True)
class HealthStep:
    health: str
    successes: int
    failures: int

    def changed_from(self, old: str) -> bool:
        return self.health != old


def next_health(health: str, successes: int, failures: int, ok: bool, t: Thresholds) -> HealthStep:
    """Apply one probe outcome to a verdict and its counters of consecutive outcomes.

    One slow or failed answer between successes never flips a healthy instance: the verdict
    moves only after ``t.fall`` failures (or ``t.rise`` successes) in a row.
    """
    if ok:
        successes, failures = successes + 1, 0
        if health != Health.HEALTHY and successes >= t.rise:
            health = Health.HEALTHY
    else:
        successes, failures = 0, failures + 1
        if health != Health.FAILING and failures >= t.fall:
            health = Health.FAILING
    return HealthStep(health, successes, failures)


@dataclass(frozen=True, slots=True)
class TierReport:
    """What one tier says it serves (``/v1/models``, ``/version``) and the hashes of its model files."""

    served_names: tuple[str, ...]
    root: str
    max_model_len: int | None
    version: str
    fingerprint: dict[str, str] | None = None  # None: no model directory to read
    name: str = ""  # the id of the card standing for the model (the served name, else the first base card)

    @classmethod
    def from_answers(
        cls, served_name: str, models: Any, version: Any, fingerprint: dict[str, str] | None
    ) -> TierReport:
        cards = models.get("data") if isinstance(models, dict) else None
        cards = [c for c in cards or [] if isinstance(c, dict)]
        names = tuple(str(c.get("id")) for c in cards)
        # The card of the served name; a LoRA adapter card (parent set) never stands for the model.
        card = next((c for c in cards if c.get("id") == served_name and not c.get("parent")), None)
        card = card or next((c for c in cards if not c.get("parent")), {})
        mml = card.get("max_model_len")
        return cls(
            served_names=names,
            root=str(card.get("root") or ""),
            max_model_len=mml if isinstance(mml, int) else None,
            version=str(version.get("version") or "") if isinstance(version, dict) else "",
            fingerprint=fingerprint,
            name=str(card.get("id") or ""),
        )


FINGERPRINT_KEYS = ("config", "tokenizer", "chat_template", "generation_config")


def drift_reasons(served_name: str, reference: TierReport, engine: TierReport) -> list[str]:
    """Why an engine does not serve the same model as the ``reference`` (the render sidecar).

    Compared: the served name, ``max_model_len`` and ``root`` from ``/v1/models``, the engine's
    vLLM version (token-in generate needs 0.23), and the content hashes of the model files. When
    both sides have hashes they decide identity, so the same files at a different path (a copy
    on another volume) are not drift; without them the paths are all there is to compare.
    """
    reasons: list[str] = []
    if served_name not in engine.served_names:
        reasons.append(f"serves {list(engine.served_names)}, not {served_name!r}")
    if reference.max_model_len is not None and engine.max_model_len != reference.max_model_len:
        reasons.append(f"max_model_len {engine.max_model_len} != render's {reference.max_model_len}")
    v = parse_version(engine.version)
    if v is None:
        reasons.append(f"unreadable vLLM version {engine.version!r}")
    elif v < TOKEN_IN_MIN:
        reasons.append(f"vLLM {engine.version} is older than 0.23 (token-in generate)")
    if reference.fingerprint is not None and engine.fingerprint is not None:
        for key in FINGERPRINT_KEYS:
            ours, theirs = reference.fingerprint.get(key, ""), engine.fingerprint.get(key, "")
            if ours != theirs:
                reasons.append(f"{key} differs ({theirs[:12] or 'missing'} vs render's {ours[:12] or 'missing'})")
    elif reference.root and engine.root != reference.root:
        reasons.append(f"root {engine.root!r} != render's {reference.root!r}")
    return reasons


def record_mismatch(name: str, model_path: str, engine: TierReport) -> list[str]:
    """How the served model's record differs from what the engine reports (not drift: nothing is quarantined).

    The operator fixes it by adopting the engine's values (``services.served_model_adopt_reported``).
    """
    reasons: list[str] = []
    if engine.name and name not in engine.served_names:
        reasons.append(f"the engine serves {engine.name!r}, the served model is named {name!r}")
    if engine.root and model_path and engine.root != model_path:
        reasons.append(f"the engine loads {engine.root!r}, the served model's model_path is {model_path!r}")
    return reasons
