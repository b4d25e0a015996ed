"""The Django project: settings, urls, asgi, Celery, the REST API, the control plane's core and the launcher.

The Celery app (``motorsite.celery``) is not imported here, unlike Celery's Django example: it
costs every Django boot about a second of CPU. ``celery -A motorsite`` finds it all the same
(Celery looks for ``motorsite.celery.app``), and the one place that sends a task,
``fleet.services.probes_enqueue``, imports it first.
"""
