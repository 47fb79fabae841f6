"""Helpers the tests and benchmarks share (external servers run as child processes)."""
