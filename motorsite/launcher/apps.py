from django.apps import AppConfig


class LauncherConfig(AppConfig):
    """Installed for its management commands (``runstack``, ``demo_fleet``, ``runserver``); it owns no models."""

    name = "motorsite.launcher"
    label = "launcher"
