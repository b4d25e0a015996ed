"""Create (or bring up to date) the demo fleet that ``make run`` serves."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.db.models import Q

from catalog.fingerprints import config_vocab_size
from catalog.models import RenderConfig, RenderSidecar, ServedModel
from catalog.services import revision_record
from fleet.models import ApiKey, EngineInstance
from fleet.services import api_key_ensure, instance_create, instance_delete, instance_update
from motorsite import tiers
from motorsite.core import bump_control_version

ACTOR = "demo_fleet"  # who the instances' history names for what this command changed


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(text)  # argparse: "invalid _address value"
    return host, int(port)


def render_socket_host(socket_dir: str, port: int) -> str:
    """The address of the sidecar ``make run`` starts for ``port`` on a unix socket in ``socket_dir``."""
    return f"unix:{tiers.render_socket_path(socket_dir, port)}"


class Command(BaseCommand):
    help = "Create the demo served model, render config, engine instances and admin login."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--model-dir", required=True)
        parser.add_argument("--served-model-name", default="tiny")
        parser.add_argument("--max-model-len", type=int, default=2048)
        parser.add_argument("--render-host", default="127.0.0.1")
        parser.add_argument("--render-port", type=int, default=8100)
        parser.add_argument(
            "--render-member-port", action="append", type=int, default=[],
            help="another sidecar of the render pool on --render-host, repeatable",
        )
        parser.add_argument(
            "--render-socket-dir", default=None, metavar="DIR",
            help="the sidecars on --render-port and --render-member-port listen on unix sockets in DIR "
            "(render-PORT.sock, vllm launch render --uds), not on --render-host",
        )
        # Sidecars in containers or pods of their own (compose, deploy/k8s): one address each, so
        # the pool sees every member (never one load-balanced name for several sidecars).
        parser.add_argument(
            "--render-member", action="append", type=_address, default=[], metavar="HOST:PORT",
            help="another sidecar of the render pool at its own address, repeatable",
        )
        parser.add_argument("--engine", action="append", default=[], help="engine base URL, repeatable")
        parser.add_argument("--engine-kind", choices=["vllm", "sim"], default="vllm")
        # The parsers the render sidecar runs (its --reasoning-parser / --tool-call-parser): the
        # model's revision records them, and the local fallback reads them from there.
        parser.add_argument("--reasoning-parser", default="")
        parser.add_argument("--tool-parser", default="")
        # P/D instances: NixlConnector over loopback (pull, Handoff); tokens-only, no native API.
        parser.add_argument("--prefill", action="append", default=[], help="prefill engine base URL, repeatable")
        parser.add_argument("--decode", action="append", default=[], help="decode engine base URL, repeatable")
        parser.add_argument(
            "--pd-native", action="store_true",
            help="the P/D engines run with --enable-scale-out: a tokenizer and their own OpenAI API (native P/D path)",
        )
        # The admin's password is MOTOR_DEMO_ADMIN_PASSWORD, never an argument: argv is public (ps).
        parser.add_argument("--admin-user", default="admin")
        # Defaults come from the environment ``motorsite.stack`` gives this command, so ``make run``
        # and the integration tests create the key records without new arguments.
        parser.add_argument(
            "--client-key", action="append", default=None,
            help="client key for /v1 (repeatable; default: MOTOR_API_KEYS)",
        )
        parser.add_argument("--admin-key", default=None, help="admin key for /api (default: MOTOR_DEMO_ADMIN_KEY)")
        parser.add_argument(
            "--lora", action="append", default=[], metavar="NAME=DIR",
            help="a LoRA adapter the engines load (--lora-modules NAME=DIR), served as a model of its own on the "
            "engines that hold it (repeatable)",
        )
        parser.add_argument(
            "--only-this-model", action="store_true",
            help="add or update this model beside the others (its own render config, engines named after it); "
            "without it the fleet is exactly this model's and every other model with no engine left is retired",
        )
        parser.add_argument(
            "--migrate", action="store_true",
            help="apply the migrations first, in this process (one Django boot instead of two: make run does)",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["migrate"]:
            # Before the fleet's transaction: migrate manages its own (and SQLite's DDL with them).
            call_command("migrate", interactive=False, verbosity=0)
        self._write(**opts)

    @transaction.atomic
    def _write(self, **opts: Any) -> None:
        only = opts["only_this_model"]
        model, _ = ServedModel.objects.update_or_create(
            name=opts["served_model_name"],
            defaults={"model_path": opts["model_dir"], "max_model_len": opts["max_model_len"],
                      # The data plane's out-of-vocabulary bound; the version probe keeps it current.
                      "vocab_size": config_vocab_size(opts["model_dir"]),
                      "state": ServedModel.State.ACTIVE},
        )
        # The version probe compares engines against this record; unchanged files add no row.
        revision_record(served_model=model, model_dir=opts["model_dir"], actor=ACTOR,
                        reasoning_parser=opts["reasoning_parser"], tool_parser=opts["tool_parser"])
        # One render config per model: the first model's is "default", another's is named after it.
        config_name = model.name if only else "default"
        RenderConfig.objects.filter(served_model=model).exclude(name=config_name).update(served_model=None)
        host, ports, sockets = opts["render_host"], [opts["render_port"], *opts["render_member_port"]], opts["render_socket_dir"]
        # On unix sockets, each started sidecar's address is its socket (port 0: it has none).
        started = [(render_socket_host(sockets, p), 0) for p in ports] if sockets else [(host, p) for p in ports]
        members = [*started, *opts["render_member"]]
        # Where an earlier run's sidecars were, if on sockets: the config's own address was its first.
        earlier = RenderConfig.objects.filter(name=config_name).values_list("host", flat=True).first() or ""
        config, _ = RenderConfig.objects.update_or_create(
            name=config_name,
            # The config's own address is its first sidecar's; a unix socket's config ignores ``port``,
            # which stays the launcher's name for the sidecar it restarts (render_restarter).
            defaults={"host": started[0][0], "port": opts["render_port"], "enable": True, "pool_size": len(members),
                      "served_model": model},
        )
        # The pool is exactly the sidecars this run started (a member left from another run would
        # be a port or a socket nobody listens on); members on hosts this run does not name are the
        # operator's and stay.
        for member_host in {h for h, _ in members}:
            config.sidecars.filter(host=member_host).exclude(port__in=[p for h, p in members if h == member_host]).delete()
        if sockets:
            # This launcher's own sidecars of an earlier run: on --render-host, or sockets in its directory.
            ours = Q(host=host) | Q(host__startswith=f"unix:{Path(sockets).resolve()}/")
            config.sidecars.filter(ours).exclude(host__in=[h for h, _ in started]).delete()
        elif earlier.startswith("unix:/"):
            # Back on TCP after a run on sockets: that run's sockets, beside its first one, are gone.
            config.sidecars.filter(host__startswith=earlier.rsplit("/", 1)[0] + "/").delete()
        for member_host, port in members:
            RenderSidecar.objects.get_or_create(render_config=config, host=member_host, port=port)
        Role = EngineInstance.Role
        fleet = [(Role.UNION, url) for url in opts["engine"]]
        fleet += [(Role.PREFILL, url) for url in opts["prefill"]] + [(Role.DECODE, url) for url in opts["decode"]]
        counts: dict[str, int] = {}
        wanted: dict[str, dict[str, Any]] = {}
        for role, url in fleet:
            counts[role] = counts.get(role, 0) + 1
            union = role == Role.UNION
            wanted[f"{model.name}-{role}-{counts[role]}" if only else f"{role}-{counts[role]}"] = {
                "url": url,
                "role": role,
                "served_model_id": model.id,
                "kind": opts["engine_kind"],
                "cap_token_generate": True,
                # The demo's real union engines run with --enable-scale-out: tokenizer and native
                # API; its P/D engines are tokens-only unless started scale-out (--pd-native).
                "cap_native_openai": opts["engine_kind"] == "vllm" and (union or opts["pd_native"]),
                "cap_tokenizer": opts["engine_kind"] == "vllm" and (union or opts["pd_native"]),
                "kv_connector": "" if union else EngineInstance.KVConnector.NIXL,
                "kv_transfer": "" if union else EngineInstance.KVTransfer.PULL,
                "model_dir": opts["model_dir"],
            }
        # The demo fleet is exactly what this run started; stale rows from another run would
        # send traffic to ports nobody listens on (and are gone before the P/D rules look at
        # the fleet this run declares).
        rows = EngineInstance.objects.filter(served_model=model) if only else EngineInstance.objects.all()
        stale = list(rows.exclude(name__in=list(wanted)).values_list("id", flat=True))
        for instance_id in stale:
            instance_delete(instance_id=instance_id, actor=ACTOR)
        # Through the services and model methods, as an operator's edits: each change of an
        # existing row (its configuration, a state other than active left by an earlier run)
        # writes its history row, and the probes' columns are left alone.
        for name, fields in wanted.items():
            instance = EngineInstance.objects.filter(name=name).first()
            if instance is None:
                instance_create(actor=ACTOR, name=name, **fields)
                continue
            instance_update(instance_id=instance.id, actor=ACTOR, **fields)
            if instance.state != EngineInstance.State.ACTIVE:
                instance.activate(actor=ACTOR)
        removed = len(stale)
        adapters = [_adapter(model, spec) for spec in opts["lora"]]
        if only:
            bump_control_version()
            self.stdout.write(f"demo fleet: model {model.name} added, {len(wanted)} engine(s), removed {removed} stale row(s)")
            return
        # A model an earlier run served beside this one has no engine left: unknown to clients.
        # (Its adapters are this run's: an adapter of an earlier run no engine loads now is retired too.)
        ServedModel.objects.exclude(id__in=[model.id, *(a.id for a in adapters)]).filter(instances=None).update(
            state=ServedModel.State.RETIRED)
        admin_password = os.environ.get("MOTOR_DEMO_ADMIN_PASSWORD", "")
        if admin_password:
            User = get_user_model()
            user, _ = User.objects.get_or_create(username=opts["admin_user"])
            user.is_staff = user.is_superuser = True
            user.set_password(admin_password)
            user.save()
        client_keys = opts["client_key"]
        if client_keys is None:
            client_keys = [k for k in os.environ.get("MOTOR_API_KEYS", "").split(",") if k]
        admin_key = opts["admin_key"] if opts["admin_key"] is not None else os.environ.get("MOTOR_DEMO_ADMIN_KEY", "")
        current = [api_key_ensure(name=f"demo client {n}", scope="client", key=k) for n, k in enumerate(client_keys, 1)]
        if admin_key:
            current.append(api_key_ensure(name="demo admin", scope="admin", key=admin_key))
        # Demo keys printed by an earlier run stop working, as the old demo engines do.
        ApiKey.objects.filter(name__startswith="demo ").exclude(id__in=[k.id for k in current]).update(revoked=True)
        bump_control_version()
        self.stdout.write(f"demo fleet: model {model.name}, {len(wanted)} engine(s), removed {removed} stale row(s)"
                          + "".join(f", adapter {a.name}" for a in adapters))


def _adapter(base: ServedModel, spec: str) -> ServedModel:
    """The served model of the LoRA adapter ``NAME=DIR`` of ``base`` (made or brought up to date)."""
    name, sep, path = spec.partition("=")
    if not (sep and name and path):
        raise CommandError(f"--lora takes NAME=DIR, not {spec!r}")
    if ServedModel.objects.filter(name=name).exclude(base=base).exists():
        raise CommandError(f"{name!r} is a served model that is not an adapter of {base.name!r}")
    adapter, _ = ServedModel.objects.update_or_create(
        name=name,
        defaults={"model_path": path, "max_model_len": base.max_model_len, "base": base,
                  "vocab_size": base.vocab_size, "state": ServedModel.State.ACTIVE},
    )
    return adapter
