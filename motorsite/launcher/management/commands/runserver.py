"""``manage.py runserver`` is Daphne's (the ASGI application, Channels' router), as when the
"daphne" app was installed; imported only when the command runs, so no other command loads Twisted."""

from daphne.management.commands.runserver import Command

__all__ = ("Command",)
