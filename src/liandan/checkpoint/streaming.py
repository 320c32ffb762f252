"""Whole-tensor weights (a Hugging Face directory, a consolidated `.safetensors` file) read into a sharded
model one tensor at a time, each rank reading from the file only the slice its shard holds: no rank ever
holds a whole copy of the model, nor of a tensor it shards.

`weight_source` opens the files and names the model they describe (its family's args, read from
`config.json` or from the consolidated file's metadata); `stream_into` fills the model's parameters, whatever
their layout (plain, tensor-parallel or FSDP2 DTensors), and the persistent buffers the files describe (a MoE
router's balancing bias: from a consolidated file, or zero for a Hugging Face checkpoint, which has none).
The checks are those of `import_hf` and `load_consolidated`: every tensor present once, with the shape the
args give, and nothing left over.

A MoE layer's experts are one stacked tensor per projection in liandan and one tensor per expert in a Hugging
Face checkpoint: a rank whose shard holds some of the experts (FSDP2 shards the stack on its first dimension,
as an expert-parallel layout does) reads only those experts' tensors, and of each only its slice.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from liandan.checkpoint import hf
from liandan.model.spec import Stacked, spec_for

# Module wrappers that insert a path component into parameter names (activation checkpointing,
# torch.compile, DDP).
_WRAPPER_PARTS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|module)(?=\.)")


def local_slice(param: torch.Tensor) -> tuple[slice, ...] | None:
    """The index of this rank's shard in the whole tensor (None: the rank holds all of it), the slice DCP
    would load into it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def local_part(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank writes: a DTensor's local shard, or the parameter itself."""
    return param.to_local() if hasattr(param, "to_local") else param


def plain_name(name: str) -> str:
    return _WRAPPER_PARTS.sub("", name).lstrip(".")


@dataclass(frozen=True)
class Stored:
    """Where one of the model's tensors is in open safetensors files: (file, stored name) of one tensor, or of
    several stacked on a new first dimension (`stacked`: a MoE layer's experts, one per expert)."""

    parts: tuple[tuple[Any, str], ...]
    stacked: bool = False

    def shape(self) -> tuple[int, ...]:
        shapes = {tuple(handle.get_slice(name).get_shape()) for handle, name in self.parts}
        if len(shapes) != 1:
            raise ValueError(f"{', '.join(n for _, n in self.parts[:2])}...: the stacked tensors differ in shape")
        (shape,) = shapes
        return (len(self.parts), *shape) if self.stacked else shape

    def read(self, index: tuple[slice, ...] | None) -> torch.Tensor:
        """The slice `index` of the whole tensor (None: all of it), reading no more from the files."""
        if not self.stacked:
            handle, name = self.parts[0]
            return handle.get_slice(name)[index if index is not None else slice(None)]
        first, rest = (index[0], index[1:]) if index is not None else (slice(None), ())
        chosen = self.parts[first]
        if not chosen:  # a shard of none of the stack (an uneven split over more ranks than slices)
            each = self.shape()[1:]
            rest = (*rest, *[slice(None)] * (len(each) - len(rest)))
            return torch.empty(0, *(len(range(n)[i]) for n, i in zip(each, rest, strict=True)))
        return torch.stack([handle.get_slice(name)[rest or slice(None)] for handle, name in chosen])


@dataclass
class WeightSource:
    """Open safetensors files and where each of the model's tensors is (liandan name -> where it is stored);
    `zeros`: the keys the files hold nothing for, which are zero (a MoE router's bias, in a Hugging Face
    checkpoint)."""

    path: Path
    args: Any
    located: dict[str, Stored]
    zeros: tuple[str, ...] = ()


def _is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def is_weight_source(path: Path) -> bool:
    """A Hugging Face directory or a consolidated `.safetensors` file (not a liandan DCP checkpoint)."""
    return _is_hf_dir(path) or (path.is_file() and path.suffix == ".safetensors")


@contextmanager
def weight_source(path: Path) -> Iterator[WeightSource]:
    """The files of `path` opened for reading slices; ValueError or FileNotFoundError name what is wrong."""
    from safetensors import safe_open

    path = Path(path)
    with ExitStack() as stack:

        def open_file(file: Path):
            try:
                return stack.enter_context(safe_open(str(file), framework="pt"))
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for malformed files
                raise ValueError(f"cannot read {file}: {err}") from None

        if _is_hf_dir(path):
            config = json.loads((path / "config.json").read_text())
            args = hf.args_from_hf_config(config, path / "config.json")
            located = _locate_hf(path, args, config, open_file)
            yield WeightSource(path, args, located, tuple(hf.unstored_keys(args)))
        elif path.is_file():
            handle = open_file(path)
            metadata = handle.metadata() or {}
            if hf.ARGS_METADATA_KEY not in metadata:
                raise ValueError(f"{path}: no {hf.ARGS_METADATA_KEY} in the safetensors metadata")
            family = metadata.get(hf.FAMILY_METADATA_KEY, "llama")
            args = hf._args_from_json(metadata[hf.ARGS_METADATA_KEY], path, family)
            stored = {key: Stored(((handle, key),)) for key in handle.keys()}  # noqa: SIM118
            yield WeightSource(path, args, _locate(path, args, stored))
        else:
            raise FileNotFoundError(f"no Hugging Face directory or consolidated .safetensors file at {path}")


def _locate_hf(path: Path, args: Any, config: dict, open_file) -> dict[str, Stored]:
    spec = spec_for(args)
    adapter = hf._adapter(spec)
    names = hf._hf_to_liandan_names(args)
    tied_hf = {adapter.to_hf_name(key) for key in spec.tied(args)}
    found: dict[str, tuple[Any, str]] = {}
    unexpected = []
    for file in hf._weight_files(path):
        handle = open_file(file)
        for hf_name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            if hf_name in names:
                if hf_name in found:
                    raise ValueError(f"{file}: {hf_name} is stored more than once")
                found[hf_name] = (handle, hf_name)
            elif hf_name in tied_hf or (adapter.ignored_suffixes and hf_name.endswith(adapter.ignored_suffixes)):
                continue  # a tied copy transformers ignores, or a buffer recomputed from the config
            elif adapter.skipped(config, hf_name):
                continue  # layers transformers does not use either
            elif 0 in handle.get_slice(hf_name).get_shape():
                continue  # holds nothing (a GLM-4.5 without shared experts stores their empty weights)
            else:
                unexpected.append(hf_name)
    if unexpected:
        raise ValueError(f"{path}: tensors liandan has no place for: {hf._preview(sorted(unexpected))}")
    stored: dict[str, Stored] = {}
    lacking: list[str] = []  # some of a stack's tensors (a key missing whole is named by `_locate`)
    for key, where in hf.hf_tensor_names(args).items():
        parts = where.names if isinstance(where, Stacked) else (where,) if where is not None else ()
        present = [name for name in parts if name in found]
        if parts and len(present) == len(parts):
            stored[key] = Stored(tuple(found[name] for name in parts), stacked=isinstance(where, Stacked))
        elif present:
            lacking += [name for name in parts if name not in found]
    if lacking:
        raise ValueError(f"{path}: checkpoint lacks {hf._preview(sorted(lacking))}")
    return _locate(path, args, stored, absent=hf.unstored_keys(args))


def _locate(path: Path, args: Any, stored: dict[str, Stored], absent: Collection[str] = ()) -> dict[str, Stored]:
    """Every key of the model's state dict but the `absent` ones, tied ones pointing at the tensor they are
    tied to, checked for shape; nothing is read yet."""
    spec = spec_for(args)
    shapes, tied = spec.state_shapes(args), spec.tied(args)
    shapes = {key: shape for key, shape in shapes.items() if key not in absent}
    unexpected = sorted(set(stored) - set(shapes))
    missing = sorted(set(shapes) - set(stored) - set(tied))
    if missing or unexpected:
        parts = ([f"missing {hf._preview(missing)}"] if missing else []) + (
            [f"unexpected {hf._preview(unexpected)}"] if unexpected else []
        )
        raise ValueError(f"{path} does not match its model arguments: {'; '.join(parts)}")
    located = {key: stored[tied[key]] if key in tied else stored[key] for key in shapes}
    for key, where in located.items():
        shape = where.shape()
        if shape != shapes[key]:
            name = where.parts[0][1] + (" (one of a stack)" if where.stacked else "")
            raise ValueError(f"{path}: {name} has shape {shape}, the model arguments give {shapes[key]}")
    return located


def differences(ours: Any, theirs: Any) -> list[str]:
    """What in the weights' model differs from the config's (`model.KEY = ours (weights: theirs)`): the
    family, and what the family's spec compares for any warm start (the shape fields, and those that change
    the function without changing a shape: the RoPE base and scaling, the norm epsilon)."""
    import dataclasses

    spec, their_spec = spec_for(ours), spec_for(theirs)
    if spec.name != their_spec.name:
        return [f"model.family = {spec.name} (weights: {their_spec.name})"]
    return spec.differences(ours, dataclasses.asdict(theirs), source="weights")


@torch.no_grad()
def stream_into(
    model: nn.Module, source: WeightSource, index_of: Callable[[torch.Tensor], tuple[slice, ...] | None] = local_slice
) -> int:
    """Copy each parameter's shard from `source`, reading only that slice, and the persistent buffers the
    source describes; returns the bytes this rank read. The model's parameter names must be the source's keys
    (wrappers aside). `index_of(param)`: the slice of the whole tensor this rank holds (None: all of it); by
    default the DTensor's own, which covers FSDP2 and tensor-parallel shards and experts sharded over a
    DTensor mesh dimension; a layout that keeps its shards as plain local tensors passes its own."""
    read = 0
    for name, param in model.named_parameters():
        key = plain_name(name)
        if key not in source.located:
            raise ValueError(f"{source.path} has no tensor for the model's parameter {key}")
        piece = source.located[key].read(index_of(param))
        target = local_part(param)
        target.copy_(piece.to(dtype=target.dtype))
        read += piece.numel() * piece.element_size()
    for name, buffer in model.named_buffers():
        key = plain_name(name)
        if key in source.zeros:
            local_part(buffer).zero_()
        elif key in source.located:  # persistent buffers only: the others are in no file
            piece = source.located[key].read(index_of(buffer))
            local_part(buffer).copy_(piece.to(dtype=buffer.dtype))
            read += piece.numel() * piece.element_size()
    return read


def load_weights(model: nn.Module, args: Any, path: Path) -> int:
    """Fill `model` (built from `args`, in any layout) from the weights at `path`, after checking that they
    are of the same model; returns the bytes this rank read. ValueError or OSError name what is wrong."""
    with weight_source(path) as weights:
        differ = differences(args, weights.args)
        if differ:
            raise ValueError(f"another model: {'; '.join(differ)}")
        return stream_into(model, weights)
