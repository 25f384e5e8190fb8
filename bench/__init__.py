"""Benchmarks for runstile (``make bench``); see bench/README.md."""
