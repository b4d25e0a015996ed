"""The launcher's management commands."""
