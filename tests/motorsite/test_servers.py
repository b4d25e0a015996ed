"""The coordinator's ASGI server for `make run`: Daphne by default, uvicorn on request (MOTOR_SERVER)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from motorsite import stack
from motorsite.launcher.management.commands.runstack import Command

CFG = stack.StackConfig(model_dir="/m", render_python="/r", engine_python="/e", coordinator_port=8123, log_dir=Path("/tmp"))


def test_daphne_serves_by_default_and_uvicorn_on_request() -> None:
    daphne = stack.coordinator_spec(CFG).argv
    assert daphne[1:] == ["-m", "daphne", "-b", "127.0.0.1", "-p", "8123", "motorsite.asgi:application"]
    uvicorn = stack.coordinator_spec(replace(CFG, server="uvicorn")).argv
    assert uvicorn[1:4] == ["-m", "uvicorn", "--host"] and uvicorn[-1] == "motorsite.asgi:application"
    assert uvicorn[uvicorn.index("--port") + 1] == "8123"
    assert uvicorn[uvicorn.index("--lifespan") + 1] == "off"  # Channels' router has no lifespan handler
    assert (uvicorn[uvicorn.index("--loop") + 1], uvicorn[uvicorn.index("--http") + 1]) == ("uvloop", stack.UVICORN_PROTOCOL)
    with pytest.raises(ValueError, match="one of daphne, uvicorn"):
        stack.coordinator_spec(replace(CFG, server="hypercorn"))


def test_make_run_takes_the_server_from_motor_server(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Command().create_parser("manage.py", "runstack").parse_args([]).server == "daphne"
    monkeypatch.setenv("MOTOR_SERVER", "uvicorn")
    assert Command().create_parser("manage.py", "runstack").parse_args([]).server == "uvicorn"
    with pytest.raises(CommandError, match="invalid choice: 'gunicorn'"):
        Command().create_parser("manage.py", "runstack").parse_args(["--server", "gunicorn"])
    monkeypatch.setenv("MOTOR_SERVER", "gunicorn")  # argparse never checks a default against the choices
    with pytest.raises(CommandError, match="MOTOR_SERVER='gunicorn' is not one of daphne, uvicorn"):
        call_command("runstack")
