"""Scoring a liandan model: log-likelihoods of continuations, rolling log-likelihoods of whole documents and
greedy or sampled generation, on token ids.

The semantics are lm-evaluation-harness's, so that its tasks and liandan's give the same numbers: a request
(context, continuation) is scored on (context + continuation) cut from the left to `max_len + 1` tokens, the
model reading all but the last and every continuation token being predicted from the tokens before it; a
document's rolling log-likelihood predicts each token exactly once, in windows of `max_len` predictions.

The model may be plain or sharded (FSDP2, tensor parallel, both): every rank calls with the same requests,
runs the same batches in the same order (the collectives of a sharded forward pair up) and gets the same
answers. Nothing here is a collective of its own.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from liandan.model.kv_cache import KVCache
from liandan.train.parallelize import reshard, sequence_split


def model_args(model: nn.Module):
    """The family args of a model, through a DDP wrapper if there is one."""
    return getattr(model, "module", model).args


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@contextlib.contextmanager
def scoring_mode(model: nn.Module) -> Iterator[None]:
    """Evaluation mode without gradients, and SDPA in place of FlexAttention: scoring uses plain causal masks,
    for which SDPA is as fast, and FlexAttention would compile a kernel for every new batch shape. Whatever
    the model was set to is restored afterwards, and FSDP2's units sharded again (this runs in the middle of
    training too)."""
    inner = getattr(model, "module", model)
    backend, training = inner.attention_backend, model.training
    if backend == "flex":
        inner.attention_backend = "sdpa"
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        inner.attention_backend = backend
        model.train(training)
        reshard(model)  # FSDP2 keeps the last units gathered after a forward: give that memory back to training


def _max_len(model: nn.Module, max_len: int | None) -> int:
    limit = model_args(model).max_seq_len
    if max_len is None:
        return limit
    if not 1 <= max_len <= limit:
        raise ValueError(f"max_len = {max_len} must be between 1 and the model's max_seq_len = {limit}")
    return max_len


def loglikelihoods(
    model: nn.Module,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int = 16,
    max_len: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[tuple[float, bool]]:
    """For each (context, continuation) of token ids: (sum of log p(continuation | context), whether every
    continuation token is the model's greedy choice). The context must have at least one token (lm-eval
    starts an empty one with the end-of-document token); (context + continuation) is cut from the left to
    `max_len + 1` tokens (default: the model's max_seq_len). `progress` is called with the number of
    requests of each batch scored."""
    max_len = _max_len(model, max_len)
    windows: list[tuple[list[int], int]] = []
    for i, (context, continuation) in enumerate(requests):
        if not continuation:
            raise ValueError(f"request {i}: the continuation is empty")
        if not context:
            raise ValueError(f"request {i}: the context is empty; begin it with the end-of-document token")
        if len(continuation) > max_len:
            raise ValueError(f"request {i}: a continuation of {len(continuation)} tokens exceeds max_len = {max_len}")
        whole = [*context, *continuation][-(max_len + 1) :]
        windows.append((whole, len(continuation)))
    results: list[tuple[float, bool]] = [(0.0, False)] * len(windows)
    # Requests that share their context (the choices of a multiple-choice question, after a few-shot prompt
    # that is most of the tokens) read it once, into a KV cache that each continuation then reads.
    by_context: dict[tuple[int, ...], list[int]] = {}
    for i, (whole, n) in enumerate(windows):
        by_context.setdefault(tuple(whole[:-n]), []).append(i)
    # Under sequence parallelism a KV-cache step of a few positions cannot be split: every request alone.
    cached = sequence_split(model) == 1
    alone = [i for members in by_context.values() if len(members) == 1 or not cached for i in members]
    shared = [members for members in by_context.values() if len(members) > 1 and cached]
    # Longest first: the batches are padded to less, and a batch too large for memory fails at once.
    alone.sort(key=lambda i: -len(windows[i][0]))
    shared.sort(key=lambda members: -len(windows[members[0]][0]))
    batches = [(alone[i : i + batch_size], _score_batch) for i in range(0, len(alone), batch_size)]
    positions = model_args(model).max_seq_len
    batches += [(batch, _score_shared_batch) for batch in _context_batches(shared, windows, batch_size, positions)]
    device = _device(model)
    with scoring_mode(model):
        for batch, score in batches:
            for i, result in zip(batch, score(model, [windows[i] for i in batch], device), strict=True):
                results[i] = result
            if progress is not None:
                progress(len(batch))
    return results


def _context_batches(
    groups: list[list[int]], windows: list[tuple[list[int], int]], batch_size: int, positions: int
) -> list[list[int]]:
    """Groups of requests with one context, packed whole (or split, when larger than a batch) into batches
    of at most `batch_size` requests. A batch reads every continuation slot against every context: the
    longest context plus the longest continuation must stay within the model's `positions` (its rotary
    table), although each request alone was cut to fit, so a group that would pass it starts a new batch."""
    chunks = [group[i : i + batch_size] for group in groups for i in range(0, len(group), batch_size)]
    batches: list[list[int]] = []
    longest_context = longest_continuation = 0
    for chunk in chunks:
        context = len(windows[chunk[0]][0]) - windows[chunk[0]][1]
        continuation = max(windows[i][1] for i in chunk)
        fits = max(longest_context, context) + max(longest_continuation, continuation) - 1 <= positions
        if batches and len(batches[-1]) + len(chunk) <= batch_size and fits:
            batches[-1].extend(chunk)
            longest_context, longest_continuation = (
                max(longest_context, context),
                max(longest_continuation, continuation),
            )
        else:
            batches.append(list(chunk))
            longest_context, longest_continuation = context, continuation
    return batches


def _score_batch(
    model: nn.Module, windows: list[tuple[list[int], int]], device: torch.device
) -> list[tuple[float, bool]]:
    """One forward over right-padded inputs: under a causal mask the padding after a row's last token cannot
    change that row's logits."""
    split = sequence_split(model)
    width = _padded(max(len(whole) - 1 for whole, _ in windows), split)
    inputs = torch.zeros(len(windows), width, dtype=torch.long)
    at = torch.zeros(len(windows), max(n for _, n in windows), dtype=torch.long)
    for row, (whole, n) in enumerate(windows):
        inputs[row, : len(whole) - 1] = torch.tensor(whole[:-1])
        # the logit at position p predicts token p + 1: the continuation's are the last n positions of the input
        at[row, :n] = torch.arange(len(whole) - 1 - n, len(whole) - 1)
    return _summarise(_logits_at(model, inputs.to(device), at.to(device), split), windows)


def _padded(length: int, split: int) -> int:
    """A length sequence parallelism can split: right padding, which a causal mask keeps from every real
    position."""
    return -(-length // split) * split


def _logits_at(model: nn.Module, inputs: torch.Tensor, at: torch.Tensor, split: int) -> torch.Tensor:
    """The logits at positions `at` (B, K). Under sequence parallelism a position's hidden state is on one
    rank only, so the model computes every position's logits (gathered) and they are picked here."""
    if split == 1:
        return model(inputs, logits_at=at)
    return model(inputs)[torch.arange(inputs.shape[0], device=inputs.device)[:, None], at]


def _score_shared_batch(
    model: nn.Module, windows: list[tuple[list[int], int]], device: torch.device
) -> list[tuple[float, bool]]:
    """The batch's distinct contexts, left-padded, go into a KV cache once; its rows are then repeated for
    each continuation, which is read (right-padded) against them. The last context position predicts the
    first continuation token, each continuation token but the last the next."""
    contexts: dict[tuple[int, ...], int] = {}
    rows = [contexts.setdefault(tuple(whole[:-n]), len(contexts)) for whole, n in windows]
    width = max(len(context) for context in contexts)
    longest = max(n for _, n in windows)
    prefix = torch.zeros(len(contexts), width, dtype=torch.long)
    for context, row in contexts.items():
        prefix[row, width - len(context) :] = torch.tensor(context)
    pads = torch.tensor([width - len(context) for context in contexts], device=device)
    cache = KVCache(width + longest - 1, pads)
    last = torch.full((len(contexts), 1), width - 1, device=device)
    repeat = torch.tensor(rows, device=device)
    first = model(prefix.to(device), cache=cache, logits_at=last)[repeat]
    if longest == 1:
        return _summarise(first, windows)
    cache.select(repeat)
    continuations = torch.zeros(len(windows), longest - 1, dtype=torch.long)
    for row, (whole, n) in enumerate(windows):
        continuations[row, : n - 1] = torch.tensor(whole[len(whole) - n : -1])
    return _summarise(torch.cat([first, model(continuations.to(device), cache=cache)], dim=1), windows)


def _summarise(logits: torch.Tensor, windows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
    """(sum of log-probabilities, greedy) of each row's continuation, from its logits (rows, longest, V):
    row r's first n_r logits predict its n_r continuation tokens; the rest is padding."""
    targets = torch.zeros(logits.shape[:2], dtype=torch.long)
    valid = torch.zeros(logits.shape[:2], dtype=torch.bool)
    for row, (whole, n) in enumerate(windows):
        targets[row, :n] = torch.tensor(whole[-n:])
        valid[row, :n] = True
    targets, valid = targets.to(logits.device), valid.to(logits.device)
    logits = logits.float()
    logprobs = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    sums = (logprobs * valid).double().sum(-1)
    greedy = ((logits.argmax(-1) == targets) | ~valid).all(-1)
    return list(zip(sums.tolist(), greedy.tolist(), strict=True))


def rolling_windows(
    tokens: Sequence[int], *, max_len: int, prefix_token: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """A document as (context, continuation) requests that predict each of its tokens once: consecutive
    chunks of `max_len` tokens, each read after as much of the text before it as fits in `max_len` inputs.
    The first token is predicted from `prefix_token` (lm-eval uses the end-of-document token); without one it
    is only read."""
    sequence = list(tokens) if prefix_token is None else [prefix_token, *tokens]
    requests = []
    for start in range(1, len(sequence), max_len):
        end = min(start + max_len, len(sequence))
        requests.append((sequence[max(0, end - max_len - 1) : start], sequence[start:end]))
    return requests


def rolling_loglikelihoods(
    model: nn.Module,
    documents: Sequence[Sequence[int]],
    *,
    max_len: int | None = None,
    prefix_token: int | None = None,
    batch_size: int = 16,
) -> list[float]:
    """The log-likelihood of each whole document (see `rolling_windows`); the windows of all documents are
    batched together."""
    max_len = _max_len(model, max_len)
    requests, owner = [], []
    for d, tokens in enumerate(documents):
        for request in rolling_windows(tokens, max_len=max_len, prefix_token=prefix_token):
            requests.append(request)
            owner.append(d)
    totals = [0.0] * len(documents)
    for d, (logprob, _) in zip(
        owner, loglikelihoods(model, requests, batch_size=batch_size, max_len=max_len), strict=True
    ):
        totals[d] += logprob
    return totals


def rolling_loglikelihood(
    model: nn.Module, tokens: Sequence[int], *, max_len: int | None = None, prefix_token: int | None = None
) -> float:
    """One document's log-likelihood (see `rolling_windows`)."""
    return rolling_loglikelihoods(model, [tokens], max_len=max_len, prefix_token=prefix_token)[0]


class _Output:
    """One prompt's generated tokens, and whether a stop sequence (or the end-of-document token) ended it."""

    def __init__(self, stops: list[list[int]], keep_stop: bool = False):
        self.tokens: list[int] = []
        self.stops = stops
        self.keep_stop = keep_stop
        self.cut: int | None = None

    def push(self, token: int) -> bool:
        """Append a token; True when the output just reached a stop sequence."""
        self.tokens.append(token)
        if not any(self.tokens[-len(s) :] == s for s in self.stops if len(s) <= len(self.tokens)):
            return False
        # Cut before the earliest stop sequence anywhere in the output, as lm-eval cuts its text.
        self.cut = min(_find(self.tokens, s) for s in self.stops if _find(self.tokens, s) >= 0)
        return True

    def result(self) -> list[int]:
        return self.tokens if self.cut is None or self.keep_stop else self.tokens[: self.cut]


def _find(tokens: list[int], needle: list[int]) -> int:
    for i in range(len(tokens) - len(needle) + 1):
        if tokens[i : i + len(needle)] == needle:
            return i
    return -1


def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_sequences: Sequence[Sequence[int]] | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    batch_size: int = 8,
    keep_stop: bool = False,
    progress: Callable[[int], None] | None = None,
    sampler: Sampler | None = None,
) -> list[list[int]]:
    """Continuations of each prompt, greedy unless a `sampler` draws the tokens: at most `max_new_tokens` tokens, ending before the first stop
    sequence (or `eos_id`) that appears in them; with `keep_stop`, ending with the stop sequence that ended
    the generation (for callers that cut decoded text themselves, when a stop token also carries text
    before the stop). Prompts are cut from the left to leave room for the new tokens within the model's
    max_seq_len. With `use_cache` the prompts of a batch are run once and each new
    token reads the cached keys and values; without it every token reruns its whole prompt alone (the
    reference the cache must equal, token for token). `progress` is called with the number of prompts of
    each batch done."""
    limit = model_args(model).max_seq_len
    if not 1 <= max_new_tokens < limit:
        raise ValueError(f"max_new_tokens = {max_new_tokens} must be between 1 and max_seq_len - 1 = {limit - 1}")
    stops = [list(s) for s in stop_sequences or () if len(s)]
    if eos_id is not None:
        stops.append([eos_id])
    kept = limit - max_new_tokens
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; begin it with the end-of-document token")
    trimmed = [list(p)[-kept:] for p in prompts]
    outputs = [_Output(stops, keep_stop) for _ in trimmed]
    device = _device(model)
    split = sequence_split(model)
    choose = _greedy if sampler is None else sampler.choose
    with scoring_mode(model):
        if use_cache and split == 1:
            order = sorted(range(len(trimmed)), key=lambda i: -len(trimmed[i]))
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                _generate_cached(
                    model,
                    [trimmed[i] for i in chunk],
                    [outputs[i] for i in chunk],
                    max_new_tokens,
                    device,
                    choose,
                    prompt_ids=chunk,
                )
                if progress is not None:
                    progress(len(chunk))
        else:
            # without the cache: also under sequence parallelism, whose splits one new position cannot take
            for row, (prompt, output) in enumerate(zip(trimmed, outputs, strict=True)):
                _generate_uncached(model, prompt, output, max_new_tokens, device, split, choose, row)
                if progress is not None:
                    progress(1)
    return [output.result() for output in outputs]


def _greedy(logits: torch.Tensor, rows: Sequence[int] = ()) -> torch.Tensor:
    return logits.argmax(-1)


class Sampler:
    """Draws the next token of each row from its logits (rows, V): softmax(logits / temperature) over the
    `top_k` most likely tokens (all when None), from a generator seeded with `seed`, so that one seed gives
    one text. A temperature of 0 is greedy.

    With `prompt_seeds`, prompt i of a `generate` call draws from a generator of its own seeded with
    `prompt_seeds[i]`: its text then depends on its seed, not on which prompts share its batch or come
    before it (to the rounding of a differently shaped batch)."""

    def __init__(
        self, temperature: float = 1.0, top_k: int | None = None, seed: int = 0,
        prompt_seeds: Sequence[int] | None = None,
    ):  # fmt: skip
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature = {temperature} must be a finite number, at least 0")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k = {top_k} must be at least 1")
        self.temperature, self.top_k = temperature, top_k
        self.generator = torch.Generator().manual_seed(seed)
        self.prompt_generators = (
            None if prompt_seeds is None else [torch.Generator().manual_seed(s) for s in prompt_seeds]
        )

    def choose(self, logits: torch.Tensor, rows: Sequence[int] = ()) -> torch.Tensor:
        """The next token of each row; `rows` are the rows' prompt indices (used with `prompt_seeds`)."""
        if self.temperature == 0:
            return _greedy(logits)
        logits = logits.float().cpu() / self.temperature  # drawn on the CPU: the same text on every device
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.prompt_generators is None:
            return torch.multinomial(probs, 1, generator=self.generator)[:, 0]
        if len(rows) != probs.shape[0]:
            raise ValueError(f"{probs.shape[0]} rows of logits but {len(rows)} prompt indices")
        return torch.cat([torch.multinomial(probs[r : r + 1], 1, generator=self.prompt_generators[prompt])[:, 0]
                          for r, prompt in enumerate(rows)])  # fmt: skip


def _generate_cached(
    model: nn.Module,
    prompts: list[list[int]],
    outputs: list[_Output],
    max_new_tokens: int,
    device: torch.device,
    choose: Callable[[torch.Tensor, Sequence[int]], torch.Tensor] = _greedy,
    prompt_ids: Sequence[int] = (),
) -> None:
    """`prompt_ids`: the prompts' indices in the whole `generate` call (what a per-prompt sampler draws by)."""
    prompt_ids = list(prompt_ids) or list(range(len(prompts)))
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, (prompt, pad) in enumerate(zip(prompts, pads, strict=True)):
        tokens[row, pad:] = torch.tensor(prompt)
    cache = KVCache(width + max_new_tokens, torch.tensor(pads, device=device))
    last = torch.full((len(prompts), 1), width - 1, device=device)
    logits = model(tokens.to(device), cache=cache, logits_at=last)[:, -1]
    active = list(range(len(prompts)))  # rows of `outputs` still in the batch, in batch order
    for step in range(max_new_tokens):
        chosen = choose(logits, [prompt_ids[i] for i in active]).to(device)
        keep = [row for row, token in enumerate(chosen.tolist()) if not outputs[active[row]].push(token)]
        if not keep or step == max_new_tokens - 1:
            return
        if len(keep) < len(active):
            rows = torch.tensor(keep, device=device)
            cache.select(rows)
            chosen = chosen[rows]
            active = [active[row] for row in keep]
        logits = model(chosen[:, None], cache=cache)[:, -1]


def _generate_uncached(
    model: nn.Module,
    prompt: list[int],
    output: _Output,
    max_new_tokens: int,
    device: torch.device,
    split: int = 1,
    choose: Callable[[torch.Tensor, Sequence[int]], torch.Tensor] = _greedy,
    row: int = 0,
) -> None:
    sequence = list(prompt)
    for _ in range(max_new_tokens):
        padded = sequence + [0] * (_padded(len(sequence), split) - len(sequence))
        token = int(choose(model(torch.tensor([padded], device=device))[:, len(sequence) - 1], [row])[0])
        if output.push(token):
            return
        sequence.append(token)
