"""The launcher's graceful restart of the render sidecar it manages, driven by the render config.

``manage.py runstack`` runs ``RenderRestarter.tick`` every second in the supervisor's wait loop;
``with_render_config`` gives the first start the sidecar settings the render config holds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

from catalog import services
from catalog.models import RenderConfig
from motorsite import stack, tiers
from motorsite.core import current_render_config
from motorsite.supervisor import Interrupted, ProcessSpec, Supervisor, free_port
from serving import stream_reports

logger = logging.getLogger(__name__)

# The longest a replaced sidecar keeps running after coordinators were pointed away from it. A
# stream keeps the sidecar it began with for its whole life (its pipeline holds the snapshot),
# so its derender calls must still find that one: the old sidecar is retired as soon as no
# coordinator process reports a request on it, or at this cap, whichever comes first. Streams
# still running at the cap lose derender (an error frame, then [DONE]).
RENDER_DRAIN_S = float(os.environ.get("MOTOR_RENDER_DRAIN_S", "30"))
# How long after the switch a zero count is not yet believed: a coordinator adopts the new
# snapshot within MOTOR_SNAPSHOT_POLL_MS (250 ms) and writes a changed count within
# stream_reports.REPORT_DELAY_S (1 s), so a stream begun just before the switch is in the
# database by then.
RENDER_SETTLE_S = 3.0
# After a failed restart the running sidecar keeps serving; try again this much later.
RENDER_RETRY_S = 60.0


def live_requests_on(base_urls: tuple[str, ...]) -> int:
    """What the coordinator processes on this machine report on the sidecar at ``base_urls``."""
    return services.render_live_streams(base_urls=base_urls, host=stream_reports.HOST)


@dataclasses.dataclass
class Retiring:
    """A replaced sidecar waiting for its last request (or the cap) before it is stopped."""

    name: str  # the supervisor's name for it
    base_urls: tuple[str, ...]  # how coordinators addressed it (the counts are keyed by these)
    switched_at: float  # when coordinators were pointed away from it (the restarter's clock)
    config_id: int
    expected: dict[str, Any]  # the config the replacement was started for
    live: int | None = None  # the last count read, for logging changes only


class RenderRestarter:
    """Restarts the managed render sidecar gracefully when a published config needs it.

    Called every second from the supervisor's wait loop (``tick``). When the render config's
    ``restart_required`` is set: start a replacement first (on the config's port if the operator
    moved it, else on a free port, since the old one still holds the current port), point the
    config at it (bumping the control version, so coordinators switch within a poll interval),
    keep the old one while requests that began on it still run, then stop it and clear the flag
    if the config is still what the replacement was started for. The sidecar keeps no state per
    stream, so what uses it is what the coordinator processes report (``live_requests``, from
    ``serving.stream_reports``): the old one is stopped once that is zero (read no earlier than
    ``settle_s`` after the switch) or at ``drain_s``, the cap. Requests that find no sidecar in
    between (the operator's new port before the replacement is up) fall back to the local
    tokenizer as on any render outage.

    A pool (``MOTOR_RENDER_POOL_SIZE``: the other members this launcher started) is replaced one
    sidecar at a time: after the first one's drain, each other member gets a replacement on a
    free port, its member row moves to it (``render_member_moved``), and it drains in turn, the
    rest of the pool serving meanwhile; ``restart_required`` is cleared after the last one.

    One restarter per render config the launcher manages: the default one (``model`` None) and
    one for each extra model's own config (``model``: its name), so every model's sidecar gets
    the same graceful restart.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        cfg: stack.StackConfig,
        *,
        drain_s: float = RENDER_DRAIN_S,
        settle_s: float = RENDER_SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
        spec_for: Callable[[stack.StackConfig], ProcessSpec] = stack.render_spec,
        live_requests: Callable[[tuple[str, ...]], int] = live_requests_on,
        model: str | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.cfg = cfg
        self.drain_s = drain_s
        self.settle_s = settle_s
        self.clock = clock
        self.spec_for = spec_for
        self.live_requests = live_requests
        # None: the default render config (the first model's); else the served model whose own
        # render config and sidecar (``stack.extra_model_specs``: "render-NAME") this one looks after.
        self.model = model
        self.prefix = "render" if model is None else f"render-{model}"
        self.current = self.prefix  # the supervisor's name for the sidecar coordinators use
        self.port = cfg.render_port
        # The other sidecars of the pool this launcher started (supervisor name -> port), replaced
        # one at a time after the first, each once the previous one's drain is over.
        self.members = {f"render-member-{i}": p for i, p in enumerate(cfg.render_member_ports, start=2)}
        self.pending: list[str] = []  # members still owed the restart in progress
        self.generation = 1
        self.retiring: Retiring | None = None
        self.retry_at = 0.0

    def tick(self) -> None:
        try:
            self._tick()
        except Interrupted:
            raise  # the supervisor stops everything
        except Exception:
            # Never take the stack down over a restart: the running sidecar keeps serving.
            logger.exception("render sidecar restart failed; retrying in %.0fs", RENDER_RETRY_S)
            self.retry_at = self.clock() + RENDER_RETRY_S

    def _tick(self) -> None:
        if self.retiring is not None:
            self._drain(self.retiring)
            return
        if self.clock() < self.retry_at:
            return
        if self.pending:
            self._replace_member(self.pending[0])
            return
        # The same row the coordinators' snapshot uses (serving.snapshots.build_snapshot).
        config = self._config()
        if config is None or not config.restart_required:
            return
        if not self._manages(config.host):
            logger.warning("render config points at %s, not a sidecar this launcher manages; not restarting", config.host)
            self.retry_at = self.clock() + RENDER_RETRY_S
            return
        expected = {k: getattr(config, k) for k in RenderConfig.RESTART_KEYS}
        port = config.port if config.port != self.port else free_port()
        self.generation += 1
        name = f"{self.prefix}-{self.generation}"
        spec = dataclasses.replace(
            self.spec_for(dataclasses.replace(self.cfg, render_port=port, render_workers=config.renderer_num_workers)),
            name=name,
        )
        logger.info("render config %s needs a restart: starting %s on port %d", config.name, name, port)
        self.supervisor.add(spec)  # blocks until ready; the old sidecar serves meanwhile
        if port != config.port:
            # On a unix socket the replacement's address is its own socket (render-PORT.sock).
            host = self._host(port) if self.cfg.render_socket_dir is not None else None
            if not services.render_sidecar_moved(config_id=config.pk, expected=expected, port=port, host=host,
                                                 actor="launcher"):
                self.supervisor.retire(name)  # changed again while starting: begin anew next tick
                return
            expected["port"] = port
            expected["host"] = host or expected["host"]
        self.retiring = Retiring(self.current, self._urls(self.port), self.clock(), config.pk, expected)
        self.current, self.port = name, port
        self.pending = list(self.members)

    def _replace_member(self, old_name: str) -> None:
        """Replace one more sidecar of the pool for the restart in progress (the first is done)."""
        config = self._config()
        if config is None or not config.restart_required:
            self.pending = []
            return
        expected = {k: getattr(config, k) for k in RenderConfig.RESTART_KEYS}
        old_port, port = self.members[old_name], free_port()
        self.generation += 1
        name = f"{self.prefix}-{self.generation}"
        spec = dataclasses.replace(
            self.spec_for(dataclasses.replace(self.cfg, render_port=port, render_workers=config.renderer_num_workers)),
            name=name,
        )
        logger.info("render pool: replacing %s (port %d) with %s on port %d", old_name, old_port, name, port)
        self.supervisor.add(spec)
        if not services.render_member_moved(config_id=config.pk, expected=expected, host=self._host(old_port),
                                            old_port=old_port, port=port, new_host=self._host(port), actor="launcher"):
            self.supervisor.retire(name)  # changed again while starting: the first sidecar starts anew
            self.pending = []
            return
        self.pending.pop(0)
        del self.members[old_name]
        self.members[name] = port
        self.retiring = Retiring(old_name, self._urls(old_port), self.clock(), config.pk, expected)

    def _host(self, port: int) -> str:
        """The address of the sidecar this launcher starts for ``port``: 127.0.0.1 or its socket."""
        if self.cfg.render_socket_dir is None:
            return stack.HOST
        return f"unix:{tiers.render_socket_path(self.cfg.render_socket_dir, port)}"

    def _manages(self, host: str) -> bool:
        if self.cfg.render_socket_dir is None:
            return host in (stack.HOST, "localhost")
        return host.startswith(f"unix:{self.cfg.render_socket_dir.resolve()}/")

    def _urls(self, port: int) -> tuple[str, ...]:
        """How coordinators may address the sidecar this launcher started on ``port``: either host
        spelling, or its socket's one URL."""
        if self.cfg.render_socket_dir is not None:
            return (stack.render_base_url(self.cfg, port),)
        return tuple(f"http://{host}:{port}" for host in (stack.HOST, "localhost"))

    def _config(self) -> RenderConfig | None:
        if self.model is None:
            return current_render_config()
        return RenderConfig.objects.filter(served_model__name=self.model).order_by("id").first()

    def _drain(self, r: Retiring) -> None:
        """Stop the old sidecar once nothing uses it or the cap is reached; else wait."""
        elapsed = self.clock() - r.switched_at
        if elapsed < self.drain_s:
            if elapsed < self.settle_s:
                return  # a request begun just before the switch may not be reported yet
            try:
                live = self.live_requests(r.base_urls)
            except Exception:
                # Unknown is not zero: keep the old sidecar until the next read or the cap.
                logger.warning("render sidecar %s: live request count unavailable; keeping it", r.name, exc_info=True)
                return
            if live > 0:
                if live != r.live:
                    logger.info("render sidecar %s drains: %d request(s) still on it (cap in %.0fs)",
                                r.name, live, self.drain_s - elapsed)
                r.live = live
                return
            why = "no request uses it any more"
        else:
            why = f"the {self.drain_s:g}s drain cap was reached ({r.live or 0} request(s) were still on it)"
        logger.info("render sidecar %s retired after %.1fs: %s", r.name, elapsed, why)
        self.supervisor.retire(r.name)
        self.retiring = None
        if not self.pending:  # the whole pool serves the change: the restart is no longer owed
            services.render_sidecar_restarted(config_id=r.config_id, expected=r.expected, actor="launcher")


def with_render_config(cfg: stack.StackConfig) -> stack.StackConfig:
    """``cfg`` with the sidecar settings the render config holds (its thread pool today).

    The pool size is part of the config an operator edits, and changing it is one of the changes
    that restart the sidecar; the first start must use it too, not the launcher's default.
    """
    config = current_render_config()
    if config is None or config.renderer_num_workers == cfg.render_workers:
        return cfg
    return dataclasses.replace(cfg, render_workers=config.renderer_num_workers)
