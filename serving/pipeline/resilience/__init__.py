"""Resilience: per-instance circuit breakers and the attempt policy (what a failed attempt excludes, whether to retry)."""
