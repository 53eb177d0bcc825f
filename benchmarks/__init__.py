"""Benchmarks: scripts that measure, writing JSON and plots to benchmarks/results/ and tables to BENCHMARKS.md."""
