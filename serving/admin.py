from django.contrib import admin

from serving.models import RenderConfig, ServedModel


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin):
    list_display = ("name", "model_path", "max_model_len", "instance_count")
    search_fields = ("name",)

    @admin.display(description="instances")
    def instance_count(self, obj: ServedModel) -> int:
        return obj.instances.count()

    def get_queryset(self, request):  # type: ignore[no-untyped-def]
        return super().get_queryset(request).prefetch_related("instances")


@admin.register(RenderConfig)
class RenderConfigAdmin(admin.ModelAdmin):
    list_display = ("name", "enable", "host", "port", "timeout_ms", "renderer_num_workers")
    fieldsets = (
        (None, {"fields": ("name", "enable")}),
        ("Sidecar", {"fields": ("image_name", "host", "port", "renderer_num_workers")}),
        ("Limits", {"fields": ("timeout_ms",)}),
    )
