"""The benchmark scripts, each a module run from the repository root: `python -m benchmarks.<name>`.
What they share is in benchmarks/common.py."""
