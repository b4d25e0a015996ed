"""Served models, revisions and render configs in the Django admin."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db import transaction
from django.db.models import Count, Model, QuerySet
from django.http import HttpRequest

from catalog.key_refs import InvalidKeyRef, check_key_ref
from catalog.models import ModelRevision, RenderConfig, RenderSidecar, ServedModel
from catalog.render_versions import member_traffic, pool_traffic, render_traffic
from catalog.served_models import served_model_set_state
from catalog.services import render_config_save
from motorsite.admin_forms import OperatorEditForm
from motorsite.core import InvalidError, bump_control_version


def _save_changed(obj: Model, form: Any, change: bool) -> None:
    """Save a new row whole, an edited one only in the fields its form changed.

    ``obj`` is a copy read when the form was posted: saved whole, it would put back what landed
    since then, such as the active revision ``revision_record`` switched or the vocabulary size
    the version probe wrote (both compare-and-set or targeted updates, never a save).
    """
    obj.save(update_fields=form.changed_data if change else None)


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin):
    form = OperatorEditForm
    list_display = ("name", "state", "base", "model_path", "max_model_len", "vocab_size", "active_revision", "instance_count",
                    "scorer_weights")
    list_select_related = ("active_revision", "base")
    list_filter = ("state",)
    search_fields = ("name",)
    actions = ("drain", "retire", "activate")
    fieldsets = (
        (None, {"fields": ("name", "model_path", "max_model_len", "vocab_size", "active_revision", "state")}),
        ("Placement", {
            "fields": ("prefix_weight", "queue_weight", "tokens_weight"),
            "description": "Each scorer gives every candidate engine a score from 0 to 1; the engine with the "
            "highest weighted sum takes the request (ties: the least loaded). The defaults (1, 0, 0) send a "
            "prompt to the engine caching most of it unless that engine is far busier "
            "(MOTOR_AFFINITY_LOAD_MARGIN_TOKENS). Saved edits reach traffic within one snapshot poll.",
        }),
    )

    @admin.display(description="weights prefix/queue/tokens")
    def scorer_weights(self, obj: ServedModel) -> str:
        return f"{obj.prefix_weight:g} / {obj.queue_weight:g} / {obj.tokens_weight:g}"

    def _set_state(self, request: HttpRequest, queryset: QuerySet, state: str) -> None:
        actor = f"admin:{request.user.get_username()}"
        for name in queryset.values_list("name", flat=True):
            served_model_set_state(name=name, state=state, actor=actor)
        self.message_user(request, f"{queryset.count()} model(s) now {state}.", messages.SUCCESS)

    @admin.action(description="Drain: take no new requests (503), let those in flight finish")
    def drain(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._set_state(request, queryset, ServedModel.State.DRAINING)

    @admin.action(description="Retire: unknown to clients (404), gone from /v1/models")
    def retire(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._set_state(request, queryset, ServedModel.State.RETIRED)

    @admin.action(description="Activate: serve again")
    def activate(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._set_state(request, queryset, ServedModel.State.ACTIVE)

    @admin.display(description="instances", ordering="n_instances")
    def instance_count(self, obj: ServedModel) -> int:
        return obj.n_instances  # type: ignore[attr-defined]

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).annotate(n_instances=Count("instances"))

    def save_model(self, request: HttpRequest, obj: ServedModel, form: Any, change: bool) -> None:
        with transaction.atomic():
            _save_changed(obj, form, change)
            bump_control_version()

    def delete_model(self, request: HttpRequest, obj: ServedModel) -> None:
        super().delete_model(request, obj)
        bump_control_version()

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet) -> None:
        super().delete_queryset(request, queryset)
        bump_control_version()


@admin.register(ModelRevision)
class ModelRevisionAdmin(admin.ModelAdmin):
    form = OperatorEditForm
    list_display = ("served_model", "label", "tokenizer_hash_short", "chat_template_hash_short", "created")
    list_select_related = ("served_model",)
    list_filter = ("served_model",)

    @admin.display(description="tokenizer")
    def tokenizer_hash_short(self, obj: ModelRevision) -> str:
        return obj.tokenizer_hash[:12] or "-"

    @admin.display(description="chat template")
    def chat_template_hash_short(self, obj: ModelRevision) -> str:
        return obj.chat_template_hash[:12] or "-"

    def save_model(self, request: HttpRequest, obj: ModelRevision, form: Any, change: bool) -> None:
        _save_changed(obj, form, change)


class RenderConfigForm(OperatorEditForm):
    class Meta:
        model = RenderConfig
        fields = "__all__"
        # The model's help text predates the rule (changing it needs a migration): the form says it.
        help_texts = {
            "obfuscation_key_ref": (
                "Where the key is, never the key: `setting:MOTOR_OBFUSCATION_KEY_<NAME>` (an environment "
                "variable) or `file:<path>` under MOTOR_OBFUSCATION_KEY_DIR."
            ),
        }

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("obfuscation") and not (data.get("obfuscation_key_ref") and data.get("obfuscation_key_id")):
            raise forms.ValidationError("Obfuscation needs a key reference and a key id.")
        if data.get("obfuscation_key_ref"):
            try:
                check_key_ref(data["obfuscation_key_ref"])
            except InvalidKeyRef as exc:
                self.add_error("obfuscation_key_ref", str(exc))
        return data


@admin.register(RenderSidecar)
class RenderSidecarAdmin(admin.ModelAdmin):
    """The render pools' members: an operator adds and removes them by address; the probes fill in the rest."""

    list_display = ("address", "render_config", "health", "sidecar_version", "traffic", "last_probe_at")
    list_filter = ("render_config", "health")
    fields = ("render_config", "host", "port", "health", "sidecar_version", "traffic", "capabilities",
              "last_probe_at", "last_probe_error")
    readonly_fields = ("health", "sidecar_version", "traffic", "capabilities", "last_probe_at", "last_probe_error")

    @admin.display(description="traffic")
    def traffic(self, obj: RenderSidecar) -> str:
        """What this member serves by its version and routes; a request class no member serves goes native."""
        return "-" if obj.pk is None else member_traffic(obj.sidecar_version, obj.capabilities)

    def save_model(self, request: HttpRequest, obj: RenderSidecar, form: Any, change: bool) -> None:
        with transaction.atomic():
            _save_changed(obj, form, change)
            bump_control_version()  # the pool is in the snapshot

    def delete_model(self, request: HttpRequest, obj: RenderSidecar) -> None:
        with transaction.atomic():
            super().delete_model(request, obj)
            bump_control_version()

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[RenderSidecar]) -> None:
        with transaction.atomic():
            super().delete_queryset(request, queryset)
            bump_control_version()


@admin.register(RenderConfig)
class RenderConfigAdmin(admin.ModelAdmin):
    form = RenderConfigForm
    list_display = (
        "name", "served_model", "enable", "host", "port", "timeout_ms", "renderer_num_workers", "health", "sidecar_version",
        "traffic", "model_record", "restart_required",
    )
    readonly_fields = (
        "pool_size", "pool", "sidecar_version", "traffic", "streaming_derender", "model_mismatch", "health", "last_probe_at", "last_probe_error",
        "restart_required",
    )
    fieldsets = (
        (None, {"fields": ("name", "served_model", "enable")}),
        ("Sidecar", {"fields": ("image_name", "host", "port", "renderer_num_workers", "pool_size", "pool")}),
        ("Limits", {"fields": ("timeout_ms", "context_budget", "derender_coalesce", "stream_interval", "stream_interval_ms",
                               "local_stream_detokenize")}),
        ("Token obfuscation", {"fields": ("obfuscation", "obfuscation_key_ref", "obfuscation_key_id")}),
        ("Probed", {"fields": (
            "sidecar_version", "traffic", "streaming_derender", "model_mismatch", "health", "last_probe_at", "last_probe_error",
            "restart_required",
        )}),
    )

    @admin.display(description="traffic")
    def traffic(self, obj: RenderConfig) -> str:
        """Where the RFC's version floors send requests with this pool, and why."""
        versions = [m.sidecar_version for m in obj.sidecars.all()] if obj.pk else []
        return pool_traffic(versions) if versions else render_traffic(obj.sidecar_version)

    @admin.display(description="render pool")
    def pool(self, obj: RenderConfig) -> str:
        """Each member with its health and what it serves (the members are edited under Render sidecars)."""
        members = list(obj.sidecars.all()) if obj.pk else []
        return "; ".join(
            f"{m.address} [{m.health}, vLLM {m.sidecar_version or '?'}]: {member_traffic(m.sidecar_version, m.capabilities)}"
            for m in members
        ) or f"{obj.base_url} (no member rows: the config's own address)"

    @admin.display(description="model record", ordering="model_mismatch")
    def model_record(self, obj: RenderConfig) -> str:
        """As the engines' column: what the sidecar serves against the served models' records."""
        if obj.model_mismatch:
            return f"⚠ {obj.model_mismatch}"
        return "matches" if obj.sidecar_version else "-"

    def save_model(self, request: HttpRequest, obj: RenderConfig, form: Any, change: bool) -> None:
        try:
            result = render_config_save(config=obj, changed=tuple(form.changed_data), actor=f"admin:{request.user.get_username()}")
        except InvalidError as exc:  # the form already checks this; kept for a race with another edit
            self.message_user(request, str(exc), messages.ERROR)
            return
        if result.restart_required:
            self.message_user(
                request, "This change takes effect when the render sidecar restarts (endpoint, workers, image or key changed).",
                messages.WARNING,
            )
