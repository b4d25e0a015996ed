"""Derender: generated ids -> OpenAI responses (full), and per-chunk streaming sessions with coalescing and stop-string hold-back."""
