"""ASGI entry point: Channels' ProtocolTypeRouter around Django's ASGI handler.

Streaming endpoints are async Django views returning ``StreamingHttpResponse``; Django's ASGI
handler turns a client disconnect into cancellation of the view's task. Served by Daphne in
``make run``; any ASGI server (uvicorn) can serve it too.
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

application = ProtocolTypeRouter({"http": django_asgi_app})
