"""Build the default contrastive training set (definition -> words) from WordNet 3.0.

Every noun and verb synset becomes one record of three strings:

- ``anchor``: the synset's definition, i.e. its gloss without the quoted example sentences,
- ``positive``: the synset's words, e.g. "dog, domestic dog, Canis familiaris",
- ``negative``: the words of a sibling synset (one sharing a hypernym, pointer ``@`` or ``@i``),
  picked with a seeded ``random.Random`` - a hard negative from the same branch of the hierarchy.

Synsets without a sibling, without a definition, or whose definition repeats an earlier one are
left out. Adjectives and adverbs are left out too: they have no hypernyms, so no siblings (and
WordNet's adjective markers such as "(a)" and "(p)" therefore never reach the data). The records
are split, seeded, into dev and train, and written as gzipped JSON lines in WordNet's file order,
nouns first, so that a rebuild gives byte-identical files.

The data.noun and data.verb files are parsed directly (format: wndb(5)); install them with
``bash setup.sh --dev`` (Debian package wordnet-base). Rebuild with:

    python data/build_wordnet.py --wordnet_dir /usr/share/wordnet --out_dir data

License: WordNet 3.0 Copyright 2006 by Princeton University, used under the WordNet 3.0 license
(see data/LICENSE-WordNet), which must accompany every copy of the data built from it.
"""

import argparse
import gzip
import json
import random
import re
from pathlib import Path

PARTS_OF_SPEECH = ("noun", "verb")
HYPERNYM_POINTERS = {"@", "@i"}
# A phrase quoted right after these words is cited by the definition, not an example of it.
CITED_PHRASE_LEAD = re.compile(r"\b(as in|phrase|expression|e\.g\.)\s*$")


def definition_of(gloss: str) -> str:
    """Cut the gloss ('definition; "example"; "example"') before its first example."""
    paren_depth = 0
    inside_cited_phrase = False
    for index, char in enumerate(gloss):
        if char == "(":
            paren_depth += 1
        elif char == ")":
            paren_depth = max(paren_depth - 1, 0)
        elif char == '"' and paren_depth == 0:
            if inside_cited_phrase:
                inside_cited_phrase = False
            elif CITED_PHRASE_LEAD.search(gloss[:index]):
                inside_cited_phrase = True
            elif gloss[index - 1].isalnum():
                # A closing quote glued to a word ends an example whose opening quote is missing
                # ('focus once again; The physicist refocused the light beam"'): drop that part.
                head, separator, _ = gloss[:index].rpartition(";")
                return _strip_separators(head if separator else gloss[:index])
            else:
                return _strip_separators(gloss[:index])
    return _strip_separators(gloss)


def _strip_separators(text: str) -> str:
    return text.strip().rstrip(";:,").strip()


def read_synsets(data_file: Path) -> dict[str, dict]:
    """Map 'pos:offset' to the synset's words, definition and hypernym keys."""
    synsets = {}
    for line in data_file.read_text(encoding="ascii").splitlines():
        if line.startswith("  "):  # license header
            continue
        fields, gloss = line.split(" | ", 1)
        offset, _lex_filenum, synset_type, word_count, *rest = fields.split()
        word_count = int(word_count, 16)
        words = [word.replace("_", " ") for word in rest[: 2 * word_count : 2]]
        pointer_count = int(rest[2 * word_count])
        pointers = rest[2 * word_count + 1 : 2 * word_count + 1 + 4 * pointer_count]
        hypernyms = [
            f"{pointers[i + 2]}:{pointers[i + 1]}"
            for i in range(0, len(pointers), 4)
            if pointers[i] in HYPERNYM_POINTERS
        ]
        synsets[f"{synset_type}:{offset}"] = {
            "words": ", ".join(words),
            "definition": definition_of(gloss),
            "hypernyms": hypernyms,
        }
    return synsets


def build_records(synsets: dict[str, dict], rng: random.Random) -> list[dict]:
    children = {}
    for key, synset in synsets.items():
        for hypernym in synset["hypernyms"]:
            children.setdefault(hypernym, []).append(key)

    records = []
    seen_anchors = set()
    for synset in synsets.values():
        anchor, positive = synset["definition"], synset["words"]
        if not anchor or anchor in seen_anchors:
            continue
        # Siblings that merely repeat the synset's own words would be no negative at all.
        sibling_words = sorted(
            {synsets[sibling]["words"] for hypernym in synset["hypernyms"] for sibling in children[hypernym]}
            - {positive}
        )
        if not sibling_words:
            continue
        seen_anchors.add(anchor)
        records.append({"anchor": anchor, "positive": positive, "negative": rng.choice(sibling_words)})
    return records


def write_jsonl_gz(path: Path, records: list[dict]) -> None:
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    # mtime=0 and no file name in the header keep the bytes identical across rebuilds.
    path.write_bytes(gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--wordnet_dir", type=Path, default=Path("/usr/share/wordnet"))
    parser.add_argument("--out_dir", type=Path, default=Path("data"))
    parser.add_argument("--dev_size", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    synsets = {}
    for part_of_speech in PARTS_OF_SPEECH:
        synsets |= read_synsets(args.wordnet_dir / f"data.{part_of_speech}")
    rng = random.Random(args.seed)
    records = build_records(synsets, rng)
    dev_indices = set(rng.sample(range(len(records)), args.dev_size))
    dev = [record for index, record in enumerate(records) if index in dev_indices]
    train = [record for index, record in enumerate(records) if index not in dev_indices]

    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl_gz(args.out_dir / "wordnet_train.jsonl.gz", train)
    write_jsonl_gz(args.out_dir / "wordnet_dev.jsonl.gz", dev)
    print(f"{len(synsets)} synsets -> {len(train)} train + {len(dev)} dev records in {args.out_dir}")


if __name__ == "__main__":
    main()
