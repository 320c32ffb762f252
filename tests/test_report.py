"""`liandan report` and the incident marks of training.png, on real runs: one trained here with a learning-rate
burst (the guard rolls it back) and NaN gradients (the guard skips that update), and a supervised one whose
worker is killed (a restart)."""

from __future__ import annotations

import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

import liandan.plan.forecast_callback  # noqa: F401 - registers "forecast", as `liandan train` does
from helpers import INCIDENT_KILL_STEP, faults_planned, liandan_here, tiny_config, write_corpus
from liandan.cli.main import main
from liandan.resilience.incidents import timeline
from liandan.run import RunDir
from liandan.track import report as report_module
from liandan.track.marks import incident_marks
from liandan.track.plot import MARKS_KEY, draw_run, plot_run
from liandan.track.report import write_report
from liandan.train import Trainer

STEPS = 30
# A byte-level model that learns in a few steps; the guard judges from step 8 and keeps a state every 5.
GUARDED = [f"--train.steps={STEPS}", "--optim.lr=3e-3", "--train.global_batch=16", "--guard.warmup=8",
           "--guard.ring_every=5", "--guard.stats_every=10", "--train.eval_every=10", "--train.eval_batches=2"]  # fmt: skip
FAULTS = "burst@update:15,nan@grad:24"  # a rollback to step 10 a step or so after 15, a skipped update at 24
CHROMIUM = "/usr/bin/chromium"


def train(out: Path, corpus: Path, *overrides: str, fault: str = "", name: str = "run") -> Path:
    """An in-process run with `fault` in $LIANDAN_FAULTS; returns its run directory."""
    with faults_planned(fault):
        cfg = tiny_config(out, corpus, f"--run.name={name}", *overrides)
        trainer = Trainer(cfg, say=lambda m: None)  # with every callback the config asks for (the live forecast's)
        try:
            return trainer.train().run_dir
        finally:
            trainer.close()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("report-corpus"), 120)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, corpus):
    return train(
        tmp_path_factory.mktemp("report-runs"), corpus, *GUARDED, "--track.plot=true", fault=FAULTS, name="faulty"
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory, faulty):
    out = tmp_path_factory.mktemp("report-out") / "faulty.html"
    written = write_report([(faulty, timeline(faulty))], out)
    return out, written


class Page(HTMLParser):
    """What a page references and says: every src and href, the text, the scripts, what could not be parsed."""

    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.text: list[str] = []
        self.scripts: list[str] = []
        self.images: list[str] = []
        self.errors: list[str] = []
        self.stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in ("meta", "img", "br", "hr", "link", "input"):
            self.stack.append(tag)
        for name, value in attrs:
            if name in ("src", "href", "action", "data", "poster", "srcset") and value is not None:
                self.links.append(value)
        if tag == "img":
            self.images.append(dict(attrs).get("src", ""))

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
        else:
            self.stack.pop()

    def handle_data(self, data):
        (self.scripts if self.stack and self.stack[-1] == "script" else self.text).append(data)


def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    assert not page.errors and page.stack == [], (page.errors, page.stack)
    return page


def test_the_runs_incidents_are_the_rollback_and_the_skipped_update(faulty):
    marks = incident_marks(RunDir(faulty).read_events())
    rollback = [m for m in marks if m.category == "rollback"]
    skipped = [m for m in marks if m.category == "skipped"]
    assert len(rollback) == 1 and 16 <= rollback[0].step <= 18 and rollback[0].back_to == 10, marks
    assert [m.step for m in skipped] == [24], marks


def test_training_png_marks_the_incidents_on_every_panel(faulty, tmp_path):
    out = plot_run(faulty, tmp_path / "training.png")
    from PIL import Image

    with Image.open(out) as picture:
        drawn = json.loads(picture.text[MARKS_KEY])
    expected = [(m.step, m.category) for m in incident_marks(RunDir(faulty).read_events())]
    assert [(m["step"], m["category"]) for m in drawn] == expected and len(expected) == 2
    # the artists themselves: a vertical line per mark on each of the three panels, the legend naming both
    fig, marks = draw_run(RunDir(faulty))
    for mark in marks:
        lines = [
            line
            for ax in fig.axes
            for line in ax.get_lines()
            if line.get_gid() == f"incident:{mark.category}:{mark.step}"
        ]
        assert len(lines) == 3 and all(list(line.get_xdata()) == [mark.step, mark.step] for line in lines)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(t.startswith("rollback (step ") for t in legend) and "skipped update (step 24)" in legend, legend
    # the trainer drew its own training.png the same way
    with Image.open(RunDir(faulty).plot()) as picture:
        assert json.loads(picture.text[MARKS_KEY]) == drawn


def test_the_report_is_one_self_contained_page_with_the_runs_incidents(faulty, report):
    out, written = report
    page = parse(out)
    assert not [link for link in page.links if not link.startswith(("#", "data:"))], page.links
    text = " ".join(" ".join(page.text).split())
    assert "faulty" in text and "steps 30 of 30" in text and "tokens 30,720" in text  # the summary
    lines = timeline(faulty)
    assert any("ROLLBACK at step" in line for line in lines) and any(
        "update skipped at step 24" in line for line in lines
    )
    for line in lines:
        assert " ".join(line.split()) in text, line
    assert "model_family" in text or "[model]" in text  # the resolved config
    # the charts are plotly.js figures, plotly.js inlined; each chart carries the incident marks
    assert any("Plotly.newPlot" in s for s in page.scripts) and max(len(s) for s in page.scripts) > 1_000_000
    figures = json.loads(re.search(r"const FIGURES = (\{.*?\});\n", out.read_text()).group(1))
    assert {"run0-loss", "run0-lr", "run0-tokens_per_s", "run0-mfu"} <= set(figures)
    loss = figures["run0-loss"]["data"]
    assert {t["name"] for t in loss} >= {"train", "validation", "rollback", "skipped update"}
    [skip] = [t for t in loss if t["name"] == "skipped update"]
    assert skip["x"][:2] == [24, 24] and "update skipped" in skip["text"][0]
    assert written[1:] == [out.with_name("faulty-faulty.png")] and written[1].stat().st_size > 10_000


def test_without_plotly_the_report_shows_the_pngs_inline(faulty, tmp_path, monkeypatch):
    monkeypatch.setattr(report_module, "_plotly_js", lambda: None)
    out = tmp_path / "static.html"
    write_report([(faulty, timeline(faulty))], out)
    page = parse(out)
    assert page.images and all(src.startswith("data:image/png;base64,") for src in page.images)
    assert not page.scripts


def test_two_runs_are_compared_on_one_chart_by_tokens_with_forecasts_shown(faulty, corpus, tmp_path):
    other = train(tmp_path, corpus, "--train.steps=20", "--train.global_batch=8", "--forecast.every=5", name="small")
    forecasts = [e for e in RunDir(other).read_events() if e["kind"] == "forecast"]
    assert forecasts
    out = tmp_path / "both.html"
    written = write_report([(faulty, timeline(faulty)), (other, timeline(other))], out)
    assert out.with_name("both-compare.png") in written
    figures = json.loads(re.search(r"const FIGURES = (\{.*?\});\n", out.read_text()).group(1))
    compare = figures["compare"]
    assert [t["name"] for t in compare["data"]] == ["faulty", "small"]
    assert compare["layout"]["xaxis"]["title"]["text"] == "tokens"
    # 16 x 64 tokens a step against 8 x 64
    assert compare["data"][0]["x"][0] == 16 * 64 and compare["data"][1]["x"][0] == 8 * 64
    assert "run1-loss" in figures and "Runs compared" in out.read_text()
    # the newest forecast of the final loss on the loss chart, every forecast in a table
    [shown] = [t for t in figures["run1-loss"]["data"] if t["name"].startswith("forecast at step")]
    newest = forecasts[-1]
    assert shown["x"] == [20] and shown["y"] == [newest["final_loss"]]
    assert shown["error_y"]["array"][0] == pytest.approx(newest["high"] - newest["final_loss"])
    text = " ".join(" ".join(parse(out).text).split())
    assert "Forecasts of the final loss" in text and f"[{newest['low']:.4g}, {newest['high']:.4g}]" in text


def test_a_bad_run_path_is_one_line(tmp_path, capsys):
    for path, said in ((tmp_path / "missing", "no such run directory"), (tmp_path, "not a run directory")):
        assert main(["report", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"liandan: error: {path}: {said}") and err.count("\n") == 1, err
    run = tmp_path / "run"
    run.mkdir()
    RunDir(run).events.write_text("")
    assert main(["report", str(run), "-o", str(tmp_path / "report.txt")]) == 2
    assert (
        capsys.readouterr().err
        == f"liandan: error: {tmp_path / 'report.txt'}: the report is an HTML file; name it with .html\n"
    )
    (tmp_path / "t.toml").write_text("")
    assert main(["report", str(run), "-o", str(tmp_path / "t.toml" / "x.html")]) == 2
    assert capsys.readouterr().err == (
        f"liandan: error: cannot write {tmp_path}/t.toml/x.html: {tmp_path}/t.toml is not a directory\n"
    )


def test_an_event_without_a_step_is_marked_at_the_step_logged_before_it():
    times = [(100.0, 1), (101.0, 2), (102.0, 3)]
    events = [{"kind": "preempted", "time": 101.5, "signal": "SIGTERM"}, {"kind": "gave_up", "time": 99.0,
              "reason": "too many restarts"}, {"kind": "eval", "step": 2, "loss": 1.0}]  # fmt: skip
    marks = incident_marks(events, times)
    assert [(m.step, m.category) for m in marks] == [(0, "restart"), (2, "preempted")]


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM} (Debian package chromium)")
def test_the_report_renders_offline_in_headless_chromium(report, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api", reason="Playwright (python) is not installed")
    out, _ = report
    requested, errors = [], []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu",
                                    "--disable-background-networking", "--disable-component-update",
                                    "--disable-sync", "--no-first-run", "--disable-quic"])  # fmt: skip
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})

            def only_the_file(route):
                requested.append(route.request.url)
                return route.continue_() if route.request.url.startswith(("file:", "data:")) else route.abort()

            page.route("**/*", only_the_file)
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(out.as_uri())
            page.wait_for_selector("#run0-loss .main-svg", timeout=30_000)
            assert page.locator(".js-plotly-plot").count() == 4
            assert page.locator("#run0-loss g.trace.scatter").count() >= 4  # train, validation, two marks
            legend = page.locator("#run0-loss .legendtext").evaluate_all("nodes => nodes.map(n => n.textContent)")
            assert {"train", "validation", "rollback", "skipped update"} <= set(legend), legend
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
            shown = shutil.copy(tmp_path / "report.png", out.with_name("report-screenshot.png"))
        finally:
            browser.close()
    assert not errors, errors
    assert [url for url in requested if not url.startswith(("file:", "data:"))] == []
    assert Path(shown).stat().st_size > 50_000


@pytest.mark.slow
def test_a_supervised_restart_is_marked_and_reported(incident_run, tmp_path):
    run = incident_run.path  # the session's: rank 1 killed after step INCIDENT_KILL_STEP, restarted once
    made = liandan_here("report", run, "-o", tmp_path / "killed.html", check=True).stdout
    assert made.startswith(f"report: {tmp_path / 'killed.html'}")
    page = parse(tmp_path / "killed.html")
    text = " ".join(" ".join(page.text).split())
    assert f"CRASH step {INCIDENT_KILL_STEP}" in text and "restart 1" in text
    from PIL import Image

    with Image.open(RunDir(run).plot()) as picture:
        drawn = json.loads(picture.text[MARKS_KEY])
    # the crash and its restart are one mark (the run's other marks: the guard's rollback, a busy host's doctor)
    restarts = [m for m in drawn if m["category"] == "restart"]
    assert [(m["step"], m["category"]) for m in restarts] == [(INCIDENT_KILL_STEP, "restart")], drawn
    assert "restart 1" in restarts[0]["label"]


@pytest.mark.parametrize("database", ["none", "damaged"])
def test_a_run_on_a_read_only_share_is_reported_from_a_store_of_its_own(faulty, small_disk, tmp_path, database):
    """The project's liandan.db cannot be made (or, damaged, cannot be set aside) on a read-only file system:
    the report is made from a store in a temporary directory, and the share is left as it was."""
    import subprocess

    share = small_disk("64m", "share")
    shutil.copytree(faulty, share / "faulty", ignore=shutil.ignore_patterns("report*"))
    if database == "damaged":
        (share / "liandan.db").write_bytes(b"not a database, " * 512)
    subprocess.run(["mount", "-o", "remount,ro", str(share)], check=True)
    before = sorted(p.name for p in share.iterdir())
    out = tmp_path / "report.html"
    assert main(["report", str(share / "faulty"), "-o", str(out)]) == 0
    page = parse(out)
    assert "faulty" in page.text and any("ROLLBACK" in text for text in page.text)
    assert sorted(p.name for p in share.iterdir()) == before


def test_incidents_and_report_list_an_incomplete_record_as_the_dashboard_does(tmp_path, capsys):
    run = tmp_path / "odd"
    run.mkdir()
    records = [{"kind": "train_start", "time": 1700000000.0, "step": 0},
               {"kind": "incident", "time": 1700000010.0, "step": 3, "failure": "crash", "rank": 1,
                "cause": "signal SIGKILL", "steps_lost": 1, "seconds_lost": 2.0, "resume_step": 2},  # no host
               {"kind": "restart", "time": "2024-01-01T00:00:00", "attempt": 1, "after_seconds": 0},
               {"kind": "gave_up", "time": None}]  # fmt: skip
    RunDir(run).events.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["incidents", str(run)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "22:13:30 +    10.0s  incident step 3: (an incomplete record: no 'host')",
        (
            "                     -> unknown: rank 1 was killed from outside (signal SIGKILL) with no traceback; next:"
            " check the host's kernel log for the out-of-memory killer, and the scheduler's"
        ),
        "??:??:??  (no time)  restart 1 at once",
        "??:??:??  (no time)  gave up step ?: (an incomplete record: no 'reason')",
        (
            "                     -> unknown: the supervisor gave up: no reason recorded; next: triage the incidents"
            " before it"
        ),
    ]
    assert main(["report", str(run), "-o", str(tmp_path / "odd.html")]) == 0
    assert "an incomplete record: no &#x27;host&#x27;" in (tmp_path / "odd.html").read_text()


def test_the_report_speaks_one_unit_and_one_colour_and_names_its_columns(faulty, tmp_path):
    from liandan.track.plot import VALIDATION_COLOUR

    out = tmp_path / "units.html"
    written = write_report([(faulty, timeline(faulty))], out)
    html = out.read_text()
    figures = json.loads(re.search(r"const FIGURES = (\{.*?\});\n", html, re.DOTALL).group(1))
    [mfu] = [f for key, f in figures.items() if key.endswith("-mfu")]
    assert mfu["layout"]["yaxis"]["tickformat"] == ".3~%"
    assert all(f["layout"]["modebar"]["orientation"] == "v" for f in figures.values())
    [loss] = [f for key, f in figures.items() if key.endswith("-loss")]
    [validation] = [t for t in loss["data"] if t.get("name") == "validation"]
    assert validation["line"]["color"] == VALIDATION_COLOUR
    forecast = {"step": 10, "final_loss": 3.0, "low": 2.9, "high": 3.1, "confidence": 0.8, "total_steps": 30}
    [head] = re.findall(r"<tr>(<th>.*?)</tr>", report_module._forecast_table([forecast]))
    assert re.findall(r"<th>(.*?)</th>", head) == ["made at step", "final loss", "interval", "confidence", "for step"]
    assert written[1].name == f"units-{faulty.name}.png"


def test_a_run_of_one_logged_step_has_axes_from_zero(tmp_path):
    run = tmp_path / "runs" / "one"
    run.mkdir(parents=True)
    RunDir(run).metrics.write_text(json.dumps({"step": 100, "loss": 3.0, "lr": 1e-3, "time": 1.0}) + "\n")
    out = tmp_path / "one.html"
    write_report([(run, [])], out)
    figures = json.loads(re.search(r"const FIGURES = (\{.*?\});\n", out.read_text(), re.DOTALL).group(1))
    assert figures and all(f["layout"]["xaxis"]["range"] == [0, 200] for f in figures.values())
