"""`liandan mix` on the shared English and Chinese text with a source planted to hurt: does it say so?

Four byte-level token stores of about 400 KB each: the tiny Shakespeare text, WikiText-2, the Chinese
classics, and more WikiText-2 with the letters of every word shuffled (the planted source: the same bytes as
English, no words). The proxies (width 64, 2 blocks, 150 steps of 16 x 64 tokens by default) are trained over
the mixture weights and the target is the mean held-out bits per byte of the three real sources
(`--target 1,1,1,0`). Printed: `liandan mix`'s table; then the planted source's verdict (the target:
"hurts") and recommended weight (the target: below 0.02), and the law's predicted target loss for the
recommended, natural and uniform mixtures. Proxies already trained in OUT are reused.

    python benchmarks/mix_planted.py --out runs/mix-planted               # 16 proxies, two at a time
    python benchmarks/mix_planted.py --out runs/mix-planted --steps 300 --parallel 4
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "corpus"
SOURCE_BYTES = 400_000

CONFIG = """\
[run]
seed = 1
output_dir = "{out}/runs"
[model]
dim = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
max_seq_len = 64
[optim]
lr = 3e-3
[schedule]
warmup_steps = 10
[train]
steps = 2000
global_batch = 16
seq_len = 64
dtype = "fp32"
[data]
stores = {stores}
[eval]
heldout_sequences = 32
contamination = false
[track]
plot = false
[doctor]
preflight = false
[checkpoint]
enabled = false
"""


def _take(records: list[dict], limit: int) -> list[dict]:
    out, total = [], 0
    for record in records:
        if total >= limit:
            break
        out.append(record)
        total += len(record["text"].encode())
    return out


def source_documents(sizes: dict[str, int]) -> dict:
    """The documents of each source named in `sizes`, about that many bytes each: shakespeare, wiki
    (WikiText-2 from its start), zh (the Chinese classics) and shuffled (the WikiText-2 after wiki's, with the
    letters of every word shuffled)."""
    from liandan.data import Document

    wiki = [json.loads(line) for line in (SHARED / "en-wikitext2.jsonl").open()]
    first = _take(wiki, sizes.get("wiki", SOURCE_BYTES))
    rng = random.Random(0)

    def shuffle(match: re.Match) -> str:
        letters = list(match.group(0))
        rng.shuffle(letters)
        return "".join(letters)

    def make(name: str, size: int) -> list:
        if name == "shakespeare":
            text = (SHARED / "en-shakespeare.txt").read_text()[:size]
            return [Document(name, str(i), text[i : i + 4000]) for i in range(0, len(text), 4000)]
        if name == "wiki":
            return [Document(name, r["id"], r["text"]) for r in first]
        if name == "zh":
            zh = [json.loads(line) for line in (SHARED / "zh-classics.jsonl").open()]
            return [Document(name, r["id"], r["text"]) for r in _take(zh, size)]
        rest = _take(wiki[len(first) :], size)
        return [Document(name, r["id"], re.sub(r"[A-Za-z]+", shuffle, r["text"])) for r in rest]

    return {name: make(name, size) for name, size in sizes.items()}


def write_stores(out: Path) -> list[Path]:
    from liandan.data import ByteTokenizer, shard_path, write_manifest, write_shard

    paths = []
    names = ("shakespeare", "wiki", "zh", "shuffled")
    for name, docs in source_documents(dict.fromkeys(names, SOURCE_BYTES)).items():
        path = out / "stores" / name
        if not (path / "manifest.json").exists():
            shard = write_shard(docs, ByteTokenizer(), shard_path(path, 0))
            write_manifest(path, [shard], ByteTokenizer())
        paths.append(path)
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/mix-planted"))
    parser.add_argument("--steps", type=int, default=150, help="steps of each proxy")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--runs", type=int, help="proxies (default: liandan mix's, 16 for four sources)")
    a = parser.parse_args()
    if not SHARED.is_dir():
        print(f"the shared corpora are not at {SHARED}", file=sys.stderr)
        return 2
    out = a.out.resolve()
    stores = write_stores(out)
    config = out / "run.toml"
    config.write_text(CONFIG.format(out=out, stores=json.dumps([str(s) for s in stores])))
    command = [sys.executable, "-m", "liandan.cli", "mix", str(config), "--out", str(out / "mix"), "--target",
               "1,1,1,0", "--parallel", str(a.parallel), f"--train.steps={a.steps}"]  # fmt: skip
    if a.runs:
        command += ["--runs", str(a.runs)]
    if subprocess.run(command, check=False).returncode:
        return 1
    report = json.loads((out / "mix" / "mix.json").read_text())["analysis"]
    planted = next(s for s in report["sources"] if s["name"] == "shuffled")
    print(f"planted source: {planted['verdict']} (target: hurts), recommended weight {planted['recommended']:.4f}"
          f" (target: < 0.02), +0.1 weight {0.1 * planted['slope']:+.4f} bits/byte")  # fmt: skip
    for kind in ("recommended", "natural", "uniform"):
        m = report[kind]
        print(f"{kind}: predicted {m['loss']:.4f} [{m['low']:.4f}, {m['high']:.4f}] bits/byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
