"""`liandan generate`: a trained run's newest checkpoint continues a prompt, sampled with a seed or greedy,
and the sampler beside the greedy generation of evaluation."""

from __future__ import annotations

import pytest
import torch

from helpers import liandan_here, run_liandan, tiny_config, write_corpus
from liandan.evaluate.loading import load_for_eval
from liandan.evaluate.scoring import Sampler, generate
from liandan.train.trainer import Trainer


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """Six steps of a tiny byte-level model with a checkpoint at the last."""
    tmp = tmp_path_factory.mktemp("generate")
    cfg = tiny_config(tmp, write_corpus(tmp, n_docs=20), "--checkpoint.async_save=false", "--checkpoint.every=6")
    Trainer(cfg, say=lambda m: None).train()
    return tmp / "run"


def test_generate_samples_a_run_from_another_directory(trained_run, tmp_path):
    args = ("generate", trained_run, "The ", "--max-new-tokens=12", "--num-samples=2", "--temperature=2")
    first = run_liandan(*args, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    samples = first.stdout.split("--- sample ")[1:]
    assert len(samples) == 2 and all(s.split("\n", 1)[1].startswith("The ") for s in samples)
    assert samples[0].split("\n", 1)[1] != samples[1].split("\n", 1)[1]  # two draws, not one text twice
    again = liandan_here(*args)
    assert again.returncode == 0 and again.stdout == first.stdout  # one seed, one text
    other = liandan_here(*args, "--seed=1")
    assert other.stdout != first.stdout


def test_greedy_generate_is_the_evaluation_greedy_continuation(trained_run):
    model, tokenizer, _ = load_for_eval(trained_run)
    prompt = tokenizer.encode_batch(["Every "])[0]
    expected = generate(model, [prompt], max_new_tokens=10)[0]
    assert generate(model, [prompt], max_new_tokens=10, sampler=Sampler(temperature=0))[0] == expected
    assert (
        generate(model, [prompt], max_new_tokens=10, sampler=Sampler(temperature=1.0, top_k=1, seed=5))[0] == expected
    )
    done = liandan_here("generate", trained_run, "Every ", "--max-new-tokens=10", "--temperature=0")
    assert done.returncode == 0 and done.stdout == tokenizer.decode([*prompt, *expected]) + "\n"


def test_sampler_draws_only_from_the_top_k():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0, 1.0]]).repeat(400, 1)
    drawn = Sampler(temperature=1.0, top_k=2, seed=0).choose(logits)
    assert set(drawn.tolist()) == {1, 2}
    assert set(Sampler(temperature=50.0, seed=0).choose(logits).tolist()) == {0, 1, 2, 3, 4}
    for temperature in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="must be a finite number, at least 0"):
            Sampler(temperature=temperature)


def test_prompt_seeds_draw_each_prompt_alike_alone_or_batched_with_or_without_the_cache(trained_run):
    model, tokenizer, _ = load_for_eval(trained_run)
    prompts = tokenizer.encode_batch(["The ", "Every word ", "A"])

    def drawn(chosen, seeds, **kwargs):
        sampler = Sampler(temperature=1.5, prompt_seeds=seeds)
        return generate(model, chosen, max_new_tokens=8, batch_size=3, sampler=sampler, **kwargs)

    together = drawn(prompts, [11, 12, 13])
    assert drawn(prompts[1:2], [12]) == together[1:2]  # alone, unpadded: the same draws
    assert drawn(prompts, [11, 12, 13], use_cache=False) == together
    other = drawn(prompts, [11, 99, 13])
    assert other[0] == together[0] and other[2] == together[2] and other[1] != together[1]


def test_a_long_prompt_is_cut_from_the_left_and_said(trained_run):
    done = liandan_here("generate", trained_run, "word " * 40, "--max-new-tokens=8", "--temperature=0")
    assert done.returncode == 0, done.stderr
    assert "cut from the left to its last 56" in done.stderr
    assert done.stdout.startswith(" word" * 11)  # the last 56 bytes of "word " * 40


def test_errors_are_one_line(trained_run, tmp_path):
    (tmp_path / "fresh").mkdir()
    no_checkpoint = liandan_here("generate", tmp_path / "fresh", "x")
    assert no_checkpoint.returncode == 2 and "no checkpoint at" in no_checkpoint.stderr
    assert len(no_checkpoint.stderr.strip().splitlines()) == 1
    too_many = liandan_here("generate", trained_run, "x", "--max-new-tokens=64")
    assert too_many.returncode == 2 and "at most 63" in too_many.stderr
    missing = liandan_here("generate", tmp_path / "nowhere", "x")
    assert missing.returncode == 2 and "no such run or checkpoint" in missing.stderr
    bad = liandan_here("generate", trained_run, "x", "--top-k=0")
    assert bad.returncode == 2 and "--top-k" in bad.stderr
    refused = {
        ("--temperature=nan",): "--temperature = nan must be a finite number",
        ("--temperature=inf",): "--temperature = inf must be a finite number",
        ("--device", "bogus"): "--device bogus: not a device",
        ("--device", "meta"): "--device meta: the meta device holds no weights",
        ("--device", "cuda:99"): "--device cuda:99: this machine has",
    }
    if not torch.cuda.is_available():
        refused["--device", "cuda"] = "--device cuda: this machine has no cuda device"
    for flags, expected in refused.items():
        done = liandan_here("generate", trained_run, "x", "--max-new-tokens=2", *flags)
        assert done.returncode == 2 and done.stdout == "", (flags, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"liandan: error: {expected}"), (flags, done.stderr)
