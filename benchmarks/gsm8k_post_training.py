"""After pretraining, on GSM8K: supervised fine-tuning, preferences from verifiable answers, DPO, and the tax.

    python benchmarks/gsm8k_post_training.py --out runs/gsm8k

1. A small Llama pretrained on the shared English and Chinese text (`liandan train`, BPE trained for the run,
   room in the embedding for ChatML's two markers).
2. The shared GSM8K split by the fixed rule of `liandan.evaluate.tasks.split_items` (every 5th item, indices 4,
   9, 14, ..., is held out) into fine-tuning items and held-out items; SFT on the fine-tuning items as one-turn
   chats, the answer the assistant's turn (`train.objective = "sft"`, from the pretrained checkpoint, with its
   tokenizer).
3. On the held-out items: the answer's loss (nats per answer token, ChatML-rendered question as context) of the
   base and of the fine-tuned model, and the share of the fine-tuned model's greedy answers that end in the
   `#### N` form.
4. `liandan eval SFT --against BASE` on the shipped tasks (every prompt format) and the base's held-out text:
   the scores before and after fine-tuning (the alignment tax), recorded and shown by `liandan report SFT`.
5. `liandan prefs` samples 4 answers per fine-tuning question from the fine-tuned model and pairs a correct one
   (or the reference answer, when none is) with a wrong one; the same on the held-out questions.
6. DPO from the fine-tuned checkpoint on the fine-tuning pairs (`train.objective = "dpo"`); on the held-out
   pairs, the reward accuracy (the policy's implicit reward beta * (log pi - log pi_ref) higher for the
   chosen reply), the margin, and the KL to the reference (the run's own `kl/token` metric, and the
   sequence-level log-ratio of the held-out replies).

Each phase's output is kept under --out and a phase whose output exists is not run again. Prints a table;
`--json` writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
CORPUS = [SHARED / "corpus" / name for name in ("en-wikitext2.jsonl", "zh-classics.jsonl", "en-shakespeare.txt")]
GSM8K = SHARED / "eval" / "gsm8k-test.jsonl"
ANSWER = re.compile(r"#### (-?[0-9.,]+)\s*$")
COMMON = ["--doctor.preflight=false", "--resilience.supervise=false", "--train.dtype=fp32"]
MODEL = ["--model.max_seq_len=512", "--model.vocab_size=4160"]  # configs/tiny.toml's Llama, room for ChatML


def liandan(*args: str) -> str:
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "liandan.cli", *args], check=False, text=True, capture_output=True)
    if done.returncode:
        sys.exit(f"liandan {' '.join(args[:3])} failed:\n{done.stderr[-3000:]}")
    print(f"  liandan {' '.join(args[:2])}: {time.time() - started:.0f} s", file=sys.stderr)
    return done.stdout


def newest_checkpoint(run: Path) -> Path:
    return max((run / "checkpoints").glob("step-*"))


def finished(run: Path, steps: int) -> bool:
    return (run / "checkpoints" / f"step-{steps:08d}").is_dir()


def split(out: Path) -> tuple[list[dict], list[dict]]:
    from liandan.evaluate.tasks import split_items

    items = [json.loads(line) for line in GSM8K.read_text().splitlines() if line.strip()]
    tune = [items[i] for i in split_items(len(items), "train")]
    held = [items[i] for i in split_items(len(items), "heldout")]
    chats = out / "gsm8k-sft.jsonl"
    if not chats.is_file():
        lines = [json.dumps({"prompt": item["question"], "response": item["answer"]}) for item in tune]
        chats.write_text("\n".join(lines) + "\n")
    return tune, held


def answer_losses(checkpoint: Path, tokenizer: Path, held: list[dict]) -> float:
    """Mean loss (nats) per answer token over the held-out items, the answer and its end token after the
    ChatML-rendered question, as fine-tuning sees them."""
    from liandan.evaluate.loading import load_for_eval
    from liandan.evaluate.runner import split_context
    from liandan.evaluate.scoring import loglikelihoods

    model, tok, _ = load_for_eval(checkpoint, tokenizer=str(tokenizer))
    requests, tokens = [], 0
    for item in held:
        context, continuation = split_context(tok, prompt_text(item), item["answer"] + "<|im_end|>")
        requests.append(([tok.eos_id, *context], continuation))
        tokens += len(continuation)
    return -sum(ll for ll, _ in loglikelihoods(model, requests, batch_size=16)) / tokens


def prompt_text(item: dict) -> str:
    return f"<|im_start|>user\n{item['question']}<|im_end|>\n<|im_start|>assistant\n"


def answer_form(checkpoint: Path, tokenizer: Path, held: list[dict], out: Path) -> dict[str, float]:
    """The share of answers (at most 320 new tokens, stopped at `<|im_end|>`) that end in `#### N`: greedy, and
    sampled at temperature 0.5 from the 50 likeliest tokens (seed 0)."""
    from liandan.evaluate.loading import load_for_eval
    from liandan.evaluate.scoring import Sampler, generate

    model, tok, _ = load_for_eval(checkpoint, tokenizer=str(tokenizer))
    prompts = [[tok.eos_id, *tok.encode_batch([prompt_text(item)])[0]] for item in held]
    shares = {}
    for name, sampler in (("greedy", None), ("sampled", Sampler(0.5, 50, seed=0))):
        outputs = generate(model, prompts, max_new_tokens=320, stop_sequences=[[tok.token_id("<|im_end|>")]],
                           eos_id=tok.eos_id, batch_size=16, sampler=sampler)  # fmt: skip
        texts = [tok.decode(o) for o in outputs]
        with (out / f"sft-heldout-answers-{name}.jsonl").open("w") as f:
            for item, text in zip(held, texts, strict=True):
                f.write(json.dumps({"question": item["question"], "answer": text}) + "\n")
        shares[name] = sum(bool(ANSWER.search(t.strip())) for t in texts) / len(texts)
    return shares


def held_out_rewards(policy: Path, reference: Path, tokenizer: Path, pairs: Path, beta: float) -> dict:
    """Reward accuracy, mean margin and the sequence log-ratio of the chosen replies on held-out pairs."""
    from liandan.evaluate.loading import load_for_eval
    from liandan.evaluate.runner import split_context
    from liandan.evaluate.scoring import loglikelihoods

    records = [json.loads(line) for line in pairs.read_text().splitlines() if line.strip()]
    tok = None
    logps = {}
    for name, checkpoint in (("policy", policy), ("reference", reference)):
        model, tok, _ = load_for_eval(checkpoint, tokenizer=str(tokenizer))
        requests = []
        for record in records:
            for side in ("chosen", "rejected"):
                context, continuation = split_context(tok, prompt_text({"question": record["prompt"]}),
                                                      record[side] + "<|im_end|>")  # fmt: skip
                requests.append(([tok.eos_id, *context], continuation))
        logps[name] = [ll for ll, _ in loglikelihoods(model, requests, batch_size=16)]
    ratio = [p - r for p, r in zip(logps["policy"], logps["reference"], strict=True)]
    chosen, rejected = ratio[0::2], ratio[1::2]
    margins = [beta * (c - r) for c, r in zip(chosen, rejected, strict=True)]
    return {
        "pairs": len(records),
        "reward_accuracy": sum(m > 0 for m in margins) / len(margins),
        "reward_margin": sum(margins) / len(margins),
        "chosen_log_ratio": sum(chosen) / len(chosen),
        "rejected_log_ratio": sum(rejected) / len(rejected),
    }


def last_metric(run: Path, key: str) -> float | None:
    found = None
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        found = record.get(key, found)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gsm8k"))
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--dpo-steps", type=int, default=150)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--samples", type=int, default=4, help="answers sampled per question by liandan prefs")
    parser.add_argument("--eval-limit", type=int, default=40, help="items per shipped task before and after")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    missing = [p for p in [*CORPUS, GSM8K] if not p.is_file()]
    if missing:
        sys.exit(f"the shared data is not there: {missing[0]} (see ../shared/README.md)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}

    base = out / "base"
    if not finished(base, args.pretrain_steps):
        liandan("train", "configs/tiny.toml", *COMMON, *MODEL, f"--run.output_dir={out}", "--run.name=base",
                f"--data.paths={json.dumps([str(p) for p in CORPUS])}", "--data.bpe_vocab_size=4096",
                "--train.seq_len=256", "--train.global_batch=16", f"--train.steps={args.pretrain_steps}",
                "--optim.lr=1e-3", "--schedule.warmup_steps=50", "--train.eval_every=0", "--eval.every=0")  # fmt: skip
    tokenizer = base / "data" / "tokenizer.json"
    base_ckpt = newest_checkpoint(base)
    tune, held = split(out)

    sft = out / "sft"
    if not finished(sft, args.sft_steps):
        liandan("train", "configs/tiny.toml", *COMMON, *MODEL, f"--run.output_dir={out}", "--run.name=sft",
                "--train.objective=sft", f"--checkpoint.init_from={base_ckpt}", f"--data.tokenizer={tokenizer}",
                f"--data.paths={json.dumps([str(out / 'gsm8k-sft.jsonl')])}", "--data.val_fraction=0",
                "--train.seq_len=384", "--train.global_batch=16", f"--train.steps={args.sft_steps}",
                "--optim.lr=1e-3", "--schedule.warmup_steps=20", "--train.eval_every=0", "--eval.every=0")  # fmt: skip
    sft_ckpt = newest_checkpoint(sft)
    sft_tokenizer = sft / "data" / "tokenizer.json"
    results["held_out_items"] = len(held)
    results["fine_tuning_items"] = len(tune)
    results["answer_loss_base"] = answer_losses(base_ckpt, sft_tokenizer, held)
    results["answer_loss_sft"] = answer_losses(sft_ckpt, sft_tokenizer, held)
    results["answer_form_sft"] = answer_form(sft_ckpt, sft_tokenizer, held, out)
    print(json.dumps(results), file=sys.stderr)

    tax = out / "tax.json"
    if not tax.is_file():  # the shipped tasks (every prompt format) and the base's held-out text, before and after
        liandan("eval", str(sft_ckpt), f"--against={base_ckpt}", "--tasks=gsm8k,cloze_en,cloze_zh",
                f"--limit={args.eval_limit}", f"--data-dir={SHARED}", "--record", f"--json={tax}")  # fmt: skip
        liandan("report", str(sft))
    results["alignment_tax"] = json.loads(tax.read_text())["tax"]

    pairs = {}
    for items in ("train", "heldout"):
        pairs[items] = out / f"prefs-{items}.jsonl"
        if not pairs[items].is_file():
            liandan("prefs", str(sft_ckpt), "--task=gsm8k", f"--data-dir={SHARED}", f"--items={items}",
                    f"--samples={args.samples}", "--reference-as-chosen", f"--out={pairs[items]}",
                    "--max-new-tokens=320")  # fmt: skip
        results[f"prefs_{items}"] = json.loads(pairs[items].with_suffix(".summary.json").read_text())

    dpo = out / "dpo"
    if not finished(dpo, args.dpo_steps):
        liandan("train", "configs/tiny.toml", *COMMON, *MODEL, f"--run.output_dir={out}", "--run.name=dpo",
                "--train.objective=dpo", f"--checkpoint.init_from={sft_ckpt}", f"--data.tokenizer={sft_tokenizer}",
                f"--data.paths={json.dumps([str(pairs['train'])])}", "--data.val_fraction=0",
                f"--train.dpo_beta={args.beta}", "--train.seq_len=384", "--train.global_batch=8",
                f"--train.steps={args.dpo_steps}", "--optim.lr=2e-5", "--schedule.warmup_steps=10",
                "--train.eval_every=0", "--eval.every=0")  # fmt: skip
    dpo_ckpt = newest_checkpoint(dpo)
    results["dpo_held_out"] = held_out_rewards(dpo_ckpt, sft_ckpt, sft_tokenizer, pairs["heldout"], args.beta)
    results["dpo_train_kl"] = last_metric(dpo, "kl/token")
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    os.chdir(REPO)
    main()
