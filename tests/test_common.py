"""liandan.common: the layout, peak FLOP/s and schedule that plan and train share, without torch."""

import subprocess
import sys

import pytest

from liandan.common import Layout, gpu_peak_flops, lr_multiplier, resolve_layout, uses_fsdp
from liandan.config import ParallelSection, ScheduleSection


def test_spec_imports_no_torch():
    code = "import sys, liandan.common; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize(
    ("sizes", "text"),
    [
        ((1, 1, 1), "single (dp_replicate=1, dp_shard=1, tp=1)"),
        ((1, 4, 1), "fsdp (dp_replicate=1, dp_shard=4, tp=1)"),
        ((4, 1, 1), "ddp (dp_replicate=4, dp_shard=1, tp=1)"),
        ((2, 2, 1), "hsdp (dp_replicate=2, dp_shard=2, tp=1)"),
        ((1, 1, 2), "tp (dp_replicate=1, dp_shard=1, tp=2)"),
        ((1, 2, 2), "fsdp+tp (dp_replicate=1, dp_shard=2, tp=2)"),
        ((2, 2, 2), "hsdp+tp (dp_replicate=2, dp_shard=2, tp=2)"),
    ],
)
def test_layout_string_is_what_checkpoints_record_and_parses_back(sizes, text):
    layout = Layout(*sizes)
    assert str(layout) == text  # meta.json, snapshots and summaries hold this string: it must not change
    assert Layout.parse(text) == layout
    assert layout.pp == layout.ep == 1 and layout.world_size == sizes[0] * sizes[1] * sizes[2]


@pytest.mark.parametrize("text", ["imported", "", "fsdp (dp_replicate=1, dp_shard=1, tp=1)", "single (tp=1)"])
def test_layout_parse_refuses_what_is_not_a_layout(text):
    with pytest.raises(ValueError, match="is not a parallel layout"):
        Layout.parse(text)


def test_pipeline_parallel_below_one_and_ep_outside_dp_shard_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^parallel.pp = 0 must be at least 1$"):
        Layout(1, 1, 1, pp=0)
    with pytest.raises(ValueError, match=r"^parallel.ep = 4 must divide parallel.dp_shard = 2: expert parallelism"):
        Layout(1, 2, 1, ep=4)
    assert Layout(1, 4, 1, ep=4).world_size == 4  # ep borrows its ranks: no processes of its own


def test_resolve_layout():
    assert resolve_layout(ParallelSection(), 4) == Layout(1, 4, 1)
    assert resolve_layout(ParallelSection(dp_replicate=2, tp=2), 8) == Layout(2, 2, 2)
    with pytest.raises(ValueError, match="must divide the number of processes"):
        resolve_layout(ParallelSection(tp=3), 4)
    with pytest.raises(ValueError, match="= 2 processes, not 4 "):
        resolve_layout(ParallelSection(dp_shard=2), 4)
    assert uses_fsdp(Layout(1, 2, 1)) and uses_fsdp(Layout(2, 1, 2)) and not uses_fsdp(Layout(2, 1, 1))


def test_peak_flops_take_the_longest_matching_name():
    assert gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("a toaster") is None


def test_lr_multiplier_is_the_trainers_schedule():
    torch = pytest.importorskip("torch")
    from liandan.train.optimizers import schedule
    from liandan.train.optimizers.container import OptimizersContainer

    cfg = ScheduleSection(kind="cosine", warmup_steps=3, min_lr_ratio=0.1)
    weight = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=1.0)
    optimizers = OptimizersContainer([torch.nn.Module()], [[optimizer]], schedule(20, cfg))
    seen = []
    for _ in range(20):
        seen.append(optimizers.lr)
        optimizers.step()
    assert seen == pytest.approx([lr_multiplier(s, 20, cfg) for s in range(20)])


def test_the_end_of_document_rule_is_shared_by_the_pipeline_and_the_export():
    from liandan.common.tokens import EOS, eos_id

    vocab = {"</s>": 7, "<eos>": 9}
    assert eos_id(vocab.get) == 7
    assert eos_id({EOS: 0, "</s>": 7}.get) == 0
    with pytest.raises(ValueError, match="tokenizer has no end-of-document token"):
        eos_id({}.get)


def test_context_parallel_has_its_dim_and_fsdp_shards_over_it():
    layout = Layout(1, 2, 1, cp=2)
    assert str(layout) == "fsdp+cp (dp_replicate=1, dp_shard=2, tp=1, cp=2)"
    assert Layout.parse(str(layout)) == layout and layout.world_size == 4 and layout.dp_size == 2
    assert str(Layout(1, 1, 2, cp=2)) == "cp+tp (dp_replicate=1, dp_shard=1, tp=2, cp=2)"
    assert uses_fsdp(Layout(1, 1, 1, cp=2))  # the cp ranks average their gradients through FSDP2
    assert resolve_layout(ParallelSection(cp=2), 8) == Layout(1, 4, 1, cp=2)
    assert resolve_layout(ParallelSection(cp=2, tp=2), 8) == Layout(1, 2, 2, cp=2)
    with pytest.raises(ValueError, match=r"^parallel.dp_replicate x parallel.cp x parallel.tp = 6 must divide"):
        resolve_layout(ParallelSection(cp=2, tp=3), 8)
    with pytest.raises(ValueError, match=r"^parallel.cp and parallel.ep cannot both exceed 1 yet"):
        resolve_layout(ParallelSection(cp=2, ep=2), 8)


def test_cpu_offload_needs_a_layout_that_shards():
    assert resolve_layout(ParallelSection(cpu_offload=True), 2) == Layout(1, 2, 1)
    for section, nproc, layout in [
        (ParallelSection(cpu_offload=True), 1, "single (dp_replicate=1, dp_shard=1, tp=1)"),
        (ParallelSection(cpu_offload=True, dp_replicate=2), 2, "ddp (dp_replicate=2, dp_shard=1, tp=1)"),
    ]:
        with pytest.raises(ValueError) as refused:
            resolve_layout(section, nproc)
        assert str(refused.value) == (
            f"parallel.cpu_offload offloads FSDP2's parameter shards, but the layout {layout} does not shard:"
            " set parallel.dp_shard to more than 1 (or -1 with more processes than dp_replicate x tp)"
        )
