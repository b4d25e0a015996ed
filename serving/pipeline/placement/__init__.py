"""Placement: which instances run a prompt (eligibility filters, load and KV-affinity scores, the scheduler), and the KV event index."""
