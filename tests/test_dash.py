"""`liandan dash` on real runs: its JSON API through a real uvicorn server (answers, evidence, hostile input,
the token off loopback) and the page in headless Chromium (a finished run with incidents, a run still
training, a comparison), with screenshots kept for a look."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import urllib.parse
from pathlib import Path

import pytest

from helpers import (
    INCIDENT_BATCH,
    INCIDENT_RUN,
    INCIDENT_STEPS,
    MICRO_MODEL,
    environment_without,
    faults_planned,
    run_liandan,
    start_liandan,
    tiny_config,
    wait_for_step,
    write_corpus,
)

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

FAULTY = (
    INCIDENT_RUN  # the session's: the guard rolls back a learning-rate burst; then a worker is killed and restarted
)
CLEAN = "clean"
SECRET = "the-secret-outside-the-project"
STEPS, TOKENS_PER_STEP = INCIDENT_STEPS, INCIDENT_BATCH * 64


def environment(**extra: str) -> dict[str, str]:
    """The environment of a subprocess: none of liandan's variables but the session's cache directory."""
    return environment_without(LIANDAN_CACHE_DIR=os.environ["LIANDAN_CACHE_DIR"], **extra)


def train(project: Path, corpus: Path, name: str, *overrides: str) -> None:
    """A finished run trained in this process (the dashboard reads its files; who wrote them does not matter)."""
    from liandan.train import Trainer

    with faults_planned():
        trainer = Trainer(tiny_config(project, corpus, f"--run.name={name}", *overrides), say=lambda m: None)
        try:
            trainer.train()
        finally:
            trainer.close()


def plant_escapes(project: Path, outside: Path) -> None:
    """A run whose files point out of the project: an event naming a file outside by its absolute path, a
    guard report and a stack dump that are symlinks to it, and a run directory that is a symlink out."""
    secret = outside / "secret.json"
    secret.write_text(json.dumps({"verdict": SECRET}))
    (outside / "secret.txt").write_text(SECRET)
    run = project / "escape"
    (run / "guard").mkdir(parents=True)
    (run / "heartbeat" / "stacks").mkdir(parents=True)
    (run / "guard" / "spike-step-00000002.json").symlink_to(secret)
    (run / "heartbeat" / "stacks" / "rank-00000.txt").symlink_to(outside / "secret.txt")
    events = [{"time": 1.0, "kind": "rollback", "step": 2, "report": str(secret), "to": 1},
              {"time": 2.0, "kind": "rollback", "step": 3, "report": "escape/guard/spike-step-00000002.json"},
              {"time": 3.0, "kind": "incident", "step": 3, "attempt": 0, "cause": "hang",
               "stacks": "../../" + str(outside / "secret.txt")}]  # fmt: skip
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    linked = outside / "linked-run"
    (linked / "guard").mkdir(parents=True)
    (linked / "events.jsonl").write_text(json.dumps({"kind": "rollback", "step": 1, "report": "x.json"}) + "\n")
    (linked / "x.json").write_text(json.dumps({"verdict": SECRET}))
    (project / "linked").symlink_to(linked)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("dash-corpus"), 200)


@pytest.fixture(scope="module")
def project(tmp_path_factory, corpus, incident_run):
    """A project directory with two finished runs (the session's incident run, on two ranks, and a clean one)
    and the planted escapes."""
    root = tmp_path_factory.mktemp("dash")
    project = incident_run.path.parent
    train(project, corpus, CLEAN, *MICRO_MODEL, "--train.steps=40")
    outside = root / "outside"
    outside.mkdir()
    plant_escapes(project, outside)
    return project


class Server:
    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc = proc
        self.url = url
        parsed = urllib.parse.urlsplit(url)
        self.host, self.port = parsed.hostname, parsed.port
        self.token = urllib.parse.parse_qs(parsed.query).get("token", [None])[0]

    def request(self, path: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None):
        """The status and the JSON body of one request, the path sent exactly as given (no normalisation)."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            data = response.read()
        finally:
            connection.close()
        return response.status, json.loads(data) if response.getheader("content-type", "").startswith(
            "application/json") else data  # fmt: skip

    def get(self, path: str, **kw):
        status, body = self.request(path, **kw)
        assert status == 200, (path, status, body)
        return body

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_dash(project: Path, *args: str) -> Server:
    proc = start_liandan("dash", project, "--port", "0", *args, env=environment())
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("dash: open "):
            return Server(proc, line.split("dash: open ", 1)[1].strip())
    proc.wait()
    raise AssertionError(f"liandan dash ended ({proc.returncode}): {''.join(lines)}{proc.stderr.read()[-3000:]}")


@pytest.fixture(scope="module")
def server(project):
    server = start_dash(project)
    yield server
    server.stop()


def incident_of_kind(server: Server, run: str, kind: str) -> dict:
    incidents = server.get(f"/api/runs/{run}/incidents")["incidents"]
    return next(i for i in incidents if i["kind"] == kind)


# -- the API -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_runs_list_and_one_run(server):
    runs = {r["name"]: r for r in server.get("/api/runs")["runs"]}
    assert {FAULTY, CLEAN} <= set(runs)
    faulty = runs[FAULTY]
    assert faulty["status"] == "finished" and faulty["step"] == STEPS and faulty["restarts"] == 1
    assert 0 < faulty["goodput"] < 1 and faulty["incidents"] >= 2 and faulty["tokens"] == STEPS * TOKENS_PER_STEP
    run = server.get(f"/api/runs/{FAULTY}")
    assert {"loss", "lr", "tokens_per_s", "mfu"} <= set(run["metric_keys"])
    assert "[train]" in run["config"] and run["summary"]["steps"] == STEPS


@pytest.mark.slow
def test_a_curve_is_thinned_with_its_extremes_and_put_against_tokens(server):
    whole = server.get(f"/api/runs/{FAULTY}/curve?key=loss")
    assert whole["step"] == list(range(1, STEPS + 1))
    thin = server.get(f"/api/runs/{FAULTY}/curve?key=loss&max_points=6&start=1&end={STEPS}")
    assert len(thin["step"]) <= 6
    assert max(thin["high"]) == max(whole["y"]) and min(thin["low"]) == min(whole["y"])  # a spike survives
    tokens = server.get(f"/api/runs/{FAULTY}/curve?key=loss&x=tokens&start=10&end=12")
    assert tokens["step"] == [10, 11, 12] and tokens["x"] == [s * TOKENS_PER_STEP for s in (10, 11, 12)]


@pytest.mark.slow
def test_an_incident_comes_with_its_evidence(server):
    rollback = incident_of_kind(server, FAULTY, "rollback")
    assert rollback["step"] is not None and "rolled back to step" in rollback["line"]
    found = server.get(f"/api/runs/{FAULTY}/incidents/{rollback['seq']}")
    report = next(e for e in found["evidence"] if e["file"].startswith("guard/spike-step-"))
    assert report["json"]["verdict"] and report["json"]["rollback"]["to"] < rollback["step"]
    assert found["layers"] and all(abs(r["step"] - rollback["step"]) <= 20 for r in found["layers"])
    crash = incident_of_kind(server, FAULTY, "incident")
    # triaged in the list and in the detail: a kill from outside leaves no traceback to tell
    assert crash["triage"]["category"] == "unknown" and "killed from outside" in crash["triage"]["evidence"]
    assert rollback["triage"]["category"] in ("data", "hardware", "code", "unknown") and rollback["triage"]["next_step"]
    found = server.get(f"/api/runs/{FAULTY}/incidents/{crash['seq']}")
    assert found["event"]["triage"] == crash["triage"]
    log = next(e for e in found["evidence"] if e["file"] == "logs/attempt-0.log")
    # the tail of the attempt that was killed after step 45 (the burst may also count as early divergence)
    assert re.search(r"guard: [a-z, ]*spike[a-z, ]* at step", log["text"]), log["text"]
    health = server.get(f"/api/runs/{FAULTY}/health")
    assert [len(w["seconds"]) for w in health["windows"]][:1] == [2]  # both ranks' phase times per window
    assert {w["step"] for w in health["windows"]} >= set(range(10, STEPS + 1, 10))
    assert [r["rank"] for r in health["doctor"]["ranks"]] == [0, 1]
    assert {e["kind"] for e in server.get(f"/api/runs/{FAULTY}/evaluations")["evaluations"]} == {"eval"}


@pytest.mark.slow
def test_comparing_runs(server):
    body = json.dumps({"runs": [FAULTY, CLEAN], "key": "loss", "x": "tokens", "max_points": 100}).encode()
    status, found = server.request("/api/compare", "POST", body, {"Content-Type": "application/json"})
    assert status == 200 and [c["run"] for c in found["curves"]] == [FAULTY, CLEAN]
    assert all(len(c["x"]) == len(c["y"]) > 0 for c in found["curves"])


@pytest.mark.slow
def test_a_finished_run_streams_its_state_once_and_ends(server):
    status, body = server.request(f"/api/runs/{FAULTY}/stream")
    text = body.decode()
    assert status == 200 and text.startswith("event: progress\ndata: ") and text.count("event:") == 1, text
    progress = json.loads(text.split("data: ", 1)[1])
    # the rollback and the crash (its restart is not counted apart); on a busy host a doctor warning may add one
    assert (progress["step"], progress["status"]) == (STEPS, "finished") and progress["incidents"] >= 2


HOSTILE = [
    ("/api/runs/..%2f..%2fetc%2fpasswd", 404),
    ("/api/runs/%2e%2e", 400),
    ("/api/runs/%2Fetc%2Fpasswd", 404),
    ("/api/runs/..%2foutside/incidents", 404),
    ("/api/runs/no-such-run", 404),
    ("/api/runs/.hidden", 404),  # a name train accepts: no such run here
    ("/api/runs/faulty/curve?key=loss&max_points=100000000", 400),
    ("/api/runs/faulty/curve?key=loss&start=-99999999999999999999", 400),
    ("/api/runs/faulty/curve?key=loss&start=abc", 400),
    ("/api/runs/faulty/curve?key=loss&start=9&end=3", 400),
    ("/api/runs/faulty/curve?key=loss&x=bogus", 400),
    ("/api/runs/faulty/curve?key=..%2f..%2fx", 400),
    ("/api/runs/faulty/curve?key=nosuchmetric", 404),
    ("/api/runs/faulty/incidents/abc", 400),
    ("/api/runs/faulty/incidents/-1", 400),
    ("/api/runs/faulty/incidents/99999999", 404),
    ("/api/runs/faulty/layers?around=1&window=99999999", 400),
    ("/api/compare", 405),
    ("/api/nothing/here", 404),
    ("/static/..%2f..%2f..%2fconfig.py", 404),
    ("/static/config.toml", 404),
]


@pytest.mark.slow
def test_hostile_and_malformed_requests_get_one_line_json_errors(server):
    for path, expected in HOSTILE:
        status, body = server.request(path)
        assert status == expected, (path, status, body)
        if path.startswith("/api"):
            assert isinstance(body, dict) and "\n" not in body["error"] and body["error"], (path, body)
    posts = [(b"{not json", 400), (b"[1, 2]", 400), (json.dumps({"runs": ["../x"]}).encode(), 400),
             (json.dumps({"runs": [FAULTY] * 13}).encode(), 400), (json.dumps({"runs": [FAULTY], "max_points": 1e9})
             .encode(), 400), (b" " * (1 << 17), 413), (b'{"runs": ["\\ud800"]}', 400),
             (json.dumps({"runs": [FAULTY], "key": "\ud800"}).encode(), 400),
             (json.dumps({"runs": [FAULTY], "key": "a\u0000"}).encode(), 400)]  # fmt: skip
    for body, expected in posts:
        status, answer = server.request("/api/compare", "POST", body, {"Content-Type": "application/json"})
        assert status == expected and "\n" not in answer["error"], (body[:40], status, answer)
    status, answer = server.request("/api/runs", headers={"Host": "attacker.example"})  # DNS rebinding
    assert status == 403, answer
    # A body shorter than its Content-Length: answered once the wait for the rest is over, not held open.
    with socket.create_connection((server.host, server.port), timeout=30) as client:
        client.sendall(b"POST /api/compare HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100\r\n\r\n{\"runs\": [")  # fmt: skip
        answer = client.makefile("rb").read()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    assert "did not arrive within" in json.loads(body)["error"]


@pytest.mark.slow
def test_nothing_outside_the_project_is_served(server):
    assert "escape" in {r["name"] for r in server.get("/api/runs")["runs"]}
    answers = []
    for incident in server.get("/api/runs/escape/incidents")["incidents"]:
        answers.append(server.get(f"/api/runs/escape/incidents/{incident['seq']}"))
    assert len(answers) == 3 and all(a["evidence"] == [] for a in answers)
    assert server.request("/api/runs/linked/incidents/0")[0] == 404  # its directory is outside the project
    assert {"linked", "linked-run"}.isdisjoint(r["name"] for r in server.get("/api/runs")["runs"])
    for path in ("/api/runs/escape/health", "/api/runs/escape/layers", "/api/runs"):
        assert SECRET not in json.dumps(server.get(path))
    assert all(SECRET not in json.dumps(a) for a in answers)


def non_loopback_address() -> str | None:
    """This machine's address on its default route, when it has one (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") or address == "0.0.0.0" else address


@pytest.mark.slow
def test_off_loopback_every_api_request_needs_the_token(project):
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to bind the dashboard to")
    server = start_dash(project, "--host", address)
    try:
        assert server.token and len(server.token) >= 20  # generated, and printed in the URL
        for headers in ({}, {"Authorization": "Bearer wrong-token-here"}, {"X-Liandan-Token": server.token[:-1]}):
            status, body = server.request("/api/runs", headers=headers)
            assert status == 401 and "token" in body["error"], (headers, status, body)
        assert server.request(f"/api/runs/{FAULTY}/incidents")[0] == 401
        assert server.request("/api/runs?token=" + server.token)[0] == 200
        assert server.request("/api/runs", headers={"Authorization": f"Bearer {server.token}"})[0] == 200
        assert server.request("/")[0] == 200  # the page itself holds no data
    finally:
        server.stop()


def test_bad_command_lines_end_in_one_line(tmp_path):
    done = run_liandan("dash", tmp_path / "missing")
    assert done.returncode == 2 and done.stderr.startswith("liandan: error: no project directory"), done.stderr
    done = run_liandan("dash", tmp_path, "--port", "70000")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    done = run_liandan("dash", tmp_path, "--host", "0.0.0.0", "--token", "short")
    assert done.returncode == 2 and "--token" in done.stderr, done.stderr


# -- in the browser ------------------------------------------------------------------------------------------
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-quic"]  # fmt: skip


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian's chromium package) for the browser tests")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need the [browser-tests] extra")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory):
    """Where the screenshots go: $LIANDAN_SCREENSHOTS when set (to look at them), else a temporary directory."""
    where = os.environ.get("LIANDAN_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def page(browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    yield page
    page.close()
    assert not errors, errors


def click_marker(page, index: int) -> None:
    """Click the `index`-th incident marker of the loss chart where a user would: on the chart, at its place."""
    marker = page.locator("#chart-loss .scatterlayer .trace").last.locator("path.point").nth(index)
    box = marker.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.locator("#chart-loss .hoverlayer .hovertext").wait_for()  # plotly clicks on what it hovers over
    page.mouse.click(x, y)


@pytest.mark.slow
def test_a_finished_run_its_incident_and_its_evidence_in_the_browser(server, page, screenshots):
    page.goto(server.url + "#/")
    page.locator(f"#runs tr[data-run='{FAULTY}'] a").click()
    page.wait_for_selector("#chart-loss .scatterlayer .trace path.point")
    markers = page.locator("#chart-loss .scatterlayer .trace").last.locator("path.point")
    assert markers.count() >= 3  # the rollback, the crash and its restart (and a doctor's warnings, on a busy host)
    assert page.locator("#stats").inner_text().count("finished") == 1
    assert page.locator("#chart-ranks .heatmaplayer").count() == 1
    page.screenshot(path=screenshots / "run.png", full_page=True)
    marked = [i for i in server.get(f"/api/runs/{FAULTY}/incidents")["incidents"] if i["step"] is not None]
    click_marker(page, next(k for k, i in enumerate(marked) if i["kind"] == "rollback"))
    panel = page.locator("#evidence")
    panel.locator("#evidence-title", has_text="rollback at step").wait_for()
    panel.locator(".verdict").wait_for()
    assert "guard/spike-step-" in panel.inner_text()
    # the incident's triage heads the panel, and the list has a column for it
    assert "Next: " in panel.locator(".triage-verdict").inner_text()
    assert page.locator("#incidents thead").inner_text().lower().split() == ["step", "kind", "time", "triage", "what"]
    page.screenshot(path=screenshots / "evidence.png")


@pytest.mark.slow
def test_two_runs_compared_in_the_browser(server, page, screenshots):
    page.goto(server.url + "#/")
    for name in (FAULTY, CLEAN):
        page.locator(f"#runs input[data-run='{name}']").check()
    page.screenshot(path=screenshots / "runs.png")
    page.locator("#compare-button").click()
    page.wait_for_selector("#chart-compare .scatterlayer .trace")
    assert page.locator("#chart-compare .legendtext").all_text_contents() == [FAULTY, CLEAN]
    page.select_option("#compare-x", "tokens")
    page.wait_for_function("document.querySelector('#chart-compare .g-xtitle').textContent === 'tokens'")
    page.locator("#compare-logy").check()
    page.locator("#compare-smooth").evaluate("(s) => { s.value = '0.8'; s.dispatchEvent(new Event('input')); }")
    page.wait_for_function("document.querySelector('#chart-compare').layout.yaxis.type === 'log'")
    assert page.locator("#chart-compare .scatterlayer .trace").count() == 4  # each run raw and smoothed
    page.screenshot(path=screenshots / "compare.png")


@pytest.mark.slow
def test_a_run_still_training_updates_live_in_the_browser(server, project, corpus, page, screenshots):
    config = project.parent / "live.toml"
    config.write_text(tiny_config(project, corpus, "--run.name=live", *MICRO_MODEL, "--train.steps=100000",
                                  "--resilience.supervise=false", "--checkpoint.every=0").to_toml())  # fmt: skip
    proc = start_liandan("train", config, env=environment(), quiet=True)
    try:
        wait_for_step(project / "live", 3, proc)
        page.goto(server.url + "#/run/live")
        page.wait_for_selector("#chart-loss .scatterlayer .trace")
        assert "running" in page.locator("#stats").inner_text() and page.locator("#live").is_visible()
        newest = "(() => { const x = document.getElementById('chart-loss').data[0].x; return x[x.length - 1]; })()"
        first = page.evaluate(newest)
        page.wait_for_function(f"{newest} > {first}", timeout=30_000)  # the page polls: no reload
        page.screenshot(path=screenshots / "live.png")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_deeply_nested_json_anywhere_is_a_one_line_answer_not_a_500(tmp_path):
    """Nesting a few thousand deep in a request's body, an event or a guard report: parsers recurse."""
    project = tmp_path / "runs"
    run = project / "deep"
    (run / "guard").mkdir(parents=True)
    deep = "[" * 5000 + "]" * 5000
    (run / "guard" / "spike-step-00000002.json").write_text('{"verdict": ' + deep + "}")
    events = [json.dumps({"time": 1.0, "kind": "rollback", "step": 2, "to": 1,
                          "report": "deep/guard/spike-step-00000002.json"}),
              '{"time": 2.0, "kind": "incident", "step": 3, "cause": "hang", "detail": ' + deep + "}"]  # fmt: skip
    (run / "events.jsonl").write_text("\n".join(events) + "\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0, "time": 1.0}\n{"step": 2, "loss": ' + deep + "}\n")
    server = start_dash(project)
    try:
        assert "deep" in {r["name"] for r in server.get("/api/runs")["runs"]}
        for incident in server.get("/api/runs/deep/incidents")["incidents"]:
            status, answer = server.request(f"/api/runs/deep/incidents/{incident['seq']}")
            assert status == 200, answer
        for path in ("/api/runs/deep", "/api/runs/deep/curve?key=loss", "/api/runs/deep/health"):
            status, answer = server.request(path)
            assert status == 200, (path, answer)
        status, answer = server.request("/api/compare", "POST", deep.encode(), {"Content-Type": "application/json"})
        assert status == 400 and answer["error"].startswith("malformed JSON: nested"), answer
    finally:
        server.stop()


def test_a_port_in_use_is_one_line_naming_it(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = run_liandan("dash", tmp_path, "--port", port)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"liandan: error: port {port} on 127.0.0.1 is already in use"), done.stderr
    assert "--port 0" in done.stderr


MARKUP = '<b>bold</b> in <module> <a href="https://example.com">a link</a>'


def hand_made_run(project: Path, name: str, events: list[dict] | None = None) -> Path:
    """A run directory written by hand: ten logged steps and the events given."""
    run = project / name
    run.mkdir(parents=True)
    metrics = [{"step": s, "loss": 5.0 - 0.1 * s, "time": 1700000000.0 + s, "lr": 1e-3} for s in range(1, 11)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events or []))
    return run


def test_run_names_that_train_accepts_open_and_path_tricks_do_not(tmp_path):
    project = tmp_path / "runs"
    for name in ("炼丹-1", "my run", "a..b"):
        hand_made_run(project, name)
    server = start_dash(project)
    try:
        assert {"炼丹-1", "my run", "a..b"} <= {r["name"] for r in server.get("/api/runs")["runs"]}
        for name in ("炼丹-1", "my run", "a..b"):
            assert server.get(f"/api/runs/{urllib.parse.quote(name)}")["name"] == name
        for trick in ("..", "%2E%2E", "..%2Fruns", "a%0Ab", "%00", "x%5C..%5Cy"):
            status, answer = server.request(f"/api/runs/{trick}")
            assert status in (400, 404) and "\n" not in answer["error"], (trick, status, answer)
    finally:
        server.stop()


def test_incident_text_is_shown_as_written_in_the_hover_label(tmp_path, page):
    project = tmp_path / "runs"
    hand_made_run(project, "markup", [{"time": 1700000005.0, "kind": "checkpoint_failed", "step": 5,
                                       "detail": MARKUP}])  # fmt: skip
    server = start_dash(project)
    try:
        page.goto(server.url + "#/run/markup")
        page.wait_for_selector("#chart-loss .scatterlayer .trace path.point")
        click_marker(page, 0)
        hover = page.locator("#chart-loss .hoverlayer .hovertext").text_content()
        assert f"checkpoint_failed at step 5: {MARKUP}" in hover, hover
        assert page.locator("#chart-loss .hoverlayer a").count() == 0
    finally:
        server.stop()


def test_the_run_page_counts_names_and_units_agree(tmp_path, page):
    """The incident count matches its table, a save's blocking time and total are told apart, the latest
    validation loss shows before the run's summary exists, and MFU ticks are percentages, none repeated."""
    project = tmp_path / "runs"
    run = hand_made_run(project, "polish", [
        {"time": 1700000003.0, "kind": "checkpoint_saved", "step": 3, "path": "polish/checkpoints/step-00000003",
         "seconds": 95.62, "blocking_seconds": 0.088},
        {"time": 1700000004.0, "kind": "eval", "step": 4, "loss": 4.125},
        {"time": 1700000005.0, "kind": "incident", "step": 5, "cause": "signal SIGKILL", "failure": "crash"},
        {"time": 1700000006.0, "kind": "restart", "step": 5, "attempt": 1, "after_seconds": 0}])  # fmt: skip
    metrics = [{"step": s, "loss": 5.0 - 0.1 * s, "time": 1700000000.0 + s, "mfu": 0.0150 + 0.0008 * s}
               for s in range(1, 11)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    server = start_dash(project)
    try:
        page.goto(server.url + "#/run/polish")
        page.wait_for_selector("#chart-mfu .ytick")
        assert page.locator("h2", has_text=re.compile("^Incidents")).inner_text() == "Incidents (1) and restarts (1)"
        assert page.locator("#incidents tbody tr").count() == 2
        stats = page.locator("#stats").inner_text()
        assert "4.125" in stats and "incidents\n1" in stats.lower(), stats
        heads = page.locator("#checkpoints th").all_text_contents()
        assert heads == ["step", "event", "path", "training blocked (s)", "save took (s)", "on disk"], heads
        assert "0.088" in page.locator("#checkpoints").inner_text()
        ticks = page.locator("#chart-mfu .ytick text").all_text_contents()
        assert ticks and all(t.endswith("%") for t in ticks) and len(set(ticks)) == len(ticks), ticks
    finally:
        server.stop()


def test_per_layer_log_axes_are_labelled_by_decades(tmp_path, page):
    project = tmp_path / "runs"
    run = hand_made_run(project, "layers")
    (run / "guard").mkdir()
    records = [{"step": s, "grad": {"layers.0.attention": 2e-4 * s, "layers.1.feed_forward": 3.0 * s}}
               for s in range(1, 11)]  # fmt: skip
    (run / "guard" / "layers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    server = start_dash(project)
    try:
        page.goto(server.url + "#/run/layers")
        page.wait_for_selector("#chart-layers .ytick")
        axis = page.evaluate("document.querySelector('#chart-layers').layout.yaxis")
        assert (axis["type"], axis["dtick"], axis["exponentformat"]) == ("log", "D2", "power")
        ticks = page.locator("#chart-layers .ytick text").all_text_contents()
        decades = [t for t in ticks if t.startswith("10")]
        assert len(decades) >= 4 and len(set(decades)) == len(decades), ticks  # 2 and 5 between, each decade named
    finally:
        server.stop()


def test_a_run_of_one_logged_step_has_step_axes_from_zero(tmp_path, page):
    project = tmp_path / "runs"
    run = project / "one"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 100, "loss": 3.0, "lr": 1e-3, "time": 1.0}) + "\n")
    server = start_dash(project)
    try:
        page.goto(server.url + "#/run/one")
        page.wait_for_selector("#chart-lr .xtick")
        for chart in ("chart-loss", "chart-lr"):
            axis = page.evaluate(f"document.getElementById('{chart}').layout.xaxis")
            assert axis["range"] == [0, 200], (chart, axis)
    finally:
        server.stop()
