"""The registry of training callbacks: callbacks register by name from their own layer; the trainer never
imports them, and `liandan train` registers liandan's own in every process that trains."""

import subprocess
import sys

import pytest
import torch

from liandan import plugins
from liandan.config import load_config
from liandan.train import Callback
from liandan.train import callbacks as registry


class Recorder(Callback):
    def __init__(self, name):
        self.name = name


@pytest.fixture
def registered():
    """Names registered by a test, forgotten afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        plugins.unregister("callback", name)


def test_factories_decide_from_the_config_in_registration_order(registered):
    @registry.register_callback("always")
    def always(cfg):
        return Recorder("always")

    @registry.register_callback("when_forecasting")
    def when_forecasting(cfg):
        return Recorder("forecasting") if cfg.forecast.every else None

    registered += ["always", "when_forecasting"]
    names = registry.registered_callbacks()
    assert names[-2:] == ["always", "when_forecasting"] and names[0] == "heartbeat"  # liandan's own first
    built = [c.name for c in registry.build_callbacks(load_config(None, []))]
    assert "always" in built and "forecasting" not in built and "forecast" not in built
    on = [c.name for c in registry.build_callbacks(load_config(None, ["--forecast.every=5"]))]
    assert {"always", "forecasting", "forecast"} <= set(on)
    assert on.index("always") < on.index("forecasting")  # same order: registration order


def test_a_name_registered_twice_is_refused(registered):
    def first(cfg):
        return None

    def second(cfg):
        return Recorder("second")

    registry.register_callback("twice")(first)
    registered.append("twice")
    registry.register_callback("twice")(first)  # the same factory again (a module imported twice): fine
    with pytest.raises(ValueError, match="callback 'twice' is registered twice"):
        registry.register_callback("twice")(second)
    with pytest.raises(ValueError, match="callback 'guard' is registered twice"):
        registry.register_callback("guard")(second)  # a built-in is never replaced


def test_every_trainer_attaches_liandans_callbacks_and_imports_them_only_then():
    """The doctor, task evaluation and the live forecast sit above the trainer in the layers: the trainer
    imports none of them, yet a trainer built from Python, with no command line, attaches them all."""
    code = (
        "import sys\n"
        "import liandan.train.trainer, liandan.train.callbacks as c\n"
        "assert not [m for m in sys.modules if m.startswith('liandan.plan')], 'the trainer imported plan'\n"
        "assert not [m for m in sys.modules if m.startswith('liandan.doctor')], 'the trainer imported doctor'\n"
        "assert not [m for m in sys.modules if m.startswith('liandan.evaluate')], 'the trainer imported evaluate'\n"
        "from liandan.config import load_config\n"
        "cfg = load_config(None, ['--forecast.every=5', '--eval.every=5', '--eval.tasks=cloze_en'])\n"
        "print(sorted({x.name for x in c.build_callbacks(cfg)} & {'doctor', 'eval_tasks', 'forecast'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['doctor', 'eval_tasks', 'forecast']"


# --------------------------------------------------------------------------------------------------------
# callbacks in the loop: every step, state across a resume, a veto of the update on every rank


class Counter(Callback):
    """Counts the steps it has seen, across resumes: its state travels in checkpoints."""

    name = "counter"

    def __init__(self):
        self.seen, self.hooks, self.loaded = 0, [], None

    def on_train_start(self, trainer):
        self.hooks.append(("start", trainer.step))

    def after_step(self, trainer, step, metrics):
        self.seen += 1
        self.hooks.append(("after", step, "loss" in metrics))

    def on_checkpoint_loaded(self, trainer, step, source):
        self.loaded = (step, self.seen)

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def _config(tmp_path, *overrides):
    from helpers import tiny_config, write_corpus

    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        write_corpus(tmp_path)
    return tiny_config(tmp_path / "runs", corpus, "--train.log_every=2", *overrides)


def test_after_step_runs_every_step_and_state_survives_a_resume(tmp_path):
    from liandan.train import Trainer

    first = Counter()
    trainer = Trainer(_config(tmp_path, "--train.steps=4", "--checkpoint.every=2"), callbacks=[first], say=print)
    trainer.train()
    trainer.close()
    assert first.hooks == [("start", 0), ("after", 1, False), ("after", 2, True), ("after", 3, False),
                           ("after", 4, True)]  # fmt: skip
    second = Counter()
    trainer = Trainer(_config(tmp_path, "--train.steps=6", "--checkpoint.every=2"), callbacks=[second], say=print)
    assert second.loaded == (4, 4)  # the state was in the step-4 checkpoint
    trainer.train()
    trainer.close()
    assert second.seen == 6 and second.hooks[0] == ("start", 4)


class VetoOnRank(Callback):
    """Vetoes the update of one step on one rank only."""

    def __init__(self, step, rank):
        self.step, self.rank, self.before = step, rank, None

    def before_optimizer_step(self, trainer, step, loss, grad_norm):
        if step + 1 == self.step:
            self.before = [p.detach().clone() for p in trainer.module.model.parameters()]
        return not (step + 1 == self.step and trainer.dist.rank == self.rank)

    def after_step(self, trainer, step, metrics):
        if step == self.step:
            after = [p.detach() for p in trainer.module.model.parameters()]
            self.unchanged = all(torch.equal(a, b) for a, b in zip(self.before, after))


def _veto_rank(rank, port, root, out):
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
    from liandan.train import Trainer

    veto = VetoOnRank(step=4, rank=1)
    cfg = _config(root, "--train.steps=4", "--checkpoint.every=0", "--parallel.dp_shard=2")
    trainer = Trainer(cfg, callbacks=[veto], say=lambda m: None)
    result = trainer.train()
    trainer.close()
    out.put((rank, veto.unchanged, result.losses))


@pytest.mark.slow
def test_one_ranks_veto_skips_the_update_on_every_rank(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_veto_rank, args=(rank, port, tmp_path, out)) for rank in range(2)]
    for p in procs:
        p.start()
    results = {rank: (unchanged, losses) for rank, unchanged, losses in (out.get(timeout=300) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    assert results[0][0] and results[1][0]  # neither rank applied the update of step 4
    assert results[0][1] == results[1][1]
    from helpers import read_metrics

    metrics = read_metrics(tmp_path / "runs" / "run")
    assert [m["step"] for m in metrics if m.get("update_skipped")] == [4]
    assert all(p.exitcode == 0 for p in procs)


# --------------------------------------------------------------------------------------------------------
# a user's callback, named in the config: no edit of liandan, and it runs in the supervised worker

USER_CALLBACKS = '''
"""A user's callback module, outside liandan."""
import os

from liandan.run.worker_env import WorkerEnv
from liandan.train.callbacks import Callback, register_callback


class StepsSeen(Callback):
    def __init__(self):
        self.seen = 0

    def after_step(self, trainer, step, metrics):
        self.seen += 1

    def state_dict(self):
        return {"seen": self.seen, "supervised": WorkerEnv.from_env().supervised, "pid": os.getpid()}


@register_callback("steps_seen")
def steps_seen(cfg):
    return StepsSeen()
'''


@pytest.mark.slow
def test_a_callback_module_named_in_the_config_runs_in_the_supervised_worker(tmp_path):
    import os

    from helpers import run_liandan, tiny_config, write_corpus
    from liandan.checkpoint.info import read_meta
    from liandan.run import RunDir

    (tmp_path / "users_callbacks.py").write_text(USER_CALLBACKS)
    config = tmp_path / "run.toml"
    cfg = tiny_config(tmp_path / "runs", write_corpus(tmp_path), "--train.steps=4", "--checkpoint.every=4",
                      '--train.callbacks=["users_callbacks"]')  # fmt: skip
    config.write_text(cfg.to_toml())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = run_liandan("train", config, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [checkpoint] = RunDir.from_saved_config(tmp_path / "runs" / "run").complete_checkpoints()
    state = read_meta(checkpoint)["callbacks"]["steps_seen"]
    assert state["seen"] == 4 and state["supervised"]  # every step, in the worker the supervisor started
    assert state["pid"] != os.getpid()
