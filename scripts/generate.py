"""`python scripts/generate.py ...` is `python -m sparse_llm.generate ...` (see there)."""

import sys

from sparse_llm.generate import main

if __name__ == "__main__":
    sys.exit(main())
