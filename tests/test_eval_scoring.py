"""Scoring primitives against direct computations with the model: log-likelihoods against a full forward and
a log-softmax, cached generation against generation that reruns the whole prompt, rolling log-likelihoods
against the document's windows scored one by one, and sharded scoring (FSDP2, tensor parallel, real gloo
processes) against one process.

The test model has a large init_std so that its logits are far apart: greedy choices then never hinge on the
last bits of a sum, and "token for token" is a fair demand of two computations that add in different orders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval_shard_worker import build, score_case
from helpers import free_port
from liandan.evaluate import scoring
from liandan.model import KVCache, ModelArgs, Transformer

ARGS = {"vocab_size": 61, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 40, "init_std": 0.3}


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelArgs(**ARGS)).eval()


def _random_tokens(generator: torch.Generator, low: int, high: int) -> list[int]:
    n = int(torch.randint(low, high, (1,), generator=generator))
    return torch.randint(0, ARGS["vocab_size"], (n,), generator=generator).tolist()


def _requests(seed: int, n: int, longest_context: int = 30) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [(_random_tokens(g, 1, longest_context), _random_tokens(g, 1, 8)) for _ in range(n)]


def _choices(seed: int, questions: int, choices: int) -> list[tuple[list[int], list[int]]]:
    """Multiple-choice requests: several continuations (one token long among them) of each context."""
    g = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(questions):
        context = _random_tokens(g, 2, 30)
        requests += [(context, _random_tokens(g, 1, 2 if c == 0 else 8)) for c in range(choices)]
    return requests


@torch.no_grad()
def direct_loglikelihood(model, context, continuation, max_len) -> tuple[float, bool]:
    whole = torch.tensor([[*context, *continuation][-(max_len + 1) :]])
    logprobs = model(whole[:, :-1])[0].float().log_softmax(-1)[-len(continuation) :]
    target = torch.tensor(continuation)
    return logprobs.gather(-1, target[:, None]).sum().item(), bool((logprobs.argmax(-1) == target).all())


@pytest.mark.parametrize(
    "batch_size, max_len, shared",
    [(1, None, False), (4, None, False), (16, 12, False), (3, None, True), (16, None, True), (16, 12, True)],
    ids=["single", "batched", "truncated", "shared-context-split", "shared-context", "shared-truncated"],
)
def test_loglikelihoods_equal_a_direct_forward(model, batch_size, max_len, shared):
    """Shared: the choices of a question read their common context once from the KV cache, also when a
    question has more choices than a batch holds; with truncation, contexts shared before it may not be."""
    requests = _choices(1, 4, 5) + _requests(2, 3) if shared else _requests(1, 11)
    got = scoring.loglikelihoods(model, requests, batch_size=batch_size, max_len=max_len)
    for (context, continuation), (logprob, greedy) in zip(requests, got, strict=True):
        want, want_greedy = direct_loglikelihood(model, context, continuation, max_len or ARGS["max_seq_len"])
        assert logprob == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert greedy == want_greedy


def test_shared_contexts_near_max_seq_len_with_long_continuations_beside_them(model):
    """Each request fits alone, but a batch that read the longest context's cache slots against the longest
    continuation of another question would run past the model's positions: the batches must keep apart."""
    g = torch.Generator().manual_seed(4)
    long_context, short_context = _random_tokens(g, 37, 38), _random_tokens(g, 5, 6)
    requests = [(long_context, _random_tokens(g, 1, 2)), (long_context, _random_tokens(g, 2, 3)),
                (short_context, _random_tokens(g, 8, 9)), (short_context, _random_tokens(g, 3, 4))]  # fmt: skip
    got = scoring.loglikelihoods(model, requests, batch_size=16)
    for (context, continuation), (logprob, greedy) in zip(requests, got, strict=True):
        want, want_greedy = direct_loglikelihood(model, context, continuation, ARGS["max_seq_len"])
        assert logprob == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert greedy == want_greedy


def test_the_models_own_greedy_continuation_is_greedy(model):
    prompt = _requests(2, 1)[0][0]
    continuation = scoring.generate(model, [prompt], max_new_tokens=5)[0]
    wrong = [(continuation[0] + 1) % ARGS["vocab_size"], *continuation[1:]]
    (_, greedy), (_, not_greedy) = scoring.loglikelihoods(model, [(prompt, continuation), (prompt, wrong)])
    assert greedy and not not_greedy


@pytest.mark.parametrize(
    "request_, message",
    [
        (([], [1]), "request 0: the context is empty"),
        (([1], []), "request 0: the continuation is empty"),
        (([1], [1] * 41), "request 0: a continuation of 41 tokens exceeds max_len = 40"),
    ],
    ids=["empty-context", "empty-continuation", "too-long"],
)
def test_bad_requests_are_refused_in_one_line(model, request_, message):
    with pytest.raises(ValueError, match=message):
        scoring.loglikelihoods(model, [request_])


@torch.no_grad()
def test_cached_forward_gives_the_logits_of_a_full_forward(model):
    """Two rows, one left-padded, run into the cache and then one token at a time: each step's logits are
    those of each row's unpadded sequence run whole."""
    sequence = torch.tensor(_random_tokens(torch.Generator().manual_seed(3), 30, 31))
    n, pad, prompt = len(sequence), 3, 8
    cache = KVCache(n, torch.tensor([pad, 0]))
    first = torch.stack([torch.cat([torch.zeros(pad, dtype=torch.long), sequence[: prompt - pad]]), sequence[:prompt]])
    steps = [model(first, cache=cache)[:, -1]]
    for slot in range(prompt, n):
        step = torch.stack([sequence[slot - pad : slot - pad + 1], sequence[slot : slot + 1]])
        steps.append(model(step, cache=cache)[:, -1])
    cached = torch.stack(steps, dim=1)
    torch.testing.assert_close(cached[0], model(sequence[None, : n - pad])[0, prompt - pad - 1 :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached[1], model(sequence[None])[0, prompt - 1 :], rtol=1e-5, atol=1e-5)


def test_cached_generation_equals_uncached_token_for_token(model):
    prompts = [context for context, _ in _requests(5, 9)]
    cached = scoring.generate(model, prompts, max_new_tokens=12, batch_size=4)
    uncached = scoring.generate(model, prompts, max_new_tokens=12, use_cache=False)
    assert cached == uncached
    assert all(len(out) == 12 for out in cached)


def test_stop_sequences_and_end_of_document_cut_the_output(model):
    prompts = [context for context, _ in _requests(6, 4)]
    free = scoring.generate(model, prompts, max_new_tokens=10)
    stop = free[0][4:6]  # the first prompt's output stops where this pair first appears
    first = next(i for i in range(len(free[0])) if free[0][i : i + 2] == stop)
    eos = free[1][3]
    for use_cache in (True, False):
        cut = scoring.generate(model, prompts, max_new_tokens=10, stop_sequences=[stop], use_cache=use_cache)
        assert cut[0] == free[0][:first]
        kept = scoring.generate(model, prompts[:1], max_new_tokens=10, stop_sequences=[stop], use_cache=use_cache,
                                keep_stop=True)  # fmt: skip
        assert kept[0] == free[0][: first + 2]
        by_eos = scoring.generate(model, prompts[1:2], max_new_tokens=10, eos_id=eos, use_cache=use_cache)
        assert by_eos[0] == free[1][: free[1].index(eos)]


def test_prompts_are_cut_from_the_left_to_leave_room(model):
    long_prompt = list(range(50))
    out = scoring.generate(model, [long_prompt], max_new_tokens=8)
    assert out == scoring.generate(model, [long_prompt[-32:]], max_new_tokens=8)
    with pytest.raises(ValueError, match="max_new_tokens = 40 must be between 1 and max_seq_len - 1 = 39"):
        scoring.generate(model, [long_prompt], max_new_tokens=40)


@torch.no_grad()
def test_rolling_loglikelihood_of_a_short_document_is_its_sum(model):
    document = _random_tokens(torch.Generator().manual_seed(7), 20, 30)
    logprobs = model(torch.tensor([[0, *document[:-1]]]))[0].float().log_softmax(-1)
    want = logprobs.gather(-1, torch.tensor(document)[:, None]).sum().item()
    assert scoring.rolling_loglikelihood(model, document, prefix_token=0) == pytest.approx(want, rel=1e-5)


@torch.no_grad()
def test_rolling_loglikelihood_of_a_long_document_predicts_each_token_once(model):
    """Chunks of max_len predictions; full chunks read only the token before them, the last one as much text
    before it as fits (lm-eval's disjoint rolling windows)."""
    document = _random_tokens(torch.Generator().manual_seed(8), 57, 58)
    max_len = 16
    sequence = [0, *document]
    want = 0.0
    for start in range(1, len(sequence), max_len):
        end = min(start + max_len, len(sequence))
        inputs = sequence[max(0, end - max_len - 1) : end - 1]
        logprobs = model(torch.tensor([inputs]))[0].float().log_softmax(-1)[-(end - start) :]
        want += logprobs.gather(-1, torch.tensor(sequence[start:end])[:, None]).sum().item()
    windows = scoring.rolling_windows(document, max_len=max_len, prefix_token=0)
    assert sum(len(continuation) for _, continuation in windows) == len(document)
    assert scoring.rolling_loglikelihood(model, document, max_len=max_len, prefix_token=0) == pytest.approx(
        want, rel=1e-5
    )


def test_scoring_restores_the_models_mode(model):
    model.train()
    model.attention_backend = "flex"
    scoring.loglikelihoods(model, [([1, 2], [3])])
    assert model.training and model.attention_backend == "flex"
    model.eval()
    model.attention_backend = "sdpa"


# ---------------------------------------------------------------------------------------------------------
# sharded: one run of two gloo processes checks FSDP2 and tensor parallelism


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded-scoring")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(9)
    case = {
        "args": ARGS,
        "state": Transformer(ModelArgs(**ARGS)).state_dict(),
        "requests": _requests(10, 7) + _choices(12, 3, 4),
        "documents": [_random_tokens(g, 5, 60) for _ in range(3)],
        "rolling_max_len": 16,
        "prompts": [context for context, _ in _requests(11, 5)],
        "max_new_tokens": 6,
    }
    torch.save(case, root / "case.pt")
    port = str(free_port())
    worker = Path(__file__).with_name("eval_shard_worker.py")
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(worker), str(root / "case.pt"), str(root)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    return score_case(build(case), case), ranks


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "tp", "tp_sp"])
def test_sharded_scoring_equals_one_process(sharded, layout):
    single, ranks = sharded
    for got in (r[layout] for r in ranks):
        assert got["generated"] == single["generated"]
        assert [g for _, g in got["loglikelihoods"]] == [g for _, g in single["loglikelihoods"]]
        assert [lp for lp, _ in got["loglikelihoods"]] == pytest.approx(
            [lp for lp, _ in single["loglikelihoods"]], rel=1e-5
        )
        assert got["rolling"] == pytest.approx(single["rolling"], rel=1e-5)
    assert ranks[0][layout] == ranks[1][layout]  # every rank gets the same answers, to the bit
