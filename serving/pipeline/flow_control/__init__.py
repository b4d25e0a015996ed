"""Flow control: token admission with a queue and deadline, and per-key token rate limits."""
