"""Hostile and careless input to planning, cluster files, plans, reports and the profiler's output (issue 17).

Each test feeds a real input (a YAML file, a plan.json, a strategy string) and checks the one-line error Tessera
gives, or that the value is honoured. In-process only: models are captured on the meta device, nothing spawns.
"""

from __future__ import annotations

import html
import json
import math
import shlex
import time

import pytest

import tessera
from tessera.cost_models import estimate
from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.errors import ClusterSpecError, ConfigError
from tessera.planner.capture import capture_preset
from tessera.planner.explain import plan_html, plan_markdown, write_html, write_markdown
from tessera.planner.plan_facts import launch_command
from tessera.planner.plan import SCHEMA_VERSION, Plan
from tessera.topology import load_cluster
from tessera.topology.cluster import Cluster, LinkLevel
from tessera.topology.validation import MAX_DEVICES, MAX_QUOTED_CHARS

GiB = 2**30
SMALL_MODEL = "llama:layers=8,hidden=1024,heads=8,kv_heads=8,ffn=4096,vocab=32000,seq=8192"
SMALL_WORKLOAD = {"global_batch": 64, "seq_len": 8192}
# An H100-like device with 8.3 GiB: SMALL_MODEL fits only with some blocks recomputed (the integer program's
# per-block choice, which a strategy string writes as block_recompute=...).
SMALL_CLUSTER = """\
device: {name: small-gpu, peak_tflops: {bf16: 989, fp32: 67}, memory_gib: 8.3, memory_bandwidth_tb_per_s: 3.35, source: test}
devices_per_node: 8
size_key: nodes
size: 1
levels:
  - {name: nvlink, group_size: node, bandwidth_gb_per_s: 450, latency_us: 3}
"""
README_STRATEGY = "dp=64,zero=3,mbs=1,recompute=none,block_recompute=53xfull/27xselective"


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cluster") / "small.yaml"
    path.write_text(SMALL_CLUSTER)
    return str(path)


@pytest.fixture(scope="module")
def small_plan(small_cluster) -> Plan:
    return tessera.plan(SMALL_MODEL, small_cluster, **SMALL_WORKLOAD)


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message and len(message) < 600, message
    return message


# ------------------------------------------------------------------ 1. pins are applied, never dropped


def test_plan_then_evaluate_its_printed_strategy_gives_the_same_estimate(small_plan, small_cluster):
    printed = small_plan.strategy.to_string()
    assert "block_recompute=" in printed  # the per-block choice the pins used to drop
    strategy, est = tessera.evaluate(SMALL_MODEL, small_cluster, strategy=printed, **SMALL_WORKLOAD)
    assert strategy == small_plan.strategy
    assert est.step_time_s == small_plan.estimate.step_time_s
    assert est.peak_memory_bytes == small_plan.estimate.peak_memory_bytes


def test_plan_fixing_the_printed_strategy_keeps_its_per_block_choices(small_plan, small_cluster):
    fixed = tessera.plan(SMALL_MODEL, small_cluster, strategy=small_plan.strategy.to_string(), **SMALL_WORKLOAD)
    assert fixed.strategy.block_recompute == small_plan.strategy.block_recompute
    assert [layer.recompute for layer in fixed.layers] == [layer.recompute for layer in small_plan.layers]
    assert fixed.estimate.peak_memory_bytes == small_plan.estimate.peak_memory_bytes


def test_the_readme_strategy_for_llama3_70b_evaluates_to_what_plan_printed():
    # README: `tessera plan --model llama3-70b --cluster dgx-h100:nodes=8 --global-batch 1024 --seq-len 8192`
    # printed this strategy at 78.49 of 79.21 GiB; evaluating it used to drop block_recompute (568 GiB).
    workload = {"global_batch": 1024, "seq_len": 8192}
    strategy, est = tessera.evaluate("llama3-70b", "dgx-h100:nodes=8", strategy=README_STRATEGY, **workload)
    assert strategy.block_recompute == ("full",) * 53 + ("selective",) * 27
    assert round(est.peak_memory_bytes / GiB, 2) == 78.49 and est.fits
    graph = capture_preset("llama3-70b", seq_len=8192)
    direct = estimate(list(graph.layers), load_cluster("dgx-h100:nodes=8"), TrainingConfig(**workload),
                      Strategy.parse(README_STRATEGY))
    assert (est.step_time_s, est.peak_memory_bytes) == (direct.step_time_s, direct.peak_memory_bytes)


def test_a_chunk_blocks_pin_sets_the_pipeline_split(small_cluster):
    pinned = "dp=2,tp=2,pp=2,zero=1,mbs=1,recompute=full,sp=true,schedule=1f1b"
    _, even = tessera.evaluate(SMALL_MODEL, small_cluster, strategy=pinned, **SMALL_WORKLOAD)
    strategy, uneven = tessera.evaluate(SMALL_MODEL, small_cluster, strategy=pinned + ",chunk_blocks=6/2", **SMALL_WORKLOAD)
    assert strategy.chunk_blocks == (6, 2)
    assert uneven.stage_peak_memory_bytes != even.stage_peak_memory_bytes
    plan = tessera.plan(SMALL_MODEL, small_cluster, strategy="pp=2,chunk_blocks=6/2", **SMALL_WORKLOAD)
    kinds = {layer.fqn: layer.kind for layer in plan.layers}
    assert [sum(kinds[f] == "block" for f in chunk) for chunk in plan.chunk_fqns()] == [6, 2]


@pytest.mark.parametrize(("pins", "message"), [
    ("block_recompute=7xfull", r"block_recompute lists 7 policies but the model has 8 blocks"),
    ("pp=2,chunk_blocks=4/3", r"chunk_blocks gives 2 chunks of 7 blocks in all but the model has 8 blocks"),
    ("pp=2,schedule=1f1b,chunk_blocks=2/2/2/2", r"chunk_blocks gives 4 chunk sizes but pp=2 x virtual_stages=1 makes 2"),
    ("chunk_blocks=4/0/4", r"field 'chunk_blocks.1': Input should be greater than 0"),
])
def test_per_block_pins_that_do_not_fit_the_model_are_refused(small_cluster, pins, message):
    with pytest.raises(ConfigError, match=message) as error:
        tessera.evaluate(SMALL_MODEL, small_cluster, strategy=pins, **SMALL_WORKLOAD)
    one_line(error)


def test_a_baseline_whose_per_block_pins_do_not_fit_cannot_run_and_says_why(small_cluster):
    comparison = tessera.compare(SMALL_MODEL, small_cluster, baselines=["dp=8,block_recompute=9xfull"], **SMALL_WORKLOAD)
    assert comparison.baselines[0].error == ("block_recompute lists 9 policies but the model has 8 blocks; give one per "
                                             "block (e.g. block_recompute=8xfull) or leave it out")


# ------------------------------------------------------------------ 2. report launch lines are shell-quoted


def test_the_report_launch_line_keeps_a_hostile_path_one_word():
    hostile = "rep; touch X #/plan.json"
    line = launch_command(nodes=1, devices_per_node=8, plan_path=hostile)
    assert shlex.split(line) == ["torchrun", "--nnodes", "1", "--nproc-per-node", "8", "--standalone", "train.py",
                                 "--plan", hostile]
    many = shlex.split(launch_command(nodes=4, devices_per_node=8, plan_path="a b/$(touch X)"))
    assert many[-2:] == ["--plan", "a b/$(touch X)"]
    assert many[many.index("--rdzv-endpoint") + 1] == "$HEAD_NODE:29500"  # left for the shell to expand


def test_reports_written_into_a_hostile_folder_quote_the_plan_path(small_plan, tmp_path):
    folder = tmp_path / "rep; touch X #"
    folder.mkdir()
    plan_path = str(folder / "plan.json")
    text = write_markdown(small_plan, folder / "report.md", plan_path=plan_path).read_text()
    fence = text.index("```sh\n") + len("```sh\n")
    assert shlex.split(text[fence:text.index("\n", fence)])[-2:] == ["--plan", plan_path]
    page = write_html(small_plan, folder / "report.html", plan_path=plan_path).read_text()
    launch = page.index("<pre><code>", page.index(">Launch</h2>")) + len("<pre><code>")
    code = html.unescape(page[launch:page.index("</code></pre>", launch)])
    assert shlex.split(code)[-2:] == ["--plan", plan_path]
    assert sorted(p.name for p in folder.iterdir()) == ["memory.png", "report.html", "report.md", "step_time.png",
                                                          "timeline.png"]  # no temporary file left behind


def test_a_backtick_run_in_the_path_cannot_close_the_markdown_code_fence(small_plan):
    text = plan_markdown(small_plan, plan_path="x```y/plan.json")
    assert "````sh\n" in text


# ------------------------------------------------------------------ 3. hostile cluster files

BILLION_LAUGHS = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")]
    + ["device: *i", "size: 1"]
)


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BILLION_LAUGHS)
    assert path.stat().st_size < 1000  # a few hundred bytes that would expand to 9^9 strings
    started = time.perf_counter()
    with pytest.raises(ClusterSpecError, match="line 1 uses a YAML anchor or alias") as error:
        load_cluster(str(path))
    assert time.perf_counter() - started < 1.0
    one_line(error)


def cluster_file(tmp_path, **level) -> str:
    fields = {"name": "nvlink", "group_size": "node", "bandwidth_gb_per_s": 450, "latency_us": 3, **level}
    path = tmp_path / "c.yaml"
    path.write_text(SMALL_CLUSTER.replace(
        "  - {name: nvlink, group_size: node, bandwidth_gb_per_s: 450, latency_us: 3}",
        "  - {" + ", ".join(f"{k}: {v}" for k, v in fields.items()) + "}",
    ))
    return str(path)


POSITIVE = r"must be a positive number from 1e-09 to 1e\+12 \(the file's units\), got "
NON_NEGATIVE = r"must be 0 or a number from 1e-09 to 1e\+12 \(the file's units\), got "


@pytest.mark.parametrize(("level", "message"), [
    ({"bandwidth_gb_per_s": ".inf"}, rf"'bandwidth_gb_per_s' {POSITIVE}inf"),
    ({"bandwidth_gb_per_s": ".nan"}, rf"'bandwidth_gb_per_s' {POSITIVE}nan"),
    ({"bandwidth_gb_per_s": 0}, rf"'bandwidth_gb_per_s' {POSITIVE}0"),
    ({"bandwidth_gb_per_s": "5.0e-320"}, rf"'bandwidth_gb_per_s' {POSITIVE}5e-320"),  # 1/x overflows
    ({"latency_us": -3}, rf"'latency_us' {NON_NEGATIVE}-3"),
    ({"latency_us": ".inf"}, rf"'latency_us' {NON_NEGATIVE}inf"),
    ({"latency_us": "1.0e+300"}, rf"'latency_us' {NON_NEGATIVE}1e\+300"),
    ({"oversubscription": ".inf"}, rf"'oversubscription' {POSITIVE}inf"),
    ({"efficiency": "1.0e-320"}, rf"'efficiency' {POSITIVE}1e-320"),
    ({"collective_latency_us": "{p2p: -1}"}, rf"'collective_latency_us.p2p' {NON_NEGATIVE}-1"),
])
def test_non_finite_or_out_of_range_link_numbers_are_refused_by_name(tmp_path, level, message):
    with pytest.raises(ClusterSpecError, match=message) as error:
        load_cluster(cluster_file(tmp_path, **level))
    one_line(error)


@pytest.mark.parametrize(("old", "new", "message"), [
    ("memory_gib: 8.3", "memory_gib: .inf", rf"'memory_gib' {POSITIVE}inf"),
    ("memory_gib: 8.3", "memory_gib: -9", rf"'memory_gib' {POSITIVE}-9"),
    ("memory_gib: 8.3", "memory_gib: 1.0e+300", rf"'memory_gib' {POSITIVE}1e\+300"),  # used to overflow int()
    ("bf16: 989", "bf16: 0", rf"'peak_tflops.bf16' {POSITIVE}0"),
    ("bf16: 989", "bf16: 1.0e+300", rf"'peak_tflops.bf16' {POSITIVE}1e\+300"),
    ("memory_bandwidth_tb_per_s: 3.35", "memory_bandwidth_tb_per_s: .nan", rf"'memory_bandwidth_tb_per_s' {POSITIVE}nan"),
], ids=["memory-inf", "memory-negative", "memory-huge", "flops-zero", "flops-huge", "bandwidth-nan"])
def test_non_finite_or_non_positive_device_numbers_are_refused_by_name(tmp_path, old, new, message):
    path = tmp_path / "c.yaml"
    path.write_text(SMALL_CLUSTER.replace(old, new))
    with pytest.raises(ClusterSpecError, match=message) as error:
        load_cluster(str(path))
    one_line(error)


def test_duplicate_keys_are_an_error_naming_the_key(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(SMALL_CLUSTER + "size: 4\n")
    with pytest.raises(ClusterSpecError, match=r"line 7: duplicate key 'size'; keep only one") as error:
        load_cluster(str(path))
    one_line(error)


def test_a_cluster_file_over_one_mib_is_refused_unread(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text(SMALL_CLUSTER + "# " + "x" * 2**20 + "\n")
    with pytest.raises(ClusterSpecError, match=r"more than the 1,048,576 a cluster file may have"):
        load_cluster(str(path))


def test_a_huge_user_value_is_cut_short_in_the_error(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text(SMALL_CLUSTER.replace("size_key: nodes", "size_key: " + "n" * 100_000))
    with pytest.raises(ClusterSpecError, match=r"field 'size_key' must be 'nodes' or 'ranks', got 'nnn") as error:
        load_cluster(str(path))
    assert len(one_line(error)) < len(str(path)) + 100 + MAX_QUOTED_CHARS


# ------------------------------------------------------------------ 4. absurd sizes fail fast


@pytest.mark.parametrize(("spec", "message"), [
    ("dgx-h100:nodes=1000000000", r"'nodes' in cluster preset dgx-h100 must be at most 1,048,576"),
    ("cpu:ranks=" + "9" * 6000, r"'ranks' in cluster preset cpu must be at most 1,048,576"),
    ("dgx-h100:nodes=131073", r"has 1,048,584 devices, more than the 1,048,576 Tessera plans for"),
    ("dgx-h100:nodes=0", r"must be a positive integer, got '0'"),
    ("dgx-h100:nodes=-1", r"must be a positive integer, got '-1'"),
    ("dgx-h100:nodes=nan", r"must be a positive integer, got 'nan'"),
])
def test_absurd_cluster_sizes_fail_fast_with_the_bound(spec, message):
    started = time.perf_counter()
    with pytest.raises(ClusterSpecError, match=message) as error:
        load_cluster(spec)
    assert time.perf_counter() - started < 1.0
    one_line(error)


def test_the_largest_allowed_cluster_loads():
    assert load_cluster(f"dgx-h100:nodes={MAX_DEVICES // 8}").num_devices == MAX_DEVICES


def test_a_cluster_file_with_too_many_devices_is_refused(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(SMALL_CLUSTER.replace("size: 1", "size: 999999999"))
    with pytest.raises(ClusterSpecError, match=r"field 'size' must be at most 1,048,576"):
        load_cluster(str(path))


# ------------------------------------------------------------------ 5. plan files and data-model values


def written_plan(tmp_path, small_plan, **changes) -> str:
    raw = json.loads(small_plan.to_json())
    raw.update(changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_a_plan_from_a_newer_tessera_says_to_upgrade(tmp_path, small_plan):
    path = written_plan(tmp_path, small_plan, schema_version=99)
    with pytest.raises(ConfigError, match=rf"{path} was written by a newer Tessera \(plan schema_version 99; this "
                                          rf"Tessera reads up to {SCHEMA_VERSION}\): upgrade Tessera") as error:
        Plan.from_json(path)
    one_line(error)


@pytest.mark.parametrize(("text", "message"), [
    ('{"schema_version": 1, "model_name": ', r"is not valid JSON \(Expecting value"),
    ("[1, 2]", r"holds list, not a plan object"),
    ('{"schema_version": "one"}', r"schema_version must be a positive integer, got 'one'"),
    ('{"schema_version": 1}', r"is not a valid plan: field 'model_name': Field required"),
])
def test_a_malformed_plan_file_is_one_config_error_naming_the_file(tmp_path, text, message):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"plan file {path}.*{message}") as error:
        Plan.from_json(path)
    one_line(error)


def test_a_plan_with_a_bad_value_names_the_field(tmp_path, small_plan):
    path = written_plan(tmp_path, small_plan, strategy=small_plan.strategy.model_dump(mode="json") | {"dp": 0})
    with pytest.raises(ConfigError, match=r"is not a valid plan: bad strategy: field 'dp': Input should be greater "
                                          r"than 0, got 0") as error:
        Plan.from_json(path)
    one_line(error)


def test_a_missing_plan_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read plan file .*nope.json: No such file"):
        Plan.from_json(tmp_path / "nope.json")


@pytest.mark.parametrize(("fields", "message"), [
    ({"global_batch": 0, "seq_len": 8}, r"field 'global_batch': Input should be greater than 0, got 0"),
    ({"global_batch": math.nan, "seq_len": 8}, r"field 'global_batch': Input should be a finite number, got nan"),
    ({"global_batch": 8, "seq_len": math.inf}, r"field 'seq_len': Input should be a finite number, got inf"),
    ({"global_batch": 10**15, "seq_len": 8}, r"field 'global_batch': Input should be less than or equal to 1073741824"),
    ({"global_batch": 8, "seq_len": -1}, r"field 'seq_len': Input should be greater than 0, got -1"),
])
def test_bad_training_values_are_one_config_error_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=rf"bad training config: {message}") as error:
        TrainingConfig(**fields)
    one_line(error)


@pytest.mark.parametrize(("text", "message"), [
    ("dp=0", r"field 'dp': Input should be greater than 0, got 0"),
    ("mbs=-1", r"field 'micro_batch': Input should be greater than 0, got '-1'"),
    ("dp=nan", r"field 'dp': Input should be a valid integer"),
    ("dp=" + "9" * 5000, r"field 'dp': .*got '9999.*\.\.\."),
    ("dp=2,dp=4", r"dp is given twice"),
    ("sp=maybe", r"write sp=true or sp=false"),
    ("block_recompute=1000000000xfull", r"more than 1,048,576 blocks"),
    ("block_recompute=0xfull", r"write e.g. chunk_blocks=4/4/3 or block_recompute=2xfull/1xnone"),
])
def test_bad_strategy_strings_are_one_config_error_naming_the_value(text, message):
    with pytest.raises(ConfigError, match=message) as error:
        Strategy.parse(text)
    one_line(error)


def test_a_strategy_built_in_code_with_a_bad_value_is_a_config_error():
    with pytest.raises(ConfigError, match=r"bad strategy: field 'tp': Input should be greater than 0, got -2"):
        Strategy(tp=-2)


# ------------------------------------------------------------------ 6. the profiler writes only files it can read


def profile_with_overheads(overheads: dict[int, float]):
    from tessera.topology.measure import ProfileSweep
    from tessera.topology.measure_device import DeviceMeasurement
    from tessera.topology.profiler import ProfileResult, _device_spec

    measured = DeviceMeasurement(
        matmul_flops_by_dtype={"fp32": 5e10, "bf16": 2e10}, matmul_dim=1024, memory_bandwidth_bytes_per_s=1e10,
        copy_bytes=2**26, threads_per_rank=1, linear_overhead_s=overheads,
    )
    import torch

    host = {"hostname": "test-host", "date": "2026-12-01T00:00:00+00:00", "world_size": 2}
    spec = _device_spec(measured, device=torch.device("cpu"), per_node=2, host=host)
    # A fitted latency and per-byte cost far below anything measurable: written as 0, not as a refused 1e-14 us.
    level = LinkLevel(name="gloo-intra-node", group_size=2, bandwidth_bytes_per_s=1e9, latency_s=1e-20,
                      collective_local_s_per_byte={"all_reduce": 1e-22}, source="test")
    cluster = Cluster(name="profiled", device=spec, num_devices=2, levels=(level,))
    return ProfileResult(cluster=cluster, measurements=(), device=measured, fits=(), host=host, sweep=ProfileSweep(),
                         elapsed_s=1.0)


def test_a_zero_or_negative_measured_overhead_is_written_at_the_measured_floor_and_loads(tmp_path):
    from tessera.topology.measure import MEASURED_FLOOR_S
    from tessera.topology.profiler import load_profile, write_profile

    path = tmp_path / "cluster.yaml"
    write_profile(profile_with_overheads({1: 0.0, 2: -3e-5, 4: 2e-4}), path)
    cluster = load_cluster(str(path))  # used to fail: "field 'linear_overhead_ms'.1 must be a positive number"
    assert cluster.device.linear_overhead_s == pytest.approx({1: MEASURED_FLOOR_S, 2: MEASURED_FLOOR_S, 4: 2e-4})
    assert load_profile(path).cluster == cluster
    assert cluster.levels[0].latency_s == 0 and cluster.levels[0].collective_local_s_per_byte == {"all_reduce": 0}
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.yaml"]  # written atomically: no temporary left


def test_the_per_linear_overhead_never_goes_below_the_floor():
    from tessera.topology.measure import MEASURED_FLOOR_S
    from tessera.topology.measure_device import REFERENCE_LINEARS, per_linear_overhead_s

    assert per_linear_overhead_s(1e-3, arithmetic_s=2e-3) == MEASURED_FLOOR_S  # arithmetic over-estimated under load
    assert per_linear_overhead_s(7e-3, arithmetic_s=1e-3) == pytest.approx(6e-3 / REFERENCE_LINEARS)
    assert 0 < MEASURED_FLOOR_S <= 1e-6


# ------------------------------------------------------------------ 7. the plan is data, written atomically


def test_plan_json_is_written_atomically_and_refuses_a_folder(tmp_path, small_plan):
    target = tmp_path / "plan.json"
    small_plan.to_json(target)
    assert Plan.from_json(target) == small_plan
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    with pytest.raises(ConfigError, match=r"plan file .* is a folder; give a file name"):
        small_plan.to_json(tmp_path)
    with pytest.raises(ConfigError, match=r"folder .*missing does not exist"):
        small_plan.to_json(tmp_path / "missing" / "plan.json")


def test_reports_render_from_the_plan_without_the_plan_rendering_itself(small_plan):
    assert not hasattr(Plan, "to_markdown") and not hasattr(Plan, "to_html")
    page = plan_html(small_plan)
    assert "<html" in page[:200] and small_plan.strategy.to_string() in page
