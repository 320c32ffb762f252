"""Dense causal-LM pretraining as a train module (`train_module.TrainModule`): one model built from its
family's spec, parallelism applied from outside, forward and backward over packed micro-batches of next-token
prediction, and the optimizers `[optim]` names. The trainer's loop calls it; nothing here knows about runs,
files or callbacks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from liandan.common.layout import Layout, uses_fsdp
from liandan.config import Config, ConfigError
from liandan.data.tokens.loader import Batch
from liandan.faults import faulty_matmuls, planned_at, slow_forward
from liandan.model.moe import routing_step
from liandan.model.spec import ModelSpec, padded_vocab
from liandan.model.spec import get as get_model_spec
from liandan.train.context_parallel import SequenceShard, cp_refusal, mean_over_cp, sequence_split
from liandan.train.expert_parallel import ep_refusal
from liandan.train.fp8 import Fp8, dims_refusal, fp8_param_count, fp8_refusal
from liandan.train.hardware import PeakMemory
from liandan.train.health.allreduce import AllReduceAudit
from liandan.train.meta_init import build_on_meta, materialize, plan_init
from liandan.train.optimizers import build_optimizers, schedule
from liandan.train.parallelize import gradient_sync, parallelize, reshard
from liandan.train.train_module import PhaseHook, TrainModule


def model_args(cfg: Config, tokenizer_vocab: int) -> Any:
    """The model's args in its family's type, derived from [model] by the family's spec."""
    m = cfg.model
    vocab = padded_vocab(m.vocab_size, tokenizer_vocab)  # multiples of 64 keep matmuls aligned
    if vocab < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size = {vocab} is smaller than the tokenizer's {tokenizer_vocab} tokens")
    return get_model_spec(m.family).args_from_config(m, vocab)


class CausalLMTrainModule(TrainModule):
    def __init__(
        self,
        cfg: Config,
        tokenizer_vocab: int,
        mesh,
        layout: Layout,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.cfg, self.device, self.dtype, self.mesh = cfg, device, dtype, mesh
        self.spec: ModelSpec = get_model_spec(cfg.model.family)
        self.args = model_args(cfg, tokenizer_vocab)
        t = cfg.train
        refusal = (
            self.spec.tp_refusal(self.args, layout.tp)
            or ep_refusal(self.args, layout.ep)
            or cp_refusal(layout.cp, t.seq_len, t.mask, getattr(self.args, "attention", "sdpa"), device.type)
        )
        if refusal:
            raise ConfigError(refusal)
        if layout.tp > 1 and cfg.parallel.loss_parallel and self.args.vocab_size % layout.tp:
            raise ConfigError(
                f"the vocabulary of {self.args.vocab_size} does not split evenly over parallel.tp = {layout.tp};"
                " set model.vocab_size to a multiple of it or parallel.loss_parallel = false"
            )
        # What building, sharding and initialising the model takes above what the process holds now: exact
        # under meta init, which is what the measurement is for; an upper bound otherwise, which leaves alone
        # the process's lifetime peak that runs built whole may be measured by.
        self.init_peak = PeakMemory(device, reset=cfg.train.meta_init).start()
        # The same seed on every rank gives every rank the same initial weights before sharding.
        torch.manual_seed(cfg.run.seed)
        materialize = None
        par = cfg.parallel
        if cfg.train.meta_init:
            # Built without storage; each rank fills its own shards once parallelize has placed them.
            model, record = build_on_meta(lambda: self.spec.build(self.args))
            materialize = partial(_materialize, plan=_config_step(plan_init, model, record), device=device,
                                  seed=cfg.run.seed, offload=par.cpu_offload)  # fmt: skip
        else:
            model = self.spec.build(self.args)
        configure = getattr(model, "configure_attention", None)
        self.attention = _config_step(configure, device) if configure else "built in"
        if layout.cp > 1 and self.attention != "sdpa":  # `auto`'s FlexAttention: the ring runs SDPA
            model.attention_backend = self.attention = "sdpa"
        self.cp_mesh = mesh["cp"] if layout.cp > 1 else None
        if cfg.train.ce_chunks > 1 or cfg.train.ce_fused:
            if not hasattr(model, "configure_loss"):
                raise ConfigError(f"model.family = {cfg.model.family!r} has no chunked or fused loss;"
                                  " use train.ce_chunks = 1 and train.ce_fused = false")  # fmt: skip
            model.configure_loss(cfg.train.ce_chunks, fused=cfg.train.ce_fused)
        if materialize is None:
            model.to(device)
        fsdp = uses_fsdp(layout)
        fp8 = self._fp8_plan(t, device)
        if fp8 and (refusal := dims_refusal(model, fp8.skip)):
            raise ConfigError(refusal)
        # Counted on the whole model before sharding: 6 FLOPs per converted weight per token run in fp8.
        self.fp8_params = fp8_param_count(model, fp8.skip) if fp8 else 0
        # DDP's all-reduce goes through the audited hook where the sdc check reads it or a `corrupt@allreduce`
        # fault strikes there; elsewhere DDP keeps its own, with no Python on the path of every bucket.
        audited = cfg.health.sdc or planned_at("allreduce")
        self.allreduce_audit = AllReduceAudit() if audited and not fsdp and layout.dp_replicate > 1 else None
        model = parallelize(
            model,
            mesh,
            layout,
            activation_checkpoint=t.activation_checkpoint,
            compile=t.compile,
            fsdp_param_dtype=dtype if fsdp and dtype != torch.float32 else None,
            spec=self.spec,
            allreduce_audit=self.allreduce_audit,
            loss_parallel=par.loss_parallel,
            sequence_parallel=par.sequence_parallel,
            materialize=materialize,
            fp8=fp8,
            cpu_offload=par.cpu_offload,
        )
        self.init_peak.stop()
        # FSDP2 casts parameters itself; elsewhere autocast runs matmuls in bf16 over fp32 master weights.
        self.autocast = dtype != torch.float32 and not fsdp
        self.model_parts = [model]
        # Offloaded parameters, their gradients and so the optimizer's state live in host memory: the update
        # runs there, with the kernels the CPU has for sharded tensors.
        param_device = torch.device("cpu") if par.cpu_offload else device
        self.optimizers = build_optimizers(self.model_parts, cfg.optim, schedule(t.steps, cfg.schedule), param_device,
                                           mixed_tensor_kinds=layout.tp > 1 or layout.ep > 1)  # fmt: skip
        self.params = self.spec.count_params(self.args)
        self.flops_per_token = self.spec.flops_per_token(self.args, t.seq_len)
        self.fp8_share = min(1.0, 6.0 * self.fp8_params / self.flops_per_token)  # of the FLOPs, run in fp8

    def optim_step(self, factor: float = 1.0) -> None:
        super().optim_step(factor)
        self._route(getattr(self.args, "moe_bias_rate", 0.0))

    def skip_step(self) -> None:
        super().skip_step()
        self._route(0.0)  # the step's routing is read and cleared; the balancing biases stay

    def _route(self, bias_rate: float) -> None:
        """After the update: the routers' loads of the step summed over the ranks, their balancing biases
        moved (the same on every rank), the step's routing kept in `routing` for metrics and the guard."""
        if getattr(self.args, "moe_experts", 0):
            self.routing = routing_step(self.model, bias_rate, across_ranks=self.mesh is not None)

    @staticmethod
    def _fp8_plan(t, device: torch.device) -> Fp8 | None:
        if t.fp8 == "none":
            return None
        refusal = fp8_refusal(t.fp8, device, emulate=t.fp8_emulate)
        if refusal:
            raise ConfigError(refusal)
        return Fp8(t.fp8, list(t.fp8_skip), t.fp8_emulate)

    def train_batch(self, batches: list[Batch], phase: PhaseHook, step: int = 0) -> torch.Tensor:
        """Forward and backward over the micro-batches of step `step` (counted from 1); returns the step's mean
        loss (detached). Gradients are synchronised on the last micro-batch only."""
        total = torch.zeros((), device=self.device)
        if self.allreduce_audit is not None:
            self.allreduce_audit.step = step
        for i, batch in enumerate(batches):
            batch = batch.to(self.device)
            with gradient_sync(self.model, sync=i == len(batches) - 1), faulty_matmuls(step):
                phase("forward", micro=i)
                slow_forward(step)
                with self._split(batch) as part:  # ring attention's forward and backward both inside
                    loss = self._micro_loss(part, len(batches), batch.loss_weight)
                    phase("backward", micro=i)
                    loss.backward()
            total += loss.detach()
        return mean_over_cp(self.cp_mesh, total)

    def _split(self, batch: Batch):
        """This rank's share of the micro-batch under context parallelism (all of it otherwise)."""
        return sequence_split(self.cp_mesh, batch.inputs, batch.targets, self._doc_ids(batch))

    def _micro_loss(self, part: SequenceShard, count: int, weight: float | None = None) -> torch.Tensor:
        """One micro-batch's share of the step's mean loss: the one arithmetic of a step and of its replay. The
        micro-batches of a step weigh the same (1 / count), or by `weight` (`Batch.loss_weight`: by targets)."""
        kwargs = {} if part.positions is None else {"positions": part.positions}
        with self.autocasting():
            loss = self.model(part.inputs, part.targets, doc_ids=part.doc_ids, **kwargs)
        loss = loss if part.weight is None else loss * part.weight
        return loss / count if weight is None else loss * weight

    @torch.no_grad()
    def replay_loss(self, batches: list[Batch], step: int) -> torch.Tensor:
        """The mean loss `train_batch` would give on `batches` at step `step`, by forward passes alone and
        in the same arithmetic (a replay, for comparison with what another rank computed); gradients and
        weights are left as they are."""
        total = torch.zeros((), device=self.device)
        with faulty_matmuls(step):
            for batch in batches:
                with self._split(batch.to(self.device)) as part:
                    total += self._micro_loss(part, len(batches), batch.loss_weight).detach()
        total = mean_over_cp(self.cp_mesh, total)
        # FSDP2 keeps the last block gathered after a forward for the backward that would follow: without
        # one, the update would go to the shards while that stale gathered copy serves the next forward.
        reshard(self.model)
        return total

    @torch.no_grad()
    def eval_batch(self, batches: list[Batch]) -> torch.Tensor:
        """Mean loss over `batches` in eval mode (this rank's; the caller averages over ranks)."""
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for batch in batches:
            with self._split(batch.to(self.device)) as part:
                total += self._micro_loss(part, 1).float()
        self.model.train()
        return mean_over_cp(self.cp_mesh, total) / max(1, len(batches))

    def autocasting(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def _doc_ids(self, batch: Batch) -> torch.Tensor | None:
        return batch.doc_ids if self.cfg.train.mask == "document" else None


def _materialize(model: torch.nn.Module, plan, device: torch.device, seed: int, offload: bool = False) -> None:
    """Fill the model's shards on `device`; offloaded, the parameter shards on the host (where FSDP2's
    offload keeps them) and the buffers (rotary tables) on `device`, where the forward reads them."""
    _config_step(materialize, model, plan, torch.device("cpu") if offload else device, seed)
    if offload and device.type != "cpu":
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module.register_buffer(
                    name, buffer.to(device), persistent=name not in module._non_persistent_buffers_set
                )


def _config_step(fn: Callable, *args: Any) -> Any:
    """Setup steps raise ValueError for impossible settings; report them as configuration errors."""
    try:
        return fn(*args)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from None
