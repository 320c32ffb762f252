"""`liandan ckpt info`, `liandan export` and `liandan import`: looking into and converting checkpoints."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from datetime import datetime, timezone
from pathlib import Path

from liandan.checkpoint.verify import CheckpointError
from liandan.run import MANIFEST, META, RunDir, check_output, partial_step_dirs, step_dir_name, step_dirs
from liandan.run.remote import is_url, locate


def add_commands(sub) -> None:
    p = sub.add_parser("ckpt")
    p.add_argument("action", choices=["info"], help="info: step, tokens, layout, size and verification")
    p.add_argument("path", help="a checkpoint, a checkpoints directory or a run directory")
    p.add_argument("--no-checksums", action="store_true", help="check sizes only (fast)")
    p.set_defaults(command=cmd_ckpt_info)

    p = sub.add_parser("export")
    p.add_argument("checkpoint", help="a checkpoint, or a run directory (its newest checkpoint)")
    p.add_argument("out", help="output directory (--hf) or .safetensors file (--consolidated)")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--hf", action="store_true", help="safetensors + config.json + tokenizer (and the chat"
                      " template of a model fine-tuned on chats) for transformers")  # fmt: skip
    kind.add_argument("--consolidated", action="store_true", help="one .safetensors file in liandan's naming")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weight dtype of an --hf export")
    p.set_defaults(command=cmd_export)

    p = sub.add_parser("import")
    p.add_argument("source", help="a directory with config.json and *.safetensors")
    p.add_argument("out", help="checkpoint directory to create; train with --checkpoint.init_from=OUT")
    p.add_argument("--hf", action="store_true", required=True, help="the source is in Hugging Face format")
    p.set_defaults(command=cmd_import)


def _user_error(err: Exception) -> CheckpointError:
    return CheckpointError(str(err))


def cmd_ckpt_info(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.checkpoint.info import HOW_TO_GET_ONE, describe_checkpoint, run_checkpoint_root

    path = locate(args.path)  # a local path, or a store's URL (`s3://bucket/prefix`)
    if not path.exists():
        raise CheckpointError(f"no such path: {path}")
    candidates = [path] if (path / META).is_file() or (path / MANIFEST).is_file() else []
    root = path
    if not candidates and not is_url(path):
        room = RunDir(path)
        root = run_checkpoint_root(path) if room.config.is_file() else path
        root = room.checkpoints if not root.is_dir() and room.checkpoints.is_dir() else root
        if not root.is_dir():
            raise CheckpointError(f"no checkpoints under {path}: {root} does not exist; {HOW_TO_GET_ONE}")
    partial: list = []
    if not candidates and is_url(root):  # a store has no rename: a step without its manifest is a save under way
        steps = step_dirs(root)
        candidates = [p for p in steps if (p / MANIFEST).is_file()]
        partial = [p for p in steps if p not in candidates]
    elif not candidates:
        candidates = sorted(step_dirs(root) + partial_step_dirs(root))
    if not candidates and not partial:
        raise CheckpointError(f"no checkpoints under {path}; {HOW_TO_GET_ONE}")
    for candidate in partial:
        print(f"{candidate}\n  partial save, not a checkpoint: no manifest (being written, or its writer died)")
    for candidate in candidates:
        info = describe_checkpoint(candidate, checksums=not args.no_checksums)
        if not info["verified"]:
            status = f"NOT VERIFIED: {info['error']}"
        else:  # without checksums a changed file of the same size passes: that is no verification
            status = "verified" if info["checksums"] else "sizes match (checksums not checked)"
        saved = info.get("saved_at")
        when = datetime.fromtimestamp(saved, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if saved else "?"
        print(f"{candidate}")
        print(f"  step {info.get('step')}, tokens {info.get('tokens') or 0:,}, saved {when}")
        print(f"  layout {info.get('layout')} over {info.get('world_size')} process(es)")
        print(f"  size {info['bytes'] / 2**20:,.1f} MiB, liandan {info.get('liandan_version')}, {status}")
    return 0


def cmd_export(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from liandan.checkpoint import hf
    from liandan.checkpoint.info import resolve_checkpoint
    from liandan.checkpoint.loading import load_model
    from liandan.data.tokens.tokenizer import ByteTokenizer
    from liandan.evaluate.loading import checkpoint_chat, checkpoint_tokenizer

    out = check_output(args.out, directory=args.hf, makes_parents=True)  # a typo costs no loading
    given = locate(args.checkpoint)
    source = resolve_checkpoint(given)
    model, meta = load_model(source)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    missing_tokenizer, chat = False, None
    try:
        if args.consolidated:
            hf.save_consolidated(state, model.args, out)
        else:
            tokenizer = checkpoint_tokenizer(source, meta, given if given != source else None)
            missing_tokenizer = tokenizer is None and meta.get("tokenizer") not in (None, ByteTokenizer().fingerprint())
            dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
            chat = checkpoint_chat(source, meta, given if given != source else None) if tokenizer else None
            hf.export_hf(state, model.args, out, tokenizer_json=tokenizer, dtype=dtype, chat=chat)
    except ValueError as err:
        raise _user_error(err) from None
    print(f"exported step {meta['step']} of {source} to {out}")
    if not args.consolidated and chat is not None:
        print(f"with its chat template; generation stops at {', '.join(chat.turn_end) or 'the end of a document'}")
    if missing_tokenizer:
        print(f"warning: the tokenizer {meta['tokenizer']} it was trained with was not found (not in the run's data "
              "directory nor in its [data] stores); the export has no tokenizer.json")  # fmt: skip
    return 0


def model_block(spec, model_args) -> str:
    """The `[model]` section a config needs to train from weights of `model_args`: the family, the fields that
    `checkpoint.init_from` compares (shape and function) and the length the rotary table covers."""
    import tomli_w

    fields = dict.fromkeys((*spec.shape_fields, *spec.function_fields(model_args), "max_seq_len"))
    section = {"family": spec.name} | {k: getattr(model_args, k) for k in fields if hasattr(model_args, k)}
    return tomli_w.dumps({"model": section}).strip()


def cmd_import(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.checkpoint import hf
    from liandan.checkpoint.hf_tokenizer import source_tokenizer
    from liandan.checkpoint.manager import CheckpointManager
    from liandan.model import spec_for

    source, out = Path(args.source), Path(args.out)
    if out.exists():  # before anything is read or written
        raise CheckpointError(f"{out} already exists; import into a new directory")
    try:
        state, model_args = hf.import_hf(source)
        notes = hf.import_notes(source)
        tokenizer = source_tokenizer(source)
    except (ValueError, FileNotFoundError) as err:
        raise _user_error(err) from None
    spec = spec_for(model_args)
    model = spec.build(model_args)
    model.load_state_dict(state, strict=True)
    staging = out.parent / f".{out.name}-staging"
    meta = {"format": "liandan-checkpoint", "tokens": 0, "layout": "imported", "model_family": spec.name,
            "model_args": dataclasses.asdict(model_args),
            "imported_from": str(source.resolve())}  # fmt: skip
    try:
        manager = CheckpointManager(staging, async_save=False)
        manager.save(0, model, None, meta)
        saved = manager.root / step_dir_name(0)
        if not (saved / MANIFEST).is_file():
            raise CheckpointError(f"could not write the checkpoint under {staging}: {manager.outcomes[-1].error}")
        if out.exists():
            raise CheckpointError(f"{out} already exists; import into a new directory")
        # A directory renamed whole into place, not a file written: the checkpoint inside was already written
        # and fsync'd by the manager's own save, so the file writer has nothing to add here.
        saved.rename(out)
    finally:  # whatever happened, the staging directory goes
        shutil.rmtree(staging, ignore_errors=True)
    if tokenizer is not None:  # beside the checkpoint, outside its manifest, as an export's is
        tokenizer.save(str(out / "tokenizer.json"))
    print(f"imported {source} into {out}; the config's model section must be:\n")
    print(model_block(spec, model_args) + "\n")
    for note in notes:
        print(f"note: {note}")
    print(
        f"train with --checkpoint.init_from={out}"
        + (f" --data.tokenizer={out / 'tokenizer.json'}" if tokenizer is not None else "")
    )
    return 0
