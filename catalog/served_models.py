"""Operator actions on served models: add one (with its own render config), weigh placement's
scorers, drain, retire, serve again.

Each bumps the control version inside its transaction, so every coordinator process serves the
change within one snapshot poll (``MOTOR_SNAPSHOT_POLL_S``), with no query per request: a drained
model refuses new requests (503) while those admitted finish, a retired one is unknown (404) and
gone from ``/v1/models``. Engines and the render config stay as records; activating brings the
model back as it was.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

from catalog.models import RenderConfig, ServedModel
from catalog.services import render_config_publish
from motorsite.core import ConflictError, InvalidError, NotFoundError, bump_control_version

logger = logging.getLogger(__name__)


def served_model_get(*, name: str) -> ServedModel:
    model = ServedModel.objects.select_related("render_config", "base").filter(name=name).first()
    if model is None:
        raise NotFoundError(f"No served model named {name!r}.")
    return model


def served_model_add(
    *, name: str, model_path: str, max_model_len: int, render: dict[str, Any] | None, actor: str,
    base: str | None = None,
) -> ServedModel:
    """Create a served model and, when ``render`` is given (parsed render config fields), its own
    render config, named after the model. Without one the model uses the default render config
    (the oldest row linked to no model), if there is one. With ``base`` it is a LoRA adapter of
    that model: rendered by the base's render config (it takes none of its own), run on the
    base's engines that load it."""
    with transaction.atomic():
        if ServedModel.objects.filter(name=name).exists():
            raise ConflictError(f"A served model named {name!r} exists.")
        of = None
        if base is not None:
            of = ServedModel.objects.filter(name=base, base=None).first()
            if of is None:
                raise InvalidError(f"base: no served model named {base!r} that is not itself an adapter.")
            if render is not None:
                raise InvalidError("render_config: a LoRA adapter is rendered by its base's render config.")
        model = ServedModel.objects.create(name=name, model_path=model_path, max_model_len=max_model_len, base=of)
        if render is not None:
            render = dict(render)
            config_name = render.pop("name", None) or name
            if RenderConfig.objects.filter(name=config_name).exists():
                raise ConflictError(f"A render config named {config_name!r} exists; a new model needs its own.")
            config = render_config_publish(changes=render, actor=actor, name=config_name).config
            RenderConfig.objects.filter(id=config.id).update(served_model=model)
        bump_control_version()
    logger.info("served model added name=%s render_config=%s actor=%s", name, render is not None, actor)
    return served_model_get(name=name)


def served_model_set_weights(*, name: str, weights: dict[str, float], actor: str) -> ServedModel:
    """Set placement's scorer weights (any of ``prefix_weight``, ``queue_weight``,
    ``tokens_weight``, already validated); the next snapshot places by them."""
    unknown = set(weights) - {"prefix_weight", "queue_weight", "tokens_weight"}
    if unknown:
        raise ValueError(sorted(unknown))
    rows = ServedModel.objects.filter(name=name)
    with transaction.atomic():
        if not (rows.update(**weights) if weights else rows.exists()):
            raise NotFoundError(f"No served model named {name!r}.")
        if weights:
            bump_control_version()
    logger.info("served model %s scorer weights %s actor=%s", name, weights, actor)
    return served_model_get(name=name)


def served_model_set_state(*, name: str, state: str, actor: str) -> ServedModel:
    """Move the model to ``state`` (one of ``ServedModel.State``); a no-op when it is there."""
    if state not in ServedModel.State.values:
        raise ValueError(state)
    with transaction.atomic():
        model = ServedModel.objects.select_for_update().filter(name=name).first()
        if model is None:
            raise NotFoundError(f"No served model named {name!r}.")
        old = model.state
        if old != state:
            ServedModel.objects.filter(id=model.id).update(state=state)
            bump_control_version()
    if old != state:
        logger.info("served model %s state %s -> %s actor=%s", name, old, state, actor)
    return served_model_get(name=name)
