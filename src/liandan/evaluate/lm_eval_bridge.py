"""A liandan model as an lm-evaluation-harness `LM`, registered as the model "liandan": any lm-eval task the
user has runs on a liandan checkpoint without exporting it, and on a model sharded as it trains.

    import liandan.evaluate.lm_eval_bridge  # registers "liandan"
    lm_eval.simple_evaluate(model="liandan", model_args="checkpoint=runs/my-run,device=cuda", tasks=[...])

or from the shell, with lm-eval's own arguments: `liandan lm-eval runs/my-run --tasks hellaswag` (or
`python -m liandan.evaluate.lm_eval_bridge --model_args checkpoint=runs/my-run --tasks hellaswag`).

Text is encoded as lm-eval's Hugging Face model encodes it (its `TemplateLM`: trailing spaces of a context
move to the continuation, an empty context becomes the end-of-document token), and every number comes from
`liandan.evaluate.scoring`, so liandan's evaluator and lm-eval agree on the same requests.

With a sharded model every process must see every request (a sharded forward is a collective): the bridge
reports one process to lm-eval, which then gives each rank all of a task's requests, and every rank computes
the same results.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ModuleNotFoundError as err:  # keeps `name`, by which the CLI names the extra
    raise ModuleNotFoundError("the lm-eval bridge needs the [eval] extra: pip install 'liandan[eval]'",
                              name=err.name) from None  # fmt: skip

from torch import nn

from liandan.config import ConfigError
from liandan.data.tokens.tokenizer import Tokenizer
from liandan.evaluate import scoring


@register_model("liandan")
class LiandanLM(TemplateLM):
    def __init__(
        self,
        checkpoint: str | Path | None = None,
        *,
        model: nn.Module | None = None,
        tokenizer: Tokenizer | str | Path | None = None,
        batch_size: int | str = 16,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        device: str | None = "auto",
        dtype: str | None = None,
        max_batch_size: Any = None,
        **others: Any,
    ):
        """Either `checkpoint` (a run, checkpoints or step directory; `tokenizer` optionally overrides the
        one it was trained with) or a `model` already built (plain or sharded) with its `tokenizer`.
        Values may be strings, as lm-eval passes `model_args`; `device` "auto" (or None) is CUDA when there is
        one, else the CPU; `max_batch_size` (lm-eval's bound on its batch-size search) is not used."""
        super().__init__()
        unknown = sorted(name for name, value in others.items() if value is not None)  # lm-eval passes unset ones
        if unknown:
            raise ConfigError(f"unknown argument(s) of the liandan model: {', '.join(unknown)}")
        if (checkpoint is None) == (model is None):
            raise ValueError("LiandanLM needs either checkpoint=PATH or model= and tokenizer=")
        if model is None:
            import torch

            from liandan.evaluate.loading import evaluation_device, load_for_eval

            dtypes = {None: None, "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                      "bfloat16": torch.bfloat16}  # fmt: skip
            if dtype not in dtypes:
                raise ConfigError(f"dtype = {dtype!r} must be one of fp32, bf16")
            device = evaluation_device(None if device == "auto" else str(device or ""), flag="device")
            model, tokenizer, _ = load_for_eval(checkpoint, tokenizer=tokenizer, device=device, dtype=dtypes[dtype])
        elif tokenizer is None or isinstance(tokenizer, (str, Path)):
            raise ValueError("LiandanLM(model=...) needs the model's tokenizer object as tokenizer=")
        self.model, self.liandan_tokenizer = model, tokenizer
        # lm-eval's "auto" searches for the largest batch that fits; liandan takes its default instead
        auto = batch_size is None or str(batch_size).startswith("auto")
        self.batch_size = _positive_int("batch_size", 16 if auto else batch_size)
        self._max_length = _positive_int("max_length", max_length) if max_length is not None else None
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        self._stops: dict[str, list[list[int]]] = {}

    @property
    def eot_token_id(self) -> int:
        return self.liandan_tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length or scoring.model_args(self.model).max_seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # liandan's tokenizers add no special tokens: documents are separated by end-of-document tokens only
        return self.liandan_tokenizer.encode_batch([string])[0]

    def tok_decode(self, tokens: list[int]) -> str:
        return self.liandan_tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = [(context, continuation) for _, context, continuation in requests]
        results = scoring.loglikelihoods(self.model, pairs, batch_size=self.batch_size, max_len=self.max_length)
        for (strings, _, _), result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [request.args[0] for request in requests]
        documents = [self.tok_encode(text) for text in texts]
        results = scoring.rolling_loglikelihoods(self.model, documents, max_len=self.max_length,
                                                 prefix_token=self.prefix_token_id, batch_size=self.batch_size)  # fmt: skip
        for text, result in zip(texts, results, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), result)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation (liandan's evaluator samples nothing). Requests are grouped by their settings;
        each group is generated in batches with the KV cache, each sequence ending at a token that holds a
        stop string, and the texts are cut at the first stop string, as lm-eval's own models cut them."""
        groups: dict[tuple, list[int]] = {}
        settings = [self._generation_settings(request.args[1]) for request in requests]
        for i, (until, max_new) in enumerate(settings):
            groups.setdefault((tuple(until), max_new), []).append(i)
        texts = [""] * len(requests)
        for (until, max_new), members in groups.items():
            prompts = [self.tok_encode(requests[i].args[0]) or [self.prefix_token_id] for i in members]
            stops = [stop for text in until for stop in self._stop_tokens(text)]
            outputs = scoring.generate(self.model, prompts, max_new_tokens=max_new, stop_sequences=stops,
                                       eos_id=self.eot_token_id, batch_size=self.batch_size, keep_stop=True)  # fmt: skip
            for i, tokens in zip(members, outputs, strict=True):
                text = self.tok_decode(tokens)
                for stop in until:
                    text = text.split(stop)[0]
                texts[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return texts

    def _stop_tokens(self, text: str) -> list[list[int]]:
        """Token sequences that end a generation at the stop string `text`: its own encoding, and every
        single token whose text contains it (a newline is often merged with what precedes it). A stop split
        across tokens some other way is not seen until the text is cut, after `max_gen_toks`."""
        if text not in self._stops:
            decode = self.liandan_tokenizer.decode
            inside = [[i] for i in range(self.liandan_tokenizer.vocab_size) if text in decode([i])]
            self._stops[text] = [self.tok_encode(text), *inside]
        return self._stops[text]

    def _generation_settings(self, kwargs: dict) -> tuple[list[str], int]:
        kwargs = dict(kwargs or {})
        if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0) > 0:
            raise ConfigError("the liandan model generates greedily: set do_sample = false and temperature = 0")
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.get("max_gen_toks") or kwargs.get("max_new_tokens") or self.max_gen_toks)
        return [s for s in until if s], min(max_new, self.max_length - 1)


def _positive_int(name: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} = {value!r} must be a positive integer") from None
    if number < 1:
        raise ConfigError(f"{name} = {value!r} must be a positive integer")
    return number


def main() -> None:
    """lm-eval's command line with the liandan model: `--model liandan` is implied."""
    from lm_eval.__main__ import cli_evaluate

    if "--model" not in sys.argv:
        sys.argv += ["--model", "liandan"]
    cli_evaluate()


if __name__ == "__main__":
    main()
