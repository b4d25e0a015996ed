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

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "motorsite.settings")

django_asgi_app = get_asgi_application()
if settings.MOTOR_SERVE_STATIC:
    # The admin's CSS and JS straight from the app directories: one process, no collectstatic,
    # no separate web server in the embedded default.
    django_asgi_app = ASGIStaticFilesHandler(django_asgi_app)

# Imported once Django is set up: the edge reads settings and the snapshot builder uses the ORM.
from motorsite import daphne_inbox, daphne_requests, send_flow  # noqa: E402
from motorsite.front_door import FrontDoor  # noqa: E402
from serving.edge import openai_api  # noqa: E402
from serving.edge.asgi import PrefixMount  # noqa: E402

# Under Daphne: the front door and the header deadline on Twisted's connections, bodies unparsed.
daphne_requests.install()
# Under both servers: send() waits while the client reads nothing (Daphne's never did), and a send
# abandoned at MOTOR_CLIENT_STALL_S drops its connection.
send_flow.install()
# Under Daphne: each request's input queue without an asyncio.Queue (a held-back stream keeps it).
daphne_inbox.install()
# The front door first: no key, no body (under uvicorn; Daphne's requests are judged in Twisted).
application = ProtocolTypeRouter({"http": FrontDoor(PrefixMount("/v1", openai_api.application, django_asgi_app))})
