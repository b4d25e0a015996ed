"""The client-facing edge: ``/v1`` as a plain ASGI app in front of Django.

Django's handler runs seven middlewares for every request, each through ``sync_to_async``
(a thread hop and back), before a view of a few lines hands the body to the data plane. The
OpenAI API needs none of them (no session, cookie, CSRF, auth user or message), so
``motorsite/asgi.py`` sends every ``/v1`` request here and everything else to Django.

- ``asgi.py``: the ASGI plumbing: the request read under a size cap, the client's disconnect
  watched while the handler runs and while it streams, responses with headers built once;
- ``bodies.py``: JSON request bodies, refused unless everything downstream can encode them;
- ``keys.py``: client keys from the fleet snapshot, no database query per request;
- ``openai_api.py``: the endpoints and the app ``motorsite/asgi.py`` mounts.
"""
