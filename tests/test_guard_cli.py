"""What the loss-spike guard did, as `liandan incidents` and `liandan skipped` tell it, on a run it rolled back."""

import json
import os
import shutil

import pytest

from helpers import liandan_here, run_liandan, tiny_config, write_corpus


@pytest.fixture(scope="session")
def guarded_run(tmp_path_factory):
    """One run, trained once for the session: a learning-rate burst at step 30 makes the loss spike at step
    31, the guard rolls back to its state of step 20 at half the learning rate for 10 steps and skips data
    steps 20..30; step 36's gradients turn NaN and that update is skipped. A subprocess, so the faults fire
    there and not in this process (each fires once per process)."""
    root = tmp_path_factory.mktemp("guarded")
    config = root / "guarded.toml"
    settings = ["--run.name=guarded", "--resilience.supervise=false", "--train.steps=40", "--train.global_batch=16",
                "--optim.lr=3e-3", "--checkpoint.every=20", "--guard.ring_every=10", "--guard.lr_factor=0.5",
                "--guard.lr_steps=10"]  # fmt: skip
    config.write_text(tiny_config(root / "runs", write_corpus(root, 200), *settings).to_toml())
    env = {**os.environ, "LIANDAN_FAULTS": "burst@update:30,nan@grad:36"}
    done = run_liandan("train", config, env=env)
    assert done.returncode == 0, done.stderr
    return root / "runs" / "guarded"


def test_incidents_show_the_rollback_and_the_skipped_update(guarded_run):
    lines = liandan_here("incidents", guarded_run, check=True).stdout.splitlines()
    rollbacks = [line for line in lines if "ROLLBACK" in line]
    assert len(rollbacks) == 1, lines  # the guard's own record of it is folded into this line
    (line,) = rollbacks
    for words in ("ROLLBACK at step 31: ", "spike", "from step 31; back to step 20, skipped data steps 20..30",
                  "11 step(s) redone", "learning rate now x0.5 of its schedule until step 30",
                  "report guard/spike-step-00000031.json"):  # fmt: skip
        assert words in line, line
    assert "no culprit batch" in line or "bad data: data step(s)" in line
    assert any("update skipped at step 36: nonfinite (from step 36): loss" in line for line in lines), lines
    assert not any("rollback begun" in line for line in lines), lines


def test_timeline_tells_each_guard_action_in_one_line(tmp_path):
    from liandan.resilience.incidents import timeline

    report = str(tmp_path / "guard" / "spike-step-00000090.json")
    events = [
        {"kind": "guard", "step": 12, "action": "warn", "detectors": ["logits"], "began": 12,
         "detail": "logits (from step 12): largest output logit 80 against a running median of 9"},
        {"kind": "too_good", "step": 50, "report": str(tmp_path / "guard" / "drop-step-00000050.json"),
         "tokens": ["a", " "]},
        {"kind": "guard", "step": 50, "action": "warn", "detectors": ["drop"], "began": 49,
         "detail": "drop (from step 49): loss 0.4 against a running median of 3.1"},
        {"kind": "guard", "step": 90, "action": "rollback", "detectors": ["spike"], "began": 88, "detail": "spike"},
        {"kind": "rollback", "step": 90, "report": report, "began": 88, "to": 75, "skipped": [75, 91],
         "lr_scale": 0.25, "lr_until": None, "seconds": 1.0, "steps_redone": 15, "detectors": ["spike"],
         "culprit_data_steps": [86, 87], "documents": 5, "reproduced": True,
         "layers_first": [{"layer": "layers.1.attention", "statistic": "attention_logit", "step": 88}]},
        {"kind": "guard", "step": 120, "action": "rollback", "detectors": ["nonfinite"], "began": 120,
         "detail": "nonfinite (from step 120): loss nan"},  # killed before its rollback was done
        {"kind": "guard", "step": 130, "action": "stop", "detectors": ["limit", "spike"], "began": 129,
         "detail": "limit (from step 129): 3 rollback(s) within guard.rollback_window = 1000 steps already"},
    ]  # fmt: skip
    lines = [json.dumps({"time": 100.0 + i, **e}) + "\n" for i, e in enumerate(events)]
    (tmp_path / "events.jsonl").write_text("".join(lines))
    lines = [line.split("s  ", 1)[1] for line in timeline(tmp_path)]
    assert lines == [
        "guard warning at step 12: logits (from step 12): largest output logit 80 against a running median of 9",
        (
            "TOO GOOD TO BE TRUE? step 50: drop (from step 49): loss 0.4 against a running median of 3.1; easiest"
            " tokens 'a', ' '; report guard/drop-step-00000050.json"
        ),
        (
            "ROLLBACK at step 90: spike from step 88; back to step 75, skipped data steps 75..90, 15 step(s) redone;"
            " learning rate now x0.25 of its schedule; bad data: data step(s) 86, 87 (5 document(s)), reproduced on"
            " replay, moved first: layers.1.attention attention_logit; report guard/spike-step-00000090.json"
        ),
        "rollback begun at step 120: nonfinite (from step 120): loss nan",
        (
            "GUARD STOPPED the run at step 130: limit (from step 129): 3 rollback(s) within guard.rollback_window ="
            " 1000 steps already"
        ),
    ]


def test_skipped_lists_the_batches_and_exports_their_documents(guarded_run, tmp_path):
    export = tmp_path / "skipped.jsonl"
    out = liandan_here("skipped", guarded_run, "--export", export, check=True).stdout.splitlines()
    assert out[0] == f"11 skipped batch(es) of {guarded_run} (newest checkpoint step-00000040)"
    assert out[1].startswith("data steps 20..30: rollback at step 31 to step 20; report ")
    assert out[1].endswith("spike-step-00000031.json")
    listed, step = set(), None
    for line in out[2:-1]:
        if line.startswith("  data step "):
            step = int(line.split()[2].rstrip(":"))
        else:
            store, source, doc_id = line.split()
            assert store == "data" and source.endswith("corpus.jsonl")
            listed.add((step, doc_id))
    assert {s for s, _ in listed} == set(range(20, 31))
    assert out[-1] == f"wrote {len(listed)} document(s) of 11 skipped batch(es) to {export}"

    corpus = {}
    for line in (guarded_run.parents[1] / "corpus.jsonl").read_text().splitlines():
        record = json.loads(line)
        corpus[record["id"]] = record["text"]
    records = [json.loads(line) for line in export.read_text().splitlines()]
    assert {(r["data_step"], r["id"]) for r in records} == listed
    for r in records:
        assert r["store"] == "data" and r["text"] == corpus[r["id"]], r["id"]  # the whole document, decoded


def _error_line(done) -> str:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    return line


def test_skipped_says_in_one_line_when_there_is_nothing_to_list_and_lists_none_when_none_was_skipped(
    guarded_run, tmp_path
):
    assert "not a run directory" in _error_line(liandan_here("skipped", tmp_path / "nowhere"))
    run = tmp_path / "copy"
    run.mkdir()
    shutil.copy(guarded_run / "config.toml", run)
    shutil.copytree(guarded_run / "data", run / "data")
    assert "no checkpoints in" in _error_line(liandan_here("skipped", run))

    # A checkpoint whose loader skipped nothing, and no rollback in the events.
    newest = guarded_run / "checkpoints" / "step-00000040"
    saved = run / "checkpoints" / "step-00000040"
    shutil.copytree(newest, saved)
    meta = json.loads((saved / "meta.json").read_text())
    meta["loader"]["skipped"] = []
    (saved / "meta.json").write_text(json.dumps(meta))
    (run / "events.jsonl").write_text("")
    none = liandan_here("skipped", run, "--export", tmp_path / "none.jsonl", check=True).stdout.splitlines()
    assert none[0] == f"0 skipped batch(es) of {run} (newest checkpoint step-00000040): the guard skipped none"
    assert none[1:] == [f"wrote 0 document(s) of 0 skipped batch(es) to {tmp_path / 'none.jsonl'}"]

    # Rollbacks in the events: one before the checkpoint that the run undid (it resumed from before it and
    # trained those batches after all), one after the checkpoint, not saved in any yet.
    loader_step = meta["loader"]["step"]
    rollbacks = [{"kind": "rollback", "step": 9, "to": 5, "skipped": [5, 9], "report": "r9"},
                 {"kind": "rollback", "step": 47, "to": 40, "skipped": [loader_step, loader_step + 2],
                  "report": "r47", "culprit_data_steps": [loader_step + 1]}]  # fmt: skip
    (run / "events.jsonl").write_text("".join(json.dumps({"time": 1.0, **e}) + "\n" for e in rollbacks))
    out = liandan_here("skipped", run, check=True).stdout.splitlines()
    assert out[0].startswith("2 skipped batch(es)")
    assert out[1] == (
        f"data steps {loader_step}..{loader_step + 1}: rollback at step 47 to step 40; report r47"
        " (after the newest checkpoint)"
    )
    assert any(line.startswith(f"  data step {loader_step + 1}: ") and "culprit" in line for line in out)
