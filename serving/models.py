"""Durable control data of what is served: models and the render sidecar's configuration."""

from __future__ import annotations

from django.db import models


class ServedModel(models.Model):
    """A model clients name in ``model``; engines and the render sidecar serve it under that name."""

    name = models.CharField(max_length=200, unique=True, help_text="The name clients send as `model`.")
    model_path = models.CharField(max_length=500, help_text="Model directory the tiers load.")
    max_model_len = models.PositiveIntegerField(default=2048)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name


class RenderConfig(models.Model):
    """The RFC's ``render_config``: where the render sidecar is and how it is called."""

    name = models.CharField(max_length=100, unique=True, default="default")
    enable = models.BooleanField(default=True, help_text="Off: requests take the engines' native path.")
    image_name = models.CharField(max_length=200, blank=True, help_text="Empty: reuse the coordinator image.")
    host = models.CharField(max_length=200, default="127.0.0.1")
    port = models.PositiveIntegerField(default=8100)
    timeout_ms = models.PositiveIntegerField(
        default=5000, help_text="Per render/derender call, and per streaming chunk (not per stream)."
    )
    renderer_num_workers = models.PositiveIntegerField(default=4)

    def __str__(self) -> str:
        return self.name

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"
