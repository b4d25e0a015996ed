"""ASGI entry point: the /v1 edge in front of Django, inside Channels' ProtocolTypeRouter.

Requests under ``/v1`` go to ``serving.edge`` (plain ASGI: no middleware, authentication from
the fleet snapshot, a client disconnect cancels the request's task at once); everything else
(admin, ``/api``, ``/metrics``, ``/healthz``, the metaserver callback, the dashboard, static
files) is Django's. Served by Daphne in ``make run``; any ASGI server (uvicorn) can serve it too.
"""

import os

from channels.routing import ProtocolTypeRouter
from django.conf import settings
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application

from motorsite.daphne_requests import hand_bodies_unparsed

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "motorsite.settings")

django_asgi_app = get_asgi_application()
hand_bodies_unparsed()  # under Daphne: no form parsing by Twisted before the app sees a body
if settings.MOTOR_SERVE_STATIC:
    # The admin's CSS and JS straight from the app directories: one process, no collectstatic,
    # no separate web server in the embedded default.
    django_asgi_app = ASGIStaticFilesHandler(django_asgi_app)

# Imported once Django is set up: the edge reads settings and the snapshot builder uses the ORM.
from serving.edge import openai_api  # noqa: E402
from serving.edge.asgi import PrefixMount  # noqa: E402

application = ProtocolTypeRouter({"http": PrefixMount("/v1", openai_api.application, django_asgi_app)})
