"""Render: OpenAI requests -> token ids through the sidecar, the local tokenizer fallback, live streams per sidecar."""
