"""Daphne's requests hand their bodies to the application unparsed.

Daphne builds each request on Twisted's ``http.Request``, which by default parses every POST's
Content-Type with the ``email`` package and then a form body (urlencoded or multipart) into
``request.args``. Daphne never reads ``args``: the ASGI application gets the raw body. So the
parse is waste on every request (about 40 us of CPU for the Content-Type alone), a form body is
held twice, and a body that Twisted cannot parse as the multipart form its Content-Type names is
answered by Twisted itself: a bare 400 without a body, the connection dropped, where the client
should get an OpenAI error from /v1 or Django's own answer elsewhere.
Twisted has the switch (``parsePOSTFormSubmission``); Daphne does not expose it, so it is set here.
"""

from __future__ import annotations

import sys
from typing import Any


def hand_bodies_unparsed() -> None:
    """Make Daphne's requests skip Twisted's form parsing.

    Called when the ASGI application is imported: under Daphne its request class is imported
    by then, and under any other server there is nothing to change (Twisted is not imported
    for it). Idempotent.
    """
    module = sys.modules.get("daphne.http_protocol")
    request_class = getattr(module, "WebRequest", None)
    if request_class is None or getattr(request_class, "_motor_bodies_unparsed", False):
        return
    init = request_class.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["parsePOSTFormSubmission"] = False
        init(self, *args, **kwargs)

    request_class.__init__ = __init__
    request_class._motor_bodies_unparsed = True
