"""Small shared builders for tests: a corpus written from Python's own documentation, a tiny run config,
`liandan` run as a subprocess, and what a run directory holds."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from liandan.config import Config, load_config
from liandan.data.tokens.chat import CHATML_JINJA
from liandan.run import RunDir

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
S3_BUCKET = "liandan-test"  # the bucket of the loopback S3 server (the `s3` fixture of conftest.py)


def write_corpus(directory: Path, n_docs: int = 40) -> Path:
    """A .jsonl of real English prose: language-reference topics that ship with Python."""
    from pydoc_data.topics import topics

    names = sorted(topics)[:n_docs]
    path = directory / "corpus.jsonl"
    with path.open("w") as handle:
        for name in names:
            handle.write(json.dumps({"id": name, "text": topics[name]}) + "\n")
    return path


# The smallest model worth training in a test: a trial or a forecast run is mostly process start-up.
MICRO_MODEL = [
    "--model.dim=32",
    "--model.n_layers=1",
    "--model.n_heads=2",
    "--model.n_kv_heads=1",
    "--model.max_seq_len=32",
    "--train.seq_len=32",
    "--train.global_batch=8",
]


# Trackers with no network, as the exporters' tests and the shared incident run use them.
TRACKER_ENV = {"WANDB_SILENT": "true", "WANDB_MODE": "offline", "WANDB_DISABLE_CODE": "true",
               "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}  # fmt: skip


def tracker_env(directory: Path) -> dict[str, str]:
    """No network, and W&B's own logs and settings under `directory` rather than the home directory."""
    homes = {name: str(directory / name.lower()) for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")}
    return {**TRACKER_ENV, **homes}


# The incident run: one supervised two-rank run, trained once per session (conftest.py's `incident_run`) for
# the tests that read such a run (the dashboard's, the exporters', the report's). The guard rolls back a
# learning-rate burst at update 30; rank 1 is killed after step 45 and the run resumes from its checkpoint of
# step 40 (saved synchronously, so it is whole when the kill comes); every exporter, the preflight doctor, the
# health checks, validation and training.png are on.
INCIDENT_RUN = "faulty"
INCIDENT_STEPS = 60
INCIDENT_BATCH = 16  # sequences of tiny_config's 64 tokens
INCIDENT_KILL_STEP = 45
INCIDENT_RESUME_STEP = 40
INCIDENT_FAULTS = f"burst@update:30,kill@step:{INCIDENT_KILL_STEP}:1"
INCIDENT_OVERRIDES = [f"--train.steps={INCIDENT_STEPS}", "--optim.lr=3e-3", f"--train.global_batch={INCIDENT_BATCH}",
                      "--guard.ring_every=10", "--guard.stats_every=20", "--train.eval_every=20",
                      "--train.eval_batches=2", "--health.straggler_every=10", "--doctor.preflight=true",
                      "--checkpoint.every=10", "--checkpoint.async_save=false", "--resilience.backoff_s=0",
                      "--track.plot=true", '--track.exporters=["tensorboard", "wandb", "mlflow"]']  # fmt: skip


@dataclass
class TrainedRun:
    """A run trained by `liandan train` in a process of its own: its directory and what the command printed."""

    path: Path
    stdout: str
    stderr: str


def tiny_config(run_dir: Path, corpus: Path, *overrides: str) -> Config:
    return load_config(
        None,
        [
            f"--run.output_dir={run_dir}",
            "--run.name=run",
            "--model.dim=64",
            "--model.n_layers=2",
            "--model.n_heads=4",
            "--model.n_kv_heads=2",
            "--model.max_seq_len=64",
            "--train.steps=6",
            "--train.global_batch=4",
            "--train.seq_len=64",
            "--train.dtype=fp32",
            "--schedule.warmup_steps=2",
            "--data.tokenizer=byte",
            f'--data.paths=["{corpus}"]',
            # drawing training.png takes a run about a CPU second; the tests of the picture ask for it
            "--track.plot=false",
            # every trainer runs the doctor first (about a CPU second); the tests of the doctor ask for it
            "--doctor.preflight=false",
            *overrides,
        ],
    )


def fill_disk(path: Path) -> Path:
    """Write zeros into the file `path` until its file system is full (a real ENOSPC); returns the path."""
    import errno

    chunk = bytes(64 << 10)
    with open(path, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(chunk)  # short writes fill the last pages; the write after them fails
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
    return path


def listening_sockets(pids) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that one of `pids` holds open (Linux /proc)."""
    import ipaddress
    import os

    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone already
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            raw, port = local.split(":")
            packed = bytes.fromhex(raw)
            # /proc writes each 32-bit word of the address in host (little-endian) order
            packed = b"".join(packed[i : i + 4][::-1] for i in range(0, len(packed), 4))
            address = ipaddress.ip_address(packed)
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
                address = address.ipv4_mapped
            found.add((str(address), int(port, 16)))
    return found


def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it (Linux /proc)."""
    import os

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def listeners_until_exit(proc, timeout: float = 400.0) -> set[tuple[str, int]]:
    """Every listening socket that `proc` or a process descended from it held while it ran (sampled)."""
    import time

    seen: set[tuple[str, int]] = set()
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        seen |= listening_sockets(process_tree(proc.pid))
        time.sleep(0.05)  # a sampling interval: the stores live for the whole run
    return seen


def wait_for_step(run_dir: Path, step: int, proc, timeout: float = 300.0) -> None:
    """Poll the run's metrics until it has logged `step`; the process `proc` must not end first."""
    import time

    metrics = RunDir.of(run_dir).follow_metrics()  # a line being written is left for the next poll
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        records = metrics.read()
        if records and records[-1].get("step", -1) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def liandan_command(*args) -> list[str]:
    """The command line of `liandan ARGS...` run from this checkout's Python."""
    return [sys.executable, "-m", "liandan.cli", *map(str, args)]


def run_liandan(
    *args, timeout: float = 600, env: dict[str, str] | None = None, check: bool = False, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`python -m liandan.cli ARGS...` in a subprocess, its output captured as text; `env` replaces the
    environment (None: this process's). With `check`, a non-zero exit raises CalledProcessError."""
    return subprocess.run(
        liandan_command(*args), capture_output=True, text=True, timeout=timeout, env=env, check=check, cwd=cwd,
    )  # fmt: skip


def liandan_here(*args, check: bool = False) -> subprocess.CompletedProcess:
    """`liandan ARGS...` run in this process (no interpreter and torch to start: seconds saved per call), its
    exit code and output captured as `run_liandan` gives them. For the commands that only read files (the
    incident timeline and the like); a training run belongs in a process of its own. With `check`, a non-zero
    exit raises CalledProcessError."""
    import io

    from liandan.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(arg) for arg in args])
    done = subprocess.CompletedProcess(["liandan", *map(str, args)], code, out.getvalue(), err.getvalue())
    if check:
        done.check_returncode()
    return done


def start_liandan(*args, env: dict[str, str] | None = None, cwd: Path | None = None, quiet: bool = False):
    """`python -m liandan.cli ARGS...` started and left running (a subprocess.Popen), its output piped as
    text, or discarded when `quiet` (then nothing can block on a full pipe); `env` replaces the environment."""
    out = subprocess.DEVNULL if quiet else subprocess.PIPE
    return subprocess.Popen(liandan_command(*args), env=env, cwd=cwd, stdout=out, stderr=out, text=True)


def environment_without(*prefixes: str, **extra: str) -> dict[str, str]:
    """This process's environment less the variables that start with one of `prefixes` (liandan's own, by
    default: faults and a supervisor's settings must not leak into the run under test), plus `extra`."""
    import os

    prefixes = prefixes or ("LIANDAN_",)
    return {**{k: v for k, v in os.environ.items() if not k.startswith(prefixes)}, **extra}


def read_metrics(run_dir: Path | str) -> list[dict]:
    """A finished run's metrics records, each line of which must be a whole record (a test of the writer
    wants to hear of a malformed line, which the run's own readers skip)."""
    metrics = RunDir.of(run_dir).follow_metrics()
    records = metrics.read(final=True)
    assert metrics.skipped == 0, f"{metrics.skipped} malformed line(s) in {metrics.path}"
    return records


@dataclass
class RunRecords:
    """What a run directory holds, read through `liandan.run.RunDir`."""

    path: Path
    metrics: list[dict]
    events: list[dict]
    summary: dict

    def of_kind(self, kind: str) -> list[dict]:
        """The events of one kind, in order."""
        return [e for e in self.events if e["kind"] == kind]


def read_run(run_dir: Path | str) -> RunRecords:
    """A run directory's metrics, events and summary (empty where a file is missing)."""
    run = RunDir.of(run_dir)
    return RunRecords(run.path, run.read_metrics(), run.read_events(), run.read_summary())


@contextlib.contextmanager
def faults_planned(fault: str = ""):
    """$LIANDAN_FAULTS set to `fault` (unset when empty) for an in-process run, with no fault yet fired; the
    variable is as it was afterwards."""
    from liandan import faults

    faults._fired.clear()
    previous = os.environ.pop(faults.ENV, None)
    if fault:
        os.environ[faults.ENV] = fault
    try:
        yield
    finally:
        os.environ.pop(faults.ENV, None)
        if previous is not None:
            os.environ[faults.ENV] = previous


def dedup_phase_one(directory: Path, tasks: list[list[str]], params) -> tuple[list[Path], list[Path]]:
    """The exact hashes and MinHash signatures of each task's texts, saved as the pipeline's clean stage saves
    them: what `find_duplicates` reads."""
    import numpy as np

    from liandan.data.dedup.dedup import MinHasher, exact_hashes

    hasher = MinHasher(params)
    exact, signatures = [], []
    for i, texts in enumerate(tasks):
        exact.append(directory / f"task{i}.exact.npy")
        signatures.append(directory / f"task{i}.minhash.npy")
        np.save(exact[-1], exact_hashes(texts))
        np.save(signatures[-1], hasher.signatures(texts))
    return exact, signatures


def free_port() -> int:
    """A TCP port free on this machine now, for a test's own rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_KILLED_RUNS: dict[tuple, Path] = {}


def killed_after_step_6(config, name, before) -> Path:
    """Run NAME's directory as layout `before` (nproc, overrides) leaves it when killed after step 6, with
    synchronous saves (its checkpoint of step 4 complete). The killed run is trained once per config and layout
    in this process, and copied for each NAME, so that the tests resuming it in several layouts each resume a
    run of their own from the same files."""
    runs = Path(config).parent / "runs"
    key = (str(config), before[0], *before[1])
    if key not in _KILLED_RUNS:
        killed_name = f"killed-{len(_KILLED_RUNS)}"
        killed = train_named(config, killed_name, before[0], *before[1], "--checkpoint.async_save=false",
                             faults="kill@step:6:0")  # fmt: skip
        assert killed.returncode != 0
        _KILLED_RUNS[key] = runs / killed_name
    shutil.copytree(_KILLED_RUNS[key], runs / name, symlinks=True)
    return runs / name


def kill_then_resume(config, name, before, after):
    """Run NAME in layout `before` (nproc, overrides) with synchronous saves, killed after step 6 (its checkpoint
    of step 4 complete; `killed_after_step_6`), then again in layout `after`; the finished process."""
    killed_after_step_6(config, name, before)
    assert len(run_losses(config, name)) == 6
    done = train_named(config, name, after[0], *after[1])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "at step 4" in done.stdout
    return done


def train_named(config, name, nproc, *overrides, faults=None):
    """`liandan train CONFIG --nproc=N --run.name=NAME` in a real process, with `faults` (or none) planned."""
    env = {k: v for k, v in os.environ.items() if k != "LIANDAN_FAULTS"}
    if faults:
        env["LIANDAN_FAULTS"] = faults
    return run_liandan("train", config, f"--nproc={nproc}", f"--run.name={name}", *overrides, env=env, timeout=300)


def run_losses(config, name):
    """The per-step losses of run NAME under the config's `runs` directory."""
    return [r["loss"] for r in read_run(config.parent / "runs" / name).metrics]


# Fine-tuning on chats with a BPE trained for the run (ChatML's markers among its special tokens), all the data
# trained on.
SFT_OVERRIDES = ["--train.objective=sft", "--data.tokenizer=bpe", "--data.bpe_vocab_size=320", "--data.val_fraction=0"]


# Chat records for supervised fine-tuning: conversations whose turns are sentences of Python's own
# documentation, a prompt/response pair, and one record of each malformed kind with the reason it is counted under.
CHAT_REJECTS = {
    b"{not json": "malformed JSON",
    b'{"messages": [{"role": "user", "content": "caf\xe9"}]}': "invalid UTF-8",
    b'["a list"]': "not a JSON object",
    b'{"text": "a document, not a conversation"}': "neither 'messages' nor 'prompt'/'response'",
    b'{"messages": [{"content": "who?"}, {"role": "assistant", "content": "me"}]}': "message without a role",
    b'{"messages": [{"role": "narrator", "content": "once"}, {"role": "assistant", "content": "ok"}]}': "unknown role",
    b'{"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "ok"}]}': (
        "content is not a string"
    ),
    b'{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}': (
        "no assistant turn"
    ),
    b'{"prompt": "2 + 2?", "response": 4}': "'prompt' or 'response' is not a string",
}


def chat_conversations(n: int) -> list[list[dict[str, str]]]:
    """`n` conversations of one to three exchanges, every second one with a system turn."""
    from pydoc_data.topics import topics

    sentences = [s.strip() for name in sorted(topics)[:40] for s in topics[name].split(". ") if 20 < len(s) < 160]
    conversations = []
    for i in range(n):
        turns = [{"role": "system", "content": "Answer from the Python reference."}] if i % 2 else []
        for k in range(1 + i % 3):
            ask, answer = sentences[(7 * i + 2 * k) % len(sentences)], sentences[(7 * i + 2 * k + 1) % len(sentences)]
            turns += [{"role": "user", "content": ask + "?"}, {"role": "assistant", "content": answer + "."}]
        conversations.append(turns)
    return conversations


def write_chat_data(directory: Path, n: int = 12, malformed: bool = True) -> Path:
    """A .jsonl of `n` conversations and one prompt/response pair, with CHAT_REJECTS's records among them."""
    lines = [json.dumps({"id": f"c{i}", "messages": m}).encode() for i, m in enumerate(chat_conversations(n))]
    lines.append(json.dumps({"prompt": "What does pass do?", "response": "Nothing; it is a placeholder."}).encode())
    if malformed:
        for k, raw in enumerate(CHAT_REJECTS):
            lines.insert(2 * k + 1, raw)
    path = directory / "chat.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


# A template in the Zephyr style (not ChatML), as a model's tokenizer_config.json carries it; like many, it
# refuses some conversations (here, a system turn after the first turn).
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('a system turn comes first') }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


# ChatML as liandan's built-in template writes it, with {% generation %} around what an assistant turn learns:
# the template an export of a ChatML fine-tune carries.
CHATML_GENERATION_TEMPLATE = CHATML_JINJA


def write_hf_chat_tokenizer(directory: Path, template: str = ZEPHYR_TEMPLATE) -> Path:
    """A small byte-level BPE with a chat template (Zephyr's style, or CHATML_GENERATION_TEMPLATE), laid out as
    a Hugging Face model's tokenizer files; the path of its tokenizer.json."""
    from liandan.data.tokens.tokenizer import train_bpe

    chatml = template == CHATML_GENERATION_TEMPLATE
    specials = ["<|im_start|>", "<|im_end|>"] if chatml else ["</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    texts = [t["content"] for c in chat_conversations(12) for t in c]
    tokenizer = train_bpe(texts, 300, special_tokens=specials)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(directory / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>" if chatml else "</s>",
              "pad_token": "<|endoftext|>", "chat_template": template}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


# One malformed preference record per reason, with the reason it is counted under.
PREFERENCE_REJECTS = {
    b'{"prompt": "hi", "chosen": "a"}': "not all of 'prompt', 'chosen', 'rejected'",
    b'{"prompt": 3, "chosen": "a", "rejected": "b"}': "'prompt' is neither a string nor a non-empty list of messages",
    b'{"prompt": "hi", "chosen": ["a"], "rejected": "b"}': "'chosen' is neither a string nor one assistant message",
    b'{"prompt": "hi", "chosen": "same", "rejected": "same"}': "'chosen' equals 'rejected'",
    b'{"prompt": "hi", "chosen": "a", "rejected": " "}': "empty reply",
    b'{"prompt": [{"role": "robot", "content": "x"}], "chosen": "a", "rejected": "b"}': "unknown role",
    b'{"prompt": "hi", "chosen": "a", "rejected": "b"': "malformed JSON",
}


def write_preference_data(directory: Path, n: int = 16, malformed: bool = True, seed: int = 0) -> Path:
    """A .jsonl of `n` synthetic preference pairs: the chosen reply a fixed pattern, the rejected one random
    letters; every other prompt a conversation (with the chosen reply as a list of one assistant message, as
    TRL's conversational datasets write it), the rest strings; PREFERENCE_REJECTS's records among them."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        noise = "".join(rng.choice("xyzqjkv ") for _ in range(12)).strip() or "zz"
        prompt = f"Count from {i % 5}."
        record = {"id": f"p{i}", "prompt": prompt, "chosen": "one two three four", "rejected": noise}
        if i % 2:
            record["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
            record["chosen"] = [{"role": "assistant", "content": record["chosen"]}]
        lines.append(json.dumps(record).encode())
    if malformed:
        for k, raw in enumerate(PREFERENCE_REJECTS):
            lines.insert(2 * k + 1, raw)
    path = directory / "prefs.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


# A DPO run of the tiny config on a BPE of 300 tokens, the pairs in rows of 64 tokens.
DPO_OVERRIDES = ["--train.objective=dpo", "--data.tokenizer=bpe", "--data.bpe_vocab_size=300", "--data.val_fraction=0",
       "--train.seq_len=64", "--train.dpo_beta=0.5"]  # fmt: skip


def pair_loader(tmp_path: Path, n: int = 6):
    """(the read stats, the store, a loader of 4 pairs a step) of `n` preference records written to tmp_path."""
    from liandan.config import load_config
    from liandan.data.pipeline.preferences import prepare_preference_store
    from liandan.data.tokens.pairs import PairLoader
    from liandan.data.tokens.store import TokenStore

    data = write_preference_data(tmp_path, n=n)
    cfg = load_config(None, [f'--data.paths=["{data}"]', *DPO_OVERRIDES[1:3]]).data
    stats = prepare_preference_store(cfg, tmp_path / "prefs", say=lambda m: None)
    store = TokenStore(tmp_path / "prefs", verify=True)
    return stats, store, PairLoader(store, 64, 4, seed=1)


def dpo_config(tmp_path: Path, data: Path, *extra: str) -> Config:
    """A DPO run of the tiny config on the preference records `data`, its checkpoints saved synchronously."""
    return tiny_config(
        tmp_path, data, *DPO_OVERRIDES, f'--data.paths=["{data}"]', "--checkpoint.async_save=false", *extra
    )


def recording_metrics(trainer) -> list[dict]:  # a liandan.train.Trainer
    """The metrics the trainer logs, as it logs them."""
    records = []
    log = trainer.logger.log_metrics

    def recorded(step, metrics):
        records.append(dict(metrics))
        log(step, metrics)

    trainer.logger.log_metrics = recorded
    return records


SUMS_TASK = """name = "sums"
description = "one-step sums in GSM8K's answer form"
kind = "generation"
path = "sums.jsonl"
question_field = "question"
answer_field = "answer"
answer_regex = "#### (-?[0-9.,]+)"
max_new_tokens = 24
"""


def write_sums_task(directory: Path, n: int = 40) -> tuple[Path, Path]:
    """A generation task of `n` one-step sums answered as GSM8K answers (`a + b = c\\n#### c`), and the same
    items as chat records (prompt, response) to fine-tune on: (the task file, the chat .jsonl)."""
    items = []
    for i in range(n):
        a, b = i % 5, (3 * i) % 4
        items.append({"question": f"Ann has {a} pens and gets {b} more. How many pens?",
                      "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sums.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    chat = directory / "sums-chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": x["question"], "response": x["answer"]}) + "\n" for x in items))
    (directory / "sums.toml").write_text(SUMS_TASK)
    return directory / "sums.toml", chat


# A multiple-choice task file over tiny_mc.jsonl (records of q, choices and gold), one shot.
MC_TOML = """name = "tiny_mc"
kind = "multiple_choice"
path = "tiny_mc.jsonl"
question_field = "q"
choices_field = "choices"
label_field = "gold"
n_shot = 1
seed = 3
"""
