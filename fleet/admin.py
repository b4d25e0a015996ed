from django.contrib import admin

from fleet.models import EngineInstance


@admin.register(EngineInstance)
class EngineInstanceAdmin(admin.ModelAdmin):
    list_display = ("name", "url", "role", "served_model", "kind", "state", "capabilities")
    list_filter = ("role", "state", "kind", "served_model")
    list_select_related = ("served_model",)
    search_fields = ("name", "url")
    fieldsets = (
        (None, {"fields": ("name", "url", "role", "served_model", "kind", "state")}),
        ("Capacity", {"fields": ("weight", "token_capacity", "max_model_len")}),
        ("Capabilities", {"fields": ("cap_token_generate", "cap_native_openai", "cap_tokenizer")}),
    )

    @admin.display(description="capabilities")
    def capabilities(self, obj: EngineInstance) -> str:
        caps = [("token-only", obj.cap_token_generate), ("native", obj.cap_native_openai), ("tokenizer", obj.cap_tokenizer)]
        return ", ".join(name for name, on in caps if on) or "-"
