"""Score every positive and hard negative of a data set with a cross-encoder, for train.py's --distill_weight.

A cross-encoder reads the anchor and a text together and scores how well the text answers it; train.py can
distil those scores into the bi-encoder (the KL divergence between the teacher's softmax over each anchor's
positive and hard negatives and the student's). Records are read as train.py reads them (the same default
fields, `--columns` alike), and written as FlagEmbedding's JSON lines, which train.py reads as they are:

    python data/score_with_cross_encoder.py --model cross-encoder/ms-marco-MiniLM-L6-v2 \
        --data mined.jsonl.gz --out scored.jsonl.gz
    accelerate launch --config_file accelerate_configs/cpu.yaml train.py --data scored.jsonl.gz \
        --distill_weight 1.0

Each output record is {"query", "pos": [...], "neg": [...], "pos_scores": [...], "neg_scores": [...]}, one
score per text in order. The scores are the model's raw outputs (logits, no sigmoid), as FlagEmbedding's
teacher scores are; --distill_temperature scales them in training.
"""

import argparse
import gzip
import json
import sys
from pathlib import Path

import torch
from sentence_transformers import CrossEncoder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # train.py, to read records as it does
from train_parts import pairs  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
add = parser.add_argument
add("--model", required=True, help="a sentence-transformers CrossEncoder folder or hub name")
add("--data", required=True, help="records as train.py's --data reads them")
add("--out", required=True, help="the JSONL file to write (.jsonl or .jsonl.gz)")
add("--columns", default="", help="fields to roles, as train.py's --columns")
add("--batch_size", type=int, default=64, help="pairs per forward of the cross-encoder")


def main(argv=None):
    args = parser.parse_args(argv)
    records = pairs.load_pairs(args.data, args.columns)[0]
    negative_columns = [column for column in records.column_names if column.startswith("negative_")]
    groups = [
        (
            record["anchor"],
            record["positive"] if isinstance(record["positive"], list) else [record["positive"]],
            [record[column] for column in negative_columns],
        )
        for record in records
    ]
    texts = [(anchor, text) for anchor, positives, negatives in groups for text in positives + negatives]
    model = CrossEncoder(args.model)
    scores = iter(
        model.predict(texts, batch_size=args.batch_size, activation_fn=torch.nn.Identity()).tolist()
    )
    with (gzip.open if args.out.endswith(".gz") else open)(args.out, "wt", encoding="utf-8") as out:
        for anchor, positives, negatives in groups:
            record = {"query": anchor, "pos": positives, "neg": negatives}
            record["pos_scores"] = [next(scores) for _ in positives]
            record["neg_scores"] = [next(scores) for _ in negatives]
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"wrote {len(groups)} records, {len(texts)} pairs scored by {args.model}, to {args.out}")


if __name__ == "__main__":
    main()
