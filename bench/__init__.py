"""Benchmarks; a package so that every script can share ``bench.common`` (run as a file or with ``-m``)."""
