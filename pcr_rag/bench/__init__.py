"""Benchmarks: workloads, the systems compared, the runner, and the shared report (JSON, Markdown, plots)."""
