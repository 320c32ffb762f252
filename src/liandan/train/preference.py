"""Direct preference optimisation (Rafailov et al., 2023) as a train module: the policy of
`CausalLMTrainModule` and a frozen reference, the policy's initial weights (`checkpoint.init_from`, else the
run's seeded initialisation), whose log-probabilities are computed on the fly.

A micro-batch is the pair loader's (`data/tokens/pairs.py`): rows 2i and 2i + 1 are pair i's chosen and
rejected conversations, targets -1 outside the reply. A row's log-probability is the sum over its reply's
tokens; with the log-ratios to the reference r_c = pi_c - ref_c and r_r = pi_r - ref_r, a pair's loss is
conservative DPO's (label smoothing e: the share of pairs assumed mislabelled),

    -(1 - e) * logsigmoid(beta * (r_c - r_r)) - e * logsigmoid(-beta * (r_c - r_r)),

DPO's own at e = 0 (TRL's "sigmoid" loss), and a step's loss the mean over its pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from liandan.common.layout import uses_fsdp
from liandan.config import Config, ConfigError
from liandan.data.tokens.loader import Batch
from liandan.faults import faulty_matmuls, slow_forward
from liandan.train.causal_lm import CausalLMTrainModule
from liandan.train.parallelize import apply_fsdp, fsdp_mesh, gradient_sync, reshard
from liandan.train.train_module import PhaseHook

# The step's metrics, means over its pairs (`kl/token`: over each reply's tokens, then over the replies, so
# that every rank's and micro-batch's mean weighs the same), named as TRL names them.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "kl/token")  # fmt: skip


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(rows,) sum of the log-probabilities (fp32) of each row's targets; targets of -1 are left out."""
    kept = targets >= 0
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    picked = log_probs.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return (picked * kept).sum(-1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards), rewards being beta * log-ratio (detached)."""
    chosen_ratio = policy_chosen - reference_chosen
    rejected_ratio = policy_rejected - reference_rejected
    logits = beta * (chosen_ratio - rejected_ratio)
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def dpo_refusal(cfg: Config, layout) -> str | None:
    """Why this run cannot train DPO, in one line, or None."""
    if cfg.train.dpo_beta <= 0:
        return f"train.dpo_beta must be positive, got {cfg.train.dpo_beta}"
    if layout.tp > 1 or layout.cp > 1 or layout.ep > 1 or layout.pp > 1:
        return (f'train.objective = "dpo" runs data-parallel only for now (FSDP, DDP, HSDP), not under {layout}:'
                " set parallel.tp, cp, ep and pp to 1")  # fmt: skip
    if cfg.train.fp8 != "none":
        return 'train.objective = "dpo" does not run with train.fp8 yet'
    return None


def frozen_reference(module: CausalLMTrainModule, layout, mesh) -> torch.nn.Module:
    """A frozen copy of the policy's weights, sharded like them under FSDP (and whole on every rank under DDP,
    which has no gradients to reduce for it)."""
    with torch.random.fork_rng(devices=[]):  # its initial values are overwritten: the run's draws stay as they were
        reference = module.spec.build(module.args).to(module.device).requires_grad_(False)
    configure = getattr(reference, "configure_attention", None)
    if configure is not None:
        configure(module.device)
    if uses_fsdp(layout):
        fsdp_dtype = module.dtype if module.dtype != torch.float32 else None
        apply_fsdp(reference, fsdp_mesh(mesh, layout), fsdp_dtype, module.spec,
                   cpu_offload=module.cfg.parallel.cpu_offload)  # fmt: skip
    policy = module.model.module if isinstance(module.model, DistributedDataParallel) else module.model
    with torch.no_grad():
        for (name, ours), theirs in zip(reference.named_parameters(), policy.parameters(), strict=True):
            if ours.shape != theirs.shape:
                raise RuntimeError(f"the reference's {name} is shaped {tuple(ours.shape)}, not as the policy's")
            ours.copy_(theirs)
    return reference.eval()


class DPOTrainModule(CausalLMTrainModule):
    def __init__(self, cfg: Config, tokenizer_vocab: int, mesh, layout, device, dtype):
        refusal = dpo_refusal(cfg, layout)
        if refusal:
            raise ConfigError(refusal)
        super().__init__(cfg, tokenizer_vocab, mesh, layout, device, dtype)
        self.beta, self.label_smoothing = cfg.train.dpo_beta, cfg.train.dpo_label_smoothing
        # The run's initial weights; the trainer loads `init_from` into it as well, on every start (a resume
        # included), so the reference never follows the policy.
        self.reference = frozen_reference(self, layout, mesh)
        self.preference_metrics: dict[str, float] = {}

    def train(self, mode: bool = True) -> None:
        super().train(mode)
        self.reference.eval()  # no dropout, whatever the policy does

    def train_batch(self, batches: list[Batch], phase: PhaseHook, step: int = 0) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        sums = torch.zeros(len(METRICS), device=self.device)
        for i, batch in enumerate(batches):
            batch = batch.to(self.device)
            with gradient_sync(self.model, sync=i == len(batches) - 1), faulty_matmuls(step):
                phase("forward", micro=i)
                slow_forward(step)
                loss, stats = self._pair_loss(batch, len(batches))
                phase("backward", micro=i)
                loss.backward()
            total += loss.detach()
            sums += stats
        self.preference_metrics = dict(zip(METRICS, (sums / len(batches)).tolist()))
        return total

    def _pair_loss(self, batch: Batch, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's share of the step's loss (its mean over pairs / count), and its metrics."""
        doc_ids = self._doc_ids(batch)
        with self.autocasting():
            logits = self.model(batch.inputs, doc_ids=doc_ids)
            with torch.no_grad():
                reference_logits = self.reference(batch.inputs, doc_ids=doc_ids)
        reshard(self.reference)  # FSDP2 keeps the last block gathered for a backward that never comes
        policy = sequence_logps(logits, batch.targets).view(-1, 2)
        reference = sequence_logps(reference_logits, batch.targets).view(-1, 2)
        losses, chosen, rejected = dpo_loss(policy[:, 0], policy[:, 1], reference[:, 0], reference[:, 1],
                                            self.beta, self.label_smoothing)  # fmt: skip
        with torch.no_grad():
            kept = batch.targets >= 0
            policy_log = torch.log_softmax(logits.detach().float(), -1)
            kl = (policy_log.exp() * (policy_log - torch.log_softmax(reference_logits.float(), -1))).sum(-1)
            stats = torch.stack([
                chosen.mean(), rejected.mean(), (chosen > rejected).float().mean(), (chosen - rejected).mean(),
                policy[:, 0].detach().mean(), policy[:, 1].detach().mean(), ((kl * kept).sum(-1) / kept.sum(-1).clamp(min=1)).mean(),
            ])  # fmt: skip
        return losses.mean() / count, stats

    @torch.no_grad()
    def replay_loss(self, batches: list[Batch], step: int) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        with faulty_matmuls(step):
            for batch in batches:
                total += self._pair_loss(batch.to(self.device), len(batches))[0]
        return total

    @torch.no_grad()
    def eval_batch(self, batches: list[Batch]) -> torch.Tensor:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for batch in batches:
            total += self._pair_loss(batch.to(self.device), 1)[0]
        self.model.train()
        return total / max(1, len(batches))
