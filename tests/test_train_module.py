"""The trainer opened to new kinds of training, from outside liandan: a custom loader and a custom train module
of two model parts with two optimizers, passed from Python; a second optimizer and a second model family, each
one file plus its registration, chosen by the config; plug-ins found through entry points. Each trains,
checkpoints and resumes bit for bit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import read_metrics, tiny_config, write_corpus
from liandan import plugins
from liandan.config import load_config
from liandan.data.tokens.loader import Batch
from liandan.plugins import Plugin
from liandan.train import Trainer
from liandan.train.components import build_components
from liandan.train.optimizers import schedule
from liandan.train.optimizers.container import OptimizersContainer
from liandan.train.train_module import TrainModule

VOCAB, DIM, SEQ = 64, 16, 32


class CountingLoader:
    """Batches of random tokens drawn from the data step, so that a resumed loader gives the same ones."""

    def __init__(self, seed: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1):
        self.seed, self.per_rank, self.step = seed, global_batch // dp_size, 0
        self.dp_rank = dp_rank

    def next_step(self, micro_batch: int) -> list[Batch]:
        g = torch.Generator().manual_seed(self.seed * 1000 + self.step * 10 + self.dp_rank)
        tokens = torch.randint(0, VOCAB, (self.per_rank, SEQ + 1), generator=g)
        tokens[:, 1::2] = (tokens[:, 0:-1:2] * 3 + 1) % VOCAB  # a rule worth learning: every other token
        self.step += 1
        return [
            Batch(tokens[i : i + micro_batch, :-1], tokens[i : i + micro_batch, 1:], torch.zeros(micro_batch, SEQ))
            for i in range(0, self.per_rank, micro_batch)
        ]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


class TwoPartModule(TrainModule):
    """An embedding part and a head part, each with its own optimizer: AdamW on the first, SGD with momentum
    on the second, as a pipeline stage's chunks or a policy beside a head would be."""

    def __init__(self, cfg, device: torch.device):
        torch.manual_seed(cfg.run.seed)
        self.model_parts = [
            nn.ModuleDict({"embed": nn.Embedding(VOCAB, DIM)}),
            nn.ModuleDict({"head": nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, VOCAB))}),
        ]
        first = torch.optim.AdamW(self.model_parts[0].parameters(), lr=cfg.optim.lr, weight_decay=0.0)
        second = torch.optim.SGD(self.model_parts[1].parameters(), lr=cfg.optim.lr, momentum=0.9)
        self.optimizers = OptimizersContainer(self.model_parts, [[first], [second]],
                                              schedule(cfg.train.steps, cfg.schedule), cfg.optim.grad_clip)  # fmt: skip
        self.flops_per_token = 6.0 * (DIM * DIM + DIM * VOCAB)

    def _loss(self, batch: Batch) -> torch.Tensor:
        hidden = self.model_parts[0]["embed"](batch.inputs)
        logits = self.model_parts[1]["head"](hidden)
        return F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten())

    def train_batch(self, batches, phase, step):
        total = torch.zeros(())
        for i, batch in enumerate(batches):
            phase("forward", micro=i)
            loss = self._loss(batch) / len(batches)
            phase("backward", micro=i)
            loss.backward()
            total += loss.detach()
        return total

    @torch.no_grad()
    def eval_batch(self, batches):
        return sum(self._loss(b) for b in batches) / len(batches)


def _config(tmp_path, *overrides):
    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        write_corpus(tmp_path)
    return tiny_config(tmp_path / "runs", corpus, "--train.steps=8", "--schedule.warmup_steps=2", "--optim.lr=0.05",
                       "--checkpoint.every=4", "--checkpoint.async_save=false", "--checkpoint.keep_last=0",
                       "--train.global_batch=4", "--train.micro_batch=2", *overrides)  # fmt: skip


def _losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


def _train_custom(cfg) -> tuple:
    parts = build_components(
        cfg,
        loader=lambda env, dp_rank, dp_size: CountingLoader(cfg.run.seed, cfg.train.global_batch, dp_rank, dp_size),
        module=lambda env, tokenizer: TwoPartModule(cfg, env.device),
        say=lambda m: None,
    )
    trainer = Trainer(parts)
    try:
        return trainer.train(), parts
    finally:
        trainer.close()


def test_a_custom_loader_and_train_module_train_checkpoint_and_resume_exactly(tmp_path):
    cfg = _config(tmp_path)
    result, parts = _train_custom(cfg)
    assert not (result.run_dir / "data").exists()  # the caller's loader: no data pipeline ran
    losses = _losses(result.run_dir)
    assert len(losses) == 8 and losses[-1][1] < losses[0][1]  # it learns
    assert isinstance(parts.module.optimizers.optimizers[1], torch.optim.SGD)
    step4, step8 = result.run_dir / "checkpoints" / "step-00000004", result.run_dir / "checkpoints" / "step-00000008"
    assert step4.is_dir() and step8.is_dir()
    shutil.rmtree(step8)  # as if the run had died after step 4

    resumed, again = _train_custom(cfg)
    assert again.module.optimizers.optimizers[1].state  # SGD's momentum came back from the checkpoint
    assert _losses(resumed.run_dir) == losses  # steps 5-8 again, bit for bit
    assert again.module.optimizers.scheduler_state() == parts.module.optimizers.scheduler_state()


def test_a_custom_loader_without_validation_trains_through_the_evaluations_and_says_why_there_is_no_loss(tmp_path):
    cfg = _config(tmp_path, "--train.eval_every=2", "--checkpoint.enabled=false")
    said: list[str] = []
    parts = build_components(cfg, loader=CountingLoader(cfg.run.seed, cfg.train.global_batch),
                             module=lambda env, tokenizer: TwoPartModule(cfg, env.device), say=said.append)  # fmt: skip
    trainer = Trainer(parts)
    try:
        result = trainer.train()
    finally:
        trainer.close()
    assert len(_losses(result.run_dir)) == 8 and result.val_loss is None
    assert said.count("no validation loss: the loader (CountingLoader) has no `validation`") == 1


@pytest.fixture
def toy_optimizer():
    plugins.register(Plugin("optimizer", "sgdm", "toy_optimizer:SGDM", options="toy_optimizer:SgdmOptions"))
    yield
    plugins.unregister("optimizer", "sgdm")


def test_a_second_optimizer_from_its_own_file_trains_checkpoints_and_resumes(tmp_path, toy_optimizer):
    cfg = _config(tmp_path, "--optim.name=sgdm", "--optim.sgdm.momentum=0.8", "--optim.lr=0.1")
    assert cfg.optim.sgdm.momentum == 0.8 and "[optim.sgdm]" in cfg.to_toml()
    trainer = Trainer(cfg, say=lambda m: None)
    try:
        assert [type(o) for o in trainer.module.optimizers] == [torch.optim.SGD]
        result = trainer.train()
    finally:
        trainer.close()
    losses = _losses(result.run_dir)
    shutil.rmtree(result.run_dir / "checkpoints" / "step-00000008")
    trainer = Trainer(cfg, say=lambda m: None)
    try:
        assert trainer.step == 4 and trainer.module.optimizers.optimizers[0].state
        resumed = trainer.train()
    finally:
        trainer.close()
    assert _losses(resumed.run_dir) == losses

    from liandan.plan.memory import optimizer_state_bytes

    assert optimizer_state_bytes(cfg) == 4.0  # the planner asks the plug-in, not AdamW's 8


def test_the_toy_family_resumes_exactly(tmp_path):
    plugins.register(Plugin("model_family", "toy", "toy_family:TOY", options="toy_family:ToyOptions"))
    try:
        corpus = write_corpus(tmp_path)
        cfg = load_config(None, [f"--run.output_dir={tmp_path / 'runs'}", "--run.name=toy", "--model.family=toy",
                                 "--model.toy.dim=32", "--model.max_seq_len=64", "--train.steps=6",
                                 "--train.global_batch=4", "--train.seq_len=64", "--train.dtype=fp32",
                                 "--schedule.warmup_steps=2", "--data.tokenizer=byte", f'--data.paths=["{corpus}"]',
                                 "--track.plot=false", "--doctor.preflight=false", "--checkpoint.every=3",
                                 "--checkpoint.async_save=false", "--checkpoint.keep_last=0"])  # fmt: skip
        runs = []
        for _ in range(2):
            trainer = Trainer(cfg, say=lambda m: None)
            try:
                runs.append(trainer.train().run_dir)
            finally:
                trainer.close()
            if len(runs) == 1:
                first = _losses(runs[0])
                shutil.rmtree(runs[0] / "checkpoints" / "step-00000006")
        assert _losses(runs[1]) == first and len(first) == 6
    finally:
        plugins.unregister("model_family", "toy")


def test_plug_ins_found_through_entry_points_own_their_config(tmp_path):
    """A package that is only installed (its metadata names an entry point) adds an optimizer with its own
    config table, listed by `liandan config --keys`, with no import of it by anyone."""
    site = tmp_path / "site"
    (site / "lionish-0.1.dist-info").mkdir(parents=True)
    (site / "lionish-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: lionish\nVersion: 0.1\n")
    (site / "lionish-0.1.dist-info" / "entry_points.txt").write_text("[liandan.optimizer]\nlionish = lionish:LIONISH\n")
    (site / "lionish.py").write_text(
        textwrap.dedent("""
        from dataclasses import dataclass
        import torch
        from liandan.config import option
        from liandan.train.optimizers import OptimizerPlugin

        @dataclass
        class LionishOptions:
            beta: float = option(0.9, "momentum of the sign", min=0.0, max=1.0)

        def build(parts, section, device, mixed):
            return [[torch.optim.SGD(p.parameters(), lr=section.lr, momentum=section.options.beta)] for p in parts]

        LIONISH = OptimizerPlugin("lionish", build, state_bytes_per_param=4.0, options=LionishOptions)
    """)
    )
    code = textwrap.dedent("""
        from liandan import plugins
        from liandan.config import ConfigError, load_config
        cfg = load_config(None, ["--optim.name=lionish", "--optim.lionish.beta=0.5"])
        print(cfg.optim.options.beta, plugins.names("optimizer"))
        try:
            load_config(None, ["--optim.name=lionish", "--optim.lionish.bta=0.5"])
        except ConfigError as err:
            print(err)
    """)
    env = {"PYTHONPATH": f"{site}:{':'.join(sys.path)}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "0.5 ['adamw', 'muon', 'lionish']"
    assert "unknown key 'optim.lionish.bta' (did you mean 'optim.lionish.beta'?)" in lines[1]


def test_flat_and_plug_in_tables_are_one_config_and_old_keys_say_where_they_went(tmp_path):
    flat = load_config(None, ["--model.dim=96", "--model.n_heads=6", "--optim.beta2=0.99"])
    tables = load_config(None, ["--model.llama.dim=96", "--model.llama.n_heads=6", "--optim.adamw.beta2=0.99"])
    assert flat == tables and flat.model.llama.dim == 96 and flat.optim.adamw.beta2 == 0.99
    path = tmp_path / "run.toml"
    path.write_text(flat.to_toml())
    assert load_config(path) == flat and "[model.llama]" in path.read_text()  # written with tables, read back
    assert load_config(path, ["--model.dim=128", "--model.n_heads=8"]).model.llama.dim == 128  # overrides win
    assert load_config(None, ["--model.dim=64", "--model.llama.dim=128"]).model.llama.dim == 128
    with pytest.raises(Exception) as err:
        load_config(None, ["--track.wandb_project=x"])
    assert str(err.value).startswith("track.wandb_project is now track.wandb.project")
    both = tmp_path / "both.toml"
    both.write_text("[model]\ndim = 96\n[model.llama]\ndim = 96\n")
    with pytest.raises(Exception) as err:
        load_config(both)
    assert "given twice" in str(err.value)


def test_a_checkpoint_written_before_the_train_module_protocol_resumes_exactly(tmp_path):
    """tests/fixtures/checkpoint-v0: the step-2 checkpoint and the token store of a 4-step run written by liandan
    before the protocol (one model, one AdamW, `[model]` and `[optim]` flat), with the losses that run logged. Resumed
    now, steps 3 and 4 give the same losses, bit for bit."""
    fixture = Path(__file__).parent / "fixtures" / "checkpoint-v0"
    expected = {int(k): v for k, v in json.loads((fixture / "expected.json").read_text())["losses"].items()}
    corpus = write_corpus(tmp_path, n_docs=8)
    cfg = load_config(None, [f"--run.output_dir={tmp_path / 'runs'}", "--run.name=old", "--model.dim=16",
                             "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1",
                             "--model.max_seq_len=32", "--train.steps=4", "--train.global_batch=2",
                             "--train.seq_len=32", "--train.dtype=fp32", "--schedule.warmup_steps=1",
                             "--data.tokenizer=byte", f'--data.paths=["{corpus}"]', "--track.plot=false",
                             "--checkpoint.every=2", "--checkpoint.async_save=false", "--track.store=false",
                             "--doctor.preflight=false"])  # fmt: skip
    run = tmp_path / "runs" / "old"
    shutil.copytree(fixture / "step-00000002", run / "checkpoints" / "step-00000002")
    shutil.copytree(fixture / "data", run / "data")  # the run's own token store, as it wrote it
    trainer = Trainer(cfg, say=lambda m: None)
    try:
        assert trainer.step == 2
        result = trainer.train()
    finally:
        trainer.close()
    assert dict(_losses(result.run_dir)) == {3: expected[3], 4: expected[4]}
