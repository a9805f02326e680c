"""python -m sparse_llm.eval: the sparse-llm-eval command (cli.py)."""

import sys

from sparse_llm.eval.cli import main

sys.exit(main())
