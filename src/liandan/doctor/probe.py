"""What the doctor measures on each rank and between ranks: the raw numbers, before any verdict.

Every rank runs the same sequence of collectives in the same order (all ranks, then n-1 rounds of disjoint
pairs), so none waits for a peer that went elsewhere; a rank's own measurements come first and need no peer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from liandan.config import DoctorSection
from liandan.doctor import environment
from liandan.faults import corrupt_contribution
from liandan.run.worker_env import node_name
from liandan.train.distributed import DistInfo
from liandan.train.hardware import datasheet_peak_flops
from liandan.train.health import checks, golden

MIB = 1 << 20
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Settings:
    """The `[doctor]` section with the device's defaults filled in."""

    golden_size: int
    matmul_size: int
    copy_bytes: int
    measure_s: float
    collective_numel: int
    bandwidth_bytes: int
    pairs: bool
    write_bytes: int

    @classmethod
    def of(cls, d: DoctorSection, device: torch.device) -> Settings:
        gpu = device.type == "cuda"
        return cls(
            golden_size=d.golden_size,
            matmul_size=d.matmul_size or (4096 if gpu else 512),
            copy_bytes=int((d.copy_mib or (512 if gpu else 32)) * MIB),
            measure_s=d.measure_s,
            collective_numel=max(1, int(d.collective_kib * 1024) // 4),
            bandwidth_bytes=int((d.bandwidth_mib or (256 if gpu else 4)) * MIB),
            pairs=d.pairs,
            write_bytes=int(d.write_mib * MIB),
        )


def dtypes(device: torch.device) -> list[torch.dtype]:
    """float32 always; bf16 where the device has it natively (emulated bf16 measures nothing useful)."""
    return [torch.float32, *([torch.bfloat16] if environment.bf16_supported(device) else [])]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def measure_rank(s: Settings, info: DistInfo, step: int, checkpoint_dir: Path, memory_dir: str) -> dict:
    """This rank's devices on their own: golden products, matmul throughput, memory bandwidth, disk, facts."""
    device = info.device
    golden_dtypes = [torch.float32, torch.bfloat16]
    record: dict = {"rank": info.rank, "local_rank": info.local_rank, "host": node_name(), "device": str(device)}
    record["golden"] = {_name(t): golden.golden_matmul(device, t, s.golden_size, seed=1234, step=step).as_dict()
                        for t in golden_dtypes}  # fmt: skip
    record["matmul"] = {}
    for dtype in dtypes(device):
        flops = checks.matmul_throughput(device, dtype, s.matmul_size, s.measure_s)
        record["matmul"][_name(dtype)] = {"flops": flops, "peak_flops": datasheet_peak_flops(device, dtype)}
    record["memory_bandwidth"] = checks.memory_bandwidth(device, s.copy_bytes, s.measure_s)
    record["disk"] = environment.write_throughput(checkpoint_dir, s.write_bytes, info.rank)
    record["facts"] = environment.facts(device, checkpoint_dir, memory_dir)
    return record


def pair_rounds(world: int) -> list[list[tuple[int, int]]]:
    """Every pair of ranks once, in n-1 rounds (n even; n rounds for n odd) of disjoint pairs (the circle
    method), so the pairs of a round run at the same time and each rank is in at most one of them."""
    ranks: list[int | None] = list(range(world)) + ([None] if world % 2 else [])
    n, rounds = len(ranks), []
    for _ in range(n - 1):
        pairs = [(ranks[i], ranks[n - 1 - i]) for i in range(n // 2)]
        rounds.append([tuple(sorted((a, b))) for a, b in pairs if a is not None and b is not None])
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]
    return rounds  # type: ignore[return-value]


def measure_links(s: Settings, info: DistInfo, step: int) -> dict:
    """Collectives among all ranks (correctness and bus bandwidth), then in every pair of ranks. A
    `corrupt@allreduce` fault drill spoils the first send buffer this rank sends (the all-gather's)."""
    if not info.distributed:
        return {"collectives": [], "bandwidth": {}, "pairs": []}
    device, world = info.device, info.world_size
    everyone = list(range(world))

    def tamper(tensor: torch.Tensor) -> None:
        corrupt_contribution(step, tensor)

    found = [c.as_dict() for c in checks.check_collectives(everyone, None, device, s.collective_numel, tamper)]
    bandwidth = {name: checks.collective_bandwidth(name, None, world, device, s.bandwidth_bytes)
                 for name in COLLECTIVES}  # fmt: skip
    pairs = []
    if s.pairs and world > 2:
        rounds = pair_rounds(world)
        groups = {pair: dist.new_group(list(pair)) for pairs_ in rounds for pair in pairs_}  # same order everywhere
        for round_pairs in rounds:
            for pair in round_pairs:
                if info.rank not in pair:
                    continue
                group = groups[pair]
                seen = checks.check_collectives(list(pair), group, device, s.collective_numel, tamper)
                busbw = checks.collective_bandwidth("all_reduce", group, 2, device, s.bandwidth_bytes)
                pairs.append({"ranks": list(pair), "ok": all(c.ok for c in seen), "bandwidth": busbw,
                              "wrong_senders": sorted({w for c in seen for w in c.wrong_senders})})  # fmt: skip
        for group in groups.values():
            dist.destroy_process_group(group)
    return {"collectives": found, "bandwidth": bandwidth, "pairs": pairs}


def gather(record: dict, info: DistInfo) -> list[dict]:
    """Every rank's record, on every rank, in rank order."""
    if not info.distributed:
        return [record]
    records: list = [None] * info.world_size
    dist.all_gather_object(records, record)
    return sorted(records, key=lambda r: r["rank"])


def probe(s: Settings, info: DistInfo, step: int, checkpoint_dir: Path, memory_dir: str) -> tuple[list[dict], float]:
    """(every rank's record, seconds taken): what `liandan doctor` judges."""
    started = time.perf_counter()
    record = measure_rank(s, info, step, checkpoint_dir, memory_dir)
    record.update(measure_links(s, info, step))
    record["seconds"] = time.perf_counter() - started
    records = gather(record, info)
    if info.device.type == "cuda":  # the copies and products held a few GiB the run is about to want
        torch.cuda.empty_cache()
    return records, time.perf_counter() - started
