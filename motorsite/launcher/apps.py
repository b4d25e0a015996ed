from django.apps import AppConfig


class LauncherConfig(AppConfig):
    """Installed for its management command (``runstack``); it owns no models."""

    name = "motorsite.launcher"
    label = "launcher"
