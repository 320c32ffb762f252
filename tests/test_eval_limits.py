"""Evaluation at the edges: every shipped task on configs/tiny.toml (a 256-token window that neither the
few-shot cloze prompts nor gsm8k's 256 new tokens fit) run from a directory other than the repository's,
what is cut to fit said once, `[eval] data_dir` found wherever liandan runs, task files whose mistakes
are one line, an answer_regex that backtracks without end, and a task too short for a contamination check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import SHARED_DATA, liandan_here, write_corpus
from liandan.config import ConfigError, DataSection, load_config
from liandan.data.pipeline.prepare import prepare_store
from liandan.data.tokens.tokenizer import ByteTokenizer
from liandan.evaluate.contamination import overlaps
from liandan.evaluate.runner import run_task
from liandan.evaluate.tasks import load_task, load_tasks, resolve_data_dir
from liandan.model.spec import get as get_model_spec

REPO = Path(__file__).resolve().parents[1]
needs_shared = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"shared data not found at {SHARED_DATA}")


def small_model(max_seq_len: int, seed: int = 0) -> torch.nn.Module:
    spec = get_model_spec("llama")
    torch.manual_seed(seed)
    model = spec.build(spec.args_type(vocab_size=257, dim=32, n_layers=1, n_heads=2, max_seq_len=max_seq_len))
    model.init_weights()
    return model.eval()


def write_task(directory: Path, toml: str, records: list[dict], name: str) -> Path:
    (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    path = directory / f"{name}.toml"
    path.write_text(toml, encoding="utf-8")
    return path


GENERATION_TOML = """name = "{name}"
kind = "generation"
path = "{name}.jsonl"
question_field = "q"
answer_field = "a"
answer_regex = "{regex}"
max_new_tokens = {max_new_tokens}
formats = ["qa"]
"""
SHORT_MC_TOML = """name = "short_mc"
kind = "multiple_choice"
path = "short_mc.jsonl"
question_field = "q"
choices_field = "choices"
label_field = "gold"
formats = ["qa", "plain"]
"""
SHORT_MC = [
    {"q": "The cat sat on the", "choices": ["mat", "theory of everything"], "gold": 0},
    {"q": "The sky is", "choices": ["blue", "green"], "gold": 0},
]


def generation_task(directory: Path, name: str, regex: str, answers: list[str], max_new_tokens: int = 4) -> Path:
    records = [{"q": f"Question {i}?", "a": a} for i, a in enumerate(answers)]
    toml = GENERATION_TOML.format(name=name, regex=regex.replace("\\", "\\\\"), max_new_tokens=max_new_tokens)
    return write_task(directory, toml, records, name)


# -- configs/tiny.toml: a trained checkpoint, and `liandan eval` of every shipped task from elsewhere ----------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """Two steps of configs/tiny.toml with the smallest model it allows beside its 256-token window, on a
    small corpus (its BPE tokenizer trained on it)."""
    from liandan.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("tiny-run")
    corpus = write_corpus(tmp, n_docs=40)
    overrides = [
        f"--run.output_dir={tmp}", "--run.name=run", "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2",
        "--model.n_kv_heads=1", "--train.steps=2", "--schedule.warmup_steps=1", "--train.global_batch=2",
        "--train.eval_every=0", f'--data.paths=["{corpus}"]', "--checkpoint.every=2",
        "--checkpoint.async_save=false", "--track.plot=false",
    ]  # fmt: skip
    cfg = load_config(REPO / "configs" / "tiny.toml", overrides)
    assert cfg.model.max_seq_len == 256 and cfg.data.tokenizer == "bpe"
    trainer = Trainer(cfg, say=lambda m: None)
    run = trainer.train().run_dir
    trainer.close()
    return run


@needs_shared
def test_every_shipped_task_runs_on_the_tiny_config_from_another_directory(tiny_run, tmp_path, monkeypatch):
    """The command `liandan demo` prints at its end, with a few items, from a directory that is not the
    repository's: `../shared/data` is found, nothing runs past the window, and what was cut is said. In this
    process (evaluation starts no worker), from that directory."""
    out = tmp_path / "eval.json"
    monkeypatch.chdir(tmp_path)
    done = liandan_here("eval", tiny_run, "--tasks", "cloze_en,cloze_zh,gsm8k", "--limit=2", f"--json={out}",
                        "--eval.heldout_sequences=2")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "flex_attention" not in done.stderr, done.stderr
    report = json.loads(out.read_text())
    assert [t["task"] for t in report["tasks"]] == ["cloze_en", "cloze_zh", "gsm8k"]
    assert all(t["n"] == 2 and len(t["scores"]) == 5 for t in report["tasks"])
    notes = {t["task"]: t["notes"] for t in report["tasks"]}
    assert "max_new_tokens 256 capped at 128" in notes["gsm8k"][0] and "prompts" in notes["gsm8k"][0]
    assert "context cut from the left" in notes["cloze_zh"][0]
    for task, lines in notes.items():
        assert len(lines) <= 1 and done.stdout.count(f"note: {task}:") == len(lines)
    # not a terminal: a plain progress line as each format begins, on stderr, and the results on stdout
    assert "eval gsm8k [plain]:" in done.stderr and "requests scored" in done.stderr
    assert "gsm8k: exact_match mean" in done.stdout and "eval gsm8k" not in done.stdout


def test_data_dir_option_and_a_missing_data_dir_in_one_line(tmp_path):
    missing = liandan_here("eval", tmp_path, "--tasks=cloze_zh", f"--data-dir={tmp_path / 'absent'}")
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert "--data-dir: no such directory" in missing.stderr
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    nowhere = liandan_here("eval", tmp_path, "--tasks=cloze_zh", f"--data-dir={empty}")
    lines = nowhere.stderr.strip().splitlines()
    assert nowhere.returncode == 2 and len(lines) == 1 and f"{empty}/corpus/zh-classics.jsonl" in lines[0], lines
    assert "--data-dir" in lines[0]


def test_a_json_path_that_cannot_be_written_is_refused_before_the_evaluation(tmp_path):
    (tmp_path / "t.toml").write_text("")
    done = liandan_here("eval", tmp_path, "--tasks=cloze_zh", "--json", tmp_path / "t.toml" / "x.json")
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"liandan: error: cannot write {tmp_path}/t.toml/x.json: {tmp_path}/t.toml is not a directory"
    ]


def test_short_items_skip_contamination_and_a_slow_regex_is_one_line(tiny_run, tmp_path):
    """A task whose items are all shorter than an n-gram is scored and said unchecked; `^(a+)+$` (which
    Python's re takes exponential time over) finishes; `^(a|aa)+$` on a long reference is one line that
    names the task and the item, before any scoring."""
    short = write_task(tmp_path, SHORT_MC_TOML, SHORT_MC, "short_mc")
    nested = generation_task(tmp_path, "nested", "^(a+)+$", ["aaaa", "a" * 40 + "b"])
    done = liandan_here("eval", tiny_run, f"--tasks={short},{nested}", "--eval.heldout_sequences=0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "contamination short_mc: not checked: no item has 8 or more words" in done.stdout
    assert "nested: exact_match mean" in done.stdout
    hanging = generation_task(tmp_path, "hanging", "^(a|aa)+$", ["aa", "a" * 60 + "b"])
    done = liandan_here("eval", tiny_run, f"--tasks={hanging}")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "task hanging" in lines[0] and "item 2" in lines[0] and "answer_regex" in lines[0]


# -- the same limits in-process ---------------------------------------------------------------------------


def test_generation_that_asks_more_than_the_window_is_capped_and_said(tmp_path):
    task = load_task(generation_task(tmp_path, "long_gen", "([0-9]+)", ["7", "8"], max_new_tokens=10**15))
    result = run_task(small_model(64), ByteTokenizer(), task, max_len=64)
    assert set(result.scores) == {"qa"} and 0 <= result.scores["qa"]["exact_match"] <= 1
    said = "long_gen: to fit the model's window of 64 tokens: max_new_tokens 1000000000000000 capped at 32, half the"
    assert result.notes == [f"{said} window"]


def test_choices_longer_than_the_window_are_scored_on_their_last_tokens(tmp_path):
    records = [{"q": "Which line follows?", "choices": ["x" * 40, "y" * 45], "gold": 1}]
    task = load_task(write_task(tmp_path, SHORT_MC_TOML.replace("short_mc", "long_mc"), records, "long_mc"))
    result = run_task(small_model(16), ByteTokenizer(), task, max_len=16)
    assert set(result.scores) == {"qa", "plain"}
    assert "4 choices longer than the window scored on their last 16 tokens" in result.notes[0]
    assert len(result.notes) == 1


def test_an_output_the_regex_cannot_search_in_time_names_the_item(tmp_path):
    task = load_task(generation_task(tmp_path, "slow", "^(a|aa)+$", ["aa", "aaaa"]))
    assert task.extract("aaaaaa") is not None  # a short text is searched as ever
    with pytest.raises(ConfigError, match=r"task slow: answer_regex .* on the output for item 3 in format qa"):
        task.extract("a" * 60 + "b", "the output for item 3 in format qa")


@pytest.mark.parametrize(
    "field, expected",
    [("formats = [{a=1}]", "field 'formats' must be a list of format names"),
     ("max_new_tokens = 0", "field 'max_new_tokens' must be >= 1")],
    ids=["format-table", "no-new-tokens"],
)  # fmt: skip
def test_task_file_mistakes_are_one_line(tmp_path, field, expected):
    path = generation_task(tmp_path, "bad", "([0-9]+)", ["1"])
    path.write_text(path.read_text().replace('formats = ["qa"]', "").replace("max_new_tokens = 4", "") + field + "\n")
    with pytest.raises(ConfigError) as err:
        load_task(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value) and expected in str(err.value), err.value
    done = liandan_here("eval", tmp_path, f"--tasks={path}")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_contamination_skips_a_task_of_short_items(tmp_path):
    task = load_task(write_task(tmp_path, SHORT_MC_TOML, SHORT_MC, "short_mc"))
    store, _ = prepare_store(DataSection(paths=[str(write_corpus(tmp_path, n_docs=3))], tokenizer="byte"),
                             tmp_path / "store", lambda m: None)  # fmt: skip
    (found,) = overlaps([task], [store], ByteTokenizer())
    assert found.skipped and found.contaminated == 0 and found.items == 2
    assert (
        found.line() == "contamination short_mc: not checked: no item has 8 or more words, too few for an n-gram match"
    )
    assert found.event()["skipped"] == found.skipped


# -- where {data_dir} is looked for -------------------------------------------------------------------------


def test_a_relative_data_dir_is_found_beside_the_config_then_here_then_in_the_checkout(tmp_path, monkeypatch):
    config_dir, here = tmp_path / "configs", tmp_path / "here"
    (config_dir / "data").mkdir(parents=True)
    (here / "data").mkdir(parents=True)
    monkeypatch.chdir(here)
    assert resolve_data_dir("data", config_dir) == config_dir / "data"
    assert resolve_data_dir("data") == here / "data"
    assert resolve_data_dir(str(tmp_path / "x")) == tmp_path / "x"
    if SHARED_DATA.is_dir():  # a source checkout: its ../shared/data is the default from anywhere
        assert resolve_data_dir("../shared/data") == SHARED_DATA
        (task,) = load_tasks(["gsm8k"])
        assert task.data_path == SHARED_DATA / "eval" / "gsm8k-test.jsonl"


def test_a_cloze_corpus_that_is_not_text_is_one_line(tmp_path):
    (tmp_path / "corpus.txt").write_bytes(b"first line of verse\n\xff\xfe not text\n")
    path = tmp_path / "cloze.toml"
    path.write_text('name = "c"\nkind = "multiple_choice"\n[generate]\ncorpus = "corpus.txt"\n')
    with pytest.raises(ConfigError, match=r"corpus.txt \(task .*cloze.toml\): not valid UTF-8 \(byte 20\)"):
        load_task(path)
