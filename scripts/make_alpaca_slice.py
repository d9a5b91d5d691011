"""Write the bundled AlpacaEval slice: every row's instruction, category, generator and response
length in MiniLM WordPiece tokens, without the response texts (which make up 8 of the 9 MB).

Run from the repository root:  .venv/bin/python scripts/make_alpaca_slice.py
Source: ../shared/data/prompts/alpaca_eval_outputs.jsonl.gz (tatsu-lab/alpaca_eval, Apache-2.0).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from adapt.tokenizer import count_tokens

SOURCE = Path("../shared/data/prompts/alpaca_eval_outputs.jsonl.gz")
TARGET = Path("adapt/workloads/data/alpaca_eval_lengths.jsonl.gz")


def main() -> None:
    with gzip.open(SOURCE, "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    lengths = count_tokens([row["output"] for row in rows])
    # Sorted by instruction so gzip sees each repeated instruction within its window.
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["instruction"], rows[i]["generator"]))
    # mtime=0 keeps the file byte-identical across runs.
    with open(TARGET, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as packed:
        for i in order:
            row = rows[i]
            record = {
                "instruction": row["instruction"],
                "category": row["category"],
                "generator": row["generator"],
                "output_tokens": lengths[i],
            }
            packed.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
    print(f"wrote {TARGET}: {len(rows):,} rows, {TARGET.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
