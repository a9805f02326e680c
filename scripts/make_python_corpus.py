"""Collect the Python sources installed on a machine into a jsonl corpus (one file per document).

Real text with no download, for GPU experiments larger than the embedded stdlib corpus:
    python scripts/make_python_corpus.py --out /tmp/corpus.jsonl --max-mb 400
    python -m sparse_llm.train data=files data.paths=[/tmp/corpus.jsonl] ...
"""

from __future__ import annotations

import argparse
import json
import random
import site
import sysconfig
from pathlib import Path


def default_roots() -> list[Path]:
    roots = [Path(sysconfig.get_paths()["stdlib"]), *map(Path, site.getsitepackages())]
    return [r for r in dict.fromkeys(roots) if r.is_dir()]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--root", type=Path, action="append", help="directories to scan (default: stdlib + site)"
    )
    parser.add_argument("--max-mb", type=float, default=400.0, help="stop after this much text")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document order")
    args = parser.parse_args()

    files = sorted({p for root in (args.root or default_roots()) for p in root.rglob("*.py") if p.is_file()})
    random.Random(args.seed).shuffle(files)
    budget, written, docs = args.max_mb * 2**20, 0, 0
    with args.out.open("w") as out:
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            out.write(json.dumps({"text": text}) + "\n")
            written += len(text)
            docs += 1
            if written >= budget:
                break
    print(f"{docs} documents, {written / 2**20:.1f} MB of text from {len(files)} files -> {args.out}")


if __name__ == "__main__":
    main()
