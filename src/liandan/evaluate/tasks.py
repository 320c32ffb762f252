"""Evaluation tasks: one small TOML file each, over a local jsonl (nothing is downloaded).

    name = "gsm8k"
    kind = "generation"                     # or "multiple_choice"
    path = "{data_dir}/eval/gsm8k-test.jsonl"
    question_field = "question"
    answer_field = "answer"                 # generation: the reference answer
    answer_regex = "#### (-?[0-9.,]+)"      # generation: what is compared, from the output and the reference
    stop = ["\\n\\n"]                       # generation: where the output ends (each format adds its own)
    max_new_tokens = 256
    n_shot = 5
    seed = 1234
    formats = ["qa", "qa_lower", "qa_upper_spaced", "q_a_inline", "plain"]

Multiple choice reads `choices_field` (a list of strings) and `label_field` (the index of the right one), or
builds its items from a corpus with `[generate]` (`liandan.evaluate.cloze`). `{data_dir}` in a path is
`[eval] data_dir` (`resolve_data_dir`); a relative path is taken from the task file's directory. Formats are
names of `BUILTIN_FORMATS` or `[[format]]` tables in the task file. Every mistake is one ConfigError naming the
file and the field (or the jsonl line).

`answer_regex` runs on the `regex` engine with a time limit (REGEX_TIMEOUT_S per search): a pattern that
backtracks catastrophically is one ConfigError naming the task and the item, never a hang.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import regex

from liandan import plugins
from liandan.config import ConfigError
from liandan.evaluate.formats import BUILTIN_FORMATS, PromptFormat, format_from_table

KINDS = ("multiple_choice", "generation")
ITEM_SPLITS = ("train", "heldout", "all")  # what `split_items` takes
HELDOUT_EVERY = 5  # every fifth item of a task (the 5th, 10th, ... in file order) is held out from fine-tuning
DEFAULT_DATA_DIR = "../shared/data"
# A source checkout's root (src/liandan/evaluate/tasks.py is three folders down): its ../shared/data is the
# default data directory wherever liandan runs from; an installed liandan has none.
SOURCE_ROOT = Path(__file__).resolve().parents[3]
REGEX_TIMEOUT_S = 1.0  # per search of answer_regex; a sane pattern takes microseconds on an answer


@dataclass
class Item:
    question: str
    answer: str  # generation: the reference text; multiple choice: the right choice
    choices: list[str] | None = None
    label: int = 0  # multiple choice: index of the right choice


@dataclass
class Task:
    name: str
    kind: str
    file: Path
    items: list[Item]
    formats: list[PromptFormat]
    n_shot: int = 0
    seed: int = 1234
    stop: list[str] = field(default_factory=list)
    answer_regex: regex.Pattern | None = None
    max_new_tokens: int = 256
    description: str = ""
    data_path: Path | None = None  # the jsonl or corpus the items come from (contamination checks read it)

    def shots(self, index: int) -> list[Item]:
        """The few-shot examples of item `index`: `n_shot` other items, the same for every format and run."""
        if not self.n_shot:
            return []
        others = [i for i in range(len(self.items)) if i != index]
        picked = random.Random(f"{self.seed}:{index}").sample(others, min(self.n_shot, len(others)))
        return [self.items[i] for i in picked]

    def extract(self, text: str, what: str = "a text") -> str | None:
        """The compared answer in a generated or reference text: the regex's first group at its first match,
        without thousands commas or a trailing full stop; the stripped text when the task has no regex. A
        search that runs past REGEX_TIMEOUT_S is a ConfigError naming `what` was searched."""
        if self.answer_regex is None:
            return text.strip()
        try:
            match = self.answer_regex.search(text, timeout=REGEX_TIMEOUT_S)
        except TimeoutError:
            raise ConfigError(
                f"{self.file}: task {self.name}: answer_regex {self.answer_regex.pattern!r} ran over"
                f" {REGEX_TIMEOUT_S:g}s on {what} ({len(text)} characters): it backtracks without end; simplify"
                " it"
            ) from None
        if match is None:
            return None
        found = match.group(1) if match.groups() else match.group(0)
        return found.strip().replace(",", "").rstrip(".")


def split_items(count: int, split: str) -> list[int]:
    """The indices (0-based, in file order) of a task's items in `split`, by the one fixed rule that keeps
    fine-tuning and held-out items apart wherever they are drawn (`liandan prefs`, benchmarks, reports): item
    i is held out when i % HELDOUT_EVERY == HELDOUT_EVERY - 1 (the 5th, 10th, 15th, ...), the rest are for
    training; "all" is every item."""
    if split not in ITEM_SPLITS:
        raise ConfigError(f"items split {split!r} is not one of {', '.join(ITEM_SPLITS)}")
    if split == "all":
        return list(range(count))
    heldout = split == "heldout"
    return [i for i in range(count) if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == heldout]


_KEYS = {
    "name": str, "kind": str, "description": str, "path": str, "question_field": str, "answer_field": str,
    "choices_field": str, "label_field": str, "answer_regex": str, "stop": list, "max_new_tokens": int,
    "n_shot": int, "seed": int, "formats": list, "format": list, "generate": dict,
}  # fmt: skip


def resolve_task_files(names: list[str]) -> list[Path]:
    """Task names (task plug-ins: liandan's own, shipped under liandan/evaluate/tasks, and any a package
    registers) or paths of task files."""
    files = []
    for name in names:
        path = Path(name)
        if path.suffix == ".toml" or path.is_file():
            if not path.is_file():
                raise ConfigError(f"task file not found: {path}")
            files.append(path)
            continue
        try:
            files.append(Path(plugins.load("task", name)))
        except plugins.PluginError:
            known = ", ".join(plugins.names("task"))
            raise ConfigError(
                f"unknown task '{name}'; known tasks: {known}; or give a path to a .toml task file"
            ) from None
    return files


def load_tasks(names: list[str], data_dir: str = DEFAULT_DATA_DIR, config_dir: Path | None = None) -> list[Task]:
    """The tasks named; a relative `data_dir` is looked for as `resolve_data_dir` says."""
    return [load_task(path, data_dir, config_dir) for path in resolve_task_files(names)]


def resolve_data_dir(data_dir: str, config_dir: Path | None = None) -> Path:
    """What `{data_dir}` stands for. A relative `[eval] data_dir` is taken from the first of these where it
    is a directory: the directory of the config file that holds it (`config_dir`, when known), the working
    directory, and the root of a source checkout of liandan (whose ../shared/data is the default); where
    it is in none of them, from the working directory, as it always was (the error that follows names it)."""
    given = Path(data_dir).expanduser()
    if given.is_absolute():
        return given
    bases = [config_dir, Path.cwd()]
    if (SOURCE_ROOT / "pyproject.toml").is_file():
        bases.append(SOURCE_ROOT)
    candidates = [(base / given).resolve() for base in bases if base is not None]
    return next((c for c in candidates if c.is_dir()), (Path.cwd() / given).resolve())


def load_task(path: str | Path, data_dir: str = DEFAULT_DATA_DIR, config_dir: Path | None = None) -> Task:
    import tomllib

    path = Path(path)
    data_dir = str(resolve_data_dir(data_dir, config_dir))
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"task file not found: {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    for key, value in raw.items():
        if key not in _KEYS:
            raise ConfigError(f"{path}: unknown field '{key}'; allowed: {', '.join(_KEYS)}")
        if not isinstance(value, _KEYS[key]) or (_KEYS[key] is int and isinstance(value, bool)):
            raise ConfigError(f"{path}: field '{key}' must be a {_KEYS[key].__name__}, got {value!r}")
    for key in ("name", "kind"):
        if key not in raw:
            raise ConfigError(f"{path}: missing field '{key}'")
    kind = raw["kind"]
    if kind not in KINDS:
        raise ConfigError(f"{path}: kind = {kind!r} is not allowed; choose one of {', '.join(KINDS)}")
    for key in ("n_shot", "seed"):
        if raw.get(key, 0) < 0:
            raise ConfigError(f"{path}: field '{key}' must be >= 0, got {raw[key]}")
    if raw.get("max_new_tokens", 1) < 1:
        raise ConfigError(f"{path}: field 'max_new_tokens' must be >= 1, got {raw['max_new_tokens']}")
    if not all(isinstance(s, str) and s for s in raw.get("stop", [])):
        raise ConfigError(f"{path}: field 'stop' must be a list of non-empty strings")
    pattern = None
    if "answer_regex" in raw:
        try:
            pattern = regex.compile(raw["answer_regex"])
        except regex.error as err:
            raise ConfigError(f"{path}: field 'answer_regex' = {raw['answer_regex']!r} is not a valid regular"
                              f" expression: {err}") from None  # fmt: skip
    formats = _formats(path, raw)
    items, data_path = _items(path, raw, data_dir)
    task = Task(
        name=raw["name"], kind=kind, file=path, items=items, formats=formats, n_shot=raw.get("n_shot", 0),
        seed=raw.get("seed", 1234), stop=list(raw.get("stop", [])), answer_regex=pattern,
        max_new_tokens=raw.get("max_new_tokens", 256), description=raw.get("description", ""), data_path=data_path,
    )  # fmt: skip
    if task.kind == "generation":  # a pattern that hangs on a reference answer fails here, before any model loads
        for number, item in enumerate(task.items, 1):
            task.extract(item.answer, f"the reference answer of item {number}")
    return task


def _formats(path: Path, raw: dict[str, Any]) -> list[PromptFormat]:
    inline = {}
    if not all(isinstance(name, str) for name in raw.get("formats", [])):
        raise ConfigError(f"{path}: field 'formats' must be a list of format names (strings), got {raw['formats']!r}")
    for number, table in enumerate(raw.get("format", []), 1):
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [[format]] number {number} must be a table")
        fmt = format_from_table(f"{path}: [[format]] number {number}", table)
        inline[fmt.name] = fmt
    names = raw.get("formats") or [*inline] or list(BUILTIN_FORMATS)
    chosen = []
    for name in names:
        fmt = inline.get(name) or BUILTIN_FORMATS.get(name)
        if fmt is None:
            allowed = ", ".join([*inline, *BUILTIN_FORMATS])
            raise ConfigError(f"{path}: field 'formats' names unknown format {name!r}; known: {allowed}")
        chosen.append(fmt)
    return chosen


def resolve_data_path(task_file: Path, text: str, data_dir: str) -> Path:
    data = Path(text.replace("{data_dir}", data_dir))
    return data if data.is_absolute() or "{data_dir}" in text else task_file.parent / data


def missing_data_hint(text: str) -> str:
    """What to do about a missing file whose path was written with {data_dir}."""
    if "{data_dir}" not in text:
        return ""
    return " ({data_dir} is [eval] data_dir: give the data's directory with --data-dir or [eval] data_dir)"


def _items(path: Path, raw: dict[str, Any], data_dir: str) -> tuple[list[Item], Path]:
    if "generate" in raw:
        if raw["kind"] != "multiple_choice":
            raise ConfigError(f"{path}: field 'generate' builds multiple-choice items; kind must be multiple_choice")
        from liandan.evaluate.cloze import cloze_items

        return cloze_items(path, raw["generate"], data_dir)
    if "path" not in raw:
        raise ConfigError(f"{path}: missing field 'path' (the jsonl of the task's items)")
    data = resolve_data_path(path, raw["path"], data_dir)
    if not data.is_file():
        raise ConfigError(f"{path}: field 'path': jsonl not found: {data}{missing_data_hint(raw['path'])}")
    needed = ["question_field", "answer_field"] if raw["kind"] == "generation" else ["question_field", "choices_field",
                                                                                     "label_field"]  # fmt: skip
    for key in needed:
        if key not in raw:
            raise ConfigError(f"{path}: missing field '{key}' (needed by kind = {raw['kind']!r})")
    items = []
    for number, record in read_jsonl(data, path):
        items.append(_item(record, raw, f"{data}:{number} (task {path})"))
    if not items:
        raise ConfigError(f"{path}: field 'path': {data} holds no items")
    return items, data


def read_jsonl(data: Path, task_file: Path) -> list[tuple[int, dict]]:
    records = []
    try:
        lines = data.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{data} (task {task_file}): not valid UTF-8 (byte {err.start})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{data}:{number} (task {task_file}): invalid JSON line ({err.msg})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{data}:{number} (task {task_file}): expected a JSON object")
        records.append((number, record))
    return records


def _item(record: dict, raw: dict[str, Any], where: str) -> Item:
    def text(key: str) -> str:
        name = raw[key]
        if not isinstance(record.get(name), str):
            raise ConfigError(f"{where}: field '{name}' ({key}) is missing or not a string")
        return record[name]

    if raw["kind"] == "generation":
        return Item(text("question_field"), text("answer_field"))
    choices, label = record.get(raw["choices_field"]), record.get(raw["label_field"])
    if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) for c in choices)):
        raise ConfigError(f"{where}: field '{raw['choices_field']}' (choices_field) must be a list of 2+ strings")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise ConfigError(f"{where}: field '{raw['label_field']}' (label_field) must be an index into the choices")
    return Item(text("question_field"), choices[label], choices, label)
