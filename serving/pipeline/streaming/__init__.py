"""Streaming responses: the event stream a client reads, relay after a mid-stream failure, fan-in of several sub-streams."""
