"""The alignment tax: `liandan eval TUNED --against [BASE]` scores a fine-tuned checkpoint and the base it started
from on the same tasks, formats and items and on the base run's held-out sources; its numbers are those of
`liandan eval` on each checkpoint alone, `--record` keeps the comparison in the tuned run, `liandan report`
shows it, and a baseline that is missing or unreadable is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import (
    MC_TOML,
    SHARED_DATA,
    liandan_here,
    read_run,
    run_liandan,
    start_liandan,
    tiny_config,
    write_chat_data,
    write_corpus,
)
from liandan.evaluate.tax import GAIN, TAX, WITHIN, compare, foreign_ids, task_verdict

MC_RECORDS = [
    {"q": "The cat sat on the", "choices": ["mat", "theory of everything", "x"], "gold": 0},
    {"q": "Two plus two is", "choices": ["four", "a very long wrong answer", "five"], "gold": 2},
    {"q": "The sky is", "choices": ["blue", "green"], "gold": 1},
    {"q": "Water is", "choices": ["wet", "a kind of rock"], "gold": 0},
]
HELDOUT = "--eval.heldout_sequences=4"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    """A base run pretrained for 4 steps (its own BPE with room for ChatML's markers, a tenth of its windows
    held out, a task file as its [eval] tasks) and an SFT run of 3 steps on chat data from its checkpoint, with
    chat windows of its own held out."""
    from liandan.train import Trainer

    tmp = tmp_path_factory.mktemp("tax")
    (tmp / "tiny_mc.jsonl").write_text("\n".join(json.dumps(r) for r in MC_RECORDS) + "\n")
    task = tmp / "tiny_mc.toml"
    task.write_text(MC_TOML)
    corpus = write_corpus(tmp, n_docs=40)
    base_cfg = tiny_config(tmp, corpus, "--run.name=base", "--data.tokenizer=bpe", "--data.bpe_vocab_size=320",
                           "--model.vocab_size=384", "--data.val_fraction=0.1", "--train.steps=4",
                           "--checkpoint.every=4", "--checkpoint.async_save=false", f'--eval.tasks=["{task}"]')  # fmt: skip
    trainer = Trainer(base_cfg, say=lambda m: None)
    base = trainer.train().run_dir
    trainer.close()
    chat = write_chat_data(tmp, n=24, malformed=False)
    start = base / "checkpoints" / "step-00000004"
    sft_cfg = tiny_config(tmp, chat, "--run.name=sft", "--train.objective=sft", f'--data.paths=["{chat}"]',
                          f"--data.tokenizer={base / 'data' / 'tokenizer.json'}", "--data.val_fraction=0.1",
                          f"--checkpoint.init_from={start}", "--train.steps=3", "--checkpoint.every=3",
                          "--checkpoint.async_save=false", "--optim.lr=3e-2")  # fmt: skip
    trainer = Trainer(sft_cfg, say=lambda m: None)
    sft = trainer.train().run_dir
    trainer.close()
    return {"base": base, "start": start, "sft": sft, "task": task, "tmp": tmp}


def _eval(out: Path, *args) -> dict:
    done = liandan_here("eval", *args, f"--json={out}", HELDOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def evaluated(pair) -> dict[str, dict]:
    """`liandan eval` of the SFT run against its base (the base's [eval] tasks, its init_from found), and of
    each checkpoint alone on the same task."""
    task = f"--tasks={pair['task']}"
    tmp = pair["tmp"]
    return {"tax": _eval(tmp / "tax.json", pair["sft"], "--against"), "base": _eval(tmp / "base.json", pair["start"], task),
            "sft": _eval(tmp / "sft.json", pair["sft"], task)}  # fmt: skip


def _scores(report: dict) -> dict:
    return {t["task"]: t["scores"] for t in report["tasks"]}


def test_before_and_after_equal_liandan_eval_of_each_checkpoint_alone(pair, evaluated):
    both, base, sft = evaluated["tax"], evaluated["base"], evaluated["sft"]
    assert both["baseline"]["checkpoint"] == str(pair["start"]) and both["baseline"]["step"] == 4
    assert _scores(both["baseline"]) == _scores(base) and _scores(both) == _scores(sft)
    assert list(_scores(both)) == ["tiny_mc"]  # the base run's [eval] tasks: the SFT run names none
    rows = {(r["task"], r["metric"]): r for r in both["tax"]["tasks"]}
    assert set(rows) == {("tiny_mc", "acc"), ("tiny_mc", "acc_norm")}
    for (task, metric), row in rows.items():
        before = next(t for t in base["tasks"] if t["task"] == task)["summary"][metric]
        after = next(t for t in sft["tasks"] if t["task"] == task)["summary"][metric]
        assert (row["before"], row["after"]) == (before["mean"], after["mean"])
        assert row["change"] == pytest.approx(after["mean"] - before["mean"])
        assert row["spread"] == max(before["spread"], after["spread"])
        assert row["verdict"] == task_verdict(row["change"], row["spread"])
        assert row["formats"] == {fmt: [base_scores[metric], sft_scores[metric]]
                                  for (fmt, base_scores), sft_scores in zip(_scores(base)[task].items(),
                                                                             _scores(sft)[task].values())}  # fmt: skip


def test_the_heldout_sources_are_the_base_runs(pair, evaluated):
    """Both models on the base run's held-out windows (the same tokens and bytes as the base's own `liandan
    eval`), not on the SFT run's chat windows; the tuned model's bits per byte equal a direct computation."""
    import torch

    from liandan.config import load_config
    from liandan.data.pipeline.prepare import open_prepared
    from liandan.data.tokens.loader import PackedLoader
    from liandan.evaluate.heldout import heldout_losses
    from liandan.evaluate.loading import load_for_eval

    both, base, sft = evaluated["tax"], evaluated["base"], evaluated["sft"]
    assert both["baseline"]["heldout"] == base["heldout"] and base["heldout"]
    assert [(h["tokens"], h["bytes"]) for h in both["heldout"]] == [(h["tokens"], h["bytes"]) for h in base["heldout"]]
    assert [h["bytes"] for h in sft["heldout"]] != [h["bytes"] for h in base["heldout"]]  # its own: chat
    (row,) = both["tax"]["heldout"]
    assert (row["before"], row["after"]) == (base["heldout"][0]["bits_per_byte"], both["heldout"][0]["bits_per_byte"])
    cfg = load_config(pair["base"] / "config.toml", [])
    loader = PackedLoader([open_prepared(pair["base"] / "data")[0]], cfg.train.seq_len, cfg.train.global_batch,
                          cfg.run.seed, cfg.data.val_fraction)  # fmt: skip
    _, base_tokenizer, _ = load_for_eval(pair["start"])
    tuned, tuned_tokenizer, _ = load_for_eval(pair["sft"])
    assert tuned_tokenizer.vocab_size == base_tokenizer.vocab_size + 2  # ChatML's markers appended
    with torch.no_grad():
        (direct,) = heldout_losses(tuned, loader, base_tokenizer, sequences=4, batch_size=cfg.eval.batch_size)
    assert direct.bits_per_byte == pytest.approx(row["after"], rel=1e-6)


def test_the_comparison_is_recorded_and_the_report_shows_it(pair, tmp_path):
    recorded = len(read_run(pair["sft"]).of_kind("eval_tax"))
    done = liandan_here("eval", pair["sft"], "--against", pair["start"], f"--tasks={pair['task']}", "--record", HELDOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "before and after fine-tuning:" in done.stdout and "held-out data:" in done.stdout
    events = read_run(pair["sft"]).of_kind("eval_tax")
    assert len(events) == recorded + 1
    event = events[-1]
    assert event["by"] == "liandan eval" and event["baseline"] == str(pair["start"]) and event["step"] == 3
    assert not read_run(pair["sft"]).of_kind("eval_heldout")  # its held-out here was the base's: in the comparison
    out = tmp_path / "report.html"
    written = liandan_here("report", pair["sft"], "--output", out)
    assert written.returncode == 0, written.stderr
    page = out.read_text()
    section = page[page.index("<h3>Before and after fine-tuning</h3>") :]
    for row in event["tasks"]:
        assert f"<td>{row['before']:.3f}</td><td>{row['after']:.3f}</td><td>{row['change']:+.3f}</td>" in section
    (held,) = event["heldout"]
    assert f"<td>data</td><td>{held['before']:.4f}</td><td>{held['after']:.4f}</td>" in section
    assert 'id="run0-tax"' in section and (tmp_path / "report-sft-tax.png").is_file()


def test_a_drop_beyond_the_spread_is_a_tax_and_stands_out():
    def report(scores: dict[str, float], bpb: float) -> dict:
        values = list(scores.values())
        summary = {"mean": sum(values) / len(values), "min": min(values), "max": max(values),
                   "spread": max(values) - min(values)}  # fmt: skip
        return {"checkpoint": "c", "step": 1, "heldout": [{"source": "web", "bits_per_byte": bpb, "loss": bpb,
                                                            "tokens": 8, "bytes": 9}],
                "tasks": [{"task": "t", "n": 4, "scores": {f: {"acc": v} for f, v in scores.items()},
                           "summary": {"acc": summary}}]}  # fmt: skip

    base = report({"qa": 0.50, "plain": 0.40}, 1.00)
    taxed = compare(base, report({"qa": 0.30, "plain": 0.25}, 1.10))
    assert taxed["tasks"][0]["verdict"] == TAX and taxed["heldout"][0]["verdict"] == TAX
    assert taxed["heldout"][0]["relative"] == pytest.approx(0.10)
    assert compare(base, report({"qa": 0.45, "plain": 0.40}, 0.9))["tasks"][0]["verdict"] == WITHIN
    assert compare(base, report({"qa": 0.70, "plain": 0.68}, 0.9))["tasks"][0]["verdict"] == GAIN
    from liandan.track import report_tax

    html = report_tax.section([taxed], "tax", {}, False, None)
    assert "<p class='tax'>tax: t acc, held-out web</p>" in html and "<tr class='tax'><td>t</td>" in html
    bars = report_tax.figure(taxed)["data"]  # before's tasks and held-out, then after's: a taxed bar in red
    assert [b["marker"]["color"] for b in bars] == [["#7f7f7f"], ["#7f7f7f"], ["#d62728"], ["#d62728"]]
    assert report_tax.draw(taxed) is not None


def test_the_held_out_ids_must_mean_the_same_to_the_tuned_model(pair):
    from liandan.data.tokens.tokenizer import ByteTokenizer, HFTokenizer, train_bpe

    base = HFTokenizer.load(pair["base"] / "data" / "tokenizer.json")
    assert foreign_ids(base, base) is None and foreign_ids(base, base.with_special_tokens(["<|im_end|>"])) is None
    other = train_bpe(["an unrelated text of its own, " * 50], vocab_size=300)
    assert "neither the base model's" in foreign_ids(base, other)
    assert "not the base model's" in foreign_ids(ByteTokenizer(), base)


def test_a_missing_or_unreadable_baseline_is_one_line(pair, tmp_path):
    def refused(*args) -> str:
        done = liandan_here("eval", *args, f"--tasks={pair['task']}")
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        (line,) = done.stderr.strip().splitlines()
        return line

    assert "checkpoint.init_from is empty" in refused(pair["base"], "--against")
    assert "is not there" in refused(pair["sft"], f"--against={tmp_path / 'absent'}")
    assert "no checkpoint at" in refused(pair["sft"], f"--against={tmp_path}")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert "Hugging Face weights" in refused(pair["sft"], f"--against={hf}")
    broken = tmp_path / "broken" / "step-00000004"
    shutil.copytree(pair["start"], broken)
    shard = max((p for p in broken.rglob("*") if p.is_file() and p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(b"\0" * shard.stat().st_size)
    line = refused(pair["sft"], f"--against={broken}")
    assert line.startswith("liandan: error: liandan eval --against: the base model") and "checksum" in line


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"shared data not found at {SHARED_DATA}")
def test_the_shipped_tasks_before_and_after_in_the_report(pair, tmp_path):
    """cloze_en and gsm8k, every format, before and after: in the comparison and the report."""
    out = tmp_path / "tax.json"
    done = liandan_here("eval", pair["sft"], "--against", "--tasks=cloze_en,gsm8k", "--limit=2", f"--json={out}",
                        f"--data-dir={SHARED_DATA}", "--eval.max_new_tokens=8", "--eval.heldout_sequences=0",
                        "--eval.contamination=false", "--record")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    tax = json.loads(out.read_text())["tax"]
    assert [(r["task"], r["metric"]) for r in tax["tasks"]] == [("cloze_en", "acc"), ("cloze_en", "acc_norm"),
                                                                ("gsm8k", "exact_match")]  # fmt: skip
    assert all(len(r["formats"]) == 5 for r in tax["tasks"]) and "bits per byte not compared" in tax["notes"][0]
    report = tmp_path / "report.html"
    assert liandan_here("report", pair["sft"], "--output", report).returncode == 0
    section = report.read_text().split("<h3>Before and after fine-tuning</h3>")[1]
    assert "<td>cloze_en</td><td>acc</td>" in section and "<td>gsm8k</td><td>exact_match</td>" in section


@pytest.mark.slow
def test_two_processes_give_the_comparison_of_one(pair, evaluated, tmp_path):
    out = tmp_path / "two.json"
    done = run_liandan("eval", pair["sft"], "--against", "--nproc=2", f"--json={out}", HELDOUT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    two, one = json.loads(out.read_text())["tax"], evaluated["tax"]["tax"]
    assert two["tasks"] == one["tasks"]
    assert [r["after"] for r in two["heldout"]] == pytest.approx([r["after"] for r in one["heldout"]], rel=1e-6)


@pytest.mark.slow
def test_the_dashboard_shows_the_newest_comparison(pair):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need the [browser-tests] extra")
    if not Path("/usr/bin/chromium").is_file():
        pytest.skip("no Chromium at /usr/bin/chromium (Debian's chromium package) for the browser tests")
    done = liandan_here("eval", pair["sft"], "--against", "--record", HELDOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    event = read_run(pair["sft"]).of_kind("eval_tax")[-1]
    proc = start_liandan("dash", pair["tmp"], "--port", "0")
    try:
        url = next(line.split("dash: open ", 1)[1].strip() for line in proc.stdout if line.startswith("dash: open "))
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(url + "#/run/sft")
            page.wait_for_selector("#before-after")
            text = page.locator("#before-after").inner_text()
            browser.close()
        assert not errors, errors
        for row in event["tasks"]:
            assert f"{row['before']:.3f}\t{row['after']:.3f}" in text and row["verdict"] in text
        assert f"held-out data\tbits/byte\t{event['heldout'][0]['before']:.4f}" in text
    finally:
        proc.terminate()
        proc.wait()
