"""The lm-evaluation-harness bridge against liandan's own scoring, on a checkpoint of a real (tiny) training
run: lm-eval tasks defined over local jsonl files (multiple choice, generation with a stop string, rolling
log-likelihood) run through `lm_eval.simple_evaluate` with the "liandan" model give, example by example, the
numbers `liandan.evaluate.scoring` gives on the same requests, and the same accuracy. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import MICRO_MODEL, faults_planned, liandan_here, run_liandan, write_corpus
from liandan.checkpoint.verify import CheckpointError
from liandan.evaluate import scoring
from liandan.evaluate.loading import load_for_eval

# Before lm-eval (and the datasets library under it) is imported: they read these once. Offline is what every
# test wants anyway, so they stay set for the session.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")
ROOT = Path(__file__).resolve().parents[1]

CHOICES = [
    {"question": "The cat sat on the", "choices": ["mat", "moon", "idea"], "answer": 0},
    {"question": "Water is", "choices": ["wet", "dry"], "answer": 1},
    {"question": "One plus one is", "choices": ["two", "three", "four", "five"], "answer": 2},
    {"question": "The keyword that defines a function is", "choices": ["def", "class", "lambda"], "answer": 0},
]
QUESTIONS = [{"prompt": "Q: What does a for loop do?\nA:", "answer": "x"}, {"prompt": "The list", "answer": "y"}]
TEXTS = [
    {"text": "A short line of text."},
    {"text": "The with statement is used to wrap the execution of a block " * 3},
]


def _task(directory: Path, name: str, rows: list[dict], body: str) -> None:
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n{body}"
    )


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("lm-eval-tasks")
    _task(directory, "local_choice", CHOICES, 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
          'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
          "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")  # fmt: skip
    _task(directory, "local_generation", QUESTIONS, 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\n'
          'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 12\n'
          "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")  # fmt: skip
    _task(directory, "local_rolling", TEXTS, 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
          'doc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n')  # fmt: skip
    return directory


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A checkpoint of a few steps of real training on the byte tokenizer, trained in this process (what is
    tested is reading it: a process of its own would only add its start-up)."""
    from liandan.config import load_config
    from liandan.train import Trainer

    root = tmp_path_factory.mktemp("bridge-run")
    corpus = write_corpus(root, n_docs=10)
    overrides = [*MICRO_MODEL, "--model.max_seq_len=64", "--train.seq_len=64", "--train.steps=3",
                 "--train.eval_every=0", "--schedule.warmup_steps=1", "--data.tokenizer=byte",
                 f'--data.paths=["{corpus}"]', f"--run.output_dir={root}", "--run.name=run", "--checkpoint.every=3",
                 "--doctor.preflight=false", "--track.plot=false", "--resilience.supervise=false"]  # fmt: skip
    with faults_planned():
        trainer = Trainer(load_config(str(ROOT / "configs" / "tiny.toml"), overrides), say=lambda m: None)
        try:
            trainer.train()
        finally:
            trainer.close()
    return root / "run"


def local_tasks(directory: Path):
    """A task manager that knows only the tasks in `directory`: indexing lm-eval's thousands of built-in
    task files takes seconds, and none of them runs here."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(directory), include_defaults=False)


@pytest.fixture(scope="module")
def evaluated(run, tasks):
    import liandan.evaluate.lm_eval_bridge  # noqa: F401 - registers "liandan"

    results = lm_eval.simple_evaluate(
        model="liandan", model_args=f"checkpoint={run},batch_size=3", log_samples=True,
        tasks=["local_choice", "local_generation", "local_rolling"], task_manager=local_tasks(tasks),
    )  # fmt: skip
    model, tokenizer, cfg = load_for_eval(run)
    assert cfg.model.llama.dim == 32 and cfg.data.tokenizer == "byte"  # the config the run trained with
    return results, model, tokenizer


def _encode(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Byte tokens: the context's and the continuation's are simply their bytes."""
    return tokenizer.encode_batch([context])[0], tokenizer.encode_batch([continuation])[0]


def test_multiple_choice_log_likelihoods_and_accuracy_agree(evaluated):
    results, model, tokenizer = evaluated
    samples = sorted(results["samples"]["local_choice"], key=lambda s: s["doc_id"])
    requests = [_encode(tokenizer, *argument) for sample in samples for argument in sample["arguments"]]
    ours = iter(scoring.loglikelihoods(model, requests))
    correct = correct_norm = 0
    for sample in samples:
        theirs = [logprob for logprob, _ in sample["filtered_resps"]]
        mine = [next(ours)[0] for _ in theirs]
        assert theirs == pytest.approx(mine, rel=1e-6)
        lengths = [len(choice) for choice in sample["doc"]["choices"]]  # lm-eval's acc_norm: per character
        correct += max(range(len(mine)), key=mine.__getitem__) == sample["target"]
        correct_norm += max(range(len(mine)), key=lambda i: mine[i] / lengths[i]) == sample["target"]
    summary = results["results"]["local_choice"]
    assert summary["acc,none"] == pytest.approx(correct / len(samples))
    assert summary["acc_norm,none"] == pytest.approx(correct_norm / len(samples))


def test_generation_agrees_and_stops_at_the_stop_strings(evaluated):
    results, model, tokenizer = evaluated
    for sample in results["samples"]["local_generation"]:
        prompt, settings = sample["arguments"][0]
        tokens = scoring.generate(model, tokenizer.encode_batch([prompt]), max_new_tokens=12)[0]
        text = tokenizer.decode(tokens)
        for stop in settings["until"]:
            text = text.split(stop)[0]
        assert sample["resps"][0][0] == text
        assert "\n" not in text and "." not in text


def test_rolling_log_likelihoods_agree(evaluated):
    results, model, tokenizer = evaluated
    for sample in results["samples"]["local_rolling"]:
        (text,) = sample["arguments"][0]
        mine = scoring.rolling_loglikelihood(model, tokenizer.encode_batch([text])[0], prefix_token=tokenizer.eos_id)
        assert sample["resps"][0][0] == pytest.approx(mine, rel=1e-6)


def test_loading_refuses_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no such run or checkpoint"):
        load_for_eval(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_for_eval(tmp_path)
    from liandan.checkpoint.info import resolve_checkpoint  # what export, info and generate share

    with pytest.raises(CheckpointError, match="no such run or checkpoint"):
        resolve_checkpoint(tmp_path / "missing")


@pytest.mark.slow
def test_lm_eval_command_runs_a_local_task(run, tasks):
    done = run_liandan("lm-eval", run, "--tasks", "local_choice", "--include_path", tasks, "--limit", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "local_choice" in done.stdout and "acc" in done.stdout


def test_lm_eval_without_tasks_is_refused_in_one_line(run):
    done = liandan_here("lm-eval", run, "--limit", "2")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "liandan: error: liandan lm-eval needs --tasks, e.g. --tasks hellaswag (`lm-eval ls tasks` lists them)"
    ]


@pytest.mark.slow
def test_lm_eval_with_an_unknown_task_is_refused_in_one_line(run, tasks):
    done = run_liandan("lm-eval", run, "--tasks", "local_choice,no_such_task", "--include_path", tasks)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("liandan: error:")]
    assert errors == ["liandan: error: lm-eval: Tasks not found: no_such_task"], done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_the_bridge_refuses_what_it_cannot_do():
    from lm_eval.api.instance import Instance

    from liandan.data.tokens.tokenizer import ByteTokenizer
    from liandan.evaluate.lm_eval_bridge import LiandanLM
    from liandan.model import ModelArgs, Transformer

    model, tokenizer = Transformer(ModelArgs(vocab_size=257, dim=32, n_layers=1, n_heads=2)), ByteTokenizer()
    with pytest.raises(ValueError, match="unknown argument.* of the liandan model: checkpont"):
        LiandanLM(model=model, tokenizer=tokenizer, checkpont="runs/x")
    with pytest.raises(ValueError, match="needs either checkpoint=PATH or model= and tokenizer="):
        LiandanLM()
    lm = LiandanLM(model=model, tokenizer=tokenizer, batch_size="auto:4", max_batch_size=None)
    sampled = Instance("generate_until", {}, ("Once", {"do_sample": True, "temperature": 0.7}), 0)
    with pytest.raises(ValueError, match="generates greedily"):
        lm.generate_until([sampled])
