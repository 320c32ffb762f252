"""The dashboard's expert-load heat map of a mixture-of-experts run: its API answer (a step's loads, layers by
experts, the newest logged step at or before the one asked for) through a real server, and the heat map with
its step slider in headless Chromium; a dense run shows none."""

from __future__ import annotations

import json

import pytest

from test_dash import browser, hand_made_run, page, start_dash  # noqa: F401 - fixtures used by name

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

STEPS = range(2, 21, 2)  # logged every second step
COLLAPSE_FROM = 12  # from here expert 0 of layer 2 takes every token (top-2 of 4: twice the mean load)


def loads(step: int) -> dict[str, float]:
    """What `RoutingStats.expert_loads()` logs: load over the layer's mean, per MoE layer and expert."""
    layer2 = [2.0, 2 / 3, 2 / 3, 2 / 3] if step >= COLLAPSE_FROM else [1.1, 0.9, 1.0, 1.0]
    out = {f"moe/1/expert/{e}": 1.0 for e in range(4)}
    out.update({f"moe/2/expert/{e}": value for e, value in enumerate(layer2)})
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    project = tmp_path_factory.mktemp("experts") / "runs"
    moe = hand_made_run(project, "moe")
    metrics = [{"step": s, "loss": 5.0 - 0.1 * s, "time": 1700000000.0 + s, "moe/2/load_max": 1.1, **loads(s)}
               for s in STEPS]  # fmt: skip
    (moe / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    hand_made_run(project, "dense")
    server = start_dash(project)
    yield server
    server.stop()


def test_the_heat_map_answers_a_steps_loads_by_layer_and_expert(server):
    newest = server.get("/api/runs/moe/experts")
    assert (newest["step"], newest["first"], newest["last"]) == (20, 2, 20)
    assert newest["layers"] == [1, 2] and newest["experts"] == 4
    assert newest["load"] == [[1.0] * 4, [2.0, 2 / 3, 2 / 3, 2 / 3]]
    before = server.get("/api/runs/moe/experts?step=11")  # not logged: the newest logged step before it
    assert before["step"] == 10 and before["load"][1] == [1.1, 0.9, 1.0, 1.0]
    assert server.get("/api/runs/moe/experts?step=1")["step"] is None  # nothing logged yet at step 1
    dense = server.get("/api/runs/dense/experts")
    assert dense["layers"] == [] and dense["load"] == [] and dense["step"] is None
    status, answer = server.request("/api/runs/moe/experts?step=-3")
    assert status == 400 and "step must be between" in answer["error"]
    status, answer = server.request("/api/runs/nothing/experts")
    assert status == 404 and "no run named" in answer["error"]


def test_only_a_moe_run_shows_the_heat_map_and_its_slider_moves_it(server, page):  # noqa: F811 - the fixture
    page.goto(server.url + "#/run/moe")
    page.wait_for_function("document.querySelector('#chart-experts') && document.querySelector('#chart-experts').data")
    shown = page.evaluate("document.querySelector('#chart-experts').data[0]")
    assert shown["type"] == "heatmap" and shown["y"] == ["layer 1", "layer 2"] and shown["z"][1][0] == 2.0
    assert page.locator("#expert-step").inner_text() == "step 20"
    slider = page.locator("#expert-slider")
    slider.evaluate(
        "(s) => { s.value = '7'; s.dispatchEvent(new Event('input')); s.dispatchEvent(new Event('change')); }"
    )
    page.wait_for_function("document.querySelector('#expert-step').textContent === 'step 6'")
    assert page.evaluate("document.querySelector('#chart-experts').data[0].z[1][0]") == 1.1
    page.goto("about:blank")  # a hash change alone keeps the moe run's page until the dense one is drawn
    page.goto(server.url + "#/run/dense")
    page.wait_for_selector("#chart-loss")
    assert page.locator("#chart-experts").count() == 0
