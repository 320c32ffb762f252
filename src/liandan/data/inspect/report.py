"""Rendering an inspection (the dict that `inspect_sources` also writes as report.json) as a self-contained
report.html (plots embedded as PNG) and a report.md summary. Both come from one layout, a list of blocks
(headings, paragraphs, tables, plots), so they always say the same; flags come first."""

from __future__ import annotations

import base64
import html
import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from liandan.data.documents.corpus import DataError
from liandan.data.inspect.charclass import CHAR_CLASSES, members, visible


def write_reports(data: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"cannot create report directory {out_dir}: {err.strerror}") from None
    paths = {"html": out_dir / "report.html", "markdown": out_dir / "report.md", "json": out_dir / "report.json"}
    # A lone surrogate (possible in JSON input) cannot be UTF-8; it is written as its escape, which a JSON
    # reader turns back into the same character.
    text = {
        "json": json.dumps(data, indent=1, ensure_ascii=False) + "\n",
        "markdown": render_markdown(data),
        "html": render_html(data),
    }
    for kind, path in paths.items():
        path.write_text(text[kind], encoding="utf-8", errors="backslashreplace")
    return paths


def _pct(x: float) -> str:
    return f"{x * 100:.3g}%"


def _is_share(flag: dict) -> bool:
    return not flag["statistic"].startswith("median") and flag["statistic"] != "documents"


def _range(flag: dict) -> str:
    low, high = flag["expected"]
    fmt = _pct if _is_share(flag) else (lambda v: f"{v:g}")
    if high is None:
        return f"≥ {fmt(low)}"
    return f"≤ {fmt(high)}" if low == 0 else f"{fmt(low)} .. {fmt(high)}"


def _flag_value(flag: dict) -> str:
    return _pct(flag["value"]) if _is_share(flag) else f"{flag['value']:g}"


# ------------------------------------------------------------------------------------------------ layout


class Code(str):
    """Corpus text in a table cell: shown verbatim (monospace), never interpreted."""


@dataclass
class Table:
    header: list[str]
    rows: list[list[Any]]
    flagged: set[int] = field(default_factory=set)  # row indices to highlight


@dataclass
class Plot:
    png: Callable[[], str]  # base64 PNG, drawn only for the HTML
    alt: str


Block = tuple[str, str] | Table | Plot  # ("h1" | "h2" | "h3" | "p" | "flags" | "ok", text)
_PERCENTILE_KEYS = ("p1", "p5", "p25", "p50", "p75", "p95", "p99")


def layout(data: dict[str, Any]) -> list[Block]:
    flags, sources = data["flags"], data["sources"]
    blocks: list[Block] = [("h1", "Data inspection"), ("flags" if flags else "ok", f"Flags ({len(flags)})")]
    if flags:
        rows = [
            [f["source"], f["statistic"], _flag_value(f), _range(f), f["message"], Code(f["example"])] for f in flags
        ]
        blocks.append(Table(["source", "statistic", "value", "expected", "what", "example"], rows))
    else:
        blocks.append(("p", "No anomalies found."))
    if data.get("baseline"):
        blocks.append(("p", f"Compared with baseline {data['baseline']}."))
    blocks.append(("h2", "Sources"))
    blocks.append(Table(["source", "documents", "sampled", "median characters", "median words", "flags"], [
        [name, s["documents"], s["sampled"], s["lengths"]["characters"].get("p50", "-"),
         s["lengths"]["words"].get("p50", "-"), sum(f["source"] == name for f in flags)]
        for name, s in sources.items()
    ]))  # fmt: skip
    limits = data["settings"]["class_limits"]
    blocks.append(Plot(lambda: _class_plot(sources, limits), "character class shares per source"))
    for name, s in sources.items():
        blocks += _source_blocks(name, s, [f for f in flags if f["source"] == name])
    if data.get("dedup"):
        blocks += [("h2", "Deduplication"), Table(["statistic", "value"], [list(kv) for kv in data["dedup"].items()])]
    if data.get("steps"):
        blocks.append(("h2", "Pipeline steps"))
    for step in data.get("steps") or []:
        n_in = max(step["documents_in"], 1)
        rows = [[why, n, _pct(n / n_in)] for why, n in step["dropped"].items()]
        rows += [[f"changed: {what}", n, _pct(n / n_in)] for what, n in step["changed"].items()]
        blocks.append(("h3", f"Step {step['name']}: {step['documents_in']} in, {step['documents_out']} out"))
        blocks.append(
            Table(["reason", "documents", "of input"], rows) if rows else ("p", "Nothing dropped or changed.")
        )
    return blocks


def _source_blocks(name: str, s: dict[str, Any], flags: list[dict]) -> list[Block]:
    blocks: list[Block] = [("h2", name)]
    if s.get("records_skipped"):
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(s["records_skipped"].items()))
        blocks.append(("p", f"Records that could not be read and are left out of these statistics: {skipped}."))
    if not s["sampled"]:
        return blocks + [("p", "No documents.")]
    blocks.append(("p", f"{s['documents']} documents; statistics from {s['sampled']} sampled."))
    blocks.append(Plot(lambda: _length_plot(name, s["lengths"]), f"{name}: lengths"))
    blocks.append(Table(["length", *_PERCENTILE_KEYS, "mean", "max"], [
        [unit, *[d[k] for k in _PERCENTILE_KEYS], d["mean"], d["max"]] for unit, d in s["lengths"].items() if d["count"]
    ]))  # fmt: skip
    if s["languages"] and s.get("languages_expected"):
        blocks += _language_blocks(s["languages"], s["languages_expected"], flags)
    elif s["languages"]:
        blocks.append(Table(["language", "share"], [[lang, _pct(v)] for lang, v in s["languages"].items()]))
    flagged = {f["statistic"].removesuffix(" share") for f in flags}
    classes = s["char_classes"]
    rows = [
        [c, _pct(v["share"]), v["denominator"], _pct(v["doc_share"]), Code(members(v["top"])),
         Code(f"{v['example']['doc_id']}: {v['example']['snippet']}" if v["example"] else "")]
        for c, v in classes.items()
    ]  # fmt: skip
    header = ["class", "share", "of", "in documents", "most frequent", "example"]
    blocks += [("h3", "Character classes"), Table(header, rows, {i for i, c in enumerate(classes) if c in flagged})]
    blocks.append(("h3", f"Most repeated lines (of {s['lines']['total']} non-empty lines)"))
    blocks.append(
        Table(
            ["count", "documents", "line"], [[e["count"], e["documents"], Code(e["line"])] for e in s["lines"]["top"]]
        )
    )
    for n, top in s["ngrams"].items():
        blocks.append(("h3", f"Most repeated {n}-grams"))
        blocks.append(
            Table(["count", "documents", "n-gram"], [[e["count"], e["documents"], Code(e["ngram"])] for e in top])
        )
    blocks.append(Table(["documents", "count"], [
        ["exact duplicates (normalized text)", s["duplicates"]["exact_duplicates"]],
        ["empty", s["documents_empty"]],
        ["short", s["documents_short"]],
    ]))  # fmt: skip
    return blocks


def _language_blocks(shares: dict[str, float], expected: list[str], flags: list[dict]) -> list[Block]:
    unexpected = {f["statistic"].split(" ")[0] for f in flags if f["kind"] == "unexpected_language"}
    rows = [[lang, _pct(v), "yes" if lang in expected else "no"] for lang, v in shares.items()]
    return [
        ("p", f"Expected languages: {', '.join(expected)}."),
        Table(["language", "share", "expected"], rows, {i for i, lang in enumerate(shares) if lang in unexpected}),
    ]


# ---------------------------------------------------------------------------------------------- markdown


_MD_SPECIAL = re.compile(r"([\\`*<&|\[\]])")


def _md(cell: Any) -> str:
    """Prose: characters markdown would act on escaped. Corpus text (Code): a code span, shown as it is."""
    text = visible(str(cell))
    if not isinstance(cell, Code):
        return _MD_SPECIAL.sub(r"\\\1", text)
    if not text:
        return ""
    text = text.replace("|", "\\|")  # the one character a table cell needs escaped even in a code span
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    return f"{fence} {text} {fence}" if text[0] == "`" or text[-1] == "`" else f"{fence}{text}{fence}"


def render_markdown(data: dict[str, Any]) -> str:
    out = []
    for block in layout(data):
        if isinstance(block, Table):
            out.append("| " + " | ".join(block.header) + " |")
            out.append("|" + "---|" * len(block.header))
            out += ["| " + " | ".join(_md(c) for c in row) + " |" for row in block.rows]
        elif isinstance(block, tuple):
            kind, text = block
            level = {"h1": "# ", "h2": "## ", "h3": "### ", "flags": "## ", "ok": "## "}.get(kind, "")
            out.append(level + _md(text))
        else:
            continue
        out.append("")
    return "\n".join(out)


# -------------------------------------------------------------------------------------------------- html


_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: .6em 0 1.2em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.flagged td { background: #fde2e2; }
code { background: #f3f3f3; padding: 0 3px; white-space: pre-wrap; word-break: break-all; }
h2.flags { color: #c0392b; } h2.ok { color: #27ae60; }
"""


_FLAGGED = ' class="flagged"'


def _esc(text: Any) -> str:
    return html.escape(visible(str(text)))


def _html_cell(cell: Any) -> str:
    if isinstance(cell, Code):
        return f"<td><code>{_esc(cell)}</code></td>" if cell else "<td></td>"
    if isinstance(cell, (int, float)):
        return f'<td class="num">{_esc(cell)}</td>'
    return f"<td>{_esc(cell)}</td>"


def render_html(data: dict[str, Any]) -> str:
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Data inspection</title><style>{_CSS}</style>"]
    parts.append("</head><body>")
    for block in layout(data):
        if isinstance(block, Table):
            head = "".join(f"<th>{_esc(h)}</th>" for h in block.header)
            rows = [
                f"<tr{_FLAGGED if i in block.flagged else ''}>{''.join(map(_html_cell, row))}</tr>"
                for i, row in enumerate(block.rows)
            ]
            parts.append(f"<table><tr>{head}</tr>{''.join(rows)}</table>")
        elif isinstance(block, Plot):
            parts.append(f'<p><img alt="{_esc(block.alt)}" src="data:image/png;base64,{block.png()}"></p>')
        else:
            kind, text = block
            tag = {"flags": "h2", "ok": "h2"}.get(kind, kind)
            css = f' class="{kind}"' if kind in ("flags", "ok") else ""
            parts.append(f"<{tag}{css}>{_esc(text)}</{tag}>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> str:
    buffer = io.BytesIO()
    # No software/version metadata, so the same statistics give the same bytes.
    fig.savefig(buffer, format="png", dpi=90, metadata={"Software": None})
    _pyplot().close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _img(png_base64: str, alt: str) -> str:
    return f'<p><img alt="{_esc(alt)}" src="data:image/png;base64,{png_base64}"></p>'


def _length_plot(name: str, lengths: dict[str, Any]) -> str:
    plt = _pyplot()
    units = [u for u, d in lengths.items() if d.get("histogram")]
    fig, axes = plt.subplots(1, len(units), figsize=(4.2 * len(units), 3.0), squeeze=False)
    for ax, unit in zip(axes[0], units):
        hist = lengths[unit]["histogram"]
        ax.stairs(hist["counts"], hist["edges"], fill=True, alpha=0.7)
        ax.axvline(lengths[unit]["p50"], color="k", lw=1, ls="--", label=f"median {lengths[unit]['p50']:g}")
        ax.set(xscale="log", title=f"{unit} per document", ylabel="documents")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(name, fontsize=10)
    fig.tight_layout()
    return _png(fig)


def _class_plot(sources: dict[str, Any], limits: dict[str, float]) -> str:
    """Each class's share per source on a log axis, with the share above which it is flagged."""
    plt = _pyplot()
    names = [c.name for c in CHAR_CLASSES]
    live = {n: s for n, s in sources.items() if s["sampled"]}
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.2))
    height = 0.8 / max(len(live), 1)
    for k, (source, s) in enumerate(live.items()):
        shares = [max(s["char_classes"][c]["share"], 1e-7) for c in names]
        ax.barh([i + k * height for i in range(len(names))], shares, height=height, label=source)
    for i, name in enumerate(names):
        if name in limits:
            ax.plot([limits[name]] * 2, [i - 0.1, i + 0.9], color="#c0392b", lw=2)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(names))], names)
    ax.set(xscale="log", xlabel="share of characters (red: flagged above)", xlim=(1e-7, 1.5))
    ax.invert_yaxis()
    if live:  # no source sampled (all empty): no bars, so no legend (matplotlib would warn of one)
        ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return _png(fig)
