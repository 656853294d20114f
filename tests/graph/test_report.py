"""The strategy report: its sections and charts, and that the numbers it prints are the plan's."""

import base64
from html.parser import HTMLParser

import pytest

import tessera
from tessera.cli import main
from tessera.planner.explain import drawn_micro_batches, plan_html, write_markdown
from tessera.planner.plan_facts import gib, launch_command, mesh_layout, seconds, step_terms, tokens
from tessera.planner.explain_plots import simulate_schedule
from tessera.planner.plan import Plan

SECTIONS = [
    "Model and cluster", "Strategy", "Per-layer plan", "Prediction", "Step time breakdown", "Memory per pipeline stage",
    "Pipeline timeline", "Alternatives", "Search", "Launch",
    "As Megatron-LM configuration", "As torchtitan configuration", "As DeepSpeed configuration",
]
FIGURES = ["step_time", "memory", "timeline"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class ReportParser(HTMLParser):
    """Collects headings, images, external references and every table (rows of cell texts) by section."""

    def __init__(self):
        super().__init__()
        self.headings, self.images, self.external, self.tables = [], [], [], {}
        self._tag, self._section, self._row, self._cell = None, None, None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self._tag = tag
        if tag == "img":
            self.images.append(attrs["src"])
        if tag in ("link", "script") or any(str(v).startswith(("http:", "https:", "//")) for v in attrs.values()):
            self.external.append((tag, attrs))
        if tag == "tr":
            self._row = []
        if tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._row.append(self._cell)
            self._cell = None
        if tag == "tr":
            self.tables.setdefault(self._section, []).append(self._row)
        self._tag = None

    def handle_data(self, data):
        if self._tag in ("h1", "h2"):
            self.headings.append((self._tag, data))
            if self._tag == "h2":
                self._section = data
        if self._cell is not None:
            self._cell += data


@pytest.fixture(scope="module")
def plan() -> Plan:
    # A pipelined plan so every chart has something to draw: 8 Llama blocks, tp=2 x pp=4 interleaved (tp must
    # divide the 2 key/value heads).
    return tessera.plan("llama-tiny:layers=8", "dgx-h100:nodes=2", global_batch=64, seq_len=64,
                        strategy="tp=2,pp=4,schedule=interleaved:2")  # micro-batch left open: runners-up


@pytest.fixture(scope="module")
def report(plan) -> ReportParser:
    parser = ReportParser()
    parser.feed(plan_html(plan))
    return parser


def rows_of(report: ReportParser, section: str) -> dict[str, list[str]]:
    """A section's table as {first cell: other cells}."""
    return {row[0]: row[1:] for row in report.tables[section]}


def test_html_has_every_section_and_chart_and_no_external_resource(report):
    assert [h for h in report.headings if h[0] == "h1"] == [("h1", "Tessera plan: llama-tiny:layers=8 on dgx-h100:nodes=2")]
    assert [text for tag, text in report.headings if tag == "h2"] == SECTIONS
    assert len(report.images) == len(FIGURES)
    for src in report.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == PNG_MAGIC
    assert report.external == [], "the report must open offline"


def test_per_layer_table_covers_every_layer_with_its_costs(plan, report):
    rows = report.tables["Per-layer plan"][1:]  # the header row first
    counted = sum(int(row[0].rpartition("(")[2].rstrip(")")) if " .. " in row[0] else 1 for row in rows)
    assert counted == len(plan.layers)
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    assert all(layer.memory_bytes > 0 and layer.time_s > 0 for layer in blocks)
    tp = f"tp=2{' +sp' if plan.strategy.sp else ''}"
    assert {row[3] for row in rows if row[1] in ("block", "attention")} == {tp}


def test_per_layer_memory_is_what_each_layer_holds_when_its_stage_peaks():
    from tessera.models import build_model

    spec = "llama-tiny:layers=4"
    plan = tessera.plan(spec, "dgx-h100:nodes=1", global_batch=16, seq_len=256,
                        strategy="dp=8,mbs=1,recompute=full")  # peaks in the backward: every block's input kept
    block_state = 16 * sum(p.numel() for p in build_model(spec).blocks[0].parameters())  # fp32 weight, grad, 2 moments
    stage = plan.estimate.stage_memory_by_category_bytes[0]
    assert all(layer.memory_bytes > block_state for layer in plan.layers if layer.kind == "block")
    assert sum(layer.memory_bytes for layer in plan.layers) <= sum(
        stage[category] for category in ("parameters", "gradients", "optimizer", "activations"))


def test_html_numbers_equal_the_plans(plan, report):
    e = plan.estimate
    prediction = rows_of(report, "Prediction")
    assert prediction["step time"] == [seconds(e.step_time_s)]
    assert float(prediction["step time"][0].removesuffix(" s")) == pytest.approx(e.step_time_s, abs=5e-4)
    assert prediction["tokens/s"] == [tokens(e.tokens_per_s)]
    assert float(prediction["tokens/s"][0].replace(",", "")) == pytest.approx(e.tokens_per_s, abs=0.5)
    assert prediction["MFU"] == [f"{e.mfu:.1%}"] and prediction["HFU"] == [f"{e.hfu:.1%}"]
    assert prediction["peak memory per device"] == [f"{gib(e.peak_memory_bytes)} of {gib(e.memory_budget_bytes)} GiB"]
    memory = rows_of(report, "Memory per pipeline stage")
    assert memory["category (GiB)"] == [f"stage {i}" for i in range(plan.strategy.pp)]
    assert memory["total"] == [gib(peak) for peak in e.stage_peak_memory_bytes]
    for category in e.memory_by_category_bytes:
        assert memory[category] == [gib(stage[category]) for stage in e.stage_memory_by_category_bytes]
    search = rows_of(report, "Search")
    assert search["candidates evaluated"] == [f"{plan.candidates_evaluated:,}"]
    assert plan.capture_time_s > 0 and search["model capture time"] == [seconds(plan.capture_time_s)]


def test_step_time_breakdown_sums_to_the_step_time(plan, report):
    for estimate in [plan.estimate, *(c.estimate for c in plan.alternatives)]:
        assert sum(step_terms(estimate).values()) == pytest.approx(estimate.step_time_s, rel=1e-9)
    table = rows_of(report, "Step time breakdown")
    terms = step_terms(plan.estimate)
    assert {name: cells[0] for name, cells in table.items() if name in terms} == {k: seconds(v) for k, v in terms.items()}
    assert table["step time"][0] == seconds(plan.estimate.step_time_s)


def test_the_breakdown_sums_to_the_step_with_stragglers_and_activation_offload():
    from tessera.api import _prepare
    from tessera.cost_models import Strategy, estimate

    graph, cluster, training = _prepare("llama3-8b:layers=8", "dgx-h100:nodes=1", global_batch=8, seq_len=8192, precision=None)
    e = estimate(list(graph.layers), cluster, training, Strategy.parse("dp=8,zero=3,mbs=1,recompute=offload"))
    terms = step_terms(e)
    assert terms["exposed offload"] > 0 and terms["stragglers"] > 0
    assert sum(terms.values()) == pytest.approx(e.step_time_s, rel=1e-9)


def test_alternatives_table_says_why_each_lost(plan, report):
    rows = report.tables["Alternatives"][1:]
    assert len(rows) == len(plan.alternatives) > 0
    for row, candidate in zip(rows, plan.alternatives):
        assert row[1] == candidate.strategy.to_string()
        assert row[2] == seconds(candidate.estimate.step_time_s)
        assert row[5].startswith(candidate.verdict) and "most: " in row[5]


def test_markdown_writes_its_charts_beside_it(plan, tmp_path):
    text = write_markdown(plan, tmp_path / "report.md").read_text()
    assert [line[3:] for line in text.splitlines() if line.startswith("## ")] == SECTIONS
    for name in FIGURES:
        assert f"]({name}.png)" in text
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
    assert f"| step time | {seconds(plan.estimate.step_time_s)} |" in text
    assert "torchrun --nnodes 2 --nproc-per-node 8" in text


def test_cli_writes_html_report_and_plan_json(tmp_path, capsys):
    out = tmp_path / "report"
    args = ["plan", "--model", "gpt-tiny", "--cluster", "cpu:ranks=2", "--global-batch", "8", "--seq-len", "32"]
    assert main([*args, "--format", "html", "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    plan = Plan.from_json(out / "plan.json")
    assert html.count("<img ") == len(FIGURES) and seconds(plan.estimate.step_time_s) in html
    assert f"--plan {out / 'plan.json'}" in html
    assert "launch" in capsys.readouterr().out
    assert main([*args, "--out", str(out)]) == 2, "--out without md/html is a one-line error"


def test_mesh_layout_says_which_axes_cross_nodes():
    megatron = tessera.Strategy(tp=8, pp=4, dp=2)
    assert mesh_layout(megatron, devices_per_node=8) == [
        "tp=8 inside each node", "pp=4 across 4 nodes (one node per stage)", "dp=2 across 8 nodes (4 nodes per dp rank)",
    ]
    assert mesh_layout(tessera.Strategy(dp=64, zero=3), devices_per_node=8) == ["dp=64 across 8 nodes (8 dp ranks per node)"]
    assert mesh_layout(tessera.Strategy(tp=4, pp=4), devices_per_node=8)[1] == "pp=4 across 2 nodes (2 stages per node)"
    assert launch_command(nodes=1, devices_per_node=8) == "torchrun --nnodes 1 --nproc-per-node 8 --standalone train.py --plan plan.json"


@pytest.mark.parametrize(("schedule", "v", "bubble"), [
    ("gpipe", 1, 3 * 3.0), ("1f1b", 1, 3 * 3.0), ("interleaved", 2, 3 * 3.0 / 2), ("zero-bubble", 1, 3 * 1.0),
])
def test_timeline_simulation_has_each_schedules_bubble(schedule, v, bubble):
    # 4 stages, forward 1 s and backward 2 s (zero-bubble: B = W = 1 s): the textbook bubbles, (p-1)(F+B)
    # for GPipe/1F1B, divided by V when interleaved, (p-1)(F+B-W) for ZB-H1.
    ops = simulate_schedule(schedule, [{"forward": 1.0, "backward": 2.0}] * 4, micro_batches=8, virtual_stages=v)
    assert max(op.end_s for op in ops) - 8 * 3.0 == pytest.approx(bubble)
    assert len(ops) == 4 * 8 * v * (3 if schedule == "zero-bubble" else 2)


def test_every_drawn_schedule_simulates_without_deadlock():
    for schedule in ("gpipe", "1f1b", "interleaved", "zero-bubble"):
        for pp in range(1, 9):
            for v in ((1, 2, 3, 4) if schedule == "interleaved" else (1,)):
                strategy = tessera.Strategy(pp=pp, schedule=schedule, virtual_stages=v)
                for m in range(1, 20):
                    drawn = drawn_micro_batches(strategy, m)
                    assert 1 <= drawn <= min(m, 2 * pp)
                    simulate_schedule(schedule, [{"forward": 1.0, "backward": 2.0}] * pp, micro_batches=drawn, virtual_stages=v)
