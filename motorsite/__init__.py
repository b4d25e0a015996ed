"""The Django project: settings, urls, asgi, Celery, the REST API, the control plane's core and the launcher."""

# The Celery app is loaded with Django (as in Celery's Django example), so `.delay()` from the
# admin or the API uses motorsite's broker; importing it reads no setting until it is used.
from motorsite.celery import app as celery_app

__all__ = ("celery_app",)
