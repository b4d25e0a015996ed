"""Client APIs served by the chat token path with a converter at its end (Messages, Responses)."""
