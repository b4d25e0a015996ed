"""Reading request bodies the way vLLM's FastAPI server does, for every route of the simulator."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from enginesim.errors import from_validation_error, json_body_error, schema_error

M = TypeVar("M", bound=BaseModel)


async def json_body(request: Request) -> Any:
    # vLLM's validate_json_request: any other media type is a validation error.
    media_type = request.headers.get("content-type", "").lower().split(";", 1)[0].strip()
    if media_type != "application/json":
        raise schema_error(
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
        )
    try:
        return json.loads(await request.body())
    except json.JSONDecodeError as exc:
        raise json_body_error(exc) from None


async def parse(request: Request, model: type[M]) -> M:
    body = await json_body(request)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None



async def peer_json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except json.JSONDecodeError:
        return None
