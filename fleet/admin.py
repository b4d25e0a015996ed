"""The fleet in the Django admin (healthchecks ``hc/api/admin.py`` style).

Machine-owned fields are read-only; operator state and breakers change only through the
actions, which call ``fleet.services`` (compare-and-set, history rows, control version bump).
"""

from __future__ import annotations

import copy
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db import models
from django.db.models import QuerySet
from django.forms.models import construct_instance
from django.http import HttpRequest

from fleet import services
from fleet.engine_capabilities import instance_traffic
from fleet.models import (
    ApiKey,
    AuditReport,
    BreakerFlip,
    BreakerState,
    EngineInstance,
    InstanceEvent,
    ManagedProcess,
    ProbeResult,
    process_of,
)
from fleet.presenters import ObfuscationStatus, inflight_tokens
from motorsite.admin_forms import OperatorEditForm

MACHINE_OWNED = (
    "state", "health", "consecutive_successes", "consecutive_failures", "last_probe_at", "last_probe_ok",
    "last_probe_error", "reported_version", "reported_name", "reported_root", "reported_max_model_len",
    "reported_fingerprint", "version_drift", "drift_reason", "model_mismatch", "lora_adapters", "capabilities",
    "created",
)


def _actor(request: HttpRequest) -> str:
    return f"admin:{request.user.get_username()}"


class BreakerOpenFilter(admin.SimpleListFilter):
    title = "breaker"
    parameter_name = "breaker"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("open", "open or half-open"), ("closed", "closed")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() == "open":
            return queryset.filter(breaker__state__in=["open", "half_open"])
        if self.value() == "closed":
            return queryset.exclude(breaker__state__in=["open", "half_open"])
        return queryset


class ProbeFailingFilter(admin.SimpleListFilter):
    title = "probe"
    parameter_name = "probe"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("failing", "failing"), ("healthy", "healthy"), ("unknown", "not probed yet")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        return queryset.filter(health=self.value()) if self.value() else queryset


class VersionDriftFilter(admin.SimpleListFilter):
    title = "version drift"
    parameter_name = "drift"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "drifted"), ("no", "matches")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() in ("yes", "no"):
            return queryset.filter(version_drift=self.value() == "yes")
        return queryset


class ModelMismatchFilter(admin.SimpleListFilter):
    title = "model record"
    parameter_name = "model_record"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("mismatch", "differs from the engine")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() == "mismatch":
            return queryset.exclude(model_mismatch="")
        return queryset


class DrainingFilter(admin.SimpleListFilter):
    title = "draining"
    parameter_name = "draining"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "draining"), ("no", "not draining")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() == "yes":
            return queryset.filter(state=EngineInstance.State.DRAINING)
        if self.value() == "no":
            return queryset.exclude(state=EngineInstance.State.DRAINING)
        return queryset


def _plain_http_urls(db_field: models.Field[Any, Any], **kwargs: Any) -> forms.Field | None:
    """Form fields with URLs assumed http:// when typed without a scheme (engines speak plain HTTP;
    Django's default becomes https in 6.0 and warns until then)."""
    if isinstance(db_field, models.URLField):
        kwargs.setdefault("assume_scheme", "http")
    return db_field.formfield(**kwargs)


class EngineInstanceForm(OperatorEditForm):
    class Meta:
        model = EngineInstance
        fields = "__all__"
        # The admin builds a subclass of this form before it applies its own callback.
        formfield_callback = _plain_http_urls

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        model = data.get("served_model")
        if model is None or self.errors:
            return data
        declaration = services.PDDeclaration(
            id=self.instance.pk,
            name=data.get("name") or "",
            role=data.get("role") or "union",
            served_model_id=model.id,
            hardware_kind=data.get("hardware_kind") or "",
            kv_connector=data.get("kv_connector") or "",
            kv_transfer=data.get("kv_transfer") or "",
            tp=data.get("tp") or 1,
        )
        try:
            services.validate_pd(declaration)
            # The form's values on a copy: the instance itself changes only when the form saves.
            services.validate_ports(construct_instance(self, copy.copy(self.instance)))
        except services.InvalidError as exc:
            raise forms.ValidationError(str(exc)) from None
        return data


@admin.register(EngineInstance)
class EngineInstanceAdmin(admin.ModelAdmin):
    form = EngineInstanceForm
    formfield_overrides = {models.URLField: {"assume_scheme": "http"}}  # as the form's own callback
    list_display = (
        "name", "url", "role", "served_model", "state", "breaker_column", "health_column", "drift", "model_record",
        "inflight", "obfuscation", "process_column", "last_probe_at", "capabilities_column",
    )
    list_filter = (
        BreakerOpenFilter, ProbeFailingFilter, VersionDriftFilter, ModelMismatchFilter, DrainingFilter, "role", "state", "served_model",
    )
    list_select_related = ("served_model", "breaker", "process")
    search_fields = ("name", "url")
    readonly_fields = (*MACHINE_OWNED, "ascend_launch", "traffic")
    fieldsets = (
        (None, {"fields": ("name", "url", "role", "served_model", "kind", "state")}),
        ("Capacity", {"fields": ("weight", "token_capacity", "max_model_len")}),
        ("Capabilities", {"fields": ("cap_token_generate", "cap_native_openai", "cap_tokenizer", "traffic", "capabilities")}),
        ("Deployment (P/D)", {"fields": ("hardware_kind", "kv_connector", "kv_transfer", "kv_port", "kv_events_endpoint", "tp", "dp", "ep")}),
        ("vllm-ascend launch", {"fields": ("ascend_launch",)}),
        ("Model files", {"fields": ("model_dir", "obfuscation_key_id")}),
        ("Health probe", {"fields": ("health", "consecutive_successes", "consecutive_failures", "last_probe_at", "last_probe_ok", "last_probe_error")}),
        ("Version probe", {"fields": ("reported_version", "reported_name", "reported_root", "model_mismatch", "reported_max_model_len", "reported_fingerprint", "version_drift", "drift_reason")}),
        ("LoRA probe", {"fields": ("lora_adapters",)}),
    )
    actions = ("drain", "undrain", "quarantine", "disable", "activate", "reset_breaker", "force_breaker_open", "probe_now",
        "adopt_reported_model",
    )

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> Any:
        # One call per page, not per row: the in-flight column reads this dict.
        self._inflight = inflight_tokens()
        # Likewise one render-config read per page for the obfuscation column.
        self._obfuscation = ObfuscationStatus.current()
        return super().changelist_view(request, extra_context)

    @admin.display(description="obfuscation")
    def obfuscation(self, obj: EngineInstance) -> str:
        status = getattr(self, "_obfuscation", None)
        if status is None:
            return "-"
        return status.excluded_reason(obj) or ("ok" if status.render.obfuscation else "-")

    @admin.display(description="capabilities")
    def capabilities_column(self, obj: EngineInstance) -> str:
        """The record's grants less what the capability probe found missing (``engine_traffic``)."""
        return self.traffic(obj)

    @admin.display(description="traffic")
    def traffic(self, obj: EngineInstance) -> str:
        """Which paths the record and the probed capabilities (version, routes, tokenizer) leave it, and
        the LoRA adapters it holds (the LoRA probe's record)."""
        if obj.pk is None:
            return "-"
        return instance_traffic(obj)

    # Not named "breaker": list_display would resolve that to the reverse one-to-one field and
    # print the BreakerState's str ("9: closed") instead of this column.
    @admin.display(description="breaker", ordering="breaker__state")
    def breaker_column(self, obj: EngineInstance) -> str:
        try:
            b = obj.breaker
        except BreakerState.DoesNotExist:
            return "closed"
        if b.state == BreakerState.State.CLOSED:
            return f"closed ({b.consecutive_failures} fail)" if b.consecutive_failures else "closed"
        return f"{b.get_state_display()} until {b.open_until:%H:%M:%S}" if b.open_until else b.get_state_display()

    @admin.display(description="health", ordering="health")
    def health_column(self, obj: EngineInstance) -> str:
        if obj.health == "failing":
            return f"failing ×{obj.consecutive_failures}"
        return obj.health

    # Text, not Django's boolean icons: "no drift" is the healthy state, and a red "False" cross
    # read as an alarm on every healthy engine.
    @admin.display(description="drift", ordering="version_drift")
    def drift(self, obj: EngineInstance) -> str:
        if not obj.version_drift:
            return "none"
        return f"drifted: {obj.drift_reason}" if obj.drift_reason else "drifted"

    @admin.display(description="model record", ordering="model_mismatch")
    def model_record(self, obj: EngineInstance) -> str:
        """What the engine reports serving, and whether the served model's record says the same."""
        if not obj.reported_name:
            return "not reported yet"
        if obj.model_mismatch:
            return f"⚠ {obj.model_mismatch}"
        return f"matches ({obj.reported_name})"

    @admin.display(description="vllm-ascend command")
    def ascend_launch(self, obj: EngineInstance) -> str:
        """The launch command and --kv-transfer-config of an Ascend engine, or why it cannot launch."""
        if obj.pk is None or not obj.is_ascend:
            return "- (not an Ascend engine)"
        try:
            launch = services.instance_ascend_launch(instance=obj)
        except services.InvalidError as exc:
            return f"cannot launch: {exc}"
        return launch.command_line()

    @admin.display(description="process")
    def process_column(self, obj: EngineInstance) -> str:
        """The launcher's view of the engine's process: restarts and why it last exited."""
        process = process_of(obj)
        if process is None:
            return "-"
        text = f"{process.get_state_display()}, {process.restarts} restart(s)"
        if process.last_exit_reason:
            text += f"; last exit: {process.last_exit_reason}"
        return text

    @admin.display(description="in-flight tokens")
    def inflight(self, obj: EngineInstance) -> str:
        inflight = getattr(self, "_inflight", None)
        if inflight is None:
            return "-"
        return str(inflight.get(obj.name, 0))

    def history_view(self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None) -> Any:
        # Django's history lists only edits made in this admin; operators also act through the
        # REST API and the launcher, whose changes live in InstanceEvent and BreakerFlip.
        extra = dict(extra_context or {})
        if object_id.isdigit():
            extra["fleet_history"] = services.instance_history(instance_id=int(object_id))
        return super().history_view(request, object_id, extra)

    def save_model(self, request: HttpRequest, obj: EngineInstance, form: Any, change: bool) -> None:
        # An edit saves only the fields the operator changed: ``obj`` was read when the form was
        # posted, and saving it whole would put back whatever state, probe verdict or other
        # operator's edit landed since then.
        services.instance_save(instance=obj, actor=_actor(request), fields=form.changed_data if change else None)

    def delete_model(self, request: HttpRequest, obj: EngineInstance) -> None:
        services.instance_delete(instance_id=obj.id, actor=_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet) -> None:
        for instance_id in list(queryset.values_list("id", flat=True)):
            services.instance_delete(instance_id=instance_id, actor=_actor(request))

    def _state_action(self, request: HttpRequest, queryset: QuerySet, action: str, verb: str, reason: str = "") -> None:
        ids = list(queryset.values_list("id", flat=True))
        n = services.instances_set_state(ids=ids, action=action, actor=_actor(request), reason=reason)
        skipped = len(ids) - n
        self.message_user(request, f"{verb} {n} engine(s)" + (f"; skipped {skipped} whose state does not allow it" if skipped else ""))

    @admin.action(description="Drain (finish current requests, take no new ones)")
    def drain(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._state_action(request, queryset, "drain", "Drained")

    @admin.action(description="Undrain (take new requests again)")
    def undrain(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._state_action(request, queryset, "undrain", "Undrained")

    @admin.action(description="Quarantine")
    def quarantine(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._state_action(request, queryset, "quarantine", "Quarantined", reason="admin action")

    @admin.action(description="Disable")
    def disable(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._state_action(request, queryset, "disable", "Disabled")

    @admin.action(description="Activate (from draining, quarantined or disabled)")
    def activate(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._state_action(request, queryset, "activate", "Activated")

    @admin.action(description="Reset breaker (close it)")
    def reset_breaker(self, request: HttpRequest, queryset: QuerySet) -> None:
        ids = list(queryset.values_list("id", flat=True))
        for instance_id in ids:
            services.breaker_reset(instance_id=instance_id, actor=_actor(request))
        self.message_user(request, f"Reset the breaker of {len(ids)} engine(s)")

    @admin.action(description="Force breaker open (60 s)")
    def force_breaker_open(self, request: HttpRequest, queryset: QuerySet) -> None:
        ids = list(queryset.values_list("id", flat=True))
        for instance_id in ids:
            services.breaker_force_open(instance_id=instance_id, actor=_actor(request), seconds=60)
        self.message_user(request, f"Forced the breaker of {len(ids)} engine(s) open for 60 s")

    @admin.action(description="Probe now")
    def probe_now(self, request: HttpRequest, queryset: QuerySet) -> None:
        n = services.probes_enqueue(instance_ids=list(queryset.values_list("id", flat=True)))
        if n is None:
            self.message_user(request, "Probes are unavailable: the Celery broker refused the message.", messages.WARNING)
        else:
            self.message_user(request, f"Queued a probe of {n} engine(s)")


    @admin.action(description="Use the model name and path the engine reports for its served model")
    def adopt_reported_model(self, request: HttpRequest, queryset: QuerySet) -> None:
        adopted, refused = [], []
        for instance in queryset.select_related("served_model"):
            try:
                model = services.served_model_adopt_reported(instance_id=instance.id, actor=_actor(request))
            except (services.InvalidError, services.ConflictError) as exc:
                refused.append(f"{instance.name}: {exc}")
            else:
                adopted.append(f"{model.name} ({model.model_path})")
        if adopted:
            self.message_user(request, f"Updated {len(adopted)} served model(s) from their engines: {', '.join(adopted)}")
        if refused:
            self.message_user(request, "Not updated: " + "; ".join(refused), messages.WARNING)


class ReadOnlyAdmin(admin.ModelAdmin):
    """History and probe rows are written by the system only."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(BreakerFlip)
class BreakerFlipAdmin(ReadOnlyAdmin):
    list_display = ("created", "instance", "old_state", "new_state", "reason", "actor")
    list_filter = ("new_state",)
    list_select_related = ("instance",)


@admin.register(InstanceEvent)
class InstanceEventAdmin(ReadOnlyAdmin):
    list_display = ("created", "instance", "kind", "old", "new", "actor", "reason")
    list_filter = ("kind",)
    list_select_related = ("instance",)


@admin.register(ProbeResult)
class ProbeResultAdmin(ReadOnlyAdmin):
    list_display = ("created", "target", "kind", "ok", "latency_ms", "error")
    list_filter = ("kind", "ok")
    list_select_related = ("instance",)

    @admin.display(description="target")
    def target(self, obj: ProbeResult) -> str:
        return obj.instance.name if obj.instance else "render sidecar"


@admin.register(AuditReport)
class AuditReportAdmin(ReadOnlyAdmin):
    list_display = ("created", "summary")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    form = OperatorEditForm
    list_display = ("name", "prefix", "scope", "tokens_per_minute", "allow_priority", "revoked", "created")
    list_filter = ("scope", "revoked")
    search_fields = ("name", "prefix")
    readonly_fields = ("prefix", "created")
    actions = ("revoke",)

    def get_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        if obj is None:
            return ["name", "scope", "tokens_per_minute", "allow_priority"]
        return ["name", "prefix", "scope", "tokens_per_minute", "allow_priority", "revoked", "created"]

    def get_readonly_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> tuple[str, ...]:
        # The scope of an existing key never changes: a client key must not become an admin key.
        # Revocation is one way, through the action: an unchecked box on a form opened before
        # the key was revoked must not bring it back.
        return ("prefix", "created", "scope", "revoked") if obj else ()

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        if change:
            # Only what the form changed: a whole-row save from this copy could undo a revocation
            # made meanwhile (the revoke action, another operator).
            obj.save(update_fields=form.changed_data)
            services.bump_control_version()
            return
        created, key = services.api_key_create(
            name=obj.name, scope=obj.scope, tokens_per_minute=obj.tokens_per_minute, allow_priority=obj.allow_priority
        )
        obj.pk, obj.prefix, obj.key_hash = created.pk, created.prefix, created.key_hash
        self.message_user(
            request, f"The key of {obj.name!r} is {key} — copy it now: only its hash is stored, it cannot be shown again.",
            messages.WARNING,
        )

    def delete_model(self, request: HttpRequest, obj: ApiKey) -> None:
        obj.delete()
        services.bump_control_version()

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet) -> None:
        queryset.delete()
        services.bump_control_version()

    @admin.action(description="Revoke")
    def revoke(self, request: HttpRequest, queryset: QuerySet) -> None:
        n = services.api_key_revoke(ids=list(queryset.values_list("id", flat=True)))
        self.message_user(request, f"Revoked {n} key(s)")


@admin.register(ManagedProcess)
class ManagedProcessAdmin(admin.ModelAdmin):
    """Read-only: the launcher writes these rows; operators read restarts and exit reasons."""

    list_display = ("name", "instance", "state", "pid", "restarts", "last_exit_reason", "last_exit_at", "updated")
    list_filter = ("state",)
    list_select_related = ("instance",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
