"""The sections of a run's config, one dataclass each, and the whole `Config`: the keys every run shares. A
plug-in's own keys live in its table (`plugin_options`), declared in the plug-in's module."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from liandan.config.fields import PluginTables, _f, plugin_options, section_dict


@dataclass
class RunSection:
    name: str = _f(
        "", "run directory name under output_dir; empty: <config file>-<timestamp> (from Python: run-<timestamp>)"
    )
    output_dir: str = _f("runs", "parent directory of run directories")
    seed: int = _f(1234, "seed for model init, data order and dropout-free RNG use", min=0)
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "where to train; auto picks cuda when present")
    overwrite: bool = _f(False, "allow reusing a run directory that already holds a run")


@dataclass
class ModelSection(PluginTables):
    """The keys every model family shares; the family's own go in `[model.<family>]` (see
    `liandan.model.llama_options` for Llama's), or flat in `[model]` as before there were several."""

    KEY = "model"
    # Checked against the registry of model families (liandan.plugins, kind "model_family").
    family: str = _f("llama", "model family (liandan.plugins): llama (qk_norm gives Qwen3-style)")
    vocab_size: int = _f(0, "0 takes the tokenizer's size, rounded up to a multiple of 64", min=0)
    max_seq_len: int = _f(2048, "longest sequence the model is built for (its rotary table covers)", min=1)
    options: Any = plugin_options("model_family", "family")


@dataclass
class OptimSection(PluginTables):
    """The keys every optimizer shares; the optimizer's own go in `[optim.<name>]` (see
    `liandan.train.optimizers.adamw_options` for AdamW's, `muon_options` for Muon's), or flat in `[optim]` as before there were several."""

    KEY = "optim"
    name: str = _f("adamw", "optimizer (liandan.plugins): adamw, muon (hidden matrices; AdamW for the rest)")
    lr: float = _f(3e-4, "peak learning rate", min=0.0)
    grad_clip: float = _f(1.0, "global gradient-norm clip over every model part and optimizer; 0 disables",
                          min=0.0)  # fmt: skip
    options: Any = plugin_options("optimizer", "name")


@dataclass
class ScheduleSection:
    kind: Literal["cosine", "linear", "wsd", "constant"] = _f("cosine", "learning-rate schedule after warmup")
    warmup_steps: int = _f(100, "linear warmup steps", min=0)
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of the peak", min=0.0, max=1.0)
    decay_fraction: float = _f(0.2, "wsd: share of steps spent in the 1-sqrt cooldown", min=0.0, max=1.0)


@dataclass
class TrainSection:
    steps: int = _f(1000, "optimizer steps", min=1)
    global_batch: int = _f(32, "sequences per optimizer step, summed over data-parallel ranks", min=1)
    micro_batch: int = _f(0, "sequences per rank per forward pass; 0 means no gradient accumulation", min=0)
    seq_len: int = _f(256, "tokens per training sequence", min=2)
    mask: Literal["causal", "document"] = _f("document", "document: no attention across packed documents")
    dtype: Literal["auto", "fp32", "bf16"] = _f("auto", "compute dtype; auto is bf16 where supported")
    activation_checkpoint: Literal["none", "selective", "full"] = _f("none", "activation recomputation")
    compile: bool = _f(False, "torch.compile each transformer block")
    ce_chunks: int = _f(
        1, "compute the output head and cross-entropy over this many slices of the tokens, each recomputed in the"
        " backward pass, so the fp32 logits of a large vocabulary never exist whole; 1 disables (tp = 1 only)", min=1,
    )  # fmt: skip
    ce_fused: bool = _f(
        False, "compute the head's and cross-entropy's gradients in the forward pass, train.ce_chunks slices of"
        " the tokens at a time, so no logits are kept for the backward pass (nor made twice, as train.ce_chunks"
        " alone does); equal to the unfused loss to rounding, not bit for bit (tp = 1 only)",
    )  # fmt: skip
    meta_init: bool = _f(
        False, "build the model on the meta device and let each rank fill only its shards (the same values as"
        " a model built whole); off: every rank builds the whole model first"
    )  # fmt: skip
    fp8: Literal["none", "tensorwise", "rowwise"] = _f(
        "none", "run the linear layers' matmuls in fp8 through torchao (CUDA, compute capability >= 8.9):"
        " tensorwise (one scale per tensor, fastest) or rowwise (one per row, more robust to outliers)"
    )  # fmt: skip
    fp8_skip: list[str] = _f(
        ["output"], "linear layers left in the run's dtype under train.fp8, as patterns of their qualified names"
        " (fnmatch: 'layers.0.*'); the rest must have both dimensions divisible by 16"
    )  # fmt: skip
    fp8_emulate: bool = _f(
        False, "emulate train.fp8's casts in the run's dtype, on any device (for tests: no speed-up)"
    )  # fmt: skip
    objective: Literal["lm", "sft", "dpo"] = _f(
        "lm", "lm: next-token prediction on every token (pretraining); sft: supervised fine-tuning on chat data"
        " (data.paths of chat records, rendered by data.chat_template), the loss taken where train.sft_targets says;"
        " dpo: preference optimisation on data.paths of prompt/chosen/rejected records by train.preference_loss"
        " (DPO against a frozen reference, the initial weights; or the reference-free SimPO or ORPO);"
        " global_batch and micro_batch then count pairs"
    )  # fmt: skip
    dpo_beta: float = _f(
        0.1, "train.objective = dpo: beta; under train.preference_loss = dpo the strength of the pull towards the"
        " reference, under simpo the scale of the length-averaged rewards (SimPO's usual value is about 2), under"
        " orpo lambda, the weight of the odds-ratio term (0.1 in the ORPO paper)", min=0.0,
    )  # fmt: skip
    dpo_label_smoothing: float = _f(
        0.0, "train.objective = dpo: the share of pairs assumed mislabelled (conservative DPO, under"
        " train.preference_loss = dpo or simpo); 0 is the loss's own", min=0.0, max=0.49,
    )  # fmt: skip
    preference_loss: Literal["dpo", "simpo", "orpo"] = _f(
        "dpo", "train.objective = dpo: dpo (against a frozen reference, the sum of each reply's log-probabilities);"
        " simpo (SimPO, reference-free: each reply's log-probability averaged over its tokens, the chosen one to"
        " lead by the margin train.simpo_gamma); orpo (ORPO, reference-free: the chosen reply's negative"
        " log-likelihood plus dpo_beta times the log odds-ratio loss); simpo and orpo build no reference model"
    )  # fmt: skip
    simpo_gamma: float = _f(
        0.5, "train.preference_loss = simpo: gamma, the reward margin the chosen reply is to lead by", min=0.0
    )  # fmt: skip
    sft_targets: Literal["assistant", "all"] = _f(
        "assistant", "train.objective = sft: learn the assistant turns only (their content and end token, by the"
        " store's loss mask), or every token of the conversations"
    )  # fmt: skip
    log_every: int = _f(1, "steps between metric records", min=1)
    eval_every: int = _f(0, "steps between validation-loss checks; 0 disables", min=0)
    eval_batches: int = _f(4, "validation batches per check", min=1)
    callbacks: list[str] = _f(
        [], "modules of training callbacks (`register_callback`) to import, in every process that trains"
    )


@dataclass
class ParallelSection:
    dp_replicate: int = _f(1, "data-parallel replicas (DDP, or HSDP with dp_shard > 1)", min=1)
    dp_shard: int = _f(-1, "FSDP2 shard group size; -1 takes whatever the other dims leave", min=-1)
    tp: int = _f(1, "tensor-parallel degree", min=1)
    ep: int = _f(
        1,
        "expert-parallel degree: the routed experts are divided among groups of ep data-parallel ranks (borrowed"
        " from dp_shard, which it must divide) and tokens travel to their experts by all-to-all",
        min=1,
    )
    pp: int = _f(1, "pipeline-parallel degree: the model's layers split into stages, one group of ranks each", min=1)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev"] = _f(
        "1f1b",
        "pipeline schedule (torch.distributed.pipelining): gpipe and 1f1b run one stage per rank; interleaved-1f1b,"
        " looped-bfs and interleaved-zb run pp_stages_per_rank; zbv and dualpipev run two per rank in a V",
    )
    pp_microbatches: int = _f(
        0, "micro-batches each pipeline step splits its data-parallel batch into; 0: pp x pp_stages_per_rank", min=0
    )
    pp_stages_per_rank: int = _f(
        1, "virtual stages each pipeline rank holds (the interleaved schedules; zbv and dualpipev need 2)", min=1
    )
    pp_layers: list[int] = _f(
        [], "decoder layers in each stage, first to last (their sum is the model's n_layers); empty: balanced by"
        " parameters and FLOPs, the first and last stages lighter for the embedding and the head"
    )  # fmt: skip
    cp: int = _f(
        1, "context-parallel degree: each sequence split over cp ranks, attention by ring (needs seq_len divisible"
        " by 2 x cp for the causal load balance)", min=1,
    )  # fmt: skip
    cpu_offload: bool = _f(
        False, "FSDP2 keeps parameters, gradients and optimizer state in CPU memory, copying each layer in for its"
        " compute (slower steps, far less device memory)"
    )  # fmt: skip
    loss_parallel: bool = _f(
        True,
        "with tp > 1, the head's logits stay split over the vocabulary and the cross-entropy is computed on"
        " the shards: no rank holds the full logits",
    )
    sequence_parallel: bool = _f(
        True,
        "with tp > 1, the norms and the residual stream are split over the sequence between the"
        " tensor-parallel regions (needs train.seq_len divisible by tp)",
    )
    backend: Literal["auto", "gloo", "nccl"] = _f("auto", "process-group backend; auto: nccl on cuda, gloo on cpu")


@dataclass
class DataSection:
    paths: list[str] = _f([], "text files or URLs (.txt, .jsonl, .parquet); empty uses Python's documentation")
    text_field: str = _f("text", "field holding the text in .jsonl records")
    tokenizer: str = _f("bpe", "byte, bpe (trained on the corpus), or a path to a tokenizer.json")
    bpe_vocab_size: int = _f(4096, "vocabulary size when training a BPE tokenizer", min=260)
    val_fraction: float = _f(0.02, "share of sequences held out for validation", min=0.0, max=0.5)
    split_seed: int = _f(
        -1, "seed of which sequences are held out; -1: run.seed. Runs of different seeds given one split_seed are"
        " scored on the same held-out sequences", min=-1
    )  # fmt: skip
    stores: list[str] = _f(
        [], "token stores written by `liandan data run` (directories or URLs: s3://..., gs://...); when set, paths"
        " and tokenizer are unused"
    )  # fmt: skip
    cache_dir: str = _f(
        "", "local copy of stores named by URL, fetched once and checked; empty: $LIANDAN_CACHE_DIR/stores, else"
        " $XDG_CACHE_HOME/liandan/stores"
    )  # fmt: skip
    weights: list[float] = _f([], "mixture weight of each store (normalized); empty weighs stores by their tokens")
    chat_template: Literal["chatml", "tokenizer"] = _f(
        "chatml", "train.objective = sft: chatml (built in, its <|im_start|> and <|im_end|> added to the"
        " tokenizer as special tokens) or tokenizer (the chat_template of the tokenizer_config.json beside"
        " data.tokenizer's tokenizer.json, rendered by transformers)"
    )  # fmt: skip


@dataclass
class CheckpointSection:
    enabled: bool = _f(
        True, "save checkpoints at all; false turns every save off (every, every_minutes, at_end and a"
        " preemption's save)"
    )  # fmt: skip
    every: int = _f(0, "steps between checkpoints; 0: no step interval (the time interval and the end still save)",
                    min=0)  # fmt: skip
    every_minutes: float = _f(
        30.0, "minutes between checkpoints, measured on rank 0's clock from the start or the newest save (all"
        " ranks agree on the step); 0: no time interval", min=0.0,
    )  # fmt: skip
    at_end: bool = _f(True, "save a checkpoint of the last step")
    dir: str = _f("", "where checkpoints go; empty means <run directory>/checkpoints")
    keep_last: int = _f(3, "newest checkpoints to keep; 0 keeps all", min=0)
    keep_every: int = _f(0, "also keep every checkpoint whose step is a multiple of this; 0 disables", min=0)
    async_save: bool = _f(True, "write checkpoints in the background while training continues")
    max_failed_saves: int = _f(
        3, "stop the run with an error after this many checkpoint saves in a row failed (a full disk, say)", min=1
    )
    resume: Literal["auto", "off"] = _f("auto", "auto: continue from the newest checkpoint that verifies")
    verify: bool = _f(True, "check every file's checksum before loading")
    init_from: str = _f(
        "", "model weights that start a new run (optimizer fresh): a checkpoint directory, a Hugging Face"
        " directory or a consolidated .safetensors file"
    )  # fmt: skip
    allow_model_change: bool = _f(
        False, "resume or init_from a checkpoint of another model (model_args differ: layers dropped, another"
        " rope_theta): the tensors the new model has load, the rest of the checkpoint is left; a tensor the"
        " checkpoint lacks, or of another shape, is still refused"
    )  # fmt: skip
    memory_every: int = _f(
        0, "under the supervisor, snapshot every rank's state into host shared memory every this many steps, so a"
        " restart after a process crash resumes from there; 0 disables", min=0,
    )  # fmt: skip
    memory_dir: str = _f("", "where memory snapshots go; empty means /dev/shm (or the temporary directory)")

    @property
    def saves(self) -> bool:
        """Whether the run saves any checkpoint: `enabled`, and a step interval, a time interval or the end."""
        return self.enabled and bool(self.every or self.every_minutes or self.at_end)


@dataclass
class ResilienceSection:
    supervise: bool = _f(True, "run the workers under a supervisor that restarts them after a crash or hang")
    max_restarts: int = _f(5, "restarts before the supervisor gives up", min=0)
    same_failure_limit: int = _f(2, "give up when the same failure recurs at the same step this many times", min=1)
    backoff_s: float = _f(
        1.0,
        "wait before restarting after a failure that recurred without progress; doubles per repeat, at most 60 s",
        min=0.0,
    )
    hang_factor: float = _f(10.0, "a hang is no progress for this many median step times...", min=1.0)
    hang_floor_s: float = _f(60.0, "...but never less than this many seconds", min=0.1)
    startup_timeout_s: float = _f(1800.0, "no progress before the first step for this long is a hang", min=1.0)
    preempt_grace_s: float = _f(
        25.0, "on SIGTERM or SIGINT, how long the workers may take to finish their step and save a checkpoint"
        " before they are stopped (they are told: when that would not fit, they save the step before); keep it"
        " below the scheduler's kill delay (Slurm KillWait, Kubernetes terminationGracePeriodSeconds, 30 s by"
        " default)", min=0.0,
    )  # fmt: skip
    collective_timeout_s: float = _f(
        600.0, "a collective that waits this long for a peer fails (c10d/NCCL timeout): the backstop when the"
        " supervisor's watchdog is not running", min=1.0,
    )  # fmt: skip


@dataclass
class ForecastSection:
    every: int = _f(0, "forecast the final loss from the curve so far every this many steps; 0 disables", min=0)
    reference_loss: float = _f(0.0, "flag the run when its forecast final loss is worse than this; 0 disables", min=0.0)


@dataclass
class GuardSection:
    """The loss-spike guard (docs/training.md, "The loss-spike guard"). Rules compare each step with the running
    level of its quantity (the median of the newest accepted values) in noise units: the median absolute
    deviation (MAD, scaled to a standard deviation) of the step-to-step changes over the last `window` accepted
    steps."""

    enabled: bool = _f(True, "watch every step for non-finite values, loss spikes, gradient and logit growth")
    window: int = _f(100, "accepted steps of history the noise (MAD of step-to-step changes) is taken over", min=4)
    warmup: int = _f(20, "steps of history before the spike, gradient and logit rules judge", min=2)
    spike_mads: float = _f(5.0, "loss spike: this many noise units above the running level...", min=0.0)
    spike_min_ratio: float = _f(0.05, "...and at least this fraction of the median loss above it", min=0.0)
    spike_persist: int = _f(2, "consecutive steps over the threshold that make a spike...", min=1)
    spike_immediate: float = _f(2.0, "...unless one step is this many times over it: a spike at once", min=1.0)
    diverge_rise: float = _f(
        0.15, "early divergence: until `window` losses are known, a loss this fraction (and spike_mads noise units)"
        " above the lowest level so far (median of 3 steps; the first loss counts) for spike_persist steps, or"
        " spike_immediate times as far once; 0 disables", min=0.0,
    )  # fmt: skip
    grad_mads: float = _f(8.0, "gradient-norm explosion: log norm this many noise units above its running level...",
                          min=0.0)  # fmt: skip
    grad_min_ratio: float = _f(10.0, "...and at least this many times the median norm", min=1.0)
    logit_mads: float = _f(8.0, "output-logit or z growth: log value this many noise units above its running level...",
                           min=0.0)  # fmt: skip
    logit_min_ratio: float = _f(2.0, "...and at least this many times the median", min=1.0)
    attention_logit_limit: float = _f(
        100.0, "largest attention logit (measured with the layer statistics) that is still healthy; 0 disables",
        min=0.0,
    )  # fmt: skip
    drop_mads: float = _f(
        8.0,
        "too good to be true: loss this many noise units below its running level for spike_persist steps...",
        min=0.0,
    )
    drop_min_ratio: float = _f(0.25, "...and at least this fraction of the median below it", min=0.0)
    source_floor: float = _f(
        0.05, "too good to be true, per store of a mixture: its sampled loss below this many nats for spike_persist"
        " of its steps...; 0 disables", min=0.0,
    )  # fmt: skip
    source_collapse: float = _f(
        4.0, "...or its loss relative to the other stores' this many times below its running median (and drop_mads"
        " MADs); 0 disables", min=0.0,
    )  # fmt: skip
    router_window: int = _f(
        20, "mixture of experts: steps a router collapse must last to be named (after router_warmup), and the"
        " steps of max/mean load whose median the drift rule follows", min=2,
    )  # fmt: skip
    router_dead: float = _f(
        0.02, "router collapse: an expert's load below this fraction of the layer's mean load...; 0 disables",
        min=0.0, max=1.0,
    )  # fmt: skip
    router_hot: float = _f(
        0.9, "...or one expert chosen by more than this fraction of the layer's tokens (judged where a balanced"
        " router gives each expert fewer: top_k/experts below it); 0 disables", min=0.0, max=1.0,
    )  # fmt: skip
    router_drift: float = _f(
        0.5, "imbalance drift: a layer's max/mean load (median over router_window steps)"
        " this much above the lowest such median since; 0 disables", min=0.0,
    )  # fmt: skip
    router_warmup: int = _f(100, "steps before the router rules judge (the balancing settles first)", min=0)
    router_lr_factor: float = _f(
        0.5, "after a rollback for a router collapse or drift, scale the learning rate by this for the rest of the"
        " run (compounding), and train on the same batches again", min=0.0, max=1.0,
    )  # fmt: skip
    on_nonfinite: Literal["warn", "skip", "rollback", "stop"] = _f("skip", "what a non-finite loss or gradient does")
    on_spike: Literal["warn", "skip", "rollback", "stop"] = _f("rollback", "what a loss spike does")
    on_grad: Literal["warn", "skip", "rollback", "stop"] = _f("skip", "what a gradient-norm explosion does")
    on_logits: Literal["warn", "skip", "rollback", "stop"] = _f("warn", "what output/attention logit growth does")
    on_drop: Literal["warn", "stop"] = _f("warn", "what a too-good-to-be-true loss drop does")
    on_diverge: Literal["warn", "skip", "rollback", "stop"] = _f("rollback", "what early divergence does")
    on_collapse: Literal["warn", "rollback", "stop"] = _f(
        "warn", "what a router collapse does (judged after the update)"
    )
    on_drift: Literal["warn", "rollback", "stop"] = _f("warn", "what an imbalance drift of the routers does")
    escalate_after: int = _f(3, "skipped updates in a row that become a rollback; 0 never escalates", min=0)
    ring_every: int = _f(25, "steps between the in-memory states kept to roll back to", min=1)
    ring_size: int = _f(
        3, "in-memory states kept (each a copy of the rank's model and optimizer state); refused at the start when"
        " they would take more than half the host memory available", min=1,
    )  # fmt: skip
    rollback_margin: int = _f(1, "roll back to a state at least this many steps before the spike began", min=0)
    skip_batches: int = _f(
        0, "batches skipped after a rollback, counted from the restored state; at least those up to the"
        " detection (0: exactly those)", min=0,
    )  # fmt: skip
    lr_factor: float = _f(1.0, "after a rollback, scale the learning rate by this (compounding)...", min=0.0, max=1.0)
    lr_steps: int = _f(0, "...for this many steps; 0 keeps it for the rest of the run", min=0)
    diverge_lr_factor: float = _f(
        0.3, "after a rollback for early divergence whose batches look normal (the learning rate is to blame), scale"
        " the learning rate by this for the rest of the run (compounding), and train on the same batches again",
        min=0.0, max=1.0,
    )  # fmt: skip
    max_rollbacks: int = _f(3, "rollbacks allowed within rollback_window steps; one more stops the run", min=0)
    rollback_window: int = _f(1000, "steps over which rollbacks are counted", min=1)
    stats_every: int = _f(100, "per-layer statistics every this many steps; 0 only around incidents", min=0)
    replay: bool = _f(True, "after a rollback, replay the spike's steps to find the layers that moved first")


@dataclass
class DoctorSection:
    """The hardware doctor (docs/resilience.md, "The doctor"): `liandan doctor`, and the preflight of every
    `liandan train`. Sizes of 0 take the device's default: small on CPUs, large enough to time on GPUs."""

    preflight: bool = _f(True, "run the doctor on every rank before the first step of `liandan train`; a failure"
                         " stops the run and names the rank and host")  # fmt: skip
    golden_size: int = _f(256, "side of the seeded matrix product each rank checks against float64 and the other"
                          " ranks", min=16, max=8192)  # fmt: skip
    matmul_size: int = _f(0, "side of the matrices whose product times matmul throughput; 0: 512 on CPUs, 4096 on"
                          " GPUs", min=0, max=16384)  # fmt: skip
    copy_mib: float = _f(0.0, "MiB copied to time memory bandwidth; 0: 32 on CPUs, 512 on GPUs", min=0.0)
    measure_s: float = _f(0.1, "seconds each throughput is timed for (the median repetition counts)", min=0.01,
                          max=10.0)  # fmt: skip
    collective_kib: float = _f(64.0, "KiB each rank sends in the collective correctness tests", min=1.0)
    bandwidth_mib: float = _f(0.0, "MiB per rank in the collective bandwidth tests, across all ranks and in pairs;"
                              " 0: 4 on CPUs, 256 on GPUs", min=0.0)  # fmt: skip
    pairs: bool = _f(True, "also test every pair of ranks, for correctness and bandwidth (n-1 rounds of pairs)")
    write_mib: float = _f(4.0, "MiB each rank writes and fsyncs into the checkpoint directory (then removes)",
                          min=0.0)  # fmt: skip
    slow_ratio: float = _f(0.5, "a throughput or bandwidth below this fraction of the median of the other ranks on"
                           " its host is out of line; 0 disables", min=0.0, max=1.0)  # fmt: skip
    on_slow: Literal["warn", "fail"] = _f("warn", "what an out-of-line throughput or bandwidth does (wrong answers"
                                          " always fail)")  # fmt: skip


@dataclass
class HealthSection:
    """Silent-data-corruption and straggler detection during training (docs/training.md, "Finding the bad
    GPU"). Check steps are multiples of `check_every`, and of `guard.ring_every` when the guard is on, so that
    every in-memory state the guard keeps to roll back to has been verified first."""

    sdc: bool = _f(True, "compare replicas' weight fingerprints, cross-check gradient norms and all-reduce sums, "
                   "and replay a step on a neighbouring rank at intervals")  # fmt: skip
    check_every: int = _f(25, "steps between weight-fingerprint, gradient-norm and all-reduce checks", min=1)
    replay_every: int = _f(
        75, "steps between replays: each data-parallel rank recomputes its neighbour's loss; 0 disables", min=0
    )
    replay_tolerance: float = _f(
        0.0, "relative difference of a replayed loss that is a mismatch; 0 takes the dtype's (fp32 1e-5, bf16 2e-2)",
        min=0.0,
    )  # fmt: skip
    golden_size: int = _f(256, "size of the golden matrix product run on every rank after a mismatch", min=16)
    stragglers: bool = _f(True, "compare per-rank phase times (data, compute, communication) across ranks")
    straggler_every: int = _f(50, "steps in one window of phase times, gathered at its end", min=1)
    straggler_ratio: float = _f(1.5, "a rank whose data or compute time is this many times the median...", min=1.0)
    straggler_min_s: float = _f(0.005, "...and at least this many seconds per step above it is over the threshold",
                                min=0.0)  # fmt: skip
    straggler_windows: int = _f(3, "consecutive windows over the threshold that make a straggler", min=1)
    exclude_stragglers: bool = _f(
        False, "on several nodes, exclude a reported straggler's node when the run next restarts"
    )


# The trackers `[track] exporters` may name (liandan.track.exporters builds them).


@dataclass
class TrackSection(PluginTables):
    """Where a run's metrics, events and config go besides its own files, which stay the source of truth
    (docs/tracking.md). Each exporter's own keys go in `[track.<exporter>]`."""

    KEY = "track"
    # exporters to TensorBoard, Weights & Biases, MLflow and any other registered one (liandan.plugins)
    exporters: list[str] = _f([], "trackers that also get the run's metrics, incidents and config: tensorboard, "
                              "wandb, mlflow (each needs its extra: pip install 'liandan[wandb]')")  # fmt: skip
    plot: bool = _f(True, "draw training.png (loss, learning rate, throughput, incidents marked) when the run ends;"
                    " `liandan report` draws the same curves from the run's files at any time")  # fmt: skip

    # the run store
    store: bool = _f(True, "index the run in its project's run store (<run.output_dir>/liandan.db) while it trains")
    store_every_s: float = _f(2.0, "seconds between the store's updates while training (at once after an incident)",
                              min=0.0)  # fmt: skip
    options: dict[str, Any] = plugin_options("exporter")


@dataclass
class EvalSection:
    """Task and held-out evaluation (docs/evaluation.md): during training on the ranks that train, with the model
    sharded as it trains, and by `liandan eval` afterwards."""

    tasks: list[str] = _f([], "task names shipped with liandan (gsm8k, cloze_en, cloze_zh) or paths of task files")
    every: int = _f(0, "steps between evaluations of the tasks and the held-out sources during training (and at"
                    " the last step); 0 disables", min=0)  # fmt: skip
    limit: int = _f(50, "items of each task evaluated (the first ones of its file); 0 takes every item", min=0)
    formats: list[str] = _f([], "prompt formats to run each task under; empty runs every format the task lists")
    data_dir: str = _f("../shared/data", "what {data_dir} stands for in task files' paths; a relative one is"
                       " looked for beside the run's config, in the working directory, then in a source checkout"
                       " (docs/evaluation.md)")  # fmt: skip
    batch_size: int = _f(16, "sequences per forward pass when scoring", min=1)
    max_new_tokens: int = _f(0, "cap on generated tokens per answer; 0 keeps each task's own", min=0)
    heldout_sequences: int = _f(16, "held-out sequences scored per data source (bits per byte); 0 disables",
                                min=0)  # fmt: skip
    samples: list[str] = _f([], "prompts continued greedily at each evaluation during training: eval_sample events")
    sample_tokens: int = _f(32, "tokens generated for each prompt of eval.samples (at most the window less one)",
                            min=1)  # fmt: skip
    contamination: bool = _f(True, "report the n-gram overlap of each task's items with the training stores")
    ngram: int = _f(13, "word n-gram length of the contamination check", min=1)


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    resilience: ResilienceSection = field(default_factory=ResilienceSection)
    forecast: ForecastSection = field(default_factory=ForecastSection)
    guard: GuardSection = field(default_factory=GuardSection)
    doctor: DoctorSection = field(default_factory=DoctorSection)
    health: HealthSection = field(default_factory=HealthSection)
    track: TrackSection = field(default_factory=TrackSection)
    eval: EvalSection = field(default_factory=EvalSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section as a table; a plug-in's table under the plug-in's name (`model.llama`, `track.wandb`)."""
        return {f.name: section_dict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def run_name(self, config_name: str) -> str:
        """`run.name`, or `<config name>-<timestamp>` when it is empty."""
        from datetime import datetime

        return self.run.name or f"{config_name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"

    def run_dir(self, config_name: str) -> Path:
        """The run directory: `<run.output_dir>/<run_name(config_name)>`. Every place that needs it asks here;
        where the name must be handed on too (to workers, to other nodes), it is this path's `.name`, so that a
        timestamped name is drawn once."""
        return Path(self.run.output_dir) / self.run_name(config_name)

    def to_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(self.to_dict())
