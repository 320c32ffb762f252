"""A data pipeline described in one TOML file (or built in Python from the same dataclasses).

    [pipeline]                  # where the output goes, how many processes, which executor
    output = "data/web-zh"
    workers = 2

    [[inputs]]                  # one table per source; each source becomes its own token store
    name = "wiki"
    paths = ["raw/wiki/*.jsonl.zst"]

    [[steps]]                   # cleaning and filtering steps, in order, by registered name
    name = "normalize"

    [dedup]                     # exact and MinHash near-duplicate removal across all sources
    threshold = 0.8

    [tokenizer]                 # train a byte-level BPE on a sample, or load a tokenizer.json
    vocab_size = 8192

Overrides work as for run configs: `--pipeline.workers=4`, `--dedup.threshold=0.7`.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from liandan.config import ConfigError, build_section, parse_override, read_toml
from liandan.config import option as _f
from liandan.data.steps.base import Step, build_step
from liandan.data.steps.langid import check_language_codes
from liandan.run.remote import is_url, locate


@dataclass
class PipelineSection:
    output: str = _f("data/pipeline", "directory that receives every stage's output and the token stores")
    publish: str = _f(
        "", "URL (s3://bucket/prefix, gs://...) or directory that receives each finished token store and the"
        " report, marker last; empty keeps them in the output directory only"
    )  # fmt: skip
    executor: Literal["local", "ray"] = _f("local", "local processes, or tasks on a Ray cluster")
    workers: int = _f(2, "parallel processes (local) or CPUs requested (ray)", min=1)
    ray_address: str = _f("", "Ray cluster to join (e.g. ray://head:10001); empty starts a local Ray")
    seed: int = _f(0, "seed of every random choice (tokenizer sample, MinHash permutations)", min=0)
    inspect: bool = _f(True, "write the inspection report of the final corpus")
    baseline: str = _f("", "an earlier report.json: flag sources whose statistics shifted since")


@dataclass
class InputSpec:
    name: str = _f("", "source name: its documents form one token store and one mixture component")
    paths: list[str] = _f(
        [], "files, URLs (s3://, gs://) or glob patterns (.txt, .jsonl, .parquet, optionally .gz/.zst)"
    )
    text_field: str = _f("text", "field holding the text in .jsonl and .parquet records")
    txt_mode: Literal["file", "paragraph", "line"] = _f("file", "what a document is in a .txt file")
    languages: list[str] = _f(
        [], "languages the source should hold (the report flags others); empty: the language step's languages"
    )
    provenance: Literal["input", "file"] = _f(
        "input", "what each document names as its source in the store's provenance: this input, or its file's path"
    )


@dataclass
class DedupSection:
    exact: bool = _f(True, "drop documents whose normalized text equals an earlier one")
    near: bool = _f(True, "drop near duplicates found by MinHash + LSH")
    threshold: float = _f(
        0.8, "Jaccard similarity of shingle sets above which documents are duplicates", min=0.05, max=1.0
    )
    ngram: int = _f(5, "words per shingle (each CJK character is a word)", min=1)
    num_perm: int = _f(112, "MinHash permutations", min=8, max=1024)
    bands: int = _f(0, "LSH bands; 0 chooses bands and rows from the threshold", min=0)
    rows: int = _f(0, "rows per band; 0 chooses them from the threshold", min=0)
    verify: bool = _f(True, "confirm candidate pairs by exact Jaccard before removing (bands then favour recall)")
    workers: int = _f(
        1,
        "jobs the near-dedup global phase is split into by band (local processes or Ray tasks, per [pipeline])",
        min=1,
    )


@dataclass
class TokenizerSection:
    kind: str = _f("bpe", "bpe (trained on a sample of the cleaned corpus), byte, or a path to a tokenizer.json")
    vocab_size: int = _f(8192, "BPE vocabulary size", min=260)
    sample_documents: int = _f(50_000, "documents, spread evenly over the corpus, that train the BPE", min=1)
    special_tokens: list[str] = _f([], "tokens the BPE keeps whole besides <|endoftext|> (e.g. chat markers)")


@dataclass
class PipelineConfig:
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    inputs: list[InputSpec] = field(default_factory=list)
    steps: list[dict[str, Any] | Step] = field(default_factory=list)
    dedup: DedupSection = field(default_factory=DedupSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)

    def check(self) -> None:
        if not self.inputs:
            raise ConfigError("the pipeline has no [[inputs]]")
        names = [i.name for i in self.inputs]
        for spec in self.inputs:
            if not spec.name or not spec.name.replace("-", "").replace("_", "").replace(".", "").isalnum():
                raise ConfigError(f"inputs.name = {spec.name!r} must be a non-empty name of letters, digits, - _ .")
            if not spec.paths:
                raise ConfigError(f"input '{spec.name}' has no paths")
            try:
                check_language_codes("inputs.languages", spec.languages)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"input '{spec.name}': {err}") from None
        if len(set(names)) != len(names):
            raise ConfigError(f"input names must differ; got {names}")
        for spec in self.steps:  # build once here so a bad step stops the run before any work
            if isinstance(spec, dict):
                build_step(spec)
        if bool(self.dedup.bands) != bool(self.dedup.rows):
            raise ConfigError("dedup.bands and dedup.rows are set together (or both left 0)")
        if self.dedup.bands and self.dedup.bands * self.dedup.rows > self.dedup.num_perm:
            raise ConfigError(
                f"dedup.bands x dedup.rows = {self.dedup.bands * self.dedup.rows} exceeds dedup.num_perm = {self.dedup.num_perm}"
            )

    def to_dict(self) -> dict[str, Any]:
        steps = [s if isinstance(s, dict) else {"name": s.name, "python": repr(s)} for s in self.steps]
        return {
            "pipeline": dataclasses.asdict(self.pipeline),
            "inputs": [_input_dict(i) for i in self.inputs],
            "steps": steps,
            "dedup": dataclasses.asdict(self.dedup),
            "tokenizer": dataclasses.asdict(self.tokenizer),
        }

    def to_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(self.to_dict())


def _input_dict(spec: InputSpec) -> dict[str, Any]:
    raw = dataclasses.asdict(spec)
    if not raw["languages"]:  # left out when unset, so outputs written before the option existed still resume
        del raw["languages"]
    return raw


def expected_languages(cfg: PipelineConfig) -> dict[str, list[str]]:
    """Per source, the languages the inspection expects: the input's own `languages`, else those the
    `language` step keeps; sources with neither are left out."""
    kept: list[str] = []
    for spec in cfg.steps:
        if isinstance(spec, dict) and spec.get("name") == "language":
            kept = list(spec.get("languages") or [])
        elif not isinstance(spec, dict) and spec.name == "language":
            kept = sorted(getattr(spec, "languages", []))
    return {i.name: list(i.languages or kept) for i in cfg.inputs if i.languages or kept}


_TABLES = {"pipeline": PipelineSection, "dedup": DedupSection, "tokenizer": TokenizerSection}


def load_pipeline(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Read a pipeline TOML, apply `--section.key=value` overrides, check it. Relative input paths are taken
    relative to the TOML file's folder."""
    raw = read_toml(path) if path is not None else {}
    for item in overrides:
        section, key, value = parse_override(item)
        if section not in _TABLES:
            raise ConfigError(f"override '{item}': only [{'], ['.join(_TABLES)}] keys can be overridden")
        raw.setdefault(section, {})[key] = value
    unknown = set(raw) - set(_TABLES) - {"inputs", "steps"}
    if unknown:
        raise ConfigError(
            f"unknown pipeline section(s) {sorted(unknown)}; allowed: {', '.join([*_TABLES, 'inputs', 'steps'])}"
        )
    built: dict[str, Any] = {k: build_section(k, cls, raw.get(k, {})) for k, cls in _TABLES.items()}
    inputs = raw.get("inputs", [])
    steps = raw.get("steps", [])
    if not isinstance(inputs, list) or not all(isinstance(i, dict) for i in inputs):
        raise ConfigError("inputs must be an array of tables: [[inputs]]")
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise ConfigError("steps must be an array of tables: [[steps]]")
    base = Path(path).parent if path is not None else Path(".")
    specs = []
    for item in inputs:
        spec = build_section("inputs", InputSpec, item)
        spec.paths = [_relative_to(base, p) for p in spec.paths]
        specs.append(spec)
    steps = [_resolve_step_paths(dict(s), base) for s in steps]
    for key in ("output", "baseline", "publish"):
        value = getattr(built["pipeline"], key)
        if value and not Path(value).is_absolute() and not any(o.startswith(f"--pipeline.{key}=") for o in overrides):
            setattr(built["pipeline"], key, _relative_to(base, value))
    cfg = PipelineConfig(inputs=specs, steps=steps, **built)
    cfg.check()
    return cfg


def _relative_to(base: Path, path: str) -> str:
    return path if Path(path).is_absolute() or is_url(path) else os.path.normpath(base / path)


# Step options that name files: like input paths, they are relative to the pipeline file.
_PATH_OPTIONS = ("eval_files", "word_files")


def _resolve_step_paths(spec: dict[str, Any], base: Path) -> dict[str, Any]:
    for key in _PATH_OPTIONS:
        if isinstance(spec.get(key), list):
            spec[key] = [_relative_to(base, p) for p in spec[key]]
    return spec


def expand_paths(spec: InputSpec) -> list[Path | str]:
    """The files of an input, sorted within each pattern, in the order the patterns are given; objects named by
    URL stay URLs."""
    from liandan.data.documents.corpus import DataError
    from liandan.data.documents.readers import files_in_directory
    from liandan.data.documents.storage import glob_url, is_file

    files: list[Path | str] = []
    for pattern in spec.paths:
        if is_url(pattern):
            found = glob_url(pattern) if glob.has_magic(pattern) else [pattern] if is_file(locate(pattern)) else []
            if not found:
                raise DataError(f"input '{spec.name}': no object matches {pattern}")
            files.extend(found)
        elif glob.has_magic(pattern):
            matches = sorted(Path(m) for m in glob.glob(pattern, recursive=True) if Path(m).is_file())
            if not matches:
                raise DataError(f"input '{spec.name}': no file matches {pattern}")
            files.extend(matches)
        elif Path(pattern).is_file():
            files.append(Path(pattern))
        elif Path(pattern).is_dir():
            files.extend(files_in_directory(Path(pattern), f"input '{spec.name}': {pattern}"))
        else:
            raise DataError(f"input '{spec.name}': data file not found: {pattern}")
    return files
