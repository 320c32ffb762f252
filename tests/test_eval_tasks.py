"""Evaluation tasks: formats and their spread, multiple-choice and generation metrics, held-out bits per byte,
contamination, bad task files, `liandan eval`, and evaluation inside a two-rank FSDP2 run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import MC_TOML, SHARED_DATA, liandan_here, read_run, run_liandan, tiny_config, write_corpus
from liandan.config import ConfigError, DataSection
from liandan.data.pipeline.prepare import prepare_store
from liandan.data.tokens.loader import PackedLoader
from liandan.data.tokens.tokenizer import ByteTokenizer
from liandan.evaluate.contamination import overlaps
from liandan.evaluate.formats import BUILTIN_FORMATS
from liandan.evaluate.heldout import heldout_losses
from liandan.evaluate.runner import cut_at_stops, multiple_choice_outcome, run_task, split_context
from liandan.evaluate.tasks import load_task
from liandan.model.spec import get as get_model_spec

needs_shared = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"shared data not found at {SHARED_DATA}")


def tiny_model(seed: int = 0) -> torch.nn.Module:
    spec = get_model_spec("llama")
    torch.manual_seed(seed)
    model = spec.build(spec.args_type(vocab_size=257, dim=32, n_layers=1, n_heads=2, max_seq_len=256))
    model.init_weights()
    return model.eval()


def write_task(directory: Path, toml: str, records: list[dict] | None = None, name: str = "task") -> Path:
    if records is not None:
        lines = "\n".join(json.dumps(r, ensure_ascii=False) for r in records)
        (directory / f"{name}.jsonl").write_text(lines + "\n", encoding="utf-8")
    path = directory / f"{name}.toml"
    path.write_text(toml, encoding="utf-8")
    return path


MC_RECORDS = [
    {"q": "The cat sat on the", "choices": ["mat", "theory of everything", "x"], "gold": 0},
    {"q": "Two plus two is", "choices": ["four", "a very long wrong answer", "five"], "gold": 2},
    {"q": "The sky is", "choices": ["blue", "green"], "gold": 1},
]


def test_multiple_choice_outcome_by_hand():
    # log-likelihoods -4, -6, -9 over 2, 6 and 10 characters: per character -2, -1, -0.9
    assert multiple_choice_outcome([-4.0, -6.0, -9.0], [2, 6, 10], 0) == (True, False)
    assert multiple_choice_outcome([-4.0, -6.0, -9.0], [2, 6, 10], 2) == (False, True)
    assert multiple_choice_outcome([-4.0, -6.0, -9.0], [2, 6, 10], 1) == (False, False)
    assert multiple_choice_outcome([-3.0, -3.0], [1, 1], 0) == (True, True)  # a tie goes to the first


def _direct_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    tokens = torch.tensor([context + continuation])
    with torch.no_grad():
        logp = F.log_softmax(model(tokens[:, :-1]).float(), dim=-1)[0]
    at = torch.arange(len(context) - 1, tokens.shape[1] - 1)
    return float(logp[at, tokens[0, len(context) :]].sum())


def test_multiple_choice_accuracy_equals_direct_computation(tmp_path):
    task = load_task(write_task(tmp_path, MC_TOML, MC_RECORDS, "tiny_mc"))
    model, tok = tiny_model(), ByteTokenizer()
    result = run_task(model, tok, task, max_len=256)
    assert set(result.scores) == set(BUILTIN_FORMATS) and result.n == 3
    for fmt in task.formats:
        right, right_norm = 0, 0
        for index, item in enumerate(task.items):
            shots = [(s.question, s.answer, s.choices) for s in task.shots(index)]
            context = fmt.prompt(shots, item.question, item.choices)
            lls = [_direct_loglikelihood(model, *split_context(tok, context, fmt.target(c))) for c in item.choices]
            best = max(range(len(lls)), key=lls.__getitem__)
            best_norm = max(range(len(lls)), key=lambda i: lls[i] / len(item.choices[i]))
            right += best == item.label
            right_norm += best_norm == item.label
        assert result.scores[fmt.name]["acc"] == pytest.approx(right / 3)
        assert result.scores[fmt.name]["acc_norm"] == pytest.approx(right_norm / 3)


def test_spread_is_mean_min_max_over_formats(tmp_path):
    task = load_task(write_task(tmp_path, MC_TOML, MC_RECORDS, "tiny_mc"))
    result = run_task(tiny_model(seed=1), ByteTokenizer(), task, max_len=256)
    for metric in ("acc", "acc_norm"):
        values = [by_metric[metric] for by_metric in result.scores.values()]
        summary = result.summary(metric)
        assert summary == pytest.approx(
            {"mean": sum(values) / len(values), "min": min(values), "max": max(values),
             "spread": max(values) - min(values)}
        )  # fmt: skip
    events = result.events(step=7)
    per_format = [e for e in events if e["format"] != "*"]
    assert len(per_format) == 2 * len(BUILTIN_FORMATS)
    summaries = [e for e in events if e["format"] == "*"]
    assert {e["metric"] for e in summaries} == {"acc", "acc_norm"}
    assert all({"mean", "min", "max", "spread", "step", "task", "value", "n"} <= set(e) for e in summaries)
    assert "spread" in result.spread_line() and "over 5 formats" in result.spread_line()


def test_formats_differ_only_in_wrapping():
    prompts = {name: f.prompt([("Q1?", "A1", None)], "Q2?", None) for name, f in BUILTIN_FORMATS.items()}
    assert len(set(prompts.values())) == len(prompts)
    assert all("Q1?" in p and "A1" in p and p.rstrip().endswith(("Q2?", ":", "A:")) for p in prompts.values())


GSM_TOML = """name = "gsm_tiny"
kind = "generation"
path = "gsm.jsonl"
question_field = "question"
answer_field = "answer"
answer_regex = "#### (-?[0-9.,]+)"
stop = ["\\n\\n"]
max_new_tokens = 6
formats = ["plain", "qa"]
"""


def test_gsm8k_answer_extraction(tmp_path):
    task = load_task(write_task(tmp_path, GSM_TOML, [{"question": "1+1?", "answer": "so 2\n#### 2"}], "gsm"))
    assert task.extract("He has 3 + 4 = 7\n#### 1,234.") == "1234"
    assert task.extract("#### -5 apples") == "-5"
    assert task.extract("the answer is 7") is None
    assert cut_at_stops("#### 18\n\nQuestion: next", ["\n\n", "\nQuestion:"]) == "#### 18"


def test_exact_match_counts_generated_answers(tmp_path):
    """A reference equal to what the model generates matches; another does not: exact match 1/2."""
    from liandan.evaluate.scoring import generate

    model, tok = tiny_model(seed=2), ByteTokenizer()
    toml = GSM_TOML.replace('answer_regex = "#### (-?[0-9.,]+)"\n', "").replace('["plain", "qa"]', '["plain"]')
    probe = load_task(write_task(tmp_path, toml, [{"question": "Q", "answer": "x"}], "gsm"))
    fmt = probe.formats[0]
    prompt = tok.encode_batch([fmt.prompt([], "Q", None)])[0]
    stops = [*probe.stop, *fmt.stop_strings()]
    ids = generate(model, [prompt], max_new_tokens=6, stop_sequences=tok.encode_batch(stops), eos_id=tok.eos_id)[0]
    produced = cut_at_stops(tok.decode(ids), stops).strip()
    records = [{"question": "Q", "answer": produced}, {"question": "Q", "answer": produced + " and more"}]
    task = load_task(write_task(tmp_path, toml, records, "gsm"))
    assert run_task(model, tok, task, max_len=256).scores["plain"]["exact_match"] == 0.5


def _two_stores(tmp_path: Path) -> list:
    (tmp_path / "en").mkdir()
    english = write_corpus(tmp_path / "en", n_docs=20)
    chinese = tmp_path / "zh.jsonl"
    verse = "床前明月光，疑是地上霜。举头望明月，低头思故乡。" * 40
    chinese.write_text("\n".join(json.dumps({"text": verse[i:] + verse[:i]}) for i in range(12)) + "\n")
    stores = []
    for name, path in (("en-store", english), ("zh-store", chinese)):
        store, _ = prepare_store(DataSection(paths=[str(path)], tokenizer="byte"), tmp_path / name, lambda m: None)
        stores.append(store)
    return stores


def test_heldout_bits_per_byte_per_source_equals_direct_computation(tmp_path):
    stores = _two_stores(tmp_path)
    loader = PackedLoader(stores, 64, 4, seed=5, val_fraction=0.2)
    model, tok = tiny_model(seed=3), ByteTokenizer()
    results = heldout_losses(model, loader, tok, sequences=5, batch_size=2, document_mask=False)
    assert [r.source for r in results] == ["en-store", "zh-store"]
    for index, result in enumerate(results):
        batch = loader.heldout_of_store(index, 5)
        with torch.no_grad():
            logits = model(batch.inputs).float()
        nats = float(F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="sum"))
        text_bytes = sum(len(tok.decode(row).encode("utf-8")) for row in batch.targets.tolist())
        assert result.tokens == batch.targets.numel() == 5 * 64
        assert result.bytes == text_bytes
        assert result.loss == pytest.approx(nats / result.tokens, rel=1e-5)
        assert result.bits_per_byte == pytest.approx(nats / math.log(2) / text_bytes, rel=1e-5)


def test_contamination_finds_a_planted_item_and_nothing_in_a_clean_store(tmp_path):
    planted = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
    records = [
        {"question": "How many legs do three spiders have if each spider has eight legs in total here?",
         "answer": "#### 24"},
        {"question": planted, "answer": "#### 72"},
    ]  # fmt: skip
    task = load_task(write_task(tmp_path, GSM_TOML, records, "gsm"))
    corpus = write_corpus(tmp_path, n_docs=15)
    docs = [json.loads(line) for line in corpus.read_text().splitlines()]
    dirty = tmp_path / "dirty.jsonl"
    docs[4]["text"] = docs[4]["text"][:500] + " " + planted + " " + docs[4]["text"][500:]
    dirty.write_text("".join(json.dumps(d) + "\n" for d in docs))
    stores = {}
    for name, path in (("clean", corpus), ("dirty", dirty)):
        stores[name], _ = prepare_store(DataSection(paths=[str(path)], tokenizer="byte"), tmp_path / name,
                                        lambda m: None)  # fmt: skip
    found = {o.source: o for o in overlaps([task], [stores["clean"], stores["dirty"]], ByteTokenizer())}
    assert (found["clean"].contaminated, found["clean"].items) == (0, 2)
    assert (found["dirty"].contaminated, found["dirty"].items) == (1, 2)
    assert "1/2 items" in found["dirty"].line()


BAD_TASKS = [
    ('kind = "generation"\npath = "d.jsonl"\n', None, "missing field 'name'"),
    ('name = "t"\nkind = "ranking"\npath = "d.jsonl"\n', None, "kind = 'ranking'"),
    (('name = "t"\nkind = "generation"\npath = "d.jsonl"\nquestion_field = "q"\nanswer_field = "a"\n'
     'answer_regex = "#### ("\n'), [{"q": "x", "a": "y"}], "'answer_regex'"),
    ('name = "t"\nkind = "generation"\npath = "absent.jsonl"\nquestion_field = "q"\nanswer_field = "a"\n', None,
     "field 'path': jsonl not found"),
    ('name = "t"\nkind = "generation"\npath = "d.jsonl"\nquestion_field = "q"\nanswer_field = "a"\n', "broken",
     "d.jsonl:2"),
    ('name = "t"\nkind = "generation"\npath = "d.jsonl"\nquestion_field = "q"\nanswer_field = "a"\n',
     [{"q": "x"}], "field 'a' (answer_field)"),
]  # fmt: skip


@pytest.mark.parametrize("toml,records,expected", BAD_TASKS)
def test_bad_task_files_get_one_line_errors_naming_file_and_field(tmp_path, toml, records, expected):
    if records == "broken":
        (tmp_path / "d.jsonl").write_text('{"q": "x", "a": "y"}\n{"q": "x", "a": \n')
    elif records is not None:
        write_task(tmp_path, "", records, "d")
    path = write_task(tmp_path, toml, None, "bad")
    with pytest.raises(ConfigError) as err:
        load_task(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and expected in message, message


def test_liandan_eval_reports_a_bad_task_file_in_one_line(tmp_path):
    path = write_task(tmp_path, 'name = "t"\nkind = "ranking"\n', None, "bad")
    done = run_liandan("eval", tmp_path, f"--tasks={path}")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "kind" in lines[0], done.stderr


# -- a trained tiny run: `liandan eval` end to end, and evaluation inside a two-rank FSDP2 run --------------

EVAL_SETTINGS = [
    f"--eval.data_dir={SHARED_DATA}", '--eval.tasks=["gsm8k","cloze_en"]', "--eval.limit=3",
    "--eval.max_new_tokens=8", "--eval.heldout_sequences=4", "--eval.batch_size=4",
]  # fmt: skip


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """20 steps of a tiny model on 2 ranks (FSDP2) with evaluation at steps 10 and 20 and checkpoints there."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    tmp = tmp_path_factory.mktemp("eval-run")
    corpus = write_corpus(tmp, n_docs=20)
    cfg = tiny_config(tmp, corpus, "--train.steps=20", "--optim.lr=3e-3", "--data.val_fraction=0.1",
                      "--checkpoint.every=10", "--checkpoint.async_save=false", "--eval.every=10", *EVAL_SETTINGS)  # fmt: skip
    config = tmp / "run.toml"
    config.write_text(cfg.to_toml())
    done = run_liandan("train", config, "--nproc=2", "--resilience.supervise=false", "--doctor.preflight=false")
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "run"


@pytest.mark.slow
def test_in_training_evaluation_on_two_fsdp_ranks_records_events_and_metrics(fsdp_run):
    run = read_run(fsdp_run)
    tasks = run.of_kind("eval_task")
    assert {(e["step"], e["task"]) for e in tasks} == {(s, t) for s in (10, 20) for t in ("gsm8k", "cloze_en")}
    assert {e["format"] for e in tasks} == {*BUILTIN_FORMATS, "*"}
    summary = [e for e in tasks if e["format"] == "*" and e["task"] == "cloze_en" and e["metric"] == "acc"]
    assert len(summary) == 2 and all(e["spread"] == e["max"] - e["min"] for e in summary)
    heldout = run.of_kind("eval_heldout")
    assert [e["step"] for e in heldout] == [10, 20]
    assert all(e["bits_per_byte"] > 0 and e["bytes"] > 0 for e in heldout)
    assert len(run.of_kind("eval_contamination")) == 2
    records = [m for m in run.metrics if "eval/cloze_en/acc_mean" in m]
    assert [m["step"] for m in records] == [10, 20]
    assert all("eval/heldout/data/bits_per_byte" in m for m in records)
    assert [m["step"] for m in run.metrics if "loss" in m] == list(range(1, 21))  # training records untouched


@pytest.mark.slow
def test_sharded_in_training_results_equal_single_process_liandan_eval(fsdp_run, tmp_path):
    out = tmp_path / "eval.json"
    done = liandan_here("eval", fsdp_run / "checkpoints", *EVAL_SETTINGS, f"--json={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gsm8k: exact_match mean" in done.stdout and "spread" in done.stdout
    report = json.loads(out.read_text())
    assert report["step"] == 20
    in_training = {(e["task"], e["format"], e["metric"]): e["value"] for e in read_run(fsdp_run).of_kind("eval_task")
                   if e["step"] == 20}  # fmt: skip
    after = {(e["task"], e["format"], e["metric"]): e["value"] for t in report["tasks"] for e in t["events"]}
    assert after == pytest.approx(in_training)
    trained = [e for e in read_run(fsdp_run).of_kind("eval_heldout") if e["step"] == 20]
    assert [(h["source"], h["tokens"], h["bytes"]) for h in report["heldout"]] == [
        (e["source"], e["tokens"], e["bytes"]) for e in trained
    ]
    assert report["heldout"][0]["bits_per_byte"] == pytest.approx(trained[0]["bits_per_byte"], rel=1e-4)


@needs_shared
def test_gsm8k_runs_end_to_end_on_a_tiny_checkpoint(tmp_path):
    from liandan.train.trainer import Trainer

    corpus = write_corpus(tmp_path, n_docs=10)
    cfg = tiny_config(tmp_path, corpus, "--train.steps=2", "--checkpoint.every=2", "--checkpoint.async_save=false")
    trainer = Trainer(cfg, say=lambda m: None)
    run = trainer.train().run_dir
    trainer.close()
    out = tmp_path / "eval.json"
    done = liandan_here("eval", run, "--tasks=gsm8k", "--limit=2", f"--json={out}", "--record", f"--eval.data_dir={SHARED_DATA}",
                        "--eval.max_new_tokens=8", "--eval.heldout_sequences=0", "--eval.contamination=false")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (task,) = json.loads(out.read_text())["tasks"]
    assert task["task"] == "gsm8k" and task["n"] == 2 and set(task["scores"]) == set(BUILTIN_FORMATS)
    assert all(set(s) == {"exact_match"} for s in task["scores"].values())
    recorded = read_run(run).of_kind("eval_task")
    assert len(recorded) == len(BUILTIN_FORMATS) + 1 and all(
        e["by"] == "liandan eval" and e["step"] == 2 for e in recorded
    )
    assert "gsm8k: exact_match mean" in done.stdout and "spread" in done.stdout


@pytest.mark.slow
@needs_shared
def test_gsm8k_runs_end_to_end_on_two_processes(fsdp_run, tmp_path):
    out = tmp_path / "eval.json"
    done = run_liandan("eval", fsdp_run, "--tasks=gsm8k", "--limit=2", "--nproc=2", f"--json={out}",
                       f"--eval.data_dir={SHARED_DATA}", "--eval.max_new_tokens=8")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (task,) = json.loads(out.read_text())["tasks"]
    assert task["task"] == "gsm8k" and task["n"] == 2 and len(task["scores"]) == len(BUILTIN_FORMATS)
    assert "gsm8k: exact_match mean" in done.stdout


@needs_shared
@pytest.mark.parametrize("task", ["cloze_en", "cloze_zh"])
def test_cloze_items_are_the_same_in_every_process(task):
    """Ranks and later `liandan eval` runs must see the same items: nothing may hang on string hash order."""
    import os
    import subprocess
    import sys

    script = (
        "import hashlib, json; from liandan.evaluate.tasks import load_tasks;"
        f"t = load_tasks(['{task}'], '{SHARED_DATA}')[0];"
        "print(hashlib.sha256(json.dumps([(i.question, i.choices, i.label) for i in t.items]).encode()).hexdigest())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(digests) == 1


def test_liandan_train_refuses_a_bad_task_file_before_any_worker_starts(tmp_path):
    bad = write_task(tmp_path, 'name = "t"\nkind = "generation"\npath = "absent.jsonl"\n', None, "bad")
    cfg = tiny_config(
        tmp_path, write_corpus(tmp_path, n_docs=2), "--eval.every=1", f"--eval.tasks={json.dumps([str(bad)])}"
    )
    config = tmp_path / "run.toml"
    config.write_text(cfg.to_toml())
    done = run_liandan("train", config, "--nproc=2")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "'path'" in lines[0], done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
