#!/bin/sh
# Build motorsite's images on a host that reaches no image registry, and bring docker/compose.yaml
# up with the coordinator on 127.0.0.1:PORT (docs/deploying.md, "Compose on this machine").
#
#   docker/up.sh [PORT]        # build what is missing or changed, start, wait until healthy
#   docker/up.sh --build       # only build the images
#   docker/up.sh --down        # stop and remove the containers (volumes kept)
#
# Not part of make test: the first build downloads the vLLM locks' packages (minutes).
# Steps: (1) a Docker daemon (Debian's docker.io, started with this machine's nofile hard limit
# when we are root); (2) a Debian bookworm base image made with debootstrap, cached; (3) the
# coordinator, render, engine, PostgreSQL and Redis images FROM it, with the machine's CA bundle
# and the on-disk CPU torch wheel staged in docker/.build/; (4) the tiny model built by
# toolchain, and the second (model-b); (5) generated secrets kept in the cache (PostgreSQL's volume keeps its password);
# (6) docker-compose up, then wait for every service's healthcheck.
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MOTOR_CACHE_DIR:-$HOME/.cache/motorsite}/docker
BASE=motorsite-base:bookworm
TORCH_WHEEL=${MOTOR_TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}
CA_BUNDLE=${MOTOR_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
PROJECT=${MOTOR_COMPOSE_PROJECT:-motorsite}
NICE="nice -n 10"
mkdir -p "$CACHE"

log() { printf '%s up.sh: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "$*"; exit 1; }

ensure_daemon() {
    docker info >/dev/null 2>&1 && return
    if [ "$(id -u)" != 0 ]; then
        die "no Docker daemon. As root: apt-get install docker.io docker-compose debootstrap; dockerd --default-ulimit nofile=$(ulimit -Hn):$(ulimit -Hn) &"
    fi
    if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || ! command -v debootstrap >/dev/null; then
        log "installing docker.io docker-compose debootstrap from Debian"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io docker-compose debootstrap >/dev/null
    fi
    # The default nofile limit dockerd gives containers exceeds this machine's hard limit, and
    # every container then fails to start: give them the hard limit itself.
    limit=$(ulimit -Hn)
    log "starting dockerd --default-ulimit nofile=$limit:$limit (log: $CACHE/dockerd.log)"
    nohup dockerd --default-ulimit "nofile=$limit:$limit" >"$CACHE/dockerd.log" 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
    die "dockerd did not start: $CACHE/dockerd.log"
}

ensure_base() {
    docker image inspect "$BASE" >/dev/null 2>&1 && return
    command -v debootstrap >/dev/null || die "debootstrap is missing: apt-get install debootstrap"
    rootfs="$CACHE/rootfs-bookworm"
    if [ ! -x "$rootfs/usr/bin/python3" ]; then
        log "debootstrap --variant=minbase bookworm (Python 3.11, as the project's environments)"
        rm -rf "$rootfs"
        $NICE debootstrap --variant=minbase \
            --include=python3,python3-venv,ca-certificates,libnuma1,libgomp1,procps \
            bookworm "$rootfs" http://deb.debian.org/debian >"$CACHE/debootstrap.log"
    fi
    log "importing $rootfs as $BASE"
    tar -C "$rootfs" --exclude=./proc --exclude=./sys --exclude=./dev -c . | docker import - "$BASE" >/dev/null
}

stage_context() {
    # What the Dockerfiles COPY from outside the repository: the machine's CA bundle (package
    # registries are reached through it) and, for the vLLM images only, the CPU torch wheel
    # (never the CUDA build). The context is the repository for every image (the legacy builder
    # has one .dockerignore), so the wheel is there only while the vLLM images build: the
    # coordinator's `COPY . .` never carries it.
    [ -f "$TORCH_WHEEL" ] || die "no CPU torch wheel at $TORCH_WHEEL (set MOTOR_TORCH_WHEEL)"
    rm -rf "$ROOT/docker/.build/wheels"
    mkdir -p "$ROOT/docker/.build/wheels"
    cp "$CA_BUNDLE" "$ROOT/docker/.build/ca-certificates.crt"
}

stage_wheel() {
    dest="$ROOT/docker/.build/wheels/$(basename "$TORCH_WHEEL")"
    ln "$TORCH_WHEEL" "$dest" 2>/dev/null || cp "$TORCH_WHEEL" "$dest"
}

build() {  # build TAG DOCKERFILE [ARG=VALUE ...]: layers cached, so an unchanged image takes seconds
    tag=$1 file=$2; shift 2
    args=""; for a in "$@"; do args="$args --build-arg $a"; done
    start=$(date +%s)
    log "building $tag ($file)"
    # shellcheck disable=SC2086
    DOCKER_BUILDKIT=0 $NICE docker build -q -t "$tag" -f "$ROOT/docker/$file" --build-arg "BASE=$BASE" $args "$ROOT" >/dev/null
    log "built $tag in $(( $(date +%s) - start ))s"
}

build_images() {
    ensure_base
    stage_context
    build motorsite-postgres:15 Dockerfile.postgres
    build motorsite-redis:7 Dockerfile.redis
    build motorsite-coordinator:latest Dockerfile.coordinator
    stage_wheel
    build motorsite-render:0.33.0 Dockerfile.vllm LOCK=render.lock
    build motorsite-engine:0.32.0 Dockerfile.vllm LOCK=engine.lock
    rm -f "$ROOT/docker/.build/wheels/"*
    docker image prune -f >/dev/null  # the dangling layers a rebuild leaves
}

compose_env() {
    # Generated once (the PostgreSQL volume keeps its first password), never in the repository.
    envfile="$CACHE/compose.env"
    if [ ! -f "$envfile" ]; then
        umask 077
        python3 - >"$envfile" <<'EOF'
import secrets
print("SECRET_KEY=" + secrets.token_urlsafe(50))
print("MOTOR_DEMO_API_KEY=sk-" + secrets.token_urlsafe(32))
print("POSTGRES_PASSWORD=" + secrets.token_urlsafe(16))
EOF
    fi
    set -a; . "$envfile"; set +a
    # Both models, built offline by the toolchain: tiny and tiny-b (another vocabulary and template).
    MOTOR_MODEL_DIR=$(cd "$ROOT" && python3 -m toolchain ensure model >/dev/null && python3 -m toolchain path model)
    MOTOR_MODEL_B_DIR=$(cd "$ROOT" && python3 -m toolchain ensure model-b >/dev/null && python3 -m toolchain path model-b)
    MOTOR_POSTGRES_IMAGE=motorsite-postgres:15 MOTOR_REDIS_IMAGE=motorsite-redis:7
    export MOTOR_MODEL_DIR MOTOR_MODEL_B_DIR MOTOR_POSTGRES_IMAGE MOTOR_REDIS_IMAGE
}

compose() { docker-compose -p "$PROJECT" -f "$ROOT/docker/compose.yaml" "$@"; }

share_cpu() {
    # cgroup v1: all containers share Docker's one cpu group, weighted 1024 like a single host
    # process; on a busy host they crawl (each vLLM container got ~1.5% of a core here, and did
    # not start in 8 min). Weigh the group as the same processes run by make run would weigh.
    shares=${MOTOR_DOCKER_CPU_SHARES_FILE:-/sys/fs/cgroup/cpu/docker/cpu.shares}
    [ -w "$shares" ] || return 0
    n=$(compose ps -q | wc -l)
    [ "$n" -gt 0 ] && [ "$(cat "$shares")" != $(( 1024 * n )) ] || return 0
    echo $(( 1024 * n )) >"$shares" && log "Docker's cpu group weighs $(( 1024 * n )) ($n containers)"
    return 0
}

compose_up() {
    # `up -d` returns only once the coordinator's dependencies are healthy (the sidecars' real
    # renders), and on a busy host they are not until the group is weighed: weigh it as
    # containers are created, not after.
    compose up -d &
    up=$!
    while kill -0 "$up" 2>/dev/null; do share_cpu; sleep 3; done
    wait "$up"
    share_cpu
}

wait_healthy() {
    deadline=$(( $(date +%s) + ${MOTOR_UP_TIMEOUT:-1200} ))
    while :; do
        pending=""
        for id in $(compose ps -q); do
            state=$(docker inspect -f '{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}-{{end}} {{.State.ExitCode}}' "$id")
            set -- $state
            case "$2/$3" in
                running/healthy|exited/-) [ "$2" = exited ] && [ "$4" != 0 ] && die "$1 exited $4: docker logs $1" ;;
                *) pending="$pending ${1#/}($2/$3)" ;;
            esac
        done
        [ -z "$pending" ] && return
        [ "$(date +%s)" -gt "$deadline" ] && die "not healthy in time:$pending"
        sleep 10
    done
}

case "${1:-}" in
    --down) ensure_daemon; compose_env; compose down; exit ;;
    --build) ensure_daemon; build_images; exit ;;
esac
MOTOR_PORT=${1:-${MOTOR_PORT:-8000}}
export MOTOR_PORT
ensure_daemon
build_images
compose_env
start=$(date +%s)
log "docker-compose up (coordinator on 127.0.0.1:$MOTOR_PORT)"
compose_up
wait_healthy
log "all services healthy in $(( $(date +%s) - start ))s: http://127.0.0.1:$MOTOR_PORT/v1 (key: MOTOR_DEMO_API_KEY in $CACHE/compose.env)"
