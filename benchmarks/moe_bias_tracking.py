"""How well the auxiliary-loss-free expert bias balances a router whose gate stands still or moves.

One `Router` (width 128, 8 experts, top-2) sees 2,048 correlated tokens a step (a shared direction plus
noise, as hidden states are early in training); after each step its bias is updated from the step's loads
exactly as in training (`Router.update_bias`). The gate is either frozen, or moved each step by a random
sign step of `--drift` on every weight: the size of an Adam update at that learning rate, which is what the
gate's own training does to the scores between two bias updates. Printed: max/mean expert load after the
first fifth of the steps (mean and largest), per score function, bias rate and drift. Seconds on one core.

    python benchmarks/moe_bias_tracking.py
"""

from __future__ import annotations

import argparse
import statistics

import torch

from liandan.model.moe import MoEConfig, Router

DIM, EXPERTS, TOP_K, TOKENS = 128, 8, 2, 2048


def balance(score: str, rate: float, drift: float, steps: int, seed: int = 0) -> tuple[float, float]:
    torch.manual_seed(seed)
    router = Router(DIM, MoEConfig(experts=EXPERTS, top_k=TOP_K, ffn_dim=1, score=score)).train()
    torch.nn.init.normal_(router.gate.weight, 0.0, 0.02)
    shared = torch.randn(DIM)
    ratios = []
    for _ in range(steps):
        tokens = shared + 0.5 * torch.randn(TOKENS, DIM)
        with torch.enable_grad():  # the router counts training forwards only
            router(tokens)
        load = router.load.clone()
        router.load.zero_()
        router.update_bias(load, rate)
        if drift:
            with torch.no_grad():
                router.gate.weight += drift * torch.sign(torch.randn_like(router.gate.weight))
        ratios.append(float(load.max() / load.mean()))
    after = ratios[steps // 5 :]
    return statistics.fmean(after), max(after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rates", type=float, nargs="+", default=[1e-3, 1e-2])
    parser.add_argument("--drifts", type=float, nargs="+", default=[0.0, 3e-4, 3e-3])
    a = parser.parse_args()
    torch.set_num_threads(1)
    print("| score | bias rate | gate drift per step | max/mean load, mean | largest |")
    print("|---|---:|---:|---:|---:|")
    for score in ("softmax", "sigmoid"):
        for rate in a.rates:
            for drift in a.drifts:
                mean, largest = balance(score, rate, drift, a.steps)
                print(f"| {score} | {rate:g} | {drift:g} | {mean:.2f} | {largest:.2f} |", flush=True)


if __name__ == "__main__":
    main()
