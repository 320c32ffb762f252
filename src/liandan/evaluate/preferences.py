"""Preference pairs from verifiable answers (`liandan prefs`): the iterative reasoning-preference recipe of
Pang et al. (2024), so that a team without human labels can still run DPO on maths.

For each question of a generation task's items, `samples` replies are drawn from a checkpoint's model. The
question is the user turn of a chat rendered by the checkpoint's own chat template with the generation prompt
(`template_of_checkpoint`), which is exactly the text a DPO run on the pairs renders before each reply; the
token that closes an assistant turn ends a reply. A reply is correct when the task's `answer_regex` finds in it
the answer it finds in the reference (exact match, as `liandan eval` grades); one in which it finds nothing is
incorrect. A pair joins a correct reply (chosen) to an incorrect one (rejected); with `reference_as_chosen` a
question none of whose replies is correct takes the task's reference answer as its chosen reply.

Reply j of item i is drawn from a generator seeded with (seed, i, j) alone, so a file depends on the seed and
the settings, not on the batch a reply shared or on which other items were asked (`--limit` 10 gives the
first ten items' replies of a full run, to the rounding of differently shaped batches).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from liandan.checkpoint.verify import CheckpointError
from liandan.config import Config, ConfigError
from liandan.data.documents.corpus import DataError
from liandan.data.tokens.chat import CHATML_TOKENS, ChatMLTemplate, ChatTemplate, ModelTemplate, TemplateError
from liandan.data.tokens.store import LOSS_MASK, MANIFEST
from liandan.evaluate.tasks import Task
from liandan.run.files import atomic_file, atomic_write_json


@dataclass
class SamplingSettings:
    samples: int = 4  # replies drawn per question
    temperature: float = 0.8
    top_k: int | None = None
    seed: int = 0
    max_new_tokens: int = 256  # after the cap that keeps the question in the model's window
    pairs_per_prompt: int = 1
    reference_as_chosen: bool = False
    batch_size: int = 32  # replies generated together


@dataclass
class Reply:
    text: str
    answer: str | None  # what answer_regex found in it
    correct: bool
    finished: bool  # the end of the turn (or of the document) stopped it, not max_new_tokens


@dataclass
class PrefsSummary:
    task: str
    items: str  # the split asked for
    prompts: int = 0  # questions sampled
    samples: int = 0
    correct: int = 0
    without_answer: int = 0  # replies in which answer_regex found nothing (counted as incorrect)
    unfinished: int = 0  # replies cut at max_new_tokens
    prompts_all_correct: int = 0
    prompts_none_correct: int = 0
    prompts_too_long: int = 0  # questions whose prompt leaves no room in the window: not sampled
    prompts_without_reference: int = 0  # items whose reference answer answer_regex finds nothing in: not sampled
    prompts_with_pairs: int = 0
    pairs: int = 0
    pairs_using_reference: int = 0
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        return self.correct / self.samples if self.samples else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "accuracy": self.accuracy}

    def lines(self) -> list[str]:
        sampled = (
            f"{self.task} ({self.items} items): {self.prompts} prompts x {self.settings.get('samples')} ="
            f" {self.samples} samples, {self.correct} correct (accuracy {self.accuracy:.3f}),"
            f" {self.without_answer} without an answer, {self.unfinished} cut at max_new_tokens"
        )
        skipped = [(self.prompts_too_long, "too long for the model's window"),
                   (self.prompts_without_reference, "without an answer in their reference")]  # fmt: skip
        prompts = (
            f"prompts: {self.prompts_all_correct} all correct, {self.prompts_none_correct} none correct,"
            f" {self.prompts_with_pairs} with pairs" + "".join(f", {n} {what} (skipped)" for n, what in skipped if n)
        )
        pairs = f"pairs: {self.pairs} written, {self.pairs_using_reference} with the reference answer as chosen"
        return [sampled, prompts, pairs]


def template_of_checkpoint(
    checkpoint: Path, config: Config | None, tokenizer: Any, given: str | None = None
) -> tuple[ChatTemplate, list[str]]:
    """(the chat template the checkpoint's run rendered its chats with, notes to say). The run's record is the
    loss-mask entry of the store it trained on (`<run>/data` or its `[data] stores`): "chatml", or
    "tokenizer:<hash>" for a model's template, found beside `[data] tokenizer` (or `given`) and checked
    against the hash. Without a record (a pretraining run, an imported checkpoint), `[data] chat_template`
    says, and ChatML needs the tokenizer to hold its markers. `given` ("chatml" or a Hugging Face tokenizer
    directory) overrides, with a note when the run recorded another. One-line errors otherwise."""
    recorded = _recorded_template(checkpoint, config)
    notes = []
    if given is not None:
        template = _named_template(given)
        if recorded is not None and recorded != template.name:
            notes.append(f"note: the run trained on chats rendered by the {recorded} template, not {template.name}")
    elif recorded == "chatml" or (recorded is None and (config is None or config.data.chat_template == "chatml")):
        template = ChatMLTemplate()
    else:
        template = _model_template(checkpoint, config, recorded)
    if template.name == "chatml":
        missing = [t for t in CHATML_TOKENS if getattr(tokenizer, "token_id", lambda _: None)(t) is None]
        if missing:
            unrecorded = " and its run recorded no chat template" if recorded is None and given is None else ""
            raise CheckpointError(
                f"{checkpoint}: its tokenizer has no chat markers ({', '.join(missing)}){unrecorded}: fine-tune it"
                ' on chat data first (train.objective = "sft"), or name a model\'s tokenizer directory with'
                " --chat-template"
            )
    return template, notes


def _named_template(given: str) -> ChatTemplate:
    if given == "chatml":
        return ChatMLTemplate()
    path = Path(given)
    directory = path if path.is_dir() else path.parent
    if not path.exists():
        raise ConfigError(f"--chat-template: neither chatml nor an existing tokenizer directory: {given}")
    return ModelTemplate(directory)


def _model_template(checkpoint: Path, config: Config | None, recorded: str | None) -> ChatTemplate:
    tokenizer_file = config.data.tokenizer if config is not None else ""
    directory = Path(tokenizer_file).parent
    if tokenizer_file in ("", "byte", "bpe") or not (directory / "tokenizer_config.json").is_file():
        where = f" beside {tokenizer_file}" if tokenizer_file not in ("", "byte", "bpe") else ""
        raise CheckpointError(f"{checkpoint}: its run rendered its chats with a model's template"
                              f" ({recorded or 'data.chat_template = tokenizer'}), whose tokenizer_config.json is"
                              f" not found{where}; name that model's tokenizer directory with --chat-template")  # fmt: skip
    template = ModelTemplate(directory)
    if recorded is not None and template.name != recorded:
        raise CheckpointError(f"{checkpoint}: the chat template beside {tokenizer_file} ({template.name}) is not the"
                              f" one its run rendered its chats with ({recorded}); name the right model's tokenizer"
                              " directory with --chat-template")  # fmt: skip
    return template


def _recorded_template(checkpoint: Path, config: Config | None) -> str | None:
    """The template named by the loss-mask entry of a store the checkpoint's run trained on (None: none says)."""
    stores = [Path(s) for s in (config.data.stores if config is not None else []) if "://" not in s]
    stores.append(checkpoint.parent.parent / "data")  # a run that tokenized [data] paths itself
    for store in stores:
        try:
            mask = json.loads((store / MANIFEST).read_text(encoding="utf-8")).get(LOSS_MASK)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(mask, dict) and isinstance(mask.get("template"), str):
            return mask["template"]
    return None


def stop_sequences(template: ChatTemplate, tokenizer: Any) -> list[list[int]]:
    """Token ids of what ends a reply: the template's end of turn (the end-of-document id is added by
    `generate`)."""
    try:
        end = template.turn_end()
    except TemplateError as err:
        raise DataError(f"the chat template cannot be used to sample replies: {err}") from None
    return [ids for ids in tokenizer.encode_batch([end]) if ids] if end else []


def grade(task: Task, text: str, reference_answer: str, what: str) -> tuple[str | None, bool]:
    """(the answer found in `text`, whether it is the reference's): exact match of what `answer_regex` finds,
    as `liandan eval` grades; no answer found is incorrect."""
    answer = task.extract(text, what)
    return answer, answer is not None and answer == reference_answer


def pair_replies(
    replies: list[Reply], reference: str, pairs_per_prompt: int, reference_as_chosen: bool
) -> list[tuple[str, str, Reply | None, Reply]]:
    """(chosen text, rejected text, chosen reply or None for the reference, rejected reply) pairs of one
    question: a correct reply against an incorrect one, distinct texts only (a reply the model repeated pairs
    once) and no blank rejected reply (DPO's reader refuses an empty reply). Every reply is used once before
    any is used twice: pair j joins the j-th correct and j-th incorrect replies (each list cycled), then the
    other combinations follow in order, up to `pairs_per_prompt`. With `reference_as_chosen`, a question with
    no correct reply pairs its reference answer against its incorrect ones."""
    correct = _distinct(r for r in replies if r.correct)
    incorrect = _distinct(r for r in replies if not r.correct and r.text.strip())
    chosen: list[tuple[str, Reply | None]] = [(r.text, r) for r in correct]
    if not chosen and reference_as_chosen:
        chosen = [(reference, None)]
    if not chosen or not incorrect:
        return []
    order = [(j % len(chosen), j % len(incorrect)) for j in range(max(len(chosen), len(incorrect)))]
    order += [(a, b) for a in range(len(chosen)) for b in range(len(incorrect)) if (a, b) not in order]
    return [(chosen[a][0], incorrect[b].text, chosen[a][1], incorrect[b]) for a, b in order[:pairs_per_prompt]]


def _distinct(replies) -> list[Reply]:
    seen, kept = set(), []
    for reply in replies:
        if reply.text not in seen:
            seen.add(reply.text)
            kept.append(reply)
    return kept


def reply_seed(seed: int, item: int, sample: int) -> int:
    """The seed of reply `sample` to item `item` (its index in the task file)."""
    return random.Random(f"liandan-prefs:{seed}:{item}:{sample}").getrandbits(63)


def sample_preferences(
    model: Any,
    tokenizer: Any,
    template: ChatTemplate,
    task: Task,
    indices: list[int],
    settings: SamplingSettings,
    summary: PrefsSummary,
    progress: Callable[[int], Any] | None = None,
) -> list[dict[str, Any]]:
    """The preference records of the items `indices` of `task` (see the module's docstring), in item order;
    `summary` counts what was sampled, graded and paired. `progress`, given the number of replies to draw,
    makes an `EvalProgress` that is told of each batch done (and closed at the end)."""
    window = model.args.max_seq_len
    room = window - settings.max_new_tokens
    stops = stop_sequences(template, tokenizer)
    asked = []
    for index in indices:
        if task.extract(task.items[index].answer, f"the reference answer of item {index + 1}") is None:
            summary.prompts_without_reference += 1
            continue
        prompt = template.generation_prompt([{"role": "user", "content": task.items[index].question}])
        ids = tokenizer.encode_batch([prompt])[0]
        if len(ids) > room:  # cut from the left it would lose the chat's header: not asked at all
            summary.prompts_too_long += 1
        else:
            asked.append((index, ids))
    bar = progress(len(asked) * settings.samples) if progress is not None else None
    try:
        return _sampled_records(model, tokenizer, task, asked, stops, settings, summary, bar)
    finally:
        if bar is not None:
            bar.close()


def _sampled_records(
    model: Any, tokenizer: Any, task: Task, asked: list[tuple[int, list[int]]], stops: list[list[int]],
    settings: SamplingSettings, summary: PrefsSummary, bar: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    from liandan.evaluate.scoring import Sampler, generate

    records = []
    per_batch = max(1, settings.batch_size // settings.samples)  # questions whose replies go in one batch
    said = 0  # tenths of the questions told of (each a line where stderr is no terminal)
    for start in range(0, len(asked), per_batch):
        group = asked[start : start + per_batch]
        prompts = [ids for _, ids in group for _ in range(settings.samples)]
        seeds = [reply_seed(settings.seed, index, j) for index, _ in group for j in range(settings.samples)]
        sampler = Sampler(settings.temperature, settings.top_k, prompt_seeds=seeds)
        outputs = generate(model, prompts, max_new_tokens=settings.max_new_tokens, stop_sequences=stops,
                           eos_id=tokenizer.eos_id, batch_size=len(prompts), sampler=sampler)  # fmt: skip
        for n, (index, _) in enumerate(group):
            mine = outputs[n * settings.samples : (n + 1) * settings.samples]
            records += _question_records(task, index, mine, tokenizer, settings, summary)
        done = start + len(group)
        if bar is not None:
            bar.advance(len(prompts))
            if done * 10 // len(asked) > said:
                said = done * 10 // len(asked)
                bar.begin(f"{task.name} ({done}/{len(asked)} questions, {summary.pairs} pairs)")
    return records


def _question_records(
    task: Task, index: int, outputs: list[list[int]], tokenizer: Any, settings: SamplingSettings,
    summary: PrefsSummary,
) -> list[dict[str, Any]]:  # fmt: skip
    item = task.items[index]
    reference = task.extract(item.answer, f"the reference answer of item {index + 1}") or ""
    replies = []
    for j, ids in enumerate(outputs):
        text = tokenizer.decode(ids)
        answer, correct = grade(task, text, reference, f"sample {j + 1} of item {index + 1}")
        replies.append(Reply(text, answer, correct, len(ids) < settings.max_new_tokens))
    summary.prompts += 1
    summary.samples += len(replies)
    right = sum(r.correct for r in replies)
    summary.correct += right
    summary.without_answer += sum(r.answer is None for r in replies)
    summary.unfinished += sum(not r.finished for r in replies)
    summary.prompts_all_correct += right == len(replies)
    summary.prompts_none_correct += right == 0
    pairs = pair_replies(replies, item.answer, settings.pairs_per_prompt, settings.reference_as_chosen)
    summary.prompts_with_pairs += bool(pairs)
    summary.pairs += len(pairs)
    records = []
    for p, (chosen, rejected, chosen_reply, rejected_reply) in enumerate(pairs):
        summary.pairs_using_reference += chosen_reply is None
        records.append({
            "id": f"{task.name}-{index}-{p}", "prompt": item.question, "chosen": chosen, "rejected": rejected,
            "task": task.name, "item": index, "reference_answer": reference,
            "chosen_answer": reference if chosen_reply is None else chosen_reply.answer,
            "rejected_answer": rejected_reply.answer,
            "chosen_from": "reference" if chosen_reply is None else "sample",
        })  # fmt: skip
    return records


def summary_path(out: Path) -> Path:
    """The JSON sidecar of a preference file: prefs.jsonl -> prefs.summary.json."""
    return out.with_name(out.name.removesuffix(".jsonl") + ".summary.json")


def write_preferences(out: Path, records: list[dict[str, Any]], summary: PrefsSummary) -> Path:
    """Write the records as jsonl and the summary beside it, each whole or not at all (a run killed while
    writing leaves the old files, or none); the sidecar's path."""
    with atomic_file(out, "w") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    sidecar = summary_path(out)
    atomic_write_json(sidecar, summary.as_dict())
    return sidecar


def say_lines(summary: PrefsSummary, say: Callable[[str], None]) -> None:
    for line in summary.lines():
        say(line)
