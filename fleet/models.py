"""Durable control data of the engine fleet."""

from __future__ import annotations

from django.db import models

from serving.models import ServedModel


class EngineInstance(models.Model):
    """One token engine (real vLLM or the simulator) the coordinator may place requests on."""

    class Role(models.TextChoices):
        UNION = "union", "union"  # prefills and decodes
        PREFILL = "prefill", "prefill"
        DECODE = "decode", "decode"

    class State(models.TextChoices):
        ACTIVE = "active", "active"  # takes new requests
        DRAINING = "draining", "draining"  # finishes what it has, takes nothing new
        QUARANTINED = "quarantined", "quarantined"  # kept out by an operator or a probe
        DISABLED = "disabled", "disabled"

    name = models.CharField(max_length=100, unique=True)
    url = models.URLField(help_text="Base URL, e.g. http://127.0.0.1:8201")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.UNION)
    served_model = models.ForeignKey(ServedModel, models.CASCADE, related_name="instances")
    weight = models.PositiveIntegerField(default=1)
    token_capacity = models.PositiveIntegerField(default=65536, help_text="Prompt + output tokens in flight.")
    max_model_len = models.PositiveIntegerField(null=True, blank=True, help_text="Empty: the served model's.")
    cap_token_generate = models.BooleanField("token-only generate", default=True)
    cap_native_openai = models.BooleanField("native OpenAI API", default=False)
    cap_tokenizer = models.BooleanField("tokenizer loaded", default=False)
    kind = models.CharField(max_length=20, default="vllm", help_text="vllm or sim")
    state = models.CharField(max_length=12, choices=State.choices, default=State.ACTIVE)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
