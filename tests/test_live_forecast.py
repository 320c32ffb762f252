"""Forecasts of the final loss while a run trains: when they are made, what they write, the flag against a
reference loss, and that training itself is untouched."""

import json
import logging
import math
import threading

import numpy as np
import pytest
import torch

from helpers import MICRO_MODEL, read_run, run_liandan, tiny_config, write_corpus
from liandan.config import ScheduleSection
from liandan.plan.forecast import schedule_fractions
from liandan.plan.forecast_callback import ForecastCallback
from liandan.plan.forecast_worker import MAX_WAITING, ForecastWorker
from liandan.plan.live_forecast import LiveForecaster
from liandan.run import RunDir
from liandan.track.store import RunStore
from liandan.train import Trainer
from liandan.train.callbacks import Callback, build_callbacks

STEPS = 40
SHAPE = [
    *MICRO_MODEL,
    f"--train.steps={STEPS}",
    "--schedule.warmup_steps=4",
    "--optim.lr=1e-2",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), n_docs=20)


def events(run_dir, kind):
    return read_run(run_dir).of_kind(kind)


def decaying_curve(steps):
    s = np.arange(1, steps + 1)
    return s, 2.0 + 3.0 * (s / 5.0) ** -0.5 + np.random.default_rng(0).normal(0.0, 0.01, steps)


# --------------------------------------------------------------------------------------------------------
# the forecaster alone


def test_forecasts_fall_due_on_logged_steps():
    lr = schedule_fractions(ScheduleSection(kind="cosine", warmup_steps=5), 100)
    f = LiveForecaster(lr, 100, every=10, samples=0)  # no interval: only when forecasts fall due matters here
    due = []
    for step in range(3, 101, 3):  # logged every 3 steps: due at the first logged step past each multiple of 10
        f.observe(step, 5.0 - step / 50)
        if f.due():
            due.append(step)
            f.forecast()
    assert due == [12, 21, 30, 42, 51, 60, 72, 81, 90]  # never at the last step, 99 being the last logged here
    f.observe(100, float("nan"))
    assert not f.due()


def test_too_few_records_skip_quietly_and_a_failed_fit_with_a_debug_note(caplog):
    lr = schedule_fractions(ScheduleSection(kind="cosine", warmup_steps=20), 200)
    steps, losses = decaying_curve(200)
    quiet = LiveForecaster(lr, 200, every=10)
    quiet.resume(steps[:12], losses[:12])  # all within the warmup: fewer than 8 records to fit
    with caplog.at_level(logging.DEBUG, logger="liandan.plan.live_forecast"):
        assert quiet.forecast() is None
    assert not caplog.records

    broken = LiveForecaster(np.full(200, np.nan), 200, every=10)  # a schedule the fit cannot use
    broken.resume(steps[:100], losses[:100])
    with caplog.at_level(logging.DEBUG, logger="liandan.plan.live_forecast"):
        assert broken.forecast() is None
    assert "forecast at step 100 skipped: ValueError" in caplog.text


def test_resumed_curve_and_the_flag():
    lr = schedule_fractions(ScheduleSection(kind="cosine", warmup_steps=20), 200)
    steps, losses = decaying_curve(200)
    f = LiveForecaster(lr, 200, every=25, reference_loss=1.0)
    f.resume(steps[:104], losses[:104])  # a run resumed at step 104: the next forecast is at 125
    f.observe(105, losses[104])
    assert not f.due()
    for step in range(106, 126):
        f.observe(step, losses[step - 1])
    assert f.due()
    result = f.forecast()
    assert result.step == 125 and result.total_steps == 200
    assert result.low <= result.final_loss <= result.high
    # the curve flattens towards 2.2: far above 1.0 even at the interval's low end
    assert result.worse_than_reference and result.central_worse_than_reference
    assert f.newly_flagged(result) and not f.newly_flagged(result)  # flagged once
    event = result.to_event()
    assert event["reference_loss"] == 1.0 and event["step"] == 125 and event["seconds"] >= 0


# --------------------------------------------------------------------------------------------------------
# in training


def test_forecasting_writes_events_and_leaves_training_untouched(tmp_path, corpus):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain_cfg = tiny_config(tmp_path, corpus, *SHAPE, "--run.name=plain")
        assert not [c for c in build_callbacks(plain_cfg) if isinstance(c, ForecastCallback)]
        plain = Trainer(plain_cfg, say=lambda m: None).train()

        cfg = tiny_config(
            tmp_path, corpus, *SHAPE, "--run.name=forecast", "--forecast.every=10", "--forecast.reference_loss=0.01"
        )
        assert len([c for c in build_callbacks(cfg) if isinstance(c, ForecastCallback)]) == 1
        said = []
        forecast = Trainer(cfg, say=said.append).train()  # attached by the trainer itself
    finally:
        torch.set_num_threads(threads)

    assert forecast.losses == plain.losses  # bit for bit
    assert forecast.val_loss == plain.val_loss
    made = events(forecast.run_dir, "forecast")
    assert [e["step"] for e in made] == [20, 30]  # at step 10 only 6 records lie past the warmup: skipped
    for e in made:
        assert e["total_steps"] == STEPS and e["confidence"] == 0.8 and e["reference_loss"] == 0.01
        assert math.isfinite(e["final_loss"]) and e["low"] <= e["final_loss"] <= e["high"]
        assert e["worse_than_reference"] is True
        assert 0 <= e["seconds"] < 10
    console = [line for line in said if line.startswith("step ") and "forecast final loss" in line]
    assert [line.split(":")[0] for line in console] == ["step 20", "step 30"]
    flags = events(forecast.run_dir, "forecast_worse_than_reference")
    assert len(flags) == 1 and flags[0]["step"] == 20 and flags[0]["low"] > 0.01
    warnings = [line for line in said if line.startswith("warning:")]
    assert len(warnings) == 1 and "worse than the reference 0.0100" in warnings[0]
    assert not events(plain.run_dir, "forecast")


def test_liandan_train_forecasts_when_asked(tmp_path, corpus):
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_config(tmp_path, corpus, *SHAPE, "--run.name=cli").to_toml())
    done = run_liandan("train", config, "--resilience.supervise=false", "--forecast.every=15", timeout=300)
    assert done.returncode == 0, done.stderr
    assert "step 15: forecast final loss" in done.stdout and "step 30: forecast final loss" in done.stdout
    assert "warning:" not in done.stdout  # no reference, no flag
    made = events(tmp_path / "cli", "forecast")
    assert [e["step"] for e in made] == [15, 30]
    assert all("reference_loss" not in e for e in made)


# --------------------------------------------------------------------------------------------------------
# off the training loop's critical path

LEAD = 5  # steps the loop must run past a forecast's step before that forecast's fit may finish


class LoopStep(Callback):
    """Tells a GatedForecaster how far the training loop has got; runs before the forecast callback."""

    order = 11

    def __init__(self, forecaster):
        self.forecaster = forecaster

    def after_step(self, trainer, step, metrics):
        with self.forecaster.gate:
            self.forecaster.loop_step = step
            self.forecaster.gate.notify_all()


class GatedForecaster(LiveForecaster):
    """A real forecaster whose fit cannot return before the training loop has finished LEAD more steps. If the
    loop waited for a forecast, that wait could never end: the gate would time out and say so."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Condition()
        self.loop_step = 0
        self.released: list[tuple[int, bool]] = []  # (the forecast's step, whether the loop opened the gate)

    def compute(self, steps, losses):
        with self.gate:
            opened = self.gate.wait_for(lambda: self.loop_step >= steps[-1] + LEAD, timeout=30)
        self.released.append((steps[-1], opened))
        return super().compute(steps, losses)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_forecasts_are_fitted_while_the_loop_goes_on_and_still_written(tmp_path, corpus, one_thread):
    cfg = tiny_config(tmp_path, corpus, *SHAPE, "--run.name=gated", "--forecast.every=10")
    forecaster = GatedForecaster.from_config(cfg)
    result = Trainer(cfg, callbacks=[LoopStep(forecaster), ForecastCallback(forecaster)], say=lambda m: None).train()

    # the loop ran LEAD steps past each forecast's step while its fit was pending: it never waited for one
    assert forecaster.released == [(10, True), (20, True), (30, True)]
    made = events(result.run_dir, "forecast")
    assert [e["step"] for e in made] == [20, 30]  # step 10's fit saw too few records: nothing to write
    for e in made:
        assert e["step"] + LEAD <= e["published_step"] <= STEPS
    # in metrics.jsonl each forecast's record (at the step it saw) comes after the training records of the
    # steps run while it was fitted
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    for e in made:
        at = next(i for i, r in enumerate(records) if "forecast_final_loss" in r and r["step"] == e["step"])
        assert records[at]["forecast_final_loss"] == e["final_loss"]
        assert records[at]["forecast_low"] == e["low"] and records[at]["forecast_high"] == e["high"]
        trained_before = {r["step"] for r in records[:at] if "loss" in r}
        assert set(range(1, e["step"] + LEAD + 1)) <= trained_before
    assert not [t for t in threading.enumerate() if t.name == "liandan-forecast"]  # stopped at the end
    with RunStore(RunDir(result.run_dir).project) as store:  # the run store has them as metrics and events
        store.ingest(result.run_dir)
        curve = store.curve("gated", "forecast_final_loss")
        assert dict(zip(curve["step"], curve["y"])) == {e["step"]: e["final_loss"] for e in made}
        assert [e["step"] for e in store.forecasts("gated")] == [e["step"] for e in made]


class FailAt(Callback):
    order = 11

    def __init__(self, step):
        self.step = step

    def after_step(self, trainer, step, metrics):
        if step == self.step:
            raise RuntimeError(f"failed at step {step}")


def test_a_failed_run_stops_its_forecast_thread_and_writes_no_more(tmp_path, corpus, one_thread):
    cfg = tiny_config(tmp_path, corpus, *SHAPE, "--run.name=failing", "--forecast.every=10")
    callback = ForecastCallback(LiveForecaster.from_config(cfg))
    with pytest.raises(RuntimeError, match="failed at step 31"):
        Trainer(cfg, callbacks=[FailAt(31), callback], say=lambda m: None).train()
    assert callback.worker is None
    assert not [t for t in threading.enumerate() if t.name == "liandan-forecast"]
    # step 30's forecast was asked for; the run failed before any step could write it
    assert all(e["step"] < 30 for e in events(tmp_path / "failing", "forecast"))


def test_a_worker_that_falls_behind_drops_the_oldest_waiting_request_and_never_more():
    started, release = threading.Event(), threading.Event()

    def fit(steps, losses):  # the fit of step 1 holds the thread until released; the others return at once
        started.set()
        assert release.wait(timeout=30)
        return steps[-1]

    worker = ForecastWorker(fit)
    worker.submit([1], [5.0])
    assert started.wait(timeout=30) and worker.in_flight
    for step in range(2, 3 + MAX_WAITING):  # one more than may wait
        worker.submit([step], [5.0])
    assert worker.poll() == [] and worker.superseded == 1
    release.set()
    assert worker.close(drain=True) == [1, *range(3, 3 + MAX_WAITING)]
    assert not worker.alive
