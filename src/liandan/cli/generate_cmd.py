"""`liandan generate RUN|CKPT "prompt"`: continue a prompt with a checkpoint's model. The newest complete
checkpoint of a run (or the checkpoint named), the tokenizer it was trained with, and generation with the
KV cache: sampled at `--temperature` from the `--top-k` likeliest tokens, seeded, or greedy at temperature 0.
The texts go to stdout, one block per sample; what was cut to fit the model's window is said on stderr."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from liandan.config import ConfigError


def add_commands(sub) -> None:
    p = sub.add_parser("generate")
    p.add_argument("path", help="a run directory (its newest checkpoint), a checkpoints directory or a step directory")
    p.add_argument("prompt", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate at most (default 100)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=200, help="draw from the k likeliest tokens only (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling: one seed, one text (default 0)")
    p.add_argument("--num-samples", type=int, default=1, help="continuations to generate (default 1)")
    p.add_argument("--device", default=None, help="where the model runs (default: cuda when there is one, else cpu)")
    p.add_argument("--tokenizer", help="'byte' or a tokenizer.json, instead of the one the checkpoint records")
    p.set_defaults(command=cmd_generate)


def cmd_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"liandan generate takes no config overrides: {' '.join(overrides)}")
    _check(args)
    path = Path(args.path)
    if not path.exists():
        raise ConfigError(f"liandan generate: no such run or checkpoint: {path}")
    from liandan.evaluate.loading import evaluation_device, load_for_eval

    device = evaluation_device(args.device)
    model, tokenizer, _ = load_for_eval(path, tokenizer=args.tokenizer, device=device)
    for text in generate_texts(model, tokenizer, args, say=lambda line: print(line, file=sys.stderr)):
        print(text)
    return 0


def _check(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens = {args.max_new_tokens} must be at least 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature = {args.temperature} must be a finite number, at least 0")
    if args.top_k < 1:
        raise ConfigError(f"--top-k = {args.top_k} must be at least 1")
    if args.num_samples < 1:
        raise ConfigError(f"--num-samples = {args.num_samples} must be at least 1")
    if not args.prompt:
        raise ConfigError("the prompt is empty")


def generate_texts(model, tokenizer, args: argparse.Namespace, say) -> list[str]:
    """The prompt followed by each sample's continuation. A prompt longer than the model's window less the
    new tokens is cut from the left, and `say` tells so."""
    from liandan.evaluate.scoring import Sampler, generate

    window = model.args.max_seq_len
    if args.max_new_tokens >= window:
        raise ConfigError(f"--max-new-tokens = {args.max_new_tokens} leaves no room for the prompt in the model's "
                          f"window of {window} tokens; at most {window - 1}")  # fmt: skip
    ids = tokenizer.encode_batch([args.prompt])[0]
    kept = window - args.max_new_tokens
    if len(ids) > kept:
        say(f"note: the prompt's {len(ids)} tokens were cut from the left to its last {kept}, to leave room for "
            f"{args.max_new_tokens} new tokens in the model's window of {window}")  # fmt: skip
        ids = ids[-kept:]
    sampler = Sampler(args.temperature, args.top_k, args.seed)
    outputs = generate(model, [ids] * args.num_samples, max_new_tokens=args.max_new_tokens,
                       eos_id=tokenizer.eos_id, batch_size=args.num_samples, sampler=sampler)  # fmt: skip
    texts = [tokenizer.decode([*ids, *output]) for output in outputs]
    if args.num_samples == 1:
        return texts
    return [f"--- sample {i + 1}\n{text}" for i, text in enumerate(texts)]
