"""The benchmark scripts, run from the repository root: `python benchmarks/<name>.py` or
`python -m benchmarks.<name>`. What they share is in benchmarks/common.py."""
