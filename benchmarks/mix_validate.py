"""`liandan mix --validate` on the three shared sources: is the recommended mixture better at a larger size?

Three byte-level token stores from the shared text, of unequal size so that the natural (token-proportional)
mixture is not the uniform one: the tiny Shakespeare text (400 KB), WikiText-2 (1.2 MB) and the Chinese
classics (800 KB). The proxies are benchmarks/mix_planted.py's (width 64, 2 blocks, 150 steps of 16 x 64
tokens); the target is the mean held-out bits per byte of the three sources (`--target average`, 128 held-out
windows each). Then the recommended, natural and uniform mixtures are trained at width 128 with 3 blocks (4.8x
the proxies' parameters) for 300 steps, 3 seeds each. Printed: the validation table, whether the recommended
mixture beats the others beyond the seed spread (the target: both), and the law's prediction for it against the
measured loss (the target: within 2%). Runs already trained in OUT are reused.

    python benchmarks/mix_validate.py --out runs/mix-validate
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from mix_planted import CONFIG, SHARED, source_documents

SIZES = {"shakespeare": 300_000, "wiki": 2_000_000, "zh": 600_000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/mix-validate"))
    parser.add_argument("--steps", type=int, default=300, help="steps of each proxy")
    parser.add_argument("--larger-steps", type=int, default=300, help="steps of each validation run")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument(
        "--target",
        default="1,1,0",
        help="liandan mix --target (default 1,1,0: the two English sources; average: all three)",
    )
    a = parser.parse_args()
    if not SHARED.is_dir():
        print(f"the shared corpora are not at {SHARED}", file=sys.stderr)
        return 2
    from liandan.data import ByteTokenizer, shard_path, write_manifest, write_shard

    out = a.out.resolve()
    stores = []
    for name, docs in source_documents(SIZES).items():
        path = out / "stores" / name
        if not (path / "manifest.json").exists():
            write_manifest(path, [write_shard(docs, ByteTokenizer(), shard_path(path, 0))], ByteTokenizer())
        stores.append(str(path))
    config = out / "run.toml"
    config.write_text(CONFIG.format(out=out, stores=json.dumps(stores)))
    command = [sys.executable, "-m", "liandan.cli", "mix", str(config), "--out", str(out / "mix"), "--target",
               a.target, "--parallel", str(a.parallel), f"--train.steps={a.steps}", "--data.val_fraction=0.1",
               "--eval.heldout_sequences=256",
               "--validate", "--seeds", str(a.seeds), "--larger", "model.dim=128", "--larger", "model.n_layers=3",
               "--larger", f"train.steps={a.larger_steps}"]  # fmt: skip
    if subprocess.run(command, check=False).returncode:
        return 1
    report = json.loads((out / "mix" / f"validate-{a.target.replace(',', '-')}.json").read_text())
    rec = report["mixtures"]["recommended"]
    for other, b in report["beats"].items():
        print(f"recommended beats {other} beyond the seed spread: {b['beyond_spread']} (target: True), margin"
              f" {b['margin']:+.4f} bits/byte")  # fmt: skip
    print(f"prediction error for the recommended mixture: {rec['error_relative']:+.2%} (target: within 2%);"
          f" {report['parameters']['ratio']:.1f}x the proxies' parameters (target: >= 4x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
