"""Benchmark harness for the dobb optimizers. Uses the library only through its public API."""
