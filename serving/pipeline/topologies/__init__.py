"""Topologies: union, Handoff and Trigger runs, the Trigger metaserver, and the PD Hybrid decider."""
