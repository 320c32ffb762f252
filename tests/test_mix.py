"""`liandan mix` (docs/mixtures.md): the swarm's design, the mixture law fitted on proxies whose true law is
known, the recommendation under the repetition cap, each source's value, and one real swarm end to end."""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import tomllib

from helpers import liandan_here, process_tree, read_metrics, run_liandan, start_liandan, wait_for_step
from liandan.config import ConfigError
from liandan.data import ByteTokenizer, Document, shard_path, write_manifest, write_shard
from liandan.plan import mixture as mx
from liandan.plan import mixture_check as mc

NAMES = ["web", "books", "spam"]
TOKENS = [6000, 3000, 1000]
NATURAL = np.array(TOKENS) / sum(TOKENS)
# The truth of the synthetic swarm: more web lowers web's loss, more books lowers books', and spam raises every
# source's loss (its own is low at any weight: it is easy to predict).
TRUTH = [
    mx.MixtureLaw(0.9, np.array([-0.8, 0.1, 0.9])),
    mx.MixtureLaw(1.0, np.array([0.2, -1.0, 0.8])),
    mx.MixtureLaw(0.3, np.array([0.1, 0.1, -0.2])),
]


def _swarm(runs: int = 12, noise: float = 0.0, seed: int = 0):
    proxies = mx.design_swarm(NATURAL, runs, 1.0, seed)
    weights = np.array([p.weights for p in proxies])
    losses = np.stack([law.predict(weights) for law in TRUTH], axis=1)
    losses += np.random.default_rng(seed + 1).normal(0, noise, losses.shape)
    return weights, losses


def _true_target(w, target):
    return sum(a * law.predict(w) for a, law in zip(target, TRUTH))


# ---------------------------------------------------------------------------------------------------------
# the design


def test_the_swarm_holds_natural_and_uniform_then_seeded_draws_centred_on_natural():
    assert mx.default_runs(2) == 8 and mx.default_runs(3) == 12 and mx.default_runs(5) == 20
    swarm = mx.design_swarm(NATURAL, 12, 1.0, seed=7)
    assert [p.kind for p in swarm[:2]] == ["natural", "uniform"] and len(swarm) == 12
    assert swarm[0].weights == pytest.approx(tuple(NATURAL)) and swarm[1].weights == pytest.approx((1 / 3,) * 3)
    assert all(min(p.weights) >= mx.MIN_WEIGHT * 0.99 and sum(p.weights) == pytest.approx(1, abs=1e-5) for p in swarm)
    assert mx.design_swarm(NATURAL, 12, 1.0, seed=7) == swarm  # seeded
    assert mx.design_swarm(NATURAL, 20, 1.0, seed=7)[:12] == swarm  # more runs: the same first proxies
    assert mx.design_swarm(NATURAL, 12, 1.0, seed=8) != swarm
    draws = np.array([p.weights for p in mx.design_swarm(NATURAL, 2000, 1.0, seed=0)[2:]])
    assert draws.mean(axis=0) == pytest.approx(NATURAL, abs=0.02)
    tight = np.array([p.weights for p in mx.design_swarm(NATURAL, 2000, 50.0, seed=0)[2:]])
    assert tight.std(axis=0).max() < draws.std(axis=0).min()  # a larger concentration stays nearer natural
    # the run config's own weights join the swarm; equal token counts make natural and uniform one proxy
    assert [p.kind for p in mx.design_swarm(NATURAL, 6, 1.0, 0, config_weights=[1, 1, 2])[:3]] == [
        "natural", "uniform", "config"]  # fmt: skip
    assert [p.kind for p in mx.design_swarm([1, 1, 1], 6, 1.0, 0)[:2]] == ["natural", "dirichlet"]
    with pytest.raises(ConfigError, match="at least 6 proxies"):
        mx.design_swarm(NATURAL, 5, 1.0, 0)


# ---------------------------------------------------------------------------------------------------------
# the law, the recommendation, the value of each source


def test_the_fit_recovers_the_true_law():
    weights, losses = _swarm()
    fit = mx.fit_mixture(weights, losses, NAMES, bootstrap=20)
    unseen = np.array([p.weights for p in mx.design_swarm(NATURAL, 40, 1.0, seed=99)])
    for law, truth in zip(fit.laws, TRUTH):
        assert law.predict(unseen) == pytest.approx(truth.predict(unseen), rel=1e-4)
    assert fit.laws[0].c == pytest.approx(0.9, abs=1e-3) and fit.laws[0].t == pytest.approx(TRUTH[0].t, abs=1e-2)
    assert np.abs(fit.leave_one_out(np.ones(3) / 3)).max() < 1e-4
    saved = mx.MixtureLaw.from_dict(json.loads(json.dumps(fit.laws[1].to_dict())))  # as mix.json holds it
    assert saved.predict(unseen) == pytest.approx(fit.laws[1].predict(unseen), rel=1e-12)
    # a weighting of the proxies (the bootstrap's) still finds an exact law; a proxy of weight 0 does not count
    proxy_weights = np.random.default_rng(0).dirichlet(np.ones(len(losses))) * len(losses)
    assert mx.fit_law(weights, losses[:, 0], proxy_weights).predict(unseen) == pytest.approx(
        TRUTH[0].predict(unseen), rel=1e-4)  # fmt: skip
    off = losses[:, 0].copy()
    off[5] += 1.0
    ignored = mx.fit_law(weights, off, np.where(np.arange(len(off)) == 5, 0.0, 1.0))
    assert ignored.predict(unseen) == pytest.approx(TRUTH[0].predict(unseen), rel=1e-3)


def test_the_bootstrap_keeps_every_proxy_so_intervals_stay_near_the_fit():
    """Few proxies over three sources, with noise: resampled with replacement, some refits lost the proxies
    spanning a source's weights and predicted thousands; weighted, every refit sees them all."""
    weights, losses = _swarm(runs=8, noise=0.02, seed=3)
    fit = mx.fit_mixture(weights, losses, NAMES, bootstrap=100)
    analysis = mx.analyse(fit, "average", np.ones(3) / 3, NATURAL, mx.repeat_caps(TOKENS, 1000, 4, NAMES))
    for kind in ("recommended", "natural", "uniform"):
        m = analysis[kind]
        assert m["low"] <= m["loss"] <= m["high"] < m["loss"] + 0.5, (kind, m)


@pytest.fixture(scope="module")
def noisy_analysis():
    """The average target over a noisy swarm of 12 proxies, no cap binding."""
    weights, losses = _swarm(noise=0.002)
    fit = mx.fit_mixture(weights, losses, NAMES, bootstrap=60)
    caps = mx.repeat_caps(TOKENS, 1000, 4, NAMES)
    return mx.analyse(fit, "average", np.ones(3) / 3, NATURAL, caps)


def test_the_recommendation_beats_natural_and_uniform_on_the_truth(noisy_analysis):
    target = np.ones(3) / 3
    best = np.array(noisy_analysis["recommended"]["weights"])
    assert best.sum() == pytest.approx(1)
    assert _true_target(best, target) < _true_target(NATURAL, target) - 0.01
    assert _true_target(best, target) < _true_target(np.ones(3) / 3, target) - 0.01
    fit = noisy_analysis["fit"]
    assert fit["loo_rms_relative"] < 0.01 and fit["bootstrap"] == 60
    # the prediction's interval holds the truth
    m = noisy_analysis["recommended"]
    assert m["low"] - 0.005 <= _true_target(best, target) <= m["high"] + 0.005


def test_a_planted_harmful_source_hurts_and_gets_no_weight(noisy_analysis):
    value = {s["name"]: s for s in noisy_analysis["sources"]}
    assert value["spam"]["verdict"] == "hurts" and value["spam"]["slope_low"] > 0
    assert value["spam"]["removed_high"] < 0  # removing it lowers the loss
    assert value["spam"]["recommended"] < 0.01
    assert value["books"]["verdict"] == "helps" and value["books"]["slope_high"] < 0
    # web already makes 60% of the natural mixture: more of it changes little (its true slope is -0.001), but
    # without it the loss goes up
    assert value["web"]["verdict"] != "hurts" and value["web"]["removed_low"] > 0.05


def test_the_slope_is_the_change_along_moving_weight_to_the_source():
    target, eps = np.array([0.2, 0.5, 0.3]), 1e-6
    for j in range(3):
        moved = (1 - eps) * NATURAL + eps * np.eye(3)[j]
        numeric = (_true_target(moved, target) - _true_target(NATURAL, target)) / eps
        assert mx.slopes(TRUTH, target, NATURAL)[j] == pytest.approx(numeric, rel=1e-4)
    removed = mx.removals(TRUTH, target, NATURAL)
    assert removed[2] == pytest.approx(_true_target(np.array([6, 3, 0]) / 9, target) - _true_target(NATURAL, target))


def test_the_repetition_cap_binds_and_an_infeasible_budget_is_refused():
    weights, losses = _swarm()
    fit = mx.fit_mixture(weights, losses, NAMES, bootstrap=10)
    target = np.array([1.0, 0, 0])  # web alone: all weight to web without a cap
    free = mx.recommend(fit.laws, target, NATURAL, np.ones(3))
    assert free[0] > 0.9
    caps = mx.repeat_caps(TOKENS, budget=30_000, max_repeat=4, names=NAMES)  # web: 4 x 6000 / 30000
    assert caps == pytest.approx([0.8, 0.4, 4 / 30])
    capped = mx.recommend(fit.laws, target, NATURAL, caps)
    assert capped[0] == pytest.approx(0.8, abs=1e-6) and capped[2] < 0.01  # the rest to books, not spam
    assert np.all(capped <= caps + 1e-9) and capped.sum() == pytest.approx(1)
    # the KL term pulls towards the natural mixture
    pulled = mx.recommend(fit.laws, target, NATURAL, np.ones(3), kl=100.0)
    assert np.abs(pulled - NATURAL).max() < 0.05
    with pytest.raises(ConfigError, match="more than --max-repeat = 4"):
        mx.repeat_caps(TOKENS, budget=50_000, max_repeat=4, names=NAMES)


def test_targets():
    assert mx.parse_target("books", NAMES)[1] == pytest.approx([0, 1, 0])
    assert mx.parse_target("average", NAMES)[1] == pytest.approx([1 / 3] * 3)
    assert mx.parse_target("1,3,0", NAMES)[1] == pytest.approx([0.25, 0.75, 0])
    for bad, message in [("2,1", "gives 2 weights for 3 sources"), ("news", "name a source"),
                         ("1,-1,1", "non-negative")]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            mx.parse_target(bad, NAMES)


# ---------------------------------------------------------------------------------------------------------
# end to end


def _store(directory, docs):
    write_manifest(directory, [write_shard(docs, ByteTokenizer(), shard_path(directory, 0))], ByteTokenizer())
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three small byte-level stores (prose, more prose, random letters) and a run config naming them."""
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("mix")
    pages = [(name, topics[name]) for name in sorted(topics)]
    rng = random.Random(0)
    noise = [Document("noise", n, "".join(rng.choices("abcdefgh ,.", k=len(t)))) for n, t in pages[45:60]]
    stores = [
        _store(root / "prose", [Document("prose", n, t) for n, t in pages[:30]]),
        _store(root / "more", [Document("more", n, t) for n, t in pages[30:45]]),
        _store(root / "noise", noise),
    ]
    config = root / "run.toml"
    config.write_text(f"""
[run]
seed = 1
output_dir = "{root / "runs"}"
[model]
dim = 32
n_layers = 1
n_heads = 2
n_kv_heads = 1
max_seq_len = 32
[train]
steps = 100
global_batch = 8
seq_len = 32
dtype = "fp32"
[schedule]
warmup_steps = 1
[data]
stores = {json.dumps([str(s) for s in stores])}
[eval]
heldout_sequences = 4
contamination = false
[track]
plot = false
[doctor]
preflight = false
[checkpoint]
enabled = false
""")
    return root, config


def test_bad_input_gets_one_line(corpus):
    root, config = corpus
    stores = json.loads(config.read_text().split("stores = ", 1)[1].splitlines()[0])
    mismatched = root / "mismatched.toml"
    mismatched.write_text(config.read_text().replace("[data]\n", "[data]\nweights = [1, 2]\n"))
    cases = [
        (config, [f'--data.stores=["{stores[0]}"]'], "needs two or more token stores"),
        (config, ["--data.stores=[]"], "give [data] stores"),
        (config, [f'--data.stores=["{stores[0]}", "{root / "missing"}"]'], "missing"),
        (config, ["--data.weights=[1, 2]"], "liandan mix sets data.weights"),
        (mismatched, [], "[data] weights gives 2 weights for 3 stores"),
        (config, ["--train.steps=4", "--max-repeat", "0.01"], "more than --max-repeat"),
        (config, ["--train.steps=4", "--target", "1,2"], "gives 2 weights for 3 sources"),
        (config, ["--train.steps=4", "--runs", "4"], "at least 6 proxies"),
    ]
    for chosen, args, message in cases:
        done = liandan_here("mix", chosen, "--out", root / "bad", "--design-only", *args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and message in lines[0], (args, done.stderr)
    done = liandan_here("mix", config, "--out", root / "bad", "--design-only", "--train.steps=4", check=True)
    assert "p000-natural" in done.stdout and "p005-dirichlet" in done.stdout  # 3 sources: 12 proxies by default
    done = liandan_here("mix", config, "--out", root / "bad", "--design-only", "--train.steps=4", "--seed=1")
    assert done.returncode == 2 and "holds the proxies of another swarm (its seed differs)" in done.stderr
    (root / "a-file").write_text("")
    done = liandan_here("mix", config, "--out", root / "a-file", "--design-only", "--train.steps=4")
    assert (
        done.returncode == 2
        and done.stderr.strip() == f"liandan: error: cannot write {root / 'a-file'}: it is a file, not a directory"
    )
    for args, message in [
        (["--larger", "model.dim"], "give KEY=VALUE"),
        (["--larger", "run.seed=3"], "liandan mix sets run.seed for each validation run"),
        (["--larger", "model.dimm=64"], "dimm"),
        (["--seeds", "1"], "at least 2 seeds"),
        (["--design-only"], "--design-only trains nothing"),
    ]:
        done = liandan_here("mix", config, "--out", root / "bad", "--train.steps=4", "--validate", *args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and message in lines[0], (args, done.stderr)


@pytest.mark.slow
def test_mix_end_to_end_then_a_rerun_reuses_the_finished_proxies(corpus):
    root, config = corpus
    out = root / "swarm"
    args = ["mix", config, "--out", out, "--runs", "6", "--parallel", "2", "--bootstrap", "20", "--train.steps=3",
            "--target", "prose"]  # fmt: skip
    # stopped while its first proxies train: none is left running
    mix = start_liandan(*args, quiet=True)
    wait_for_step(out / "proxies" / "p000-natural", 1, mix)
    tree = process_tree(mix.pid)
    mix.send_signal(signal.SIGTERM)
    assert mix.wait(timeout=60) == 130
    assert len(tree) > 1 and not [pid for pid in tree if Path(f"/proc/{pid}").exists()]
    # run again: the interrupted proxies start over, and all six finish
    done = run_liandan(*args)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "mix.json").read_text())
    assert {p["state"] for p in report["proxies"]} <= {"finished", "reused"} and len(report["proxies"]) == 6
    assert all(set(p["bits_per_byte"]) == {"prose", "more", "noise"} for p in report["proxies"])
    steps = [r["step"] for r in read_metrics(out / "proxies" / "p000-natural") if "loss" in r]
    assert steps == [1, 2, 3]  # the interrupted attempt's records were not kept beside the new ones
    analysis = report["analysis"]
    assert analysis["target"] == "prose" and analysis["target_weights"] == [1.0, 0.0, 0.0]
    assert {s["verdict"] for s in analysis["sources"]} <= {"helps", "neutral", "hurts"}
    assert sum(analysis["recommended"]["weights"]) == pytest.approx(1)
    assert (out / "mix.png").stat().st_size > 1000
    assert "0 failed" in done.stdout and "train on it: --data.stores=" in done.stdout
    for source in ("prose", "more", "noise"):
        assert source in done.stdout
    # a proxy that never wrote its summary (killed at its end) is trained again; the others are read back
    proxies = sorted(p for p in (out / "proxies").iterdir() if p.is_dir())  # beside them: the run store
    (proxies[3] / "summary.json").unlink()
    before = {p.name: (p / "metrics.jsonl").stat().st_mtime_ns for p in proxies}
    again = run_liandan(*args)
    assert again.returncode == 0, again.stderr
    assert "1 trained now, 5 finished earlier" in again.stdout
    after = {p.name: (p / "metrics.jsonl").stat().st_mtime_ns for p in proxies}
    assert [name for name in before if before[name] != after[name]] == [proxies[3].name]
    rerun = json.loads((out / "mix.json").read_text())  # trained again, bit for bit the same
    assert [p["bits_per_byte"] for p in rerun["proxies"]] == [p["bits_per_byte"] for p in report["proxies"]]
    # checked at a larger size: the recommended, natural and uniform mixtures, two seeds each, on one held-out split
    larger = [*args, "--validate", "--seeds", "2", "--larger", "model.dim=48", "--larger", "train.steps=4"]
    done = run_liandan(*larger)
    assert done.returncode == 0, done.stderr
    assert "6 finished earlier" in done.stdout and "validation runs: 6 trained now" in done.stdout
    check = json.loads((out / "validate-prose.json").read_text())
    assert check["parameters"]["ratio"] > 1.5 and check["steps"] == 4 and check["target"] == "prose"
    kinds = ("recommended", "natural", "uniform")
    assert [r["name"] for r in check["runs"]] == [f"{k}-s{s}" for s in (1, 2) for k in kinds]
    for run in check["runs"]:
        config = tomllib.loads((Path(run["run_dir"]) / "config.toml").read_text())
        assert config["run"]["seed"] == run["seed"] and config["data"]["split_seed"] == 1
        assert config["model"]["llama"]["dim"] == 48 and config["data"]["weights"] == pytest.approx(run["weights"])
        assert set(run["bits_per_byte"]) == {"prose", "more", "noise"}
    recommended = check["mixtures"]["recommended"]
    assert recommended["weights"] == pytest.approx(mc.without_tiny(analysis["recommended"]["weights"]))
    prose = [r["bits_per_byte"]["prose"] for r in check["runs"] if r["kind"] == "recommended"]
    assert recommended["measured"] == pytest.approx(prose) and recommended["mean"] == pytest.approx(np.mean(prose))
    assert (out / "validate-prose.png").stat().st_size > 1000 and "the law's prediction" in done.stdout
    again = run_liandan(*larger)  # finished runs are read back; another size in the same place is refused
    assert again.returncode == 0 and "validation runs: 0 trained now, 6 finished earlier" in again.stdout
    assert json.loads((out / "validate-prose.json").read_text())["mixtures"] == check["mixtures"]
    other = run_liandan(*args, "--validate", "--seeds", "2", "--larger", "model.dim=64", "--larger", "train.steps=4")
    assert other.returncode == 2 and "holds the validation runs of another recommendation or size" in other.stderr


def test_validation_moves_the_law_to_the_larger_size_by_the_anchors_and_judges_beyond_the_spread():
    target = np.array([0.5, 0.5, 0.0])
    laws = {n: law.to_dict() for n, law in zip(NAMES, TRUTH)}
    mixtures = {"recommended": (0.7, 0.3, 0.0), "natural": tuple(NATURAL), "uniform": (1 / 3,) * 3}
    runs = mc.validation_runs(mixtures, seeds=3, first_seed=5)
    assert [p.name for p in runs[:4]] == ["recommended-s5", "natural-s5", "uniform-s5", "recommended-s6"]
    shift = np.array([-0.4, -0.3, -0.1])  # the larger model: lower losses, by source
    noise = {5: 0.0, 6: 0.004, 7: -0.004}

    def results(extra: dict[str, float]):
        return [{n: float(law.predict(np.array(p.weights)) + s + noise[p.seed] + extra.get(p.kind, 0.0))
                 for n, law, s in zip(NAMES, TRUTH, shift)} for p in runs]  # fmt: skip

    report = mc.summarise(runs, results({}), laws, target, NAMES)
    rec = report["mixtures"]["recommended"]
    truth = float(
        sum(a * (law.predict(np.array(mixtures["recommended"])) + s) for a, law, s in zip(target, TRUTH, shift))
    )
    assert report["shift"] == pytest.approx(dict(zip(NAMES, shift)), abs=1e-12)
    assert rec["predicted"] == pytest.approx(truth, abs=1e-12) and rec["mean"] == pytest.approx(truth, abs=1e-12)
    assert rec["error_relative"] == pytest.approx(0, abs=1e-12)
    assert rec["high"] - rec["low"] == pytest.approx(0.008) and rec["seeds"] == [5, 6, 7]
    assert rec["predicted_at_proxy_size"] - rec["predicted"] == pytest.approx(-(shift @ target))
    # natural's worst mixture margin is large; a recommended run 0.05 worse overlaps uniform's seeds
    assert report["beats"]["natural"]["beyond_spread"] == (rec["high"] < report["mixtures"]["natural"]["low"])
    worse = mc.summarise(runs, results({"recommended": 0.5}), laws, target, NAMES)
    assert not any(b["beyond_spread"] for b in worse["beats"].values())
    assert worse["prediction_error_relative"] < 0  # it measured worse than the law said
    better = mc.summarise(runs, results({"recommended": -0.5}), laws, target, NAMES)
    assert all(b["beyond_spread"] and b["margin"] > 0.4 for b in better["beats"].values())
    # a recommendation trains with its tiny weights left out; --larger is checked
    assert mc.without_tiny([0.6, 0.39995, 0.00005]) == (0.60003, 0.39997, 0.0)
    with pytest.raises(ConfigError, match="at least 2 seeds"):
        mc.validation_runs(mixtures, seeds=1, first_seed=0)


def test_the_default_larger_size_doubles_the_width_of_a_nested_model_section():
    from liandan.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml", [])  # [model.llama] dim
    assert mc.larger_overrides([], cfg) == [f"--model.dim={2 * cfg.model.llama.dim}"]
    assert mc.larger_overrides(["--model.n_layers=6", "train.steps=9"], cfg) == ["--model.n_layers=6",
                                                                                "--train.steps=9"]  # fmt: skip
