"""The resume oracle (`liandan doctor --resume`): it passes where resume is exact, in every layout two processes
make, and it fails, naming the step, on a planted resume bug (a loader that forgets its position)."""

import json
import os

import pytest

from helpers import MICRO_MODEL, run_liandan, tiny_config, write_corpus
from liandan.cli.main import main
from liandan.common.layout import Layout
from liandan.doctor.resume import RELATIVE_TOLERANCE, default_layouts, parse_layout


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("oracle")
    # two key/value heads, so that tensor parallelism over two ranks can split the micro model
    cfg = tiny_config(root / "runs", write_corpus(root, n_docs=8), *MICRO_MODEL, "--model.n_kv_heads=2")
    path = root / "tiny.toml"
    path.write_text(cfg.to_toml())
    return path


def _environment(**faults: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LIANDAN_FAULTS", "LIANDAN_FAULTS_ALWAYS")}
    return {**env, **faults}


@pytest.mark.slow
def test_resume_is_exact_in_every_two_process_layout(config, tmp_path):
    report_path = tmp_path / "report.json"
    done = run_liandan(
        "doctor", "--resume", config, "--layouts=1,ddp2,fsdp2,tp2", "--resume-steps=4", f"--json={report_path}",
        env=_environment(), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("resume is exact: 8 resumes at step 2")
    report = json.loads(report_path.read_text())
    assert report["passed"] and report["device"] == "cpu" and report["workdir"] is None  # nothing left behind
    checks = report["checks"]
    # each layout resumes its own checkpoint and the one the layout before it in the ring saved
    assert {(c["saved_in"], c["resumed_in"]) for c in checks} == {
        *((n, n) for n in ("1", "ddp2", "fsdp2", "tp2")),
        ("1", "ddp2"), ("ddp2", "fsdp2"), ("fsdp2", "tp2"), ("tp2", "1"),
    }  # fmt: skip
    for check in checks:
        assert check["passed"] and check["loss_step"] in (3, 4) and check["weight_tensor"]
        if check["saved_in"] == check["resumed_in"]:  # same numbers in the same order: bit for bit
            assert check["exact"] and check["loss_diff"] == 0 and check["weight_diff"] == 0
        else:
            assert not check["exact"]
            assert check["loss_relative"] <= RELATIVE_TOLERANCE and check["weight_relative"] <= RELATIVE_TOLERANCE


@pytest.mark.slow
def test_a_loader_that_forgets_its_position_fails_at_the_first_resumed_step(config, tmp_path):
    report_path, runs = tmp_path / "report.json", tmp_path / "runs"
    failed = run_liandan(
        "doctor", "--resume", config, "--layouts=1,ddp2", "--save-in=first", "--resume-steps=4", "--resume-at=2",
        f"--resume-dir={runs}", f"--json={report_path}", env=_environment(LIANDAN_FAULTS_ALWAYS="forget@loader:0"),
        timeout=300,
    )  # fmt: skip
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
    (line,) = failed.stderr.strip().splitlines()
    assert line.startswith("liandan doctor: resume drift: saved in 1, resumed in 1: the loss of step 3 differs")
    checks = json.loads(report_path.read_text())["checks"]
    # one reference, in the first layout, resumed in both: the bug shows in either
    assert [(c["saved_in"], c["resumed_in"]) for c in checks] == [("1", "1"), ("1", "ddp2")]
    for check in checks:
        assert not check["passed"] and check["first_diverging_step"] == 3
        # far outside float noise: the step trained on another batch
        assert check["loss_relative"] > 10 * RELATIVE_TOLERANCE and check["weight_relative"] > 10 * RELATIVE_TOLERANCE
    assert (runs / "resume-1-then-ddp2" / "metrics.jsonl").is_file()  # the runs are kept to look into


def test_parse_layout():
    assert parse_layout("1").layout == Layout(1, 1, 1)
    assert parse_layout("ddp2").layout == Layout(2, 1, 1)
    assert parse_layout("fsdp2+tp2").layout == Layout(1, 2, 2) and parse_layout("fsdp2+tp2").nproc == 4
    assert parse_layout("ddp2xfsdp2").layout.kind == "hsdp"
    assert parse_layout("pp2").layout == Layout(1, 1, 1, pp=2) and parse_layout("fsdp2+pp2").nproc == 4


def test_default_layouts_leave_out_what_the_model_cannot_split(tmp_path):
    cfg = tiny_config(tmp_path, tmp_path / "corpus.jsonl", *MICRO_MODEL)  # one key/value head
    chosen, skipped = default_layouts(cfg, on_gpu=False)
    assert [c.name for c in chosen] == ["1", "ddp2", "fsdp2"]
    assert skipped == [
        "tp2: parallel.tp = 2 must divide model.n_heads = 2 and n_kv_heads = 1",
        "pp2: model.n_layers = 1 blocks cannot fill 2 pipeline stages (pp x pp_stages_per_rank)",
    ]


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--resume", "missing.toml"], "config file not found: missing.toml"),
        (["--layouts=1,pq2"], "--layouts: 'pq2' is not a layout; use 1, ddpN, fsdpN, tpN"),
        (["--layouts=1,fsdp3"], "layout fsdp3: train.global_batch = 8 does not split into 3 data-parallel ranks"),
        (["--resume-steps=4", "--resume-at=4"], "--resume-at = 4 must be between 1 and --resume-steps - 1 = 3"),
        (["--resume-dir={config}"], "must be a new or empty directory"),
        (["--save-in=some"], "--save-in = 'some' must be one of each, first"),
        (["--resume", "{config}/tiny.toml", "other.toml"], "takes one config; 'other.toml' is one too many"),
    ],
    ids=[
        "missing-config",
        "bad-layout",
        "untrainable-layout",
        "resume-at-the-end",
        "used-dir",
        "save-in",
        "two-configs",
    ],
)
def test_bad_input_is_one_line(config, capsys, arguments, message):
    if not any(a.startswith("--resume=") or a == "--resume" for a in arguments):
        arguments = ["--resume", str(config), *arguments]
    arguments = [a.replace("{config}", str(config.parent)) for a in arguments]
    assert main(["doctor", *arguments]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("liandan: error: ")
    assert message in line


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, override",
    [("pp2", "--model.n_layers=2"), ("cp2", "--train.mask=causal")],
    ids=["pipeline", "context-parallel"],
)
def test_resume_from_a_split_checkpoint_is_exact_in_its_layout_and_close_without_it(config, tmp_path, layout, override):
    """A reference trained on 2 pipeline stages (1F1B, two blocks) or with each sequence split over 2 ranks (ring
    attention on the CPU), resumed in its own layout, is bit for bit the run that never stopped; resumed in one
    process, within the tolerance."""
    report_path = tmp_path / "report.json"
    done = run_liandan(
        "doctor", "--resume", config, f"--layouts={layout},1", "--save-in=first", "--resume-steps=4",
        f"--json={report_path}", override, env=_environment(), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = json.loads(report_path.read_text())["checks"]
    assert [(c["saved_in"], c["resumed_in"], c["exact"]) for c in checks] == [
        (layout, layout, True),
        (layout, "1", False),
    ]
    assert all(c["passed"] for c in checks)


def test_a_context_parallel_layout_the_config_cannot_split_is_refused(config, capsys):
    assert main(["doctor", "--resume", str(config), "--layouts=1,cp2", "--train.mask=document"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "layout cp2: parallel.cp = 2 needs train.mask = 'causal'" in line
