"""A tiny OTLP/HTTP trace receiver on 127.0.0.1 for the tracing tests: it decodes each export
request the real exporter sends (protobuf, ``POST /v1/traces``) and answers 200."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class Receiver:
    """A tiny OTLP/HTTP trace receiver on 127.0.0.1: decodes each export, answers 200."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.paths.append(self.path)
                assert self.headers["Content-Type"] == "application/x-protobuf"
                received.requests.append(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def attributes(self, span: Any) -> dict[str, str]:
        return {a.key: a.value.string_value for a in span.attributes}

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """(resource attributes, span) of every span received."""
        out = []
        for request in list(self.requests):  # the server thread may append meanwhile
            for rs in request.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                out += [(resource, span) for ss in rs.scope_spans for span in ss.spans]
        return out
