"""How a strategy report looks: its charts, the pipeline-schedule simulation the timeline draws, and the
Markdown and HTML rendering of its sections (``planner.explain`` decides what the sections say).

Every chart is drawn on a bare ``matplotlib.figure.Figure`` (the Agg canvas, no ``pyplot``), so making a
report never touches the caller's interactive backend or global figure state; each returns PNG bytes.

The timeline is a small discrete-event simulation of the schedule's *order*: every stage runs its
operations in the order the schedule prescribes, and an operation starts when its stage is free and the
operation it depends on (the previous virtual stage's forward, the next one's backward) has finished.
Durations come from ``Estimate.stage_time_per_micro_batch_s``: a stage's forward is its forward compute,
its backward is backward plus recomputation, and its tensor-parallel and point-to-point seconds are
shared between the two in proportion to their compute. Orders:

- GPipe: every forward, then every backward (Huang et al., NeurIPS'19).
- 1F1B: ``pp - s - 1`` warm-up forwards on stage ``s``, then one forward / one backward, then the
  remaining backwards (Narayanan et al., SC'21, Sec. 2.2).
- Interleaved: Megatron-LM's order over ``V`` chunks per rank, micro-batches in groups of ``pp``, with
  ``2 (pp - s - 1) + (V - 1) pp`` warm-up forwards (Narayanan et al., SC'21, Sec. 2.2).
- Zero-bubble (ZB-H1): 1F1B's order with each backward split into an input-gradient pass ``B`` and a
  weight-gradient pass ``W`` of half the backward each; stage ``s`` defers up to ``s`` ``W`` passes to
  its cool-down, so the backward chain hops stage to stage at ``B``'s pace and the deferred ``W`` fill
  the cool-down. With equal F, B and W this gives the paper's bubble ``(pp - 1)(F + B - W)``, a third of
  1F1B's (Qi et al., ICLR'24, Sec. 3).

The simulation draws the schedule's shape; the step time the report states is the cost model's.
"""

from __future__ import annotations

import base64
import html
import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tessera.files import MARK, write_atomically, written_by_tessera_beside

GiB = 2**30
COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
CATEGORY_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")
TERM_COLORS = {"compute": "#4c72b0", "recompute": "#dd8452", "exposed": "#55a868", "bubble": "#c44e52",
               "optimizer": "#8172b3"}
KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}

REPORT_MD = "report.md"
"""The Markdown report's file name; its charts are written beside it (``tessera plan --format md --out DIR``)."""


@dataclass(frozen=True)
class TimelineOp:
    """One pass of one micro-batch through one chunk on one pipeline stage, placed in time."""

    kind: str  # "F" forward, "B" backward (input gradient for zero-bubble), "W" weight gradient
    stage: int
    micro_batch: int
    chunk: int
    start_s: float
    end_s: float


class ScheduleDeadlock(RuntimeError):
    """The per-stage orders wait on each other: no stage can run its next operation."""


def simulate_schedule(
    schedule: str, stage_times: Sequence[Mapping[str, float]], *, micro_batches: int, virtual_stages: int = 1
) -> list[TimelineOp]:
    """Place every operation of ``micro_batches`` micro-batches of ``schedule`` on ``len(stage_times)`` stages."""
    p, v = len(stage_times), (virtual_stages if schedule == "interleaved" else 1)
    orders = [_stage_order(schedule, stage, p=p, v=v, m=micro_batches) for stage in range(p)]
    durations = [_pass_durations(times, v=v, split_weight=schedule == "zero-bubble") for times in stage_times]
    return _run_orders(orders, durations, p=p, v=v)


def _pass_durations(times: Mapping[str, float], *, v: int, split_weight: bool) -> dict[str, float]:
    """Seconds of one chunk's F, B (and W) for one micro-batch on a stage."""
    forward, backward = times.get("forward", 0.0), times.get("backward", 0.0) + times.get("recompute", 0.0)
    comm = sum(times.get(kind, 0.0) for kind in ("tp_comm", "pp_comm", "ep_comm", "cp_comm"))
    share = forward / (forward + backward) if forward + backward > 0 else 0.5
    f, b = (forward + comm * share) / v, (backward + comm * (1 - share)) / v
    return {"F": f, "B": b / 2, "W": b / 2} if split_weight else {"F": f, "B": b}


def _stage_order(schedule: str, stage: int, *, p: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """The (kind, micro_batch, chunk) operations stage ``stage`` runs, in order."""
    forwards = [(mb, c) for group in range(0, m, p) for c in range(v) for mb in range(group, min(group + p, m))]
    backwards = [(mb, v - 1 - c) for mb, c in forwards]
    if schedule == "gpipe":
        return [("F", mb, c) for mb, c in forwards] + [("B", mb, c) for mb, c in backwards]
    warmup = min(2 * (p - stage - 1) + (v - 1) * p if v > 1 else p - stage - 1, len(forwards))
    order = [("F", mb, c) for mb, c in forwards[:warmup]]
    for i in range(len(forwards) - warmup):
        order += [("F", *forwards[warmup + i]), ("B", *backwards[i])]
    order += [("B", mb, c) for mb, c in backwards[len(forwards) - warmup :]]
    return _defer_weight_passes(order, limit=stage) if schedule == "zero-bubble" else order


def _defer_weight_passes(order: list[tuple[str, int, int]], *, limit: int) -> list[tuple[str, int, int]]:
    """Follow each B with its W, keeping up to ``limit`` W passes pending (ZB-H1)."""
    result, pending = [], []
    for op in order:
        result.append(op)
        if op[0] == "B":
            pending.append(("W", op[1], op[2]))
            while len(pending) > limit:
                result.append(pending.pop(0))
    return result + pending


def _dependency(kind: str, stage: int, mb: int, chunk: int, *, p: int, v: int) -> tuple | None:
    """The operation (on another stage) this one waits for, or None."""
    virtual = chunk * p + stage
    if kind == "F" and virtual > 0:
        return ("F", (virtual - 1) % p, mb, (virtual - 1) // p)
    if kind == "B" and virtual < p * v - 1:
        return ("B", (virtual + 1) % p, mb, (virtual + 1) // p)
    return None  # the last virtual stage's B follows its own F; W follows its own B (same stage, in order)


def _run_orders(
    orders: list[list[tuple[str, int, int]]], durations: list[dict[str, float]], *, p: int, v: int
) -> list[TimelineOp]:
    finished: dict[tuple, float] = {}
    position, clock, placed = [0] * p, [0.0] * p, []
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for stage in range(p):
            while position[stage] < len(orders[stage]):
                kind, mb, chunk = orders[stage][position[stage]]
                needs = _dependency(kind, stage, mb, chunk, p=p, v=v)
                if needs is not None and needs not in finished:
                    break
                start = max(clock[stage], finished.get(needs, 0.0))
                clock[stage] = start + durations[stage][kind]
                finished[(kind, stage, mb, chunk)] = clock[stage]
                placed.append(TimelineOp(kind, stage, mb, chunk, start, clock[stage]))
                position[stage] += 1
                progressed = True
        if not progressed:
            raise ScheduleDeadlock(f"schedule orders deadlock at positions {position}")
    return placed


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight", metadata={"Software": MARK})
    return buffer.getvalue()


def _figure(width: float, height: float):
    from matplotlib.figure import Figure  # imported here: planning never pays for matplotlib

    return Figure(figsize=(width, height), layout="constrained")


def memory_chart(stages: Sequence[Mapping[str, int]], *, budget_bytes: int) -> bytes:
    """Stacked bars of each pipeline stage's peak memory by category, with the device limit as a line."""
    figure = _figure(max(5.0, 1.0 + 0.7 * len(stages)), 4.0)
    axes = figure.subplots()
    names = [f"stage {i}" for i in range(len(stages))] if len(stages) > 1 else ["every device"]
    bottoms = [0.0] * len(stages)
    categories = list(dict.fromkeys(key for stage in stages for key in stage))
    for index, category in enumerate(categories):
        heights = [stage.get(category, 0) / GiB for stage in stages]
        axes.bar(names, heights, bottom=bottoms, label=category, color=CATEGORY_COLORS[index % len(CATEGORY_COLORS)])
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    axes.axhline(budget_bytes / GiB, color="#c00000", linestyle="--", linewidth=1.5)
    axes.annotate(f"device limit {budget_bytes / GiB:.0f} GiB", (0, budget_bytes / GiB), xycoords=("axes fraction", "data"),
                  xytext=(4, 3), textcoords="offset points", color="#c00000", fontsize=8)
    axes.set_ylim(0, max(max(bottoms), budget_bytes / GiB) * 1.12)
    axes.set_ylabel("GiB per device")
    axes.set_title("Peak memory per pipeline stage")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if len(stages) > 8:
        axes.tick_params(axis="x", labelrotation=45)
    return _png(figure)


def breakdown_chart(terms: Mapping[str, float], *, step_time_s: float) -> bytes:
    """Horizontal bars of the step time's terms, each labelled with seconds and share of the step."""
    figure = _figure(7.0, 0.45 * len(terms) + 1.2)
    axes = figure.subplots()
    names, values = list(terms)[::-1], list(terms.values())[::-1]
    bars = axes.barh(names, values, color=[_term_color(name) for name in names])
    for bar, value in zip(bars, values):
        share = value / step_time_s if step_time_s else 0.0
        axes.annotate(f"{value:.3f} s ({share:.1%})", (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                      xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    axes.set_xlim(0, max(values, default=1.0) * 1.3 or 1.0)
    axes.set_xlabel("seconds per step")
    axes.set_title(f"Step time {step_time_s:.3f} s by term")
    return _png(figure)


def _term_color(term: str) -> str:
    if term.startswith("exposed "):
        return TERM_COLORS["exposed"]
    return TERM_COLORS.get(term, "#8c8c8c")


def timeline_chart(ops: Sequence[TimelineOp], *, stages: int, title: str) -> bytes:
    """Gantt chart of a simulated schedule: one row per stage, boxes labelled with the micro-batch."""
    figure = _figure(10.0, 0.5 * stages + 1.5)
    axes = figure.subplots()
    end = max((op.end_s for op in ops), default=1.0)
    last_chunk = max((op.chunk for op in ops), default=0)
    for op in ops:
        alpha = 1.0 - 0.5 * op.chunk / max(last_chunk, 1)  # later chunks lighter
        axes.broken_barh([(op.start_s, op.end_s - op.start_s)], (op.stage - 0.4, 0.8), facecolors=COLORS[op.kind],
                         edgecolor="white", linewidth=0.5, alpha=alpha)
        if (op.end_s - op.start_s) / end > 0.012:
            axes.text((op.start_s + op.end_s) / 2, op.stage, str(op.micro_batch), ha="center", va="center",
                      fontsize=6, color="white")
    axes.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    axes.set_ylim(stages - 0.5, -0.5)
    axes.set_xlim(0, end)
    axes.set_xlabel("seconds")
    axes.set_title(title, fontsize=10)
    kinds = sorted({op.kind for op in ops}, key="FBW".index)
    from matplotlib.patches import Patch

    handles = [Patch(color=COLORS[k], label=KIND_NAMES[k]) for k in kinds]
    if last_chunk:
        handles += [Patch(color="#888888", label="chunk 0"), Patch(color="#888888", alpha=0.5, label=f"chunk {last_chunk}")]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return _png(figure)


# ------------------------------------------------------------------------------- report documents


@dataclass(frozen=True)
class Table:
    """A table: a header row and rows of already formatted cells."""

    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Figure:
    """A chart: file stem, caption and PNG bytes."""

    name: str
    caption: str
    png: bytes


@dataclass(frozen=True)
class Code:
    """A shell command or other literal text."""

    text: str
    language: str = "sh"
    """The Markdown fence's language (``sh``, ``python``, ``json``)."""


@dataclass(frozen=True)
class Bullets:
    """A bullet list."""

    items: tuple[str, ...]


Block = str | Table | Figure | Code | Bullets  # a plain string is a paragraph; `backticks` mark code


@dataclass(frozen=True)
class Section:
    """A titled part of the report."""

    title: str
    blocks: tuple[Block, ...]


def render_markdown(title: str, sections: Sequence[Section], *, figure_dir: Path | None = None) -> str:
    """Markdown; each figure is written to ``figure_dir/<name>.png`` and linked (left out without a folder)."""
    lines = [f"<!-- {MARK}: a run into this folder replaces it. -->", f"# {title}", ""]
    for section in sections:
        lines += [f"## {section.title}", ""]
        for block in section.blocks:
            lines += [*_markdown_block(block, figure_dir), ""]
    return "\n".join(lines)


def _markdown_block(block: Block, figure_dir: Path | None) -> list[str]:
    if isinstance(block, str):
        return [block]
    if isinstance(block, Bullets):
        return [f"- {item}" for item in block.items]
    if isinstance(block, Code):
        fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", block.text)), default=0))
        return [f"{fence}{block.language}", block.text, fence]  # a fence longer than any backtick run inside (CommonMark)
    if isinstance(block, Figure):
        if figure_dir is None:
            return [f"*{block.caption} (chart written when the report is saved to a folder)*"]
        chart = figure_dir / f"{block.name}.png"
        write_atomically(chart, lambda temp: temp.write_bytes(block.png), what="report chart",
                         replace_any=written_by_tessera_beside(chart, figure_dir / REPORT_MD))
        return [f"![{block.caption}]({block.name}.png)"]
    cell = lambda text: text.replace("|", "\\|")  # noqa: E731
    rows = [block.header, tuple("---" for _ in block.header), *block.rows]
    return ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1100px; margin: 2em auto;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; border-bottom: 2px solid #4c72b0; padding-bottom: .3em; }
h2 { font-size: 1.25em; margin-top: 1.8em; color: #2a4d7f; }
table { border-collapse: collapse; margin: .6em 0; font-size: .92em; }
th, td { border: 1px solid #ccd; padding: .3em .7em; text-align: left; vertical-align: top; }
th { background: #eef2f8; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td code { overflow-wrap: anywhere; }
code, pre { font-family: ui-monospace, Menlo, Consolas, monospace; background: #f4f5f7; }
pre { padding: .8em; overflow-x: auto; border-radius: 4px; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #e3e3e3; }
figcaption { font-size: .85em; color: #555; }
"""
NUMERIC = re.compile(r"^[\d,.%\s]+(s|GiB)?$")


def render_html(title: str, sections: Sequence[Section]) -> str:
    """One self-contained HTML page: inline CSS, figures as base64 PNG, no external resources."""
    body = [f"<h1>{html.escape(title)}</h1>"]
    for section in sections:
        body.append(f'<section><h2>{html.escape(section.title)}</h2>')
        body += [_html_block(block) for block in section.blocks]
        body.append("</section>")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<meta name=\"generator\" content=\"{MARK}\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")


def _inline(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _html_block(block: Block) -> str:
    if isinstance(block, str):
        return f"<p>{_inline(block)}</p>"
    if isinstance(block, Bullets):
        return "<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in block.items) + "</ul>"
    if isinstance(block, Code):
        return f"<pre><code>{html.escape(block.text)}</code></pre>"
    if isinstance(block, Figure):
        data = base64.b64encode(block.png).decode("ascii")
        return (f'<figure id="{block.name}"><img src="data:image/png;base64,{data}" alt="{html.escape(block.caption)}">'
                f"<figcaption>{html.escape(block.caption)}</figcaption></figure>")
    head = "".join(f"<th>{html.escape(h)}</th>" for h in block.header)
    rows = "".join("<tr>" + "".join(_html_cell(c) for c in row) + "</tr>" for row in block.rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def _html_cell(text: str) -> str:
    return f'<td class="num">{html.escape(text)}</td>' if NUMERIC.match(text) else f"<td>{_inline(text)}</td>"
