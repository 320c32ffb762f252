"""Evaluation inside the training loop, registered as "eval_tasks" (`--eval.every=N --eval.tasks=...`).

Every `eval.every` steps and at the last, on every rank that trains and with the model sharded as it trains
(FSDP2, tensor parallel): the tasks under each of their formats, the held-out loss of each data source and
the greedy continuations of `[eval] samples` ("eval_sample" events).
Every rank passes the same requests, so each forward of the sharded model has all its ranks, and every rank
gets the same answers; the main rank writes them as "eval_task" and "eval_heldout" events and as one metrics
record of eval/... keys at the step (beside the step's training record, which keeps its own timing). The
contamination of each task in the training stores is checked once, at the start, by the main rank
("eval_contamination" events).

Importing this module registers it; `liandan train` does so in every process that trains.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from liandan.config import Config
from liandan.train.callbacks import Callback

if TYPE_CHECKING:
    from liandan.train.context import TrainContext


class TaskEvalCallback(Callback):
    order = 21  # after the validation loss (20), before snapshots and checkpoints

    def __init__(self, cfg: Config):
        from liandan.evaluate.tasks import load_tasks

        self.cfg = cfg
        self.tasks = load_tasks(cfg.eval.tasks, cfg.eval.data_dir)  # before the model is built: a bad file fails early
        self.off = False  # the train module is not one model this evaluation can score
        self.said: set[str] = set()  # what was cut to fit the window is the same at every evaluation: said once

    def on_train_start(self, ctx: TrainContext) -> None:
        e = self.cfg.eval
        self.off = ctx.module.whole_model() is None or not hasattr(ctx.loader, "validation")
        if self.off and ctx.layout.pp > 1:
            ctx.say(f"eval: task scoring and samples need the whole model on one rank; under parallel.pp ="
                    f" {ctx.layout.pp} [eval] is left out (the validation loss runs through the pipeline)")  # fmt: skip
            return
        if self.off:
            ctx.say(f"eval: {type(ctx.module).__name__} with {type(ctx.loader).__name__} is not one model of a known"
                    " family reading token stores: [eval] is left out")  # fmt: skip
            return
        if e.contamination and self.tasks and ctx.dist.is_main:
            from liandan.evaluate.contamination import overlaps

            for overlap in overlaps(self.tasks, ctx.stores, ctx.tokenizer, limit=e.limit, ngram=e.ngram):
                ctx.logger.log_event("eval_contamination", step=ctx.step, **overlap.event())
                ctx.say(overlap.line())

    def after_step(self, ctx: TrainContext, step: int, metrics: dict[str, float]) -> None:
        if self.off or (step % self.cfg.eval.every and step != self.cfg.train.steps) or ctx.rollback.pending:
            return
        ctx.phase("eval")
        tasks, heldout = evaluate_in_training(ctx, self.tasks, self.cfg)
        samples = samples_in_training(ctx, self.cfg)
        if not ctx.dist.is_main:
            return
        values: dict[str, float] = {}
        for result in tasks:
            for fields in result.events(step):
                ctx.logger.log_event("eval_task", **fields)
            values.update(result.metric_values())
            ctx.say(f"step {step}: {result.spread_line()}")
            for note in set(result.notes) - self.said:
                ctx.say(f"note: {note}")
                self.said.add(note)
        for prompt, text in samples:
            ctx.logger.log_event("eval_sample", step=step, prompt=prompt, text=text)
            ctx.say(f"step {step}: sample {_cut(prompt + text, 100)!r}")
        for source in heldout:
            ctx.logger.log_event("eval_heldout", **source.event(step))
            values[f"eval/heldout/{source.source}/loss"] = source.loss
            values[f"eval/heldout/{source.source}/bits_per_byte"] = source.bits_per_byte
            ctx.say(f"step {step}: {source.line()}")
        if values:
            ctx.logger.log_metrics(step, values)


def evaluate_in_training(ctx: TrainContext, tasks: list[Any], cfg: Config) -> tuple[list[Any], list[Any]]:
    """Every task and held-out source on the trainer's (sharded) model, the same on every rank."""
    from liandan.evaluate.heldout import heldout_losses
    from liandan.evaluate.runner import run_task

    e = cfg.eval
    model = ctx.module.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), ctx.module.autocasting():
            results = [
                run_task(model, ctx.tokenizer, task, limit=e.limit, max_len=cfg.model.max_seq_len,
                         batch_size=e.batch_size, formats=e.formats, max_new_tokens=e.max_new_tokens)
                for task in tasks
            ]  # fmt: skip
        heldout = []
        if e.heldout_sequences:
            heldout = heldout_losses(
                model, ctx.loader, ctx.tokenizer, sequences=e.heldout_sequences, batch_size=e.batch_size,
                document_mask=cfg.train.mask == "document", device=ctx.device, autocast=ctx.module.autocasting,
            )  # fmt: skip
    finally:
        model.train(was_training)
    return results, heldout


def samples_in_training(ctx: TrainContext, cfg: Config) -> list[tuple[str, str]]:
    """(prompt, greedy continuation) of each of `[eval] samples`, on the trainer's (sharded) model: every rank
    generates the same tokens, so each forward has all its ranks. A prompt longer than the window is cut from
    the left (the text logged is the prompt as given); one that encodes to nothing starts at end-of-document."""
    from liandan.evaluate.scoring import generate

    prompts = cfg.eval.samples
    if not prompts:
        return []
    tokenizer = ctx.tokenizer
    new_tokens = min(cfg.eval.sample_tokens, cfg.model.max_seq_len - 1)
    encoded = [ids or [tokenizer.eos_id] for ids in tokenizer.encode_batch(list(prompts))]
    with ctx.module.autocasting():
        outputs = generate(ctx.module.model, encoded, max_new_tokens=new_tokens, eos_id=tokenizer.eos_id,
                           batch_size=cfg.eval.batch_size)  # fmt: skip
    return [(prompt, tokenizer.decode(output)) for prompt, output in zip(prompts, outputs, strict=True)]


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def eval_tasks_callback(cfg: Config) -> TaskEvalCallback | None:
    if not cfg.eval.every or not (cfg.eval.tasks or cfg.eval.heldout_sequences or cfg.eval.samples):
        return None
    return TaskEvalCallback(cfg)
