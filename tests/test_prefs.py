"""`liandan prefs`: replies sampled from a chat-tuned checkpoint, graded against a task's reference answers and
paired (a correct reply chosen, an incorrect or unanswered one rejected) into preference records that DPO reads
and trains on; one seed, one file; the reference as the chosen reply where no reply is right; the split of a
task's items into fine-tuning and held-out items; and bad input refused in one line."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from helpers import (
    CHATML_GENERATION_TEMPLATE,
    liandan_here,
    tiny_config,
    write_corpus,
    write_hf_chat_tokenizer,
    write_sums_task,
)
from liandan.config import ConfigError
from liandan.data.documents.corpus import ReadStats
from liandan.data.documents.preferences import read_preferences
from liandan.data.tokens.chat import IM_END, ChatMLTemplate, ModelTemplate
from liandan.evaluate.preferences import (
    PrefsSummary,
    Reply,
    grade,
    pair_replies,
    summary_path,
    write_preferences,
)
from liandan.evaluate.tasks import HELDOUT_EVERY, load_task, split_items

SFT_STEPS = 30


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A tiny model fine-tuned on the sums task's items as ChatML chats (its BPE holds the markers): the run
    directory and the task file."""
    from liandan.train import Trainer

    tmp = tmp_path_factory.mktemp("prefs")
    task, chat = write_sums_task(tmp)
    cfg = tiny_config(tmp, chat, "--train.objective=sft", "--data.tokenizer=bpe", "--data.bpe_vocab_size=320",
                      "--data.val_fraction=0", f"--train.steps={SFT_STEPS}", "--optim.lr=3e-3",
                      "--checkpoint.async_save=false", "--checkpoint.every=0")  # fmt: skip
    Trainer(cfg, say=lambda m: None).train()
    # the loss falls fast enough for the guard's too-good-to-be-true report, which must skip the prompts' -1 targets
    assert list((tmp / "run" / "guard").glob("drop-step-*.json"))
    return tmp / "run", task


def _prefs(run: Path, task: Path, out: Path, *extra: str):
    return liandan_here("prefs", run, "--task", task, "--out", out, "--limit=8", *extra)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_right_number_is_chosen_and_a_wrong_or_missing_one_rejected(tmp_path):
    task_file, _ = write_sums_task(tmp_path, n=5)
    task = load_task(task_file)
    texts = ["2 + 5 = 7\n#### 7", "2 + 5 = 8\n#### 8", "the answer is seven", "2 + 5 = 7\n#### 7", " \n",
             "#### 7.0", "#### 1,007"]  # fmt: skip
    graded = [grade(task, text, "7", f"reply {i}") for i, text in enumerate(texts)]
    assert graded == [("7", True), ("8", False), (None, False), ("7", True), (None, False), ("7.0", False),
                      ("1007", False)]  # fmt: skip
    assert grade(task, "so #### 1,007.", "1007", "reply")[1]  # commas and a full stop are not the number
    replies = [Reply(text, answer, right, True) for text, (answer, right) in zip(texts, graded, strict=True)]

    pairs = pair_replies(replies[:5], "#### 7", pairs_per_prompt=4, reference_as_chosen=False)
    # one distinct right reply, two distinct non-blank wrong ones: the repeat and the blank reply pair nowhere
    assert [(c, r) for c, r, _, _ in pairs] == [(texts[0], texts[1]), (texts[0], texts[2])]
    assert pair_replies(replies[:5], "#### 7", 1, False) == pairs[:1]
    assert pair_replies([replies[0], replies[3]], "#### 7", 4, True) == []  # all right: nothing to prefer
    wrong = [replies[1], replies[2]]
    assert pair_replies(wrong, "#### 7", 4, False) == []  # none right, and no reference asked for
    with_reference = pair_replies(wrong, "2 + 5 = 7\n#### 7", 4, True)
    assert [(c, r, source) for c, r, source, _ in with_reference] == [("2 + 5 = 7\n#### 7", texts[1], None),
                                                                      ("2 + 5 = 7\n#### 7", texts[2], None)]  # fmt: skip
    # a right reply is preferred to the reference: the reference stands in only where no reply is right
    assert pair_replies([replies[0], replies[1]], "ref", 4, True)[0][2] is replies[0]


def test_every_reply_is_paired_once_before_any_twice():
    right = [Reply(f"#### 7 ({i})", "7", True, True) for i in range(2)]
    wrong = [Reply(f"#### {i}", str(i), False, True) for i in range(3)]
    pairs = pair_replies([*right, *wrong], "", pairs_per_prompt=6, reference_as_chosen=False)
    firsts = [(c, r) for c, r, _, _ in pairs[:3]]
    assert {c for c, _ in firsts} == {r.text for r in right} and {r for _, r in firsts} == {w.text for w in wrong}
    assert len({(c, r) for c, r, _, _ in pairs}) == 6  # then the other combinations, none twice


def test_the_split_rule_keeps_fine_tuning_and_held_out_items_apart():
    train, heldout, every = (split_items(23, split) for split in ("train", "heldout", "all"))
    assert heldout == [4, 9, 14, 19] and HELDOUT_EVERY == 5
    assert not set(train) & set(heldout) and sorted(train + heldout) == every == list(range(23))
    with pytest.raises(ConfigError, match="items split 'test'"):
        split_items(23, "test")


def test_templates_give_the_prompt_a_reply_follows_and_the_end_of_its_turn(tmp_path):
    asked = [{"role": "user", "content": "What is 2 + 5?"}]
    answered = [*asked, {"role": "assistant", "content": "#### 7"}]
    chatml = ChatMLTemplate()
    assert chatml.turn_end() == IM_END
    assert chatml.render(answered).text.startswith(chatml.generation_prompt(asked) + "#### 7" + IM_END)
    zephyr = ModelTemplate(write_hf_chat_tokenizer(tmp_path / "zephyr").parent)
    assert zephyr.turn_end() == "</s>"
    assert zephyr.render(answered).text.startswith(zephyr.generation_prompt(asked) + "#### 7</s>")
    model_chatml = ModelTemplate(write_hf_chat_tokenizer(tmp_path / "chatml", CHATML_GENERATION_TEMPLATE).parent)
    assert model_chatml.generation_prompt(asked) == chatml.generation_prompt(asked)
    assert model_chatml.turn_end() == IM_END


def test_prefs_grades_samples_into_pairs_dpo_reads_and_one_seed_writes_one_file(chat_run, tmp_path):
    run, task_file = chat_run
    done = _prefs(run, task_file, tmp_path / "a.jsonl", "--pairs-per-prompt=2")
    assert done.returncode == 0, done.stderr
    records = _records(tmp_path / "a.jsonl")
    summary = json.loads((tmp_path / "a.summary.json").read_text())
    assert summary["prompts"] == 8 and summary["samples"] == 32 and summary["pairs"] == len(records) > 0
    assert summary["settings"]["template"] == "chatml" and summary["pairs_using_reference"] == 0
    assert f"accuracy {summary['accuracy']:.3f}" in done.stdout and f"{len(records)} written" in done.stdout
    task = load_task(task_file)
    train_items = split_items(len(task.items), "train")[:8]
    for record in records:
        assert record["item"] in train_items and record["prompt"] == task.items[record["item"]].question
        reference = task.extract(task.items[record["item"]].answer)
        assert task.extract(record["chosen"]) == reference == record["chosen_answer"] == record["reference_answer"]
        assert task.extract(record["rejected"]) != reference and record["rejected_answer"] != reference
    stats = ReadStats()
    pairs = list(read_preferences(tmp_path / "a.jsonl", stats=stats, on_reject=lambda r: pytest.fail(str(r))))
    assert len(pairs) == len(records) and not stats.skipped
    assert pairs[0].chosen[-1]["content"] == records[0]["chosen"] and pairs[0].pair_id == records[0]["id"]

    again = _prefs(run, task_file, tmp_path / "b.jsonl", "--pairs-per-prompt=2")
    assert again.returncode == 0 and (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "a.jsonl").read_bytes()
    other = _prefs(run, task_file, tmp_path / "c.jsonl", "--pairs-per-prompt=2", "--seed=1")
    assert (tmp_path / "c.jsonl").read_bytes() != (tmp_path / "a.jsonl").read_bytes(), other.stderr
    # each reply is drawn from a seed of its own: fewer items, in smaller batches, draw the same replies
    fewer = liandan_here("prefs", run, "--task", task_file, "--out", tmp_path / "d.jsonl", "--limit=3",
                         "--pairs-per-prompt=2", "--batch-size=4")  # fmt: skip
    assert fewer.returncode == 0, fewer.stderr
    assert _records(tmp_path / "d.jsonl") == [r for r in records if r["item"] in train_items[:3]]


def test_the_reference_answer_is_chosen_where_no_sample_is_right_and_the_pairs_train_a_dpo_run(chat_run, tmp_path):
    from liandan.train import Trainer

    run, task_file = chat_run
    out = tmp_path / "heldout.jsonl"
    done = _prefs(run, task_file, out, "--items=heldout", "--reference-as-chosen")
    assert done.returncode == 0, done.stderr
    summary = json.loads(summary_path(out).read_text())
    plain = _prefs(run, task_file, tmp_path / "plain.jsonl", "--items=heldout")
    without = json.loads((tmp_path / "plain.summary.json").read_text())
    assert plain.returncode == 0 and without["pairs_using_reference"] == 0
    assert summary["correct"] == without["correct"]  # the same replies, only paired differently
    assert summary["prompts"] == len(split_items(40, "heldout")) == 8
    assert summary["prompts_none_correct"] > 0, "the tiny model got every held-out question right at least once"
    task = load_task(task_file)
    records = _records(out)
    from_reference = [r for r in records if r["chosen_from"] == "reference"]
    assert summary["pairs_using_reference"] == len(from_reference) > 0
    assert summary["pairs"] == without["pairs"] + len(from_reference)
    assert {r["item"] for r in records} <= set(split_items(40, "heldout"))
    for record in from_reference:
        assert record["chosen"] == task.items[record["item"]].answer

    # the command the output ends with trains on the file: from the checkpoint, with its tokenizer
    told = done.stdout.strip().splitlines()[-1]
    assert told.startswith("train on them: liandan train CONFIG --train.objective=dpo")
    overrides = shlex.split(told.split("CONFIG", 1)[1])
    assert f"--checkpoint.init_from={next((run / 'checkpoints').iterdir())}" in overrides
    cfg = tiny_config(tmp_path, out, *overrides, "--data.val_fraction=0", "--train.steps=2", "--train.global_batch=2",
                      "--checkpoint.enabled=false")  # fmt: skip
    said: list[str] = []
    result = Trainer(cfg, say=said.append).train()
    assert any(f"preference optimisation on {len(records)} pairs" in line for line in said), said
    assert len(result.losses) == 2 and all(loss > 0 for loss in result.losses)


def test_bad_input_is_refused_in_one_line_and_writes_nothing(chat_run, tmp_path):
    from liandan.train import Trainer

    run, task_file = chat_run
    out = tmp_path / "p.jsonl"
    no_regex = tmp_path / "no-regex.toml"
    no_regex.write_text(task_file.read_text().replace('answer_regex = "#### (-?[0-9.,]+)"\n', ""))
    (tmp_path / "sums.jsonl").write_text((task_file.parent / "sums.jsonl").read_text())
    pretrained = tmp_path / "pretrained"
    Trainer(tiny_config(pretrained, write_corpus(tmp_path, n_docs=8), "--train.steps=2",
                        "--checkpoint.async_save=false"), say=lambda m: None).train()  # fmt: skip
    cases = {
        (tmp_path / "nowhere", task_file): "no such run or checkpoint",
        (run, no_regex): "answer_regex, and this one has none",
        (run, tmp_path / "missing.toml"): "task file not found",
        (run, task_file, "-k", "1"): "sample at least 2",
        (run, task_file, "--temperature=0"): "must be above 0",
        (run, task_file, "--temperature=nan"): "--temperature = nan: must be a finite number",
        (run, task_file, "--device=bogus"): "--device bogus: not a device",
        (run, task_file, "--device=meta"): "--device meta: the meta device holds no weights",
        (run, task_file, "--device=cuda:99"): "--device cuda:99: this machine has",
        (run, task_file, "--pairs-per-prompt=0"): "--pairs-per-prompt = 0 must be at least 1",
        (run, task_file, "--items=test"): "--items test: choose one of train, heldout, all",
        (pretrained / "run", task_file): "its tokenizer has no chat markers",
    }
    for (path, task, *extra), expected in cases.items():
        done = liandan_here("prefs", path, "--task", task, "--out", out, *extra)
        assert done.returncode == 2, (expected, done.stderr)
        assert expected in done.stderr and len(done.stderr.strip().splitlines()) == 1, (expected, done.stderr)
        assert not out.exists() and not summary_path(out).exists()
    wrong_name = liandan_here("prefs", run, "--task", task_file, "--out", tmp_path / "p.json")
    assert wrong_name.returncode == 2 and "name it *.jsonl" in wrong_name.stderr
    under_a_file = liandan_here("prefs", run, "--task", task_file, "--out", task_file / "p.jsonl")
    assert under_a_file.returncode == 2 and f"{task_file} is not a directory" in under_a_file.stderr


def test_the_file_is_written_whole_or_not_at_all(tmp_path):
    out = tmp_path / "prefs.jsonl"
    out.write_text("old\n")
    good = {"id": "x", "prompt": "q", "chosen": "#### 1", "rejected": "#### 2"}
    with pytest.raises(TypeError):
        write_preferences(out, [good, {**good, "rejected": {1, 2}}], PrefsSummary("sums", "train"))
    assert out.read_text() == "old\n" and not summary_path(out).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefs.jsonl"]  # no temporary left behind
    write_preferences(out, [good], PrefsSummary("sums", "train", pairs=1))
    assert _records(out) == [good] and json.loads(summary_path(out).read_text())["pairs"] == 1


def test_a_run_tuned_with_a_models_template_samples_with_it_and_says_when_it_is_not_found(tmp_path):
    import shutil

    from liandan.train import Trainer

    task_file, chat = write_sums_task(tmp_path)
    tokenizer = write_hf_chat_tokenizer(tmp_path / "zephyr")
    cfg = tiny_config(tmp_path, chat, "--train.objective=sft", f"--data.tokenizer={tokenizer}",
                      "--data.chat_template=tokenizer", "--data.val_fraction=0", "--train.steps=4",
                      "--checkpoint.async_save=false")  # fmt: skip
    Trainer(cfg, say=lambda m: None).train()
    run, out = tmp_path / "run", tmp_path / "p.jsonl"
    # this BPE never saw the questions: a prompt takes more of the 64-token window than ChatML's tokenizer's
    short = ("--limit=2", "--reference-as-chosen", "--max-new-tokens=12")
    done = liandan_here("prefs", run, "--task", task_file, "--out", out, *short)
    assert done.returncode == 0, done.stderr
    summary = json.loads(summary_path(out).read_text())
    assert summary["settings"]["template"] == ModelTemplate(tokenizer.parent).name != "chatml"
    assert summary["samples"] == 8 and summary["pairs"] > 0, summary
    assert len(list(read_preferences(out, on_reject=lambda r: pytest.fail(str(r))))) == summary["pairs"]
    assert f"--data.tokenizer={tokenizer} --data.chat_template=tokenizer" in done.stdout  # what DPO renders with

    shutil.move(tokenizer.parent, tmp_path / "moved")
    lost = liandan_here("prefs", run, "--task", task_file, "--out", tmp_path / "q.jsonl", "--limit=2")
    assert lost.returncode == 2 and len(lost.stderr.strip().splitlines()) == 1
    assert "name that model's tokenizer directory with --chat-template" in lost.stderr
    found = liandan_here("prefs", run, "--task", task_file, "--out", tmp_path / "q.jsonl", *short,
                         f"--chat-template={tmp_path / 'moved'}")  # fmt: skip
    assert found.returncode == 0, found.stderr
    assert (tmp_path / "q.jsonl").read_bytes() == out.read_bytes()
