"""Add hard negatives to (anchor, positive) pairs with any sentence-transformers model, for train.py.

sentence-transformers' `mine_hard_negatives` embeds every anchor and every distinct positive, and for each
anchor takes the positives of other pairs that the model ranks closest as its negatives. Some of those are
false negatives (texts as right as the positive); a margin drops a candidate scoring too close to the pair's
own positive:

    python data/mine_hard_negatives.py --model BAAI/bge-small-en-v1.5 --data pairs.jsonl \
        --out mined.jsonl.gz --num_negatives 4 --range_max 50 --relative_margin 0.05 --query_prompt "query: "

The output holds JSON lines {"anchor", "positive", "negative_1", ..., "negative_N"}, which train.py reads as
they are (`--data mined.jsonl.gz`). Anchors for which fewer than N negatives pass the filters are dropped.
"""

import argparse
import gzip
import json
from pathlib import Path

import datasets
from sentence_transformers import SentenceTransformer
from sentence_transformers.util import mine_hard_negatives

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
add = parser.add_argument
add("--model", required=True, help="sentence-transformers folder or hub name")
add(
    "--data",
    required=True,
    help="pairs: a .jsonl[.gz], .csv or .parquet file, or a hub data set name[:split]",
)
add("--out", required=True, help="the JSONL file to write (.jsonl or .jsonl.gz)")
add("--anchor_column", default="anchor")
add("--positive_column", default="positive")
add("--num_negatives", type=int, default=3, help="negatives per anchor")
add("--range_min", type=int, default=0, help="skip the N closest candidates (likely unlabeled positives)")
add("--range_max", type=int, default=None, help="consider only the N closest candidates")
add("--absolute_margin", type=float, default=None, help="false negatives: drop candidates scoring above "
    "the positive's score minus this")  # fmt: skip
add("--relative_margin", type=float, default=None, help="false negatives: drop candidates scoring above "
    "(1 - this) times the positive's score")  # fmt: skip
add("--max_score", type=float, default=None, help="drop candidates scoring above this")
add("--sampling_strategy", choices=["top", "random"], default="top", help="closest, or random among range")
add("--query_prompt", default=None, help="prepended to anchors when embedding")
add("--document_prompt", default=None, help="prepended to positives when embedding")
add("--batch_size", type=int, default=32)


def load_pairs(source, anchor, positive):
    path = Path(source)
    file_format = FILE_FORMATS.get(next((s for s in reversed(path.suffixes) if s != ".gz"), ""))
    if file_format:
        dataset = datasets.load_dataset(file_format, data_files=str(path), split="train")
    else:
        name, _, split = source.partition(":")
        dataset = datasets.load_dataset(name, split=split or "train")
    missing = [field for field in (anchor, positive) if field not in dataset.column_names]
    if missing:
        parser.error(
            f"{source} has no field {missing}; its fields are {dataset.column_names}. "
            "Name yours with --anchor_column and --positive_column."
        )
    pairs = dataset.select_columns([anchor, positive])
    return pairs.rename_columns({anchor: "anchor", positive: "positive"})


def main(argv=None):
    args = parser.parse_args(argv)
    pairs = load_pairs(args.data, args.anchor_column, args.positive_column)
    mined = mine_hard_negatives(
        pairs,
        SentenceTransformer(args.model),
        anchor_column_name="anchor",
        positive_column_name="positive",
        num_negatives=args.num_negatives,
        range_min=args.range_min,
        range_max=args.range_max,
        absolute_margin=args.absolute_margin,
        relative_margin=args.relative_margin,
        max_score=args.max_score,
        sampling_strategy=args.sampling_strategy,
        query_prompt=args.query_prompt,
        corpus_prompt=args.document_prompt,
        output_format="n-tuple",  # anchor, positive, negative_1, ..., negative_N: train.py's layout
        batch_size=args.batch_size,
    )
    with (gzip.open if args.out.endswith(".gz") else open)(args.out, "wt", encoding="utf-8") as out:
        for record in mined:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(
        f"wrote {len(mined)} of {len(pairs)} anchors with {args.num_negatives} negatives each to {args.out}"
    )
    return mined


if __name__ == "__main__":
    main()
