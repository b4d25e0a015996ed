"""``python3 -m toolchain ensure|relock|path|exec|test`` (see the package docstring; ``test``: toolchain/suite.py)."""

from __future__ import annotations

import os
import sys

from . import (
    OBF_TEST_KEY,
    ROOT,
    ensure,
    ensure_chromium,
    ensure_docker_compose,
    location,
    python,
    rehash,
    relock,
    suite,
)

KINDS = ("app", "render", "engine", "model", "model-obf", "model-b", "model-lora")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "ensure":
        for kind in args or KINDS:
            if kind in ("chromium", "docker-compose"):
                if not (ensure_chromium() if kind == "chromium" else ensure_docker_compose()):
                    return 1
            else:
                ensure(kind)
        return 0
    if cmd == "relock":
        for kind in args:
            relock(kind)
        return 0
    if cmd == "rehash":
        for kind in args:
            rehash(kind)
        return 0
    if cmd == "path":
        print(location(args[0]))
        return 0
    if cmd in ("exec", "test"):
        # Run a command with the app environment's python, everything installed first.
        for kind in KINDS:
            ensure(kind)
        env = {**os.environ, "PYTHONPATH": str(ROOT), **toolchain_env()}
        if (cmd == "test" or args[:2] == ["-m", "pytest"]) and not test_prerequisites(env):
            return 1
        exe = str(python("app"))
        if cmd == "test":
            # `make test`: the suite as two pytest sessions at once (toolchain/suite.py); `args` go to both.
            return suite.main(args, env, exe)
        os.execve(exe, [exe, *args], env)
    print(f"unknown command {cmd!r}", file=sys.stderr)
    return 2


def test_prerequisites(env: dict[str, str]) -> bool:
    """Install what only the test suite needs; whether the suite may run."""
    # `make test` runs every test: a skip for a missing prerequisite fails the run
    # (tests/conftest.py). MOTOR_PREREQUISITES=optional in the caller's environment allows it.
    env.setdefault("MOTOR_PREREQUISITES", "required")
    # Only the test suite drives a browser or checks the compose file; `make run` never
    # waits for these installs.
    for name, ensured in (("Chromium", ensure_chromium), ("docker-compose", ensure_docker_compose)):
        if not ensured() and env["MOTOR_PREREQUISITES"] == "required":
            print(f"motorsite: the test suite needs {name} (MOTOR_PREREQUISITES=required); "
                  "install it or set MOTOR_PREREQUISITES=optional", file=sys.stderr, flush=True)
            return False
    return True


def toolchain_env() -> dict[str, str]:
    """The variables through which the coordinator finds the installed tiers."""
    return {
        "MOTOR_RENDER_PYTHON": str(python("render")),
        "MOTOR_ENGINE_PYTHON": str(python("engine")),
        "MOTOR_MODEL_DIR": str(location("model")),
        # The second small model (another vocabulary and chat template): two models, one fleet.
        "MOTOR_MODEL_B_DIR": str(location("model-b")),
        # The tiny model's LoRA adapter (PEFT's files), for engines started with --enable-lora.
        "MOTOR_LORA_DIR": str(location("model-lora")),
        # The tiny model obfuscated with the public test key, for the obfuscation tests.
        "MOTOR_OBF_MODEL_DIR": str(location("model-obf")),
        "MOTOR_OBF_TEST_KEY": OBF_TEST_KEY,
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
