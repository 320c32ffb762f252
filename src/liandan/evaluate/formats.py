"""Prompt formats: several semantically equal ways to lay out the same few-shot prompt.

A score that moves when "Answer:" becomes "ANSWER :" measures the format, not the model (Sclar et al. 2023
found spreads of tens of points from formatting alone), so every task runs under each of its formats and
reports the mean, min, max and spread. A format changes only the wrapping: the labels before the question
and the answer, their casing, the separators and spacing, and how listed choices are labelled. The question
and the answer text, and the continuation a multiple-choice item is scored on, stay the same.

    Question: <question>          <- input_label + label_sep, then the question
    A. <choice 1>                  <- choice lines, only when the format lists choices
    Answer: <answer>               <- output_label + label_sep (stripped), target_sep, then the answer
    <shot_sep>
    Question: <next question> ...
"""

from __future__ import annotations

import dataclasses
import string
from dataclasses import dataclass
from typing import Any, Literal

from liandan.config import ConfigError

ChoiceLabels = Literal["none", "letters", "lower_letters", "numbers"]
Casing = Literal["as_is", "lower", "upper"]


@dataclass(frozen=True)
class PromptFormat:
    name: str
    input_label: str = "Question"
    output_label: str = "Answer"
    label_sep: str = ": "
    field_sep: str = "\n"
    shot_sep: str = "\n\n"
    target_sep: str = " "
    casing: Casing = "as_is"
    choice_labels: ChoiceLabels = "none"
    choice_mark: str = ". "

    def context(self, question: str, choices: list[str] | None = None) -> str:
        """The prompt of one item up to where its answer starts (no trailing separator)."""
        parts = [self._label(self.input_label) + question]
        if choices and self.choice_labels != "none":
            parts += [f"{self.choice_label(i)}{self.choice_mark}{choice}" for i, choice in enumerate(choices)]
        if self.output_label:
            parts.append(self._label(self.output_label).rstrip())
        return self.field_sep.join(parts)

    def target(self, answer: str) -> str:
        """What follows the context: the scored continuation of a choice, or a shot's answer."""
        return self.target_sep + answer

    def prompt(self, shots: list[tuple[str, str, list[str] | None]], question: str, choices: list[str] | None) -> str:
        """The few-shot prompt: each shot (question, answer, choices) answered, then the item's context."""
        done = [self.context(q, c) + self.target(a) for q, a, c in shots]
        return self.shot_sep.join([*done, self.context(question, choices)])

    def stop_strings(self) -> list[str]:
        """Where a generated answer ends in this format: the next shot's separator, the next question's label."""
        stops = [self.shot_sep]
        if self.input_label:
            stops.append(self.field_sep + self._label(self.input_label).rstrip())
        return stops

    def choice_label(self, index: int) -> str:
        if self.choice_labels == "numbers":
            return str(index + 1)
        letters = string.ascii_uppercase if self.choice_labels == "letters" else string.ascii_lowercase
        return letters[index % 26]

    def _label(self, label: str) -> str:
        if not label:
            return ""
        cased = label.lower() if self.casing == "lower" else label.upper() if self.casing == "upper" else label
        return cased + self.label_sep


# Semantically equal layouts; every separator between shots keeps a blank line, so a multi-line answer (a GSM8K
# solution) never looks like the end of a shot.
BUILTIN_FORMATS: dict[str, PromptFormat] = {
    f.name: f
    for f in (
        PromptFormat("qa", choice_labels="letters"),
        PromptFormat("qa_lower", casing="lower", choice_labels="numbers", choice_mark=") "),
        PromptFormat(
            "qa_upper_spaced", casing="upper", label_sep=" : ", choice_labels="lower_letters", choice_mark=" - "
        ),
        PromptFormat("q_a_inline", input_label="Q", output_label="A", field_sep=" ", shot_sep="\n\n\n"),
        PromptFormat("plain", input_label="", output_label="", target_sep="\n"),
    )
}

_FIELDS = {f.name: f for f in dataclasses.fields(PromptFormat)}


def format_from_table(where: str, table: dict[str, Any]) -> PromptFormat:
    """A format written inline in a task file ([[format]] with a name and any fields to change from "qa")."""
    for key, value in table.items():
        if key not in _FIELDS:
            raise ConfigError(f"{where}: unknown format field '{key}'; allowed: {', '.join(_FIELDS)}")
        if not isinstance(value, str):
            raise ConfigError(f"{where}: format field '{key}' must be a string, got {value!r}")
    if not table.get("name"):
        raise ConfigError(f"{where}: missing field 'name'")
    choices = {"casing": Casing, "choice_labels": ChoiceLabels}
    for key, allowed in choices.items():
        if key in table and table[key] not in allowed.__args__:
            raise ConfigError(f"{where}: {key} = {table[key]!r}; choose one of {', '.join(allowed.__args__)}")
    return PromptFormat(**table)
