"""``manage.py render_image``: the container image of the render sidecar, from the render config.

Compose and the Kubernetes manifests take the sidecar's image from here, so the render config's
``image_name`` is what is deployed:

    MOTOR_RENDER_IMAGE=$(python manage.py render_image) docker compose -f docker/compose.yaml up
    (cd deploy/k8s && kustomize edit set image motorsite-render=$(python manage.py render_image))
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from motorsite.core import current_render_config

# The project's own build of the sidecar (docker/Dockerfile.vllm with LOCK=render.lock), used when
# the render config names no image. (The coordinator's image has no vLLM: it cannot be reused.)
DEFAULT_RENDER_IMAGE = "motorsite-render:0.33.0"


def render_image(image_name: str) -> str:
    """The image to deploy for a render config whose ``image_name`` is this."""
    return image_name.strip() or DEFAULT_RENDER_IMAGE


class Command(BaseCommand):
    help = "Print the render sidecar's container image: the render config's image_name, or the project's build."

    def handle(self, *args: Any, **options: Any) -> None:
        config = current_render_config()
        self.stdout.write(render_image(config.image_name if config else ""))
