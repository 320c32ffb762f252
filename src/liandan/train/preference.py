"""Preference optimisation as a train module: the policy of `CausalLMTrainModule` trained on preference pairs
by one of three losses (`train.preference_loss`).

A micro-batch is the pair loader's (`data/tokens/pairs.py`): rows 2i and 2i + 1 are pair i's chosen and
rejected conversations, targets -1 outside the reply. Label smoothing e is the share of pairs assumed
mislabelled (conservative DPO); a step's loss is the mean over its pairs.

- dpo (Rafailov et al., 2023; TRL's DPOTrainer, "sigmoid" loss): against a frozen reference, the policy's
  initial weights (`checkpoint.init_from`, else the run's seeded initialisation), whose log-probabilities are
  computed on the fly. A row's log-probability is the sum over its reply's tokens; with the log-ratios to the
  reference r_c = pi_c - ref_c and r_r = pi_r - ref_r, a pair's loss is
      -(1 - e) * logsigmoid(beta * (r_c - r_r)) - e * logsigmoid(-beta * (r_c - r_r)).
- simpo (Meng et al., 2024; TRL's CPOTrainer, loss_type "simpo", cpo_alpha 0): no reference; a row's
  log-probability is the mean over its reply's tokens, and with z = beta * (pi_c - pi_r) - gamma,
      -(1 - e) * logsigmoid(z) - e * logsigmoid(-z).
- orpo (Hong et al., 2024; TRL's ORPOTrainer): no reference; with the mean log-probabilities p_c, p_r and the
  log odds ratio l = (p_c - p_r) - (log(1 - exp(p_c)) - log(1 - exp(p_r))), a step's loss is the negative
  log-likelihood of its chosen replies (a mean over all their tokens, as SFT's loss) plus beta (ORPO's lambda)
  times the mean over its pairs of -logsigmoid(l).
"""

from __future__ import annotations

import math

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

# The step's metrics, means over its pairs, named as TRL's trainer of each loss names them: rewards are beta *
# the log-ratio to the reference under DPO, beta * the mean log-probability under SimPO and ORPO, and logps the
# summed log-probabilities under DPO, the means under SimPO and ORPO. `kl/token` (DPO only: over each reply's
# tokens, then over the replies, so that every rank's and micro-batch's mean weighs the same). ORPO's own:
# `nll_loss` (of the step's chosen replies), `log_odds_ratio` (mean logsigmoid(l)), `log_odds_chosen` (mean l).
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")  # fmt: skip
METRICS = {"dpo": (*REWARDS, "kl/token"), "simpo": REWARDS,
           "orpo": (*REWARDS, "nll_loss", "log_odds_ratio", "log_odds_chosen")}  # fmt: skip
# The mean log-probability given to a reply the row's cut leaves without any token (its prompt fills the row):
# the pair's loss is then a constant, as under DPO, where such a reply's sum is 0.
EMPTY_REPLY_LOGP = -1.0


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor, average: bool = False) -> torch.Tensor:
    """(rows,) sum of the log-probabilities (fp32) of each row's targets, or with `average` their mean
    (EMPTY_REPLY_LOGP for a row without any); targets of -1 are left out."""
    sums, counts = reply_logps(logits, targets)
    return mean_logps(sums, counts) if average else sums


def reply_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows,) sums of the log-probabilities (fp32) of each row's targets, and (rows,) how many it has."""
    kept = targets >= 0
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    picked = log_probs.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return (picked * kept).sum(-1), kept.sum(-1)


def mean_logps(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return torch.where(counts > 0, sums / counts.clamp(min=1), EMPTY_REPLY_LOGP)


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


def simpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards) from mean log-probabilities, rewards being beta *
    the mean log-probability (detached)."""
    logits = beta * (policy_chosen - policy_rejected) - gamma
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses, beta * policy_chosen.detach(), beta * policy_rejected.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation: log1p(-exp(x)) far from 0, log(-expm1(x)) near it
    (Maechler, 2012; the branch point -log 2)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair odds-ratio losses -beta * logsigmoid(l), chosen rewards, rejected rewards, log odds ratios l)
    from mean log-probabilities; the chosen replies' negative log-likelihood is added by the caller."""
    log_odds = (policy_chosen - policy_rejected) - (log1mexp(policy_chosen) - log1mexp(policy_rejected))
    losses = -beta * F.logsigmoid(log_odds)
    return losses, beta * policy_chosen.detach(), beta * policy_rejected.detach(), log_odds.detach()


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
    """`train.objective = "dpo"`, by the loss `train.preference_loss` names: a frozen reference for dpo, none
    (no weights, no forward pass) for the reference-free simpo and orpo."""

    def __init__(self, cfg: Config, tokenizer_vocab: int, mesh, layout, device, dtype):
        refusal = dpo_refusal(cfg, layout)
        if refusal:
            raise ConfigError(refusal)
        super().__init__(cfg, tokenizer_vocab, mesh, layout, device, dtype)
        t = cfg.train
        self.loss_name, self.metric_names = t.preference_loss, METRICS[t.preference_loss]
        self.beta, self.label_smoothing, self.gamma = t.dpo_beta, t.dpo_label_smoothing, t.simpo_gamma
        # The run's initial weights; the trainer loads `init_from` into it as well, on every start (a resume
        # included), so the reference never follows the policy.
        self.reference = frozen_reference(self, layout, mesh) if self.loss_name == "dpo" else None
        self.preference_metrics: dict[str, float] = {}

    def train(self, mode: bool = True) -> None:
        super().train(mode)
        if self.reference is not None:
            self.reference.eval()  # no dropout, whatever the policy does

    def train_batch(self, batches: list[Batch], phase: PhaseHook, step: int = 0) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        sums = torch.zeros(len(self.metric_names), device=self.device)
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
        self.preference_metrics = dict(zip(self.metric_names, (sums / len(batches)).tolist()))
        return total

    def _pair_loss(self, batch: Batch, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's share of the step's loss (its mean over pairs / count), and its metrics."""
        doc_ids = self._doc_ids(batch)
        with self.autocasting():
            logits = self.model(batch.inputs, doc_ids=doc_ids)
        if self.loss_name == "dpo":
            return self._dpo_loss(batch, logits, doc_ids, count)
        sums, counts = reply_logps(logits, batch.targets)
        average = mean_logps(sums, counts).view(-1, 2)
        chosen_logps, rejected_logps = average[:, 0], average[:, 1]
        if self.loss_name == "simpo":
            losses, chosen, rejected = simpo_loss(chosen_logps, rejected_logps, self.beta, self.gamma,
                                                  self.label_smoothing)  # fmt: skip
            return losses.mean() / count, _reward_stats(chosen, rejected, chosen_logps, rejected_logps)
        losses, chosen, rejected, log_odds = orpo_loss(chosen_logps, rejected_logps, self.beta)
        # The chosen replies' NLL, a mean over all their targets in the step: this micro-batch's mean times its
        # share of them (`Batch.loss_weight`), or, for a batch of its own (validation), its mean / count.
        nll = -sums[0::2].sum() / counts[0::2].sum().clamp(min=1)
        weight = batch.loss_weight if batch.loss_weight is not None else 1 / count
        with torch.no_grad():
            stats = torch.cat([
                _reward_stats(chosen, rejected, chosen_logps, rejected_logps),
                torch.stack([nll.detach() * weight * count, F.logsigmoid(log_odds).mean(), log_odds.mean()]),
            ])  # fmt: skip
        return nll * weight + losses.mean() / count, stats

    def _dpo_loss(self, batch: Batch, logits: torch.Tensor, doc_ids, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self.autocasting(), torch.no_grad():
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
            kl_per_reply = ((kl * kept).sum(-1) / kept.sum(-1).clamp(min=1)).mean()
            stats = torch.cat([_reward_stats(chosen, rejected, policy[:, 0], policy[:, 1]), kl_per_reply[None]])
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


@torch.no_grad()
def _reward_stats(chosen: torch.Tensor, rejected: torch.Tensor, chosen_logps: torch.Tensor,
                  rejected_logps: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """REWARDS's values: means over the micro-batch's pairs."""
    return torch.stack([chosen.mean(), rejected.mean(), (chosen > rejected).float().mean(), (chosen - rejected).mean(),
                        chosen_logps.detach().mean(), rejected_logps.detach().mean()])  # fmt: skip
