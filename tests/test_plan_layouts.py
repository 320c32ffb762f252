"""The planner's layouts in full: pipeline bubbles and activations in flight by schedule, the stage split,
memory per pipeline rank, context parallel, CPU offload, the predicted step time and the ranking of every
layout with its reason; `liandan plan` and `liandan launch --layout auto`; and the memory per device (per
pipeline rank, once pipeline training runs) against the measured peak of real runs on 2 CPU processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_port, write_corpus
from liandan.cli.main import main
from liandan.common.layout import Layout
from liandan.config import ConfigError, load_config
from liandan.model import ModelArgs
from liandan.plan.activations import activation_memory
from liandan.plan.layout_rank import rank_layouts
from liandan.plan.layouts import Candidate, Network, Workload, evaluate
from liandan.plan.memory import memory_per_device, param_split
from liandan.plan.pipeline import bubble_share, in_flight, rank_stages, split_layers
from liandan.plan.run_plan import plan_model_args

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
H100_BF16 = 989e12


def args_70b() -> ModelArgs:
    return plan_model_args(load_config(ROOT / "configs" / "llama-70b.toml", []))


def workload(args=None, **kw) -> Workload:
    base = {"seq_len": 8192, "global_batch": 512, "peak_flops": H100_BF16, "network": Network()}
    return Workload(args or args_70b(), **{**base, **kw})


# ---------------------------------------------------------------------------------------------------------
# schedules


@pytest.mark.parametrize(
    "schedule, v, expected",
    [
        ("gpipe", 1, 3 / 11),  # (p - 1) / (m + p - 1), p = 4, m = 8
        ("1f1b", 1, 3 / 11),
        ("interleaved-1f1b", 2, 1.5 / 9.5),  # the idle time divided by v
        ("looped-bfs", 4, 0.75 / 8.75),
        ("interleaved-zb", 2, 0.5 / 8.5),  # a third of the interleaved bubble (ZB-H1)
        ("zbv", 1, 0.5 / 8.5),  # two stages per rank whatever pp_stages_per_rank says
        ("dualpipev", 1, 0.5 / 8.5),
    ],
)
def test_bubble_share_by_schedule(schedule, v, expected):
    assert bubble_share(schedule, 4, 8, v) == pytest.approx(expected)
    assert bubble_share(schedule, 1, 8, v) == 0.0
    assert bubble_share(schedule, 4, 64, v) < bubble_share(schedule, 4, 8, v)  # more micro-batches, less idle


def test_activations_in_flight_by_schedule():
    p, m = 4, 16
    assert [in_flight("1f1b", p, m, r) for r in range(p)] == [4, 3, 2, 1]
    assert in_flight("1f1b", p, 2, 0) == 2  # never more than the step's micro-batches
    assert [in_flight("gpipe", p, m, r) for r in range(p)] == [m] * p
    # Korthikanti et al. 2022: the first rank of the interleaved schedule keeps p(1 + (p - 1)/(p v))
    assert in_flight("interleaved-1f1b", p, m, 0, 2) == pytest.approx(p * (1 + (p - 1) / (p * 2)))
    assert in_flight("interleaved-1f1b", p, m, p - 1, 2) < in_flight("interleaved-1f1b", p, m, 0, 2)
    assert [in_flight("zbv", p, m, r) for r in range(p)] == [p] * p
    assert in_flight("dualpipev", p, m, 0) == p + 1


def test_rank_stages_loop_or_fold():
    assert rank_stages("interleaved-1f1b", 4, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rank_stages("zbv", 4) == [[0, 7], [1, 6], [2, 5], [3, 4]]  # the first rank holds embedding and head
    assert rank_stages("1f1b", 4, 3) == [[0], [1], [2], [3]]


def test_split_layers_lightens_the_ends():
    assert split_layers(80, 8) == [10] * 8
    split = split_layers(80, 8, 1.2, 1.2)
    assert sum(split) == 80 and split[0] < 10 and split[-1] < 10 and max(split) == 11
    assert split_layers(4, 4, 3, 3) == [1, 1, 1, 1]  # every stage keeps a layer
    with pytest.raises(ConfigError, match="cannot fill"):
        split_layers(3, 4)


# ---------------------------------------------------------------------------------------------------------
# memory per pipeline rank


def test_unpipelined_candidate_is_the_memory_estimate():
    args = args_70b()
    for tp, b, mode in ((8, 2, "none"), (4, 4, "full")):
        est = memory_per_device(args, Layout(1, 256 // tp, tp), micro_batch=b, seq_len=8192, activation_checkpoint=mode,
                                sequence_parallel=True, loss_parallel=True, accumulation_steps=2 // b or 1)  # fmt: skip
        c = Candidate(1, 256 // tp, tp, microbatches=2 // b or 1, micro_batch=b, checkpoint=mode)
        assert evaluate(workload(args), c).worst.total == pytest.approx(est.total)


def test_context_parallel_divides_activations_and_folds_into_fsdp():
    w = workload()
    one = evaluate(w, Candidate(1, 8, 8, cp=1, microbatches=1, micro_batch=1)).worst
    two = evaluate(w, Candidate(1, 4, 8, cp=2, microbatches=1, micro_batch=1)).worst
    args = args_70b()
    acts = activation_memory(args, micro_batch=1, seq_len=8192, tp=8, sequence_parallel=True, loss_parallel=True)
    assert one.total - two.total == pytest.approx(acts.total / 2, rel=0.01)  # each rank holds half the sequence
    assert two.params == pytest.approx(one.params)  # FSDP shards over dp_shard x cp: 8 ranks either way


def test_pipeline_ranks_by_hand():
    args = args_70b()
    w = workload(args)
    c = Candidate(1, 8, 8, pp=4, schedule="1f1b", microbatches=16, micro_batch=1, checkpoint="full")
    e = evaluate(w, c)
    assert sum(e.stage_layers) == 80 and e.stage_layers[0] < e.stage_layers[1]
    first, last = e.ranks[0], e.ranks[-1]
    assert first.embedding and not first.head and last.head and not last.embedding
    acts = activation_memory(args, micro_batch=1, seq_len=8192, tp=8, checkpoint="full", sequence_parallel=True,
                             loss_parallel=True)  # fmt: skip
    # rank 0 keeps p = 4 micro-batches of its layers' inputs; the head's logits only on the last rank
    layer = acts.per_layer
    assert first.activations == pytest.approx(4 * e.stage_layers[0] * layer + acts.block_backward)
    assert last.activations == pytest.approx(1 * e.stage_layers[-1] * layer + max(acts.head, acts.block_backward))
    split = param_split(args, 8)
    table = -(-128256 * 8192 // 8)
    assert first.params == pytest.approx(4 * (e.stage_layers[0] * split.block + table) / 8)  # fp32, /dp_shard
    assert last.params == pytest.approx(4 * (e.stage_layers[-1] * split.block + split.root - table) / 8)
    gpipe = evaluate(w, Candidate(1, 8, 8, pp=4, schedule="gpipe", microbatches=16, micro_batch=1, checkpoint="full"))
    kept = gpipe.ranks[0].activations - acts.block_backward
    assert kept == pytest.approx(4 * (first.activations - acts.block_backward))  # all 16 micro-batches against 4
    inter = evaluate(w, Candidate(1, 8, 8, pp=4, schedule="interleaved-1f1b", stages_per_rank=2, microbatches=16,
                                  micro_batch=1, checkpoint="full"))  # fmt: skip
    assert inter.time.bubble_share < e.time.bubble_share
    assert inter.ranks[0].in_flight == pytest.approx(4 * (1 + 3 / 8))
    assert e.worst.total == max(r.total for r in e.ranks)


def test_offload_moves_the_states_to_the_host_and_costs_time():
    w = workload()
    on = Candidate(1, 32, 8, microbatches=1, micro_batch=2, checkpoint="full", offload=True)
    off = Candidate(1, 32, 8, microbatches=1, micro_batch=2, checkpoint="full")
    a, b = evaluate(w, on), evaluate(w, off)
    states = b.worst.params + b.worst.grads + b.worst.optimizer
    assert a.worst.params == a.worst.optimizer == 0 and a.worst.host == pytest.approx(states)
    # the parameters and optimizer state leave the device; the gradients were below the activations' peak
    assert a.worst.total == pytest.approx(b.worst.total - b.worst.params - b.worst.optimizer)
    assert a.time.offload > 0 and a.time.total > b.time.total


def test_step_time_terms():
    w = workload()
    c = Candidate(1, 8, 8, pp=4, schedule="1f1b", microbatches=8, micro_batch=1, checkpoint="full")
    t = evaluate(w, c).time
    share = 3 / 11
    assert t.bubble_share == pytest.approx(share)
    assert t.bubble == pytest.approx((t.compute + t.recompute + t.tp + t.cp + t.ep) * share / (1 - share))
    assert t.recompute == pytest.approx(t.compute / 3, rel=0.05)  # full recomputation: the forward again
    assert "pp" in t.crossing and "tp" not in t.crossing  # 64 ranks per stage: neighbours are nodes apart
    small_nodes = Workload(**{**w.__dict__, "network": Network(gpus_per_node=4)})
    assert "tp" in evaluate(small_nodes, c).time.crossing


# ---------------------------------------------------------------------------------------------------------
# ranking


def test_ranking_orders_fitting_layouts_and_gives_every_other_a_reason():
    rows = rank_layouts(workload(), 256, device_memory_gib=80, headroom=0.1, schedule="interleaved-1f1b",
                        stages_per_rank=2)  # fmt: skip
    fitting = [r for r in rows if r.fits]
    assert fitting and fitting[0].reason == ""
    times = [r.step_seconds for r in fitting]
    assert times == sorted(times)
    assert all(r.reason for r in rows[1:])
    assert all(r.reason.endswith("slower") or "slower:" in r.reason for r in fitting[1:])
    reasons = " | ".join(r.reason for r in rows)
    assert "does not fit" in reasons and "cannot fill" in reasons and "crosses nodes" in reasons


def test_a_tensor_parallel_group_beyond_a_node_is_named():
    args = ModelArgs(vocab_size=32000, dim=4096, n_layers=16, n_heads=32, n_kv_heads=32, ffn_dim=11008,
                     max_seq_len=4096)  # fmt: skip
    w = workload(args, seq_len=4096, global_batch=64)
    rows = rank_layouts(w, 32, device_memory_gib=80, headroom=0.1, micro_batch=1)
    tp16 = next(r for r in rows if r.dims == "dp_shard=2 tp=16")
    assert tp16.fits and tp16.reason.split(": ", 1)[1].startswith("tp=16 crosses nodes: tensor-parallel traffic")
    deep = next(r for r in rows if r.dims == "dp_shard=1 pp=32")
    assert "pp=32" in deep.reason
    few = rank_layouts(w, 32, device_memory_gib=80, headroom=0.1, micro_batch=1, pp_microbatches=2)
    assert any("fewer than the 4 stages" in r.reason for r in few)
    # torch's interleaved schedules run m // pp rounds, which must divide m: 9 on 4 stages makes 2 rounds
    odd = rank_layouts(workload(args, seq_len=4096, global_batch=18), 32, device_memory_gib=80, headroom=0.1,
                       pp_microbatches=9, schedule="interleaved-1f1b", stages_per_rank=2)  # fmt: skip
    assert next(r for r in odd if r.dims == "dp_shard=2 tp=4 pp=4").reason == (
        "pp=4: interleaved-1f1b runs its micro-batches in rounds: 9 do not split into 2 rounds"
    )


def test_nothing_fits():
    rows = rank_layouts(workload(), 8, device_memory_gib=4, headroom=0.1)
    assert not any(r.fits for r in rows)
    assert all(r.reason.startswith("does not fit") for r in rows if r.evaluated is not None)


# ---------------------------------------------------------------------------------------------------------
# the command line


def run_main(capsys, *argv):
    code = main(list(map(str, argv)))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_ranks_the_70b_layouts(capsys):
    code, out, _ = run_main(capsys, "plan", ROOT / "configs" / "llama-70b.toml", "--nproc", "256", "--top", "0")
    assert code == 0
    assert "Layouts on 256 x H100 (8 GPUs per node), ranked by predicted step time" in out
    assert "best" in out and "slower" in out and "Layouts that do not fit or cannot run" in out
    code, out, _ = run_main(capsys, "plan", ROOT / "configs" / "llama-70b.toml", "--nproc", "256", "--json")
    plan = json.loads(out)
    best = plan["ranking"][0]
    assert best["fits"] and best["step_seconds"] > 0 and "--parallel.tp=" in " ".join(best["overrides"])
    layout = plan["memory"]["layout"]  # the config's, as before
    assert (layout["dp_replicate"], layout["dp_shard"], layout["tp"], layout.get("pp", 1)) == (1, 32, 8, 1)


@pytest.mark.parametrize("nproc", [64, 256, 512])
def test_the_70b_plan_ranks_torchtitans_layout_with_its_reason(capsys, nproc):
    """torchtitan's published 70B layout, FSDP x TP 8, fits only with full recomputation (as torchtitan runs it)
    once a Llama block's activations are counted; without context parallelism the planner prefers tp = 2 and
    says why torchtitan's shape ranks lower: its tensor-parallel collectives, counted as exposed."""
    code, out, _ = run_main(capsys, "plan", ROOT / "configs" / "llama-70b.toml", "--nproc", nproc, "--max-cp", "1",
                            "--json", "--top", "0")  # fmt: skip
    ranking = json.loads(out)["ranking"]
    assert code == 0 and ranking[0]["dims"] == f"dp_shard={nproc // 2} tp=2"
    shape = next(r for r in ranking if r["dims"] == f"dp_shard={nproc // 8} tp=8")
    assert shape["fits"] and "--train.activation_checkpoint=full" in shape["overrides"]
    assert shape["reason"].endswith("slower: tensor-parallel traffic 22% of the step")


def test_plan_of_a_pipelined_config_shows_every_rank(capsys):
    code, out, _ = run_main(capsys, "plan", ROOT / "configs" / "llama-70b.toml", "--nproc", "256", "--top", "3",
                            "--parallel.pp=4", "--parallel.pp_microbatches=16", "--parallel.cp=2")  # fmt: skip
    assert code == 0
    assert "Memory per pipeline rank: dp_shard=4 tp=8 pp=4 cp=2, interleaved-1f1b v=2 m=16" in out
    assert "<- worst" in out and "bubble" in out
    code, out, _ = run_main(capsys, "plan", ROOT / "configs" / "llama-70b.toml", "--nproc", "256", "--json",
                            "--parallel.pp=4")  # fmt: skip
    staged = json.loads(out)["staged"]
    assert staged["candidate"]["pp"] == 4 and len(staged["ranks"]) == 4 and staged["worst"]["total"] > 0


def test_plan_of_an_offloaded_config_and_the_default_device_count(capsys):
    code, out, _ = run_main(capsys, "plan", ROOT / "configs" / "llama-70b.toml", "--nproc", "64", "--top", "1",
                            "--parallel.cpu_offload=true")  # fmt: skip
    assert code == 0 and "Memory per device: dp_shard=8 tp=8, micro-batch 1, full AC, offload" in out
    assert "(host 16.43 GiB)" in out  # 70.6B parameters x 16 bytes / 64 devices stay in host memory
    code, out, _ = run_main(capsys, "plan", ROOT / "configs" / "llama-70b.toml", "--parallel.pp=4", "--top", "1")
    assert code == 0 and out.startswith("plan ") and ": 32 x H100" in out.splitlines()[0]  # tp 8 x pp 4


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--gpus-per-node", "0"], "--gpus-per-node = 0 must be at least 1"),
        (["--compute-efficiency", "1.5"], "--compute-efficiency = 1.5 must be in (0, 1]"),
        (["--top", "-1"], "--top = -1 must not be negative"),
        (["--max-cp", "0"], "--max-cp = 0 must be at least 1"),
        (["--parallel.pp=3"], "does not make 256 processes"),
    ],
)
def test_plan_bad_inputs_give_one_line(capsys, argv, words):
    code, _, err = run_main(capsys, "plan", ROOT / "configs" / "llama-70b.toml", "--nproc", "256", *argv)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def tiny_toml(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(
        "[model]\nvocab_size = 256\nmax_seq_len = 64\n[model.llama]\ndim = 64\nn_layers = 4\nn_heads = 4\n"
        f'n_kv_heads = 2\n[train]\nglobal_batch = 8\nseq_len = 64\n[data]\ntokenizer = "byte"\n'
        f'[run]\noutput_dir = "{tmp_path / "runs"}"\n'
    )
    return path


def test_launch_takes_the_planners_layout(capsys, tiny_toml):
    code, out, err = run_main(capsys, "launch", tiny_toml, "--nodes", "2", "--gpus-per-node", "2", "--layout", "auto",
                              "--hosts", "a,b")  # fmt: skip
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 2
    chosen = err.strip().splitlines()[-1]
    assert chosen.startswith("liandan: layout auto: ") and "on 4 x H100" in chosen
    for line in lines:
        assert "--parallel.dp_shard=" in line and "--parallel.tp=" in line and "--train.activation_checkpoint=" in line
    # the planner's fastest layouts pipeline this model, which the trainer refuses until it runs pipelines: the
    # launch passes them over, says so, and takes the fastest it accepts
    overrides = [w for w in lines[0].split() if w.startswith(("--parallel.", "--train."))]
    cfg = load_config(tiny_toml, overrides)
    from liandan.common.layout import resolve_layout

    assert resolve_layout(cfg.parallel, 4).world_size == 4
    if "--parallel.pp=1" in overrides:
        assert all("passed over" in line for line in err.strip().splitlines()[:-1])


def test_launch_gives_v_schedules_two_stages_per_rank_and_passes_over_what_the_trainer_refuses(capsys, tiny_toml):
    # the planner's zbv layouts run two stages per rank, as the trainer needs; those the trainer does not run
    # (zbv under FSDP, tp x pp with sequence parallelism) are said and skipped
    code, out, err = run_main(capsys, "launch", tiny_toml, "--nodes", "2", "--gpus-per-node", "2", "--layout", "auto",
                              "--hosts", "a,b", "--parallel.pp_schedule=zbv", "--model.moe_experts=4")  # fmt: skip
    assert code == 0
    *passed, chosen = err.strip().splitlines()
    assert passed and all(line.startswith("liandan: layout auto: passed over ") for line in passed)
    assert not any("pp_stages_per_rank" in line for line in passed)
    assert any("zbv computes weight gradients apart" in line for line in passed)
    assert " pp=" not in chosen and "--parallel.pp=1" in out
    from liandan.plan.layouts import Candidate

    for schedule, per_rank in [("zbv", 1), ("dualpipev", 1), ("1f1b", 1), ("interleaved-1f1b", 2)]:
        pipelined = Candidate(1, 1, 1, 2, 1, 1, schedule, per_rank, 4, 1, "none", False).overrides()
        assert f"--parallel.pp_stages_per_rank={2 if schedule in ('zbv', 'dualpipev') else per_rank}" in pipelined


def test_launch_without_a_fitting_layout_says_so(capsys, tiny_toml):
    code, _, err = run_main(capsys, "launch", tiny_toml, "--nodes", "1", "--gpus-per-node", "2", "--layout", "auto",
                            "--hosts", "a", "--model.dim=65536", "--model.n_heads=4", "--model.n_kv_heads=4")  # fmt: skip
    assert code == 2 and "no layout of 2 x H100 fits this run" in err


# ---------------------------------------------------------------------------------------------------------
# against measured peak memory on 2 CPU processes (tests/plan_memory_worker.py)

TOLERANCE = 0.15
# Full recomputation keeps little, so the allocator's slack weighs more in the resident set: -8% to -21% here,
# more in CI's fresh environment (docs/planning.md); every other run and difference, full recomputation's at 4x
# the tokens among them, is held to 15%.
TOLERANCE_ACTIVATION_RUNS = {"activations-full": 0.5}


def measure_on_two_ranks(root: Path, names: str, *overrides: str) -> list[dict]:
    write_corpus(root)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
        command = [sys.executable, str(TESTS / "plan_memory_worker.py"), str(root), str(root), names, *overrides]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


def _linux_peak_reset() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


linux_only = pytest.mark.skipif(not _linux_peak_reset(), reason="needs Linux /proc/self/clear_refs and VmHWM")


@pytest.mark.slow
@linux_only
def test_fsdp_memory_per_device_matches_measured_peak(tmp_path):
    names = "tiny,states-3.3M,states-13M,activations-none,activations-full"
    for report in measure_on_two_ranks(tmp_path, names, "--parallel.dp_shard=2"):
        fixed = report["tiny"][0] - report["tiny"][1]
        errs = {name: (est - (m - fixed)) / (m - fixed) for name, (m, est) in report.items() if name != "tiny"}
        for a, b in (("states-13M", "states-3.3M"), ("activations-none", "activations-full")):
            (ma, ea), (mb, eb) = report[a], report[b]
            errs[f"{a} - {b}"] = ((ea - eb) - (ma - mb)) / (ma - mb)
        print({k: round(v, 3) for k, v in errs.items()}, f"fixed {fixed / 2**20:.1f} MiB")
        assert 0 <= fixed < 20 * 2**20
        for name, err in errs.items():
            assert abs(err) < TOLERANCE_ACTIVATION_RUNS.get(name, TOLERANCE), (name, err, errs)


@pytest.mark.slow
@linux_only
def test_pipeline_memory_per_stage_matches_measured_peak(tmp_path):
    """Each pipeline rank's measured peak against the planner's estimate for that rank, on 2 stages."""
    runs = ("activations-none", "activations-full", "activations-long-none", "activations-long-full")
    reports = measure_on_two_ranks(tmp_path, ",".join(("tiny", *runs)), "--parallel.pp=2", "--parallel.pp_schedule=1f1b",
                                   "--parallel.pp_microbatches=4")  # fmt: skip
    if "refused" in reports[0]:
        pytest.skip(f"pipeline training does not run yet: {reports[0]['refused']}")
    for report in reports:
        fixed = report["tiny"][0] - report["tiny"][1]
        for name in runs:
            measured, estimate = report[name]
            err = (estimate - (measured - fixed)) / (measured - fixed)
            print(
                f"{name}: measured {(measured - fixed) / 2**20:.1f} MiB, estimated {estimate / 2**20:.1f} MiB, {err:+.1%}"
            )
            assert abs(err) < TOLERANCE_ACTIVATION_RUNS.get(name, TOLERANCE), (name, err, report)
