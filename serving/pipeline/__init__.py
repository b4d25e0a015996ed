"""The data plane: plain asyncio, no Django; render -> place -> generate -> derender for one request."""
