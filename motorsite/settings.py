"""motorsite settings: one module, every knob read from the environment.

A value that does not parse fails at start with ``ImproperlyConfigured`` rather than
silently becoming a default. The embedded default needs no server: SQLite and an
in-memory channel layer. ``DATABASE_URL`` (postgres://, sqlite:///) and ``REDIS_URL`` switch
to PostgreSQL and Redis.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from urllib.parse import unquote, urlparse

from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from None


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean, got {raw!r}")


def sqlite_options(timeout_s: float) -> dict[str, object]:
    """OPTIONS that let the coordinator, Celery and the write-back thread share one SQLite file.

    WAL: readers never block the writer and the writer never blocks readers. IMMEDIATE: a
    transaction takes the write lock at BEGIN, so a read-then-update (the compare-and-set flips)
    waits for the lock under the busy timeout; a DEFERRED one that read first cannot upgrade and
    fails at once with "database is locked", whatever the timeout. synchronous=NORMAL is WAL's
    usual setting: a power cut may lose the last commits, a process crash loses nothing.
    ``timeout`` is Python's sqlite3 busy timeout (sqlite3_busy_timeout); a PRAGMA busy_timeout
    would only repeat it.
    """
    return {
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL",
        "transaction_mode": "IMMEDIATE",
        "timeout": timeout_s,
    }


def database_from_url(url: str, *, sqlite_timeout_s: float = 5.0) -> dict[str, object]:
    parsed = urlparse(url)
    if parsed.scheme == "sqlite":
        # sqlite:///relative.db and sqlite:////absolute.db, as dj-database-url reads them.
        path = parsed.path[1:] if parsed.path.startswith("/") else parsed.path
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": path or ":memory:",
            "OPTIONS": sqlite_options(sqlite_timeout_s),
        }
    if parsed.scheme in ("postgres", "postgresql", "pgsql"):
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(parsed.path.lstrip("/")),
            "USER": unquote(parsed.username or ""),
            "PASSWORD": unquote(parsed.password or ""),
            "HOST": parsed.hostname or "",
            "PORT": str(parsed.port or ""),
            "CONN_MAX_AGE": 0,
        }
    raise ImproperlyConfigured(f"DATABASE_URL scheme {parsed.scheme!r} is not supported")


# What Django's own deploy check (security.W009) calls a strong key, and the key DEBUG runs with.
SECRET_KEY_MIN_LENGTH = 50
SECRET_KEY_MIN_UNIQUE = 5
DEV_SECRET_KEY = "motorsite-dev-only-not-secret"
# Client and admin keys, and the demo admin password: what a random key of the documented recipe
# always passes and a typed or copied one mostly does not. These are not strength estimates; they
# refuse what a review found shipped (deploy/k8s/secret.yaml's `sk-motor-change-me` opened /v1).
API_KEY_MIN_LENGTH = 20
API_KEY_MIN_UNIQUE = 6
PASSWORD_MIN_LENGTH = 12
PASSWORD_MIN_UNIQUE = 6
# Parts of the placeholders and examples this project has shipped (the k8s Secret, compose, the
# README): a secret containing one was copied from a file, not generated, and is public.
PLACEHOLDER_MARKERS = (
    "change-me", "changeme", "change_me", "replace-me", "replace_me", "placeholder", "example", "...", "<", ">",
)
# What each kind of secret is generated with; the refusal says it, so the fix is one paste.
GENERATE_SECRET_KEY = "python3 -c 'import secrets; print(secrets.token_urlsafe(50))'"
GENERATE_API_KEY = "python3 -c 'import secrets; print(\"sk-\" + secrets.token_urlsafe(32))'"
GENERATE_PASSWORD = "python3 -c 'import secrets; print(secrets.token_urlsafe(16))'"


def is_placeholder(value: str) -> bool:
    """Whether ``value`` carries a marker of a shipped placeholder (``change-me``, ``sk-...``)."""
    lowered = value.lower()
    return any(marker in lowered for marker in PLACEHOLDER_MARKERS)


def check_secret_key(key: str, *, name: str = "SECRET_KEY") -> str:
    """Return ``key`` if Django's deploy check would call it strong and it is no shipped placeholder;
    raise ``ImproperlyConfigured`` if not (the message never repeats the key)."""
    if is_placeholder(key):
        raise ImproperlyConfigured(
            f"{name} is a placeholder copied from an example (deploy/k8s/secret.yaml, compose, the README), "
            f"which anyone can read: generate one with {GENERATE_SECRET_KEY}"
        )
    if (
        len(key) < SECRET_KEY_MIN_LENGTH
        or len(set(key)) < SECRET_KEY_MIN_UNIQUE
        or key.startswith("django-insecure-")
        or key == DEV_SECRET_KEY
    ):
        raise ImproperlyConfigured(
            f"{name} must be at least {SECRET_KEY_MIN_LENGTH} characters with {SECRET_KEY_MIN_UNIQUE} or more "
            f"distinct ones ({GENERATE_SECRET_KEY}); "
            "or leave it unset to have one generated under MOTOR_VAR_DIR"
        )
    return key


def check_api_key(key: str, *, name: str, min_length: int = API_KEY_MIN_LENGTH, min_unique: int = API_KEY_MIN_UNIQUE,
                  generate: str = GENERATE_API_KEY) -> str:
    """Return ``key`` (a client or admin key, or a password) unless it is a placeholder or too weak
    to be a generated one; raise ``ImproperlyConfigured`` saying how to make one (never the key)."""
    if is_placeholder(key):
        raise ImproperlyConfigured(
            f"{name} holds a placeholder copied from an example, which anyone can read: generate one with {generate}"
        )
    if len(key) < min_length or len(set(key)) < min_unique:
        raise ImproperlyConfigured(
            f"{name} holds a key shorter than {min_length} characters or with fewer than {min_unique} distinct "
            f"ones: generate one with {generate}"
        )
    return key


def check_database_password(url: str) -> str:
    """Return ``url`` unless its password is a shipped placeholder (``postgresql://u:change-me@...``)."""
    password = unquote(urlparse(url).password or "")
    if password and is_placeholder(password):
        raise ImproperlyConfigured(
            f"DATABASE_URL's password is a placeholder copied from an example: set the database user's real "
            f"password (generate one with {GENERATE_PASSWORD})"
        )
    return url


def persistent_secret_key(path: Path) -> str:
    """The key stored at ``path``, generated there (mode 0600) by the first process that needs it.

    Every process of one ``make run`` (coordinator, Celery, launcher) reads the same file, so
    sessions and signed values survive restarts. The new key is written to a private temporary
    file and hard-linked into place: of two processes starting together, exactly one link wins
    and both then read the winner's whole key, never a half-written one.
    """
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(50))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return check_secret_key(path.read_text().strip(), name=str(path))


DEBUG = env_bool("DEBUG", False)
# make run's state (database, logs, the generated SECRET_KEY); runstack reads the same variable.
MOTOR_VAR_DIR = Path(env_str("MOTOR_VAR_DIR", str(BASE_DIR / "var")))
# With DEBUG off a key is either given (and strong) or generated once and kept in MOTOR_VAR_DIR.
# Several machines serving one site (Kubernetes replicas) must share one: set SECRET_KEY there.
if DEBUG:
    # Any given key is taken as it is (a development machine), but never a shipped placeholder: a
    # debug pod started from the k8s Secret would sign metaserver routes with a public key.
    if env_str("SECRET_KEY") and is_placeholder(env_str("SECRET_KEY")):
        check_secret_key(env_str("SECRET_KEY"))
    SECRET_KEY = env_str("SECRET_KEY") or DEV_SECRET_KEY
elif env_str("SECRET_KEY"):
    SECRET_KEY = check_secret_key(env_str("SECRET_KEY"))
else:
    SECRET_KEY = persistent_secret_key(MOTOR_VAR_DIR / "secret_key")
ALLOWED_HOSTS = env_str("ALLOWED_HOSTS", "127.0.0.1,localhost,testserver").split(",")

INSTALLED_APPS = [
    # Not "daphne": its app imports daphne.server (Twisted's reactor, ~0.8 s of CPU) into every
    # manage.py command and Celery process. The launcher's ``runserver`` is Daphne's (ASGI), and
    # wins over staticfiles' only from before it in this list.
    "motorsite.launcher",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "catalog",
    "fleet",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# MOTOR_TLS: clients reach this site over HTTPS. Daphne serves plain HTTP, so TLS ends at a proxy
# in front, which must set X-Forwarded-Proto (and drop a client's own): cookies are then sent
# over HTTPS only and Django knows the request was secure (CSRF's origin check, redirects).
MOTOR_TLS = env_bool("MOTOR_TLS", False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = MOTOR_TLS
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if MOTOR_TLS else None
# HSTS pins browsers to HTTPS for this long; opt in once HTTPS works (0: no header).
SECURE_HSTS_SECONDS = env_int("MOTOR_HSTS_SECONDS", 0) if MOTOR_TLS else 0
if SECURE_HSTS_SECONDS < 0:
    raise ImproperlyConfigured("MOTOR_HSTS_SECONDS must not be negative")

ROOT_URLCONF = "motorsite.urls"
ASGI_APPLICATION = "motorsite.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# SQLite only: how long a write waits for another connection's write transaction before it fails
# with "database is locked" (a 500). Writes here last milliseconds; only a stuck writer (a
# migration, a sqlite3 shell in a transaction) should ever reach this.
MOTOR_SQLITE_TIMEOUT_S = env_int("MOTOR_SQLITE_TIMEOUT_MS", 10000) / 1000
DATABASES = {
    "default": database_from_url(
        check_database_password(env_str("DATABASE_URL", f"sqlite:///{BASE_DIR / 'var' / 'db.sqlite3'}")),
        sqlite_timeout_s=MOTOR_SQLITE_TIMEOUT_S,
    )
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_str("REDIS_URL")
if REDIS_URL:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}}
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}}
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "var" / "static"
MOTOR_SERVE_STATIC = env_bool("MOTOR_SERVE_STATIC", True)
# Long prompts and token-id prompts are big JSON bodies; Django's 2.5 MB default is too small.
# Every /v1 body over it is refused with 413 before it is read (motorsite/front_door.py).
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("MOTOR_MAX_BODY_BYTES", 32 * 1024 * 1024)
# Every other route (admin, /api, the metaserver callback, the rest of Django) takes small
# bodies: a form, an instance record, a callback's transfer parameters. Over this: 413 before the
# body is read (motorsite/front_door.py), and the admin's login page is reachable without a key.
MOTOR_CONTROL_MAX_BODY_BYTES = env_int("MOTOR_CONTROL_MAX_BODY_BYTES", 1024 * 1024)
# From the moment the server waits for a request (connection open, or the previous response
# sent) until the request's headers are complete: a client that trickles its headers (slowloris)
# or holds an idle connection is cut then, under Daphne and uvicorn alike. Far above what a
# client on a slow link needs for a few KiB of headers. A load balancer that keeps idle
# connections to this process open longer would see them closed: set it above the balancer's
# idle timeout there (docs/deploying.md, "In front of the coordinator").
MOTOR_HEADER_TIMEOUT_S = env_int("MOTOR_HEADER_TIMEOUT_MS", 20000) / 1000
if MOTOR_HEADER_TIMEOUT_S <= 0 or MOTOR_CONTROL_MAX_BODY_BYTES < 0 or DATA_UPLOAD_MAX_MEMORY_SIZE < 0:
    raise ImproperlyConfigured(
        "MOTOR_HEADER_TIMEOUT_MS must be positive; MOTOR_MAX_BODY_BYTES and MOTOR_CONTROL_MAX_BODY_BYTES not negative"
    )
# Deepest nesting of a /v1 body (400 past it): well inside what every encoder downstream
# (httpx, the standard library, pydantic) handles; chat bodies with tools and JSON schemas nest
# a few dozen levels at most.
MOTOR_MAX_JSON_DEPTH = env_int("MOTOR_MAX_JSON_DEPTH", 64)

# Client keys for /v1 (serving/edge/keys.py): the ApiKey records of the control plane; until
# the first client record exists, these plain keys. With no key at all /v1 answers 401: it is
# open to anyone only with MOTOR_OPEN_ACCESS=true, never by accident.
MOTOR_API_KEYS = [
    check_api_key(k, name="MOTOR_API_KEYS" if env_str("MOTOR_API_KEYS") else "MOTOR_DEMO_API_KEY")
    for k in env_str("MOTOR_API_KEYS", env_str("MOTOR_DEMO_API_KEY")).split(",")
    if k
]
# Read by demo_fleet and runstack (not settings), checked here so that no process starts with a
# weak one: the admin key opens /api, the password the admin.
if env_str("MOTOR_DEMO_ADMIN_KEY"):
    check_api_key(env_str("MOTOR_DEMO_ADMIN_KEY"), name="MOTOR_DEMO_ADMIN_KEY")
if env_str("MOTOR_DEMO_ADMIN_PASSWORD"):
    check_api_key(
        env_str("MOTOR_DEMO_ADMIN_PASSWORD"), name="MOTOR_DEMO_ADMIN_PASSWORD",
        min_length=PASSWORD_MIN_LENGTH, min_unique=PASSWORD_MIN_UNIQUE, generate=GENERATE_PASSWORD,
    )
MOTOR_OPEN_ACCESS = env_bool("MOTOR_OPEN_ACCESS", False)

# Bounds of the data plane, each a named knob (the pipeline never invents its own timeouts).
MOTOR_CONNECT_TIMEOUT_S = env_int("MOTOR_CONNECT_TIMEOUT_MS", 2000) / 1000  # TCP connect to render/engines
MOTOR_ENGINE_READ_TIMEOUT_S = env_int("MOTOR_ENGINE_READ_TIMEOUT_MS", 60000) / 1000  # per chunk / non-stream reply
# A non-streaming reply may take this much longer per token of its max_tokens (a long generation
# on a slow engine is not a failure); 100 ms is a slow CPU engine's time per output token.
MOTOR_ENGINE_REPLY_S_PER_TOKEN = env_int("MOTOR_ENGINE_REPLY_MS_PER_TOKEN", 100) / 1000
# Streaming: an engine silent this long mid-stream has stalled (relay or error frame); relays per
# request after a mid-stream engine failure; retries of one derender chunk on connection errors / 5xx.
MOTOR_STREAM_CHUNK_TIMEOUT_S = env_int("MOTOR_STREAM_CHUNK_TIMEOUT_MS", 30000) / 1000
MOTOR_STREAM_MAX_RELAYS = env_int("MOTOR_STREAM_MAX_RELAYS", 2)
# A streaming client that reads nothing for this long is cut (engines aborted, its admission
# lease released): until then its stream holds its lease and one server write buffer. 60 s is
# longer than any pause a live client on a slow or briefly interrupted network takes.
MOTOR_CLIENT_STALL_S = env_int("MOTOR_CLIENT_STALL_S", 60)
if MOTOR_CLIENT_STALL_S < 1:
    raise ImproperlyConfigured("MOTOR_CLIENT_STALL_S must be at least 1 (seconds)")
# Per request: choices (n x prompts; each is an engine sequence and a derender stream) and
# completion prompts (vLLM's VLLM_MAX_COMPLETION_PROMPTS default). Past either: 400.
MOTOR_MAX_CHOICES = env_int("MOTOR_MAX_CHOICES", 128)
MOTOR_MAX_PROMPTS = env_int("MOTOR_MAX_PROMPTS", 1024)
if MOTOR_MAX_CHOICES < 1 or MOTOR_MAX_PROMPTS < 1:
    raise ImproperlyConfigured("MOTOR_MAX_CHOICES and MOTOR_MAX_PROMPTS must be at least 1")
# Trigger's metaserver reads these from the environment itself (it is Django-free); they are
# checked here so that a typo stops the start instead of failing the first Trigger request.
# BASE_URL goes into callback URLs (this process, or a load balancer in front of the replicas);
# OWNER_URL is this process's own address, where another replica forwards our callbacks.
for _name in ("MOTOR_METASERVER_BASE_URL", "MOTOR_METASERVER_OWNER_URL"):
    _url = env_str(_name)
    if _url and (urlparse(_url).scheme not in ("http", "https") or not urlparse(_url).netloc):
        raise ImproperlyConfigured(f"{_name} must be an http(s) URL such as http://10.0.0.5:8000, got {_url!r}")
# Signs Trigger's callback routes (serving.pipeline.topologies.metaserver reads it itself); the
# default is derived from SECRET_KEY, checked above.
if env_str("MOTOR_METASERVER_KEY"):
    check_secret_key(env_str("MOTOR_METASERVER_KEY"), name="MOTOR_METASERVER_KEY")
# The name this coordinator process goes by in motor_coordinator_info (and its traces): the pod name
# in the k8s manifests, the service in compose; Prometheus joins it onto every metric of the process.
MOTOR_REPLICA = env_str("MOTOR_REPLICA") or socket.gethostname()
# OpenTelemetry traces of each request's phases, exported over OTLP/HTTP as the standard OTEL_*
# variables say (serving/pipeline/tracing.py). Off: OpenTelemetry is not even imported.
MOTOR_TRACING = env_bool("MOTOR_TRACING", False)
# Same-chunk retries of a streaming derender after a connection error or a 5xx, inside the
# chunk's one bound (the render config's timeout_ms). 0: the RFC's "no automatic derender retry".
MOTOR_DERENDER_CHUNK_RETRIES = env_int("MOTOR_DERENDER_CHUNK_RETRIES", 0)
if "MOTOR_DERENDER_PATIENCE_MS" in os.environ:  # removed: a chunk has one bound now (docs/render-faults.md)
    raise ImproperlyConfigured(
        "MOTOR_DERENDER_PATIENCE_MS is gone: a derender chunk is bounded by the render config's timeout_ms, "
        "retries included (MOTOR_DERENDER_CHUNK_RETRIES); unset it"
    )
# Each process reads fleet.ControlVersion at most this often and rebuilds its snapshot when it
# changed: how long an admin/API edit takes to reach live traffic (one tiny query per interval).
MOTOR_SNAPSHOT_POLL_S = env_int("MOTOR_SNAPSHOT_POLL_MS", 250) / 1000
# Full rebuild even without a version bump, for rows written behind the services' back.
MOTOR_SNAPSHOT_TTL_S = env_int("MOTOR_SNAPSHOT_TTL_MS", 60000) / 1000
# Keep-alive connections a coordinator process keeps open to each render sidecar and engine.
MOTOR_UPSTREAM_IDLE_CONNECTIONS = env_int("MOTOR_UPSTREAM_IDLE_CONNECTIONS", 64)
# The largest reply the upstream client reads whole (render, derender, a non-streaming generate,
# an error body); past it the upstream is treated as broken (serving/pipeline/http11.py says why 64 MiB).
MOTOR_UPSTREAM_MAX_REPLY_BYTES = env_int("MOTOR_UPSTREAM_MAX_REPLY_BYTES", 64 * 1024 * 1024)
if MOTOR_UPSTREAM_MAX_REPLY_BYTES < 64 * 1024:  # under a render reply of an ordinary prompt: a typo
    raise ImproperlyConfigured(f"MOTOR_UPSTREAM_MAX_REPLY_BYTES must be at least 65536, got {MOTOR_UPSTREAM_MAX_REPLY_BYTES}")

# Celery: Redis when REDIS_URL is set; otherwise kombu's filesystem transport in
# MOTOR_CELERY_DIR, so worker and beat work across processes with nothing installed.
MOTOR_CELERY_DIR = Path(env_str("MOTOR_CELERY_DIR", str(BASE_DIR / "var" / "celery")))
CELERY_BROKER_URL = REDIS_URL or "filesystem://"
CELERY_TASK_IGNORE_RESULT = True  # tasks write their outcome to the database
# Probes (fleet.probes): one real request each, bounded by this timeout; a verdict flips after
# RISE successes or FALL failures in a row, so one slow answer never flaps an instance.
MOTOR_PROBE_TIMEOUT_S = env_int("MOTOR_PROBE_TIMEOUT_MS", 10000) / 1000
# Cadence of health probes (beat reads the same variable in fleet.tasks, before Django is set up).
MOTOR_PROBE_INTERVAL_S = env_int("MOTOR_PROBE_INTERVAL_MS", 15000) / 1000
MOTOR_PROBE_RISE = env_int("MOTOR_PROBE_RISE", 2)
MOTOR_PROBE_FALL = env_int("MOTOR_PROBE_FALL", 3)
MOTOR_PROBE_RETENTION_DAYS = env_int("MOTOR_PROBE_RETENTION_DAYS", 7)
MOTOR_QUARANTINE_ON_DRIFT = env_bool("MOTOR_QUARANTINE_ON_DRIFT", True)

# Where a render config's `file:` obfuscation key references may point (catalog/key_refs.py): a
# reference elsewhere is refused, so the admin cannot be made to read (and hash) any file.
MOTOR_OBFUSCATION_KEY_DIR = Path(env_str("MOTOR_OBFUSCATION_KEY_DIR", str(MOTOR_VAR_DIR / "obfuscation-keys")))
# make run's children (motorsite/supervisor.py) write var/log/<name>.log; each is rotated once it
# passes MOTOR_LOG_MAX_BYTES, keeping MOTOR_LOG_BACKUPS older files, so a chatty engine cannot
# fill the disk that holds the database and the Celery broker.
MOTOR_LOG_MAX_BYTES = env_int("MOTOR_LOG_MAX_BYTES", 32 * 1024 * 1024)
MOTOR_LOG_BACKUPS = env_int("MOTOR_LOG_BACKUPS", 3)
if MOTOR_LOG_MAX_BYTES < 0 or MOTOR_LOG_BACKUPS < 0:
    raise ImproperlyConfigured("MOTOR_LOG_MAX_BYTES and MOTOR_LOG_BACKUPS must not be negative")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {"httpx": {"level": "WARNING"}, "django.channels.server": {"level": "WARNING"}},
}
