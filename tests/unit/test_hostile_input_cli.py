"""Hostile and careless input at the command line: one clear line, a non-zero exit, no traceback (issue 17).

A subset of ``benchmarks/bad_inputs.py``'s corpus runs in-process (``tessera.cli.main``), judged by the corpus's
own criteria; then one test per rule the CLI keeps: numbers validated where argparse reads them, user text shown
literally, ``--debug`` on either side of the verb, output paths checked before the search, the backstop for bugs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import io
import sys
from pathlib import Path

import pytest
from rich.console import Console

from tessera import cli, cli_args
from tessera.cli import main
from tessera.errors import ModelSpecError
from tessera.files import written_by_tessera
from tessera.models import model_config, with_override
from tessera.models.limits import MAX_CAPACITY_FACTOR, MAX_DIMS


def _load_corpus():
    """``benchmarks/`` is scripts, not a package: load the corpus from its file."""
    path = Path(__file__).parents[2] / "benchmarks" / "bad_inputs.py"
    spec = importlib.util.spec_from_file_location("bad_inputs", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bad_inputs"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


corpus = _load_corpus()
CASES = {case.name: case for case in corpus.CASES}
SUBSET = [
    "plan/global-batch=0", "plan/global-batch=nan", f"plan/global-batch={10**15}", "plan/seq-len=-5",
    "plan/top=-1", "plan/expert-capacity=inf", "plan/mtbf-hours=0", "plan/checkpoint-gbps=nan",
    "plan/restart-minutes=-1", "plan/checkpoint-every without --mtbf-hours", "evaluate/global-batch=0",
    "compare/seq-len=0", "plan/json /proc", "plan/json a folder", "plan/out is a file", "plan/json empty",
    "launch/--nodes -1", "launch/--procs-per-node 0", "launch/a folder", "launch/dev-zero", "profile/--nproc 0",
    "profile/--out /proc/x.yaml", "profile/--trials -1", "top/--debug alone",
    "model/'gpt-tiny:layers=100000000'", "model/'gpt-tiny:layers=2,layers=3'", "model/markup foo[/bar]",
    "model/markup :llama:", "factory/raises", "factory/none", "cluster/'cpu:ranks=0'", "evaluate/strategy tp=3",
]
"""Representative and fast: most fail while parsing; the rest after a tiny capture."""


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    """The corpus's valid plan (``{plan}``), written by the CLI itself."""
    folder = tmp_path_factory.mktemp("fixtures")
    assert main([*corpus.FIXTURE_PLAN, str(folder / "plan.json")]) == 0
    return folder


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    return lines[-1]


@pytest.mark.parametrize("name", SUBSET)
def test_corpus_case_is_one_clear_line(name, fixtures, tmp_path, monkeypatch, capsys):
    case = CASES[name]
    if case.setup is not None:
        case.setup(tmp_path, fixtures)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(case.command(tmp_path, fixtures), capsys)
    failure = corpus.judge(case, returncode=code, stdout=out, stderr=err, seconds=0.0, tmp=tmp_path)
    assert failure is None, f"{failure}: {err[-400:]}"


def test_corpus_covers_every_verb():
    verbs = {case.verb for case in corpus.CASES}
    assert {"plan", "evaluate", "compare", "resume", "export", "launch", "profile", "presets"} <= verbs
    assert len(corpus.CASES) >= 200 and len(CASES) == len(corpus.CASES), "case names are unique"


# ----------------------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("digits", ["٨", "１６"])
def test_digits_of_other_scripts_are_refused_as_cluster_specs_refuse_them(capsys, digits):
    code, _, err = run(["plan", *corpus.BASE, "--global-batch", digits], capsys)
    assert code == 2 and f"got '{digits}'" in error_line(err)


def test_global_batch_zero_is_refused_not_defaulted(capsys):
    code, _, err = run(["plan", "--global-batch", "0"], capsys)
    assert code == 2
    assert err.strip() == ("tessera plan: error: argument --global-batch: expected a whole number of sequences "
                           f"from 1 to {cli_args.MAX_GLOBAL_BATCH:,}, got '0' (usage: tessera plan --help)")  # one line


@pytest.mark.parametrize(("option", "value"), [
    ("--seq-len", str(10**12)), ("--expert-capacity", "nan"), ("--mtbf-hours", "-inf"), ("--top", "1.5"),
])
def test_bad_numbers_fail_while_parsing(option, value, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_run", lambda *a: pytest.fail("a bad number reached the verb"))
    code, _, err = run(["plan", option, value], capsys)
    assert code == 2 and error_line(err).startswith(f"tessera plan: error: argument {option}: expected ")


def test_launch_with_negative_nodes_is_refused(fixtures, capsys):
    code, out, err = run(["launch", str(fixtures / "plan.json"), "--nodes", "-1"], capsys)
    assert code == 2 and out == "" and "argument --nodes" in error_line(err)


def test_cli_bounds_match_the_data_model_bounds():
    from tessera.cost_models import types

    # cli_args keeps its own copies, so that parsing imports nothing heavy.
    assert cli_args.MAX_SEQ_LEN == MAX_DIMS["seq_len"] == types.MAX_SEQ_LEN
    assert cli_args.MAX_GLOBAL_BATCH == types.MAX_GLOBAL_BATCH
    assert cli_args.MAX_CAPACITY_FACTOR == MAX_CAPACITY_FACTOR


# ----------------------------------------------------------------------------------------- model specs


@pytest.mark.parametrize(("spec", "fragment"), [
    ("gpt-tiny:layers=100000000", "past Tessera's bound of 1,024"),
    ("gpt-tiny:layers=2,layers=3", "gives layers twice"),
    ("llama-tiny:seq=64,seq_len=128", "gives seq_len twice"),
    ("llama-tiny:rope_theta=nan", "finite"),
    ("moe-tiny:capacity=inf", "finite"),
    ("moe-tiny:layers=1000,experts=1000", "expert modules"),
    ("gpt-tiny:ffn=0", "ffn_hidden must be positive"),
    ("gpt-tiny:bogus=1", "key in dropout, ffn"),
    ("llama-tiny:head_dim=100000000000000000000", "past Tessera's bound of 16,384"),
])
def test_absurd_or_malformed_model_specs_fail_fast(spec, fragment):
    with pytest.raises(ModelSpecError, match=fragment):
        model_config(spec)


def test_with_override_replaces_the_specs_own_value():
    assert with_override("llama-tiny:seq=64,layers=4", "seq", 128) == "llama-tiny:layers=4,seq=128"
    assert with_override("llama-tiny:seq_len=64", "seq", 128) == "llama-tiny:seq=128"
    assert model_config(with_override("llama-tiny:seq=64", "seq", 128)).seq_len == 128


def test_unknown_model_guesses_a_preset_and_names_every_kind_of_spec(capsys):
    code, _, err = run(["plan", "--model", "llama3-8", "--cluster", "cpu:ranks=2"], capsys)
    line = error_line(err)
    assert code == 2 and "did you mean 'llama3-8b'?" in line
    assert "known presets:" in line and "hf:<model_type>" in line and "file.py:factory" in line
    code, _, err = run(["plan", "--model", "qwen3-30b-a3b", "--cluster", "cpu:ranks=2"], capsys)
    assert code == 2 and "did you mean" not in error_line(err)


def test_mtp_layers_on_tessera_s_runtime_are_refused_naming_the_way_out(capsys):
    code, _, err = run(["evaluate", "--model", "llama-tiny", "--cluster", "cpu:ranks=2", "--strategy", "dp=2",
                        "--mtp-layers", "1"], capsys)
    assert code == 2 and "Tessera's runtime trains none" in error_line(err) and "--runs-on" in error_line(err)


def test_factory_that_raises_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "broken.py").write_text("def make():\n    raise ValueError('no such layer')\n")
    code, _, err = run(["plan", "--model", f"{tmp_path}/broken.py:make", "--cluster", "cpu:ranks=2"], capsys)
    line = error_line(err)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert line.startswith("error: model factory") and "broken.py:make()" in line and "no such layer" in line


# ----------------------------------------------------------------------------------------- user text


@pytest.mark.parametrize("text", ["foo[/bar]", "[red]x[/red]", ":llama:"])
def test_markup_and_emoji_in_user_text_print_as_typed(text, capsys):
    code, _, err = run(["plan", "--model", text], capsys)
    assert code == 2 and error_line(err).startswith("error: unknown model") and repr(text) in error_line(err)


def test_report_shows_user_names_literally(fixtures):
    from tessera.planner.plan import Plan
    from tessera.report import print_plan

    plan = Plan.from_json(fixtures / "plan.json").model_copy(update={"model_name": "hf:llama:[/x]"})
    buffer = io.StringIO()
    print_plan(plan, Console(file=buffer, width=200, emoji=False))
    assert "Tessera plan: hf:llama:[/x] on cpu:ranks=2" in buffer.getvalue()


# ----------------------------------------------------------------------------------------- --debug and the backstop


@pytest.mark.parametrize("argv", [["--debug", "plan", "--model", "nope"], ["plan", "--model", "nope", "--debug"]])
def test_debug_before_or_after_the_verb_raises(argv):
    with pytest.raises(ModelSpecError):
        main(argv)


def test_unexpected_exception_is_one_internal_error_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_print_presets", lambda *a: 1 / 0)
    code, _, err = run(["presets"], capsys)
    assert code == 1 and err.count("\n") == 1
    assert error_line(err) == ("error: internal error (ZeroDivisionError: division by zero); rerun with --debug for "
                               "the traceback")
    with pytest.raises(ZeroDivisionError):
        main(["--debug", "presets"])


def test_ctrl_c_exits_130_quietly(monkeypatch, capsys):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_print_presets", interrupted)
    assert run(["presets"], capsys) == (130, "", "")


# ----------------------------------------------------------------------------------------- output paths


@pytest.mark.parametrize("path", ["/proc/x.json", "/nonexistent/dir/p.json", "."])
def test_unwritable_json_is_refused_before_planning(path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_search_with_progress", lambda *a: pytest.fail("searched before checking --json"))
    code, _, err = run(["plan", "--json", path], capsys)
    assert code == 2 and "argument --json" in error_line(err)


def test_report_folder_keeps_the_users_files(tmp_path, capsys):
    out = tmp_path / "rep"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, _ = run(["plan", *corpus.BASE, "--format", "md", "--out", str(out), "--json", str(tmp_path / "p.json")],
                     capsys)
    assert code == 0 and (out / "notes.txt").read_text() == "mine"
    assert {"report.md", "plan.json"} <= {p.name for p in out.iterdir()} and (tmp_path / "p.json").exists()
    assert not [p for p in (*out.iterdir(), *tmp_path.iterdir()) if p.name.startswith(".")], "no staging left behind"
    assert "](" in (out / "report.md").read_text(), "the charts are linked beside the report"


@pytest.mark.parametrize("name", ["report.md", "plan.json", "step_time.png"])
def test_a_report_replaces_its_own_files_and_refuses_the_users(tmp_path, capsys, name):
    """A second run into a report folder replaces what the first wrote; a file of the user's with one of those
    names is refused before the search, and left as it was."""
    out = tmp_path / "rep"
    argv = ["plan", *corpus.BASE, "--format", "md", "--out", str(out)]
    assert run(argv, capsys)[0] == 0
    assert run(argv, capsys)[0] == 0  # its own files, replaced
    assert oct((out / "report.md").stat().st_mode & 0o044) == oct(0o044 & ~current_umask()), "readable as a new file"
    (out / name).write_text("mine")
    code, _, err = run(argv, capsys)
    assert code == 2 and f"{name} already exists and Tessera did not write it" in error_line(err)
    assert (out / name).read_text() == "mine"


def test_plan_json_and_a_cluster_file_are_not_written_over_a_users_file(tmp_path, capsys):
    (tmp_path / "p.json").write_text('{"mine": 1}')
    code, _, err = run(["plan", *corpus.BASE, "--json", str(tmp_path / "p.json")], capsys)
    assert code == 2 and "Tessera did not write it" in error_line(err)
    (tmp_path / "c.yaml").write_text("mine: 1\n")
    code, _, err = run(["profile", "--quick", "--out", str(tmp_path / "c.yaml")], capsys)
    assert code == 2 and "Tessera did not write it" in error_line(err)
    assert (tmp_path / "p.json").read_text() == '{"mine": 1}' and (tmp_path / "c.yaml").read_text() == "mine: 1\n"


def test_a_users_file_that_merely_mentions_tessera_or_looks_like_a_plan_is_not_replaced(tmp_path, capsys):
    # The mark anywhere in the first 64 KiB (any case), or any JSON with a plan's three top-level keys, was taken
    # for Tessera's own: --json and --out replaced them.
    notes, lookalike = tmp_path / "notes.md", tmp_path / "mine.json"
    notes.write_text("# My notes\n\nThe plan says: Written by Tessera, checked by me.\n")
    lookalike.write_text('{"schema_version": 1, "strategy": "mine", "training": "mine"}')
    for target in (notes, lookalike):
        before = target.read_text()
        code, _, err = run(["plan", *corpus.BASE, "--json", str(target)], capsys)
        assert code == 2 and "Tessera did not write it" in error_line(err) and target.read_text() == before
    code, _, _ = run(["plan", *corpus.BASE, "--json", str(tmp_path / "p.json"), "--format", "md", "--out",
                      str(tmp_path / "rep")], capsys)
    assert code == 0
    for own in (tmp_path / "p.json", *(tmp_path / "rep").iterdir()):  # its plan, report and charts: its own
        assert written_by_tessera(own), own


def test_notes_whose_heading_mentions_tessera_or_quote_an_old_report_are_not_replaced(tmp_path, capsys):
    # A '#' line that merely contained the mark, and an old report's opening anywhere in the first 4 KiB, counted
    # as Tessera's: --out replaced the notes and, beside the second, the user's chart.
    cases = {"heading": "# Which of these were written by Tessera and which by hand\n\nweeks of work\n",
             "quoted": "My diary: weeks of work\n\nThe old tool printed:\n\n    # Tessera plan: gpt-tiny\n"}
    for name, text in cases.items():
        out = tmp_path / name
        out.mkdir()
        (out / "report.md").write_text(text)
        code, _, err = run(["plan", *corpus.BASE, "--format", "md", "--out", str(out)], capsys)
        assert code == 2 and "Tessera did not write it" in error_line(err) and (out / "report.md").read_text() == text


def test_a_link_at_an_output_path_is_refused_not_replaced(tmp_path, capsys):
    (tmp_path / "shared").mkdir()
    (tmp_path / "plan.json").symlink_to("shared/current.json")
    code, _, err = run(["plan", *corpus.BASE, "--json", str(tmp_path / "plan.json")], capsys)
    assert code == 2 and "plan.json is a link (to shared/current.json); give the file's own path" in error_line(err)
    assert (tmp_path / "plan.json").is_symlink()


def test_control_characters_from_received_files_are_printed_as_escapes():
    from tessera.topology.validation import printable

    assert printable("MyNet\x1b[2K\x1b]52;c;ZWNobw==\x07 ok") == "MyNet\\x1b[2K\\x1b]52;c;ZWNobw==\\x07 ok"
    assert printable("café 1,024 GiB\n") == "café 1,024 GiB\n"


def test_machine_readable_output_stays_parseable_with_json(tmp_path, capsys):
    code, out, err = run(["plan", *corpus.BASE, "--format", "json", "--json", str(tmp_path / "p.json")], capsys)
    assert code == 0 and json.loads(out)["strategy"] and "plan written to" in err


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_megatron_layer_count_the_model_does_not_have_is_refused(capsys):
    code, _, err = run(["evaluate", "--model", "gpt-tiny", "--cluster", "cpu:ranks=2", "--from-megatron",
                        "--num-layers 40 --global-batch-size 8 --seq-length 32 --micro-batch-size 1"], capsys)
    assert code == 2 and "the configuration states 40 layers but model gpt-tiny has" in error_line(err)


def test_an_mtbf_shorter_than_a_step_says_no_progress_instead_of_shares_past_100_percent(capsys):
    code, out, _ = run(["plan", *corpus.BASE, "--mtbf-hours", "1e-9"], capsys)
    assert code == 0 and "Reliability: no progress." in out and "%" not in out.split("Reliability: no progress.")[1]


def test_evaluate_fills_a_strategy_that_cannot_fit_with_its_leanest_completion(capsys):
    """As compare fills a baseline: how far it is over at best, not its fastest completion."""
    import tessera

    args = dict(model="llama3-70b", cluster="dgx-h100:nodes=8", global_batch=1024, seq_len=8192, strategy="dp=64,zero=0")
    _, estimate = tessera.evaluate(**args)
    comparison = tessera.compare(**{k: v for k, v in args.items() if k != "strategy"}, baselines=["dp=64,zero=0"])
    assert not estimate.fits
    assert estimate.peak_memory_bytes == comparison.baselines[0].estimate.peak_memory_bytes


def test_the_default_sequence_is_one_a_built_in_model_covers(capsys):
    """gpt-tiny's positions end at 64: the default --seq-len is then 64, not 4096 (which it would refuse)."""
    code, out, _ = run(["plan", "--model", "gpt-tiny", "--cluster", "cpu:ranks=2", "--format", "json"], capsys)
    assert code == 0 and json.loads(out)["training"]["seq_len"] == 64


def test_sequence_parallelism_pinned_without_tensor_parallelism_is_refused(capsys):
    code, _, err = run(["plan", *corpus.BASE, "--fix", "sp=true,tp=1"], capsys)
    assert code == 2 and "sp=true splits activations over the tensor-parallel ranks" in error_line(err)


@pytest.mark.parametrize(("content", "message"), [
    ("", "is empty; write its fields"), ("- a\n- b\n", "holds a list, not a mapping of fields"), (None, "is a folder")])
def test_a_cluster_file_that_is_not_one_says_what_it_is(tmp_path, capsys, content, message):
    path = tmp_path / "c.yaml" if content is not None else tmp_path
    if content is not None:
        path.write_text(content)
    code, _, err = run(["plan", "--model", "gpt-tiny", "--cluster", str(path)], capsys)
    assert code == 2 and message in error_line(err)


def test_a_report_of_an_earlier_version_is_replaced_with_its_charts(tmp_path, capsys):
    """Reports written before the mark began "# Tessera plan:"; their charts carried no mark and are replaced beside
    such a report."""
    out = tmp_path / "rep"
    out.mkdir()
    (out / "report.md").write_text("# Tessera plan: llama3-70b on dgx-h100:nodes=8\n")
    (out / "step_time.png").write_bytes(b"\x89PNG old chart")
    assert run(["plan", *corpus.BASE, "--format", "md", "--out", str(out)], capsys)[0] == 0
    assert (out / "step_time.png").read_bytes() != b"\x89PNG old chart"


def test_an_expert_capacity_for_a_model_without_experts_is_refused(capsys):
    code, _, err = run(["plan", *corpus.BASE, "--expert-capacity", "2"], capsys)
    assert code == 2 and "sets the load of routed experts, and gpt-tiny has none" in error_line(err)


def test_an_empty_training_script_is_refused(tmp_path, capsys):
    plan = tmp_path / "p.json"
    assert run(["plan", *corpus.BASE, "--json", str(plan)], capsys)[0] == 0
    code, _, err = run(["launch", str(plan), "--script", ""], capsys)
    assert code == 2 and "the training script path is empty" in error_line(err)


def test_version_and_a_hub_id_under_hf(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"tessera {version('tessera')}"
    assert main(["plan", "--model", "hf:meta-llama/Llama-3.1-8B", "--cluster", "dgx-h100:nodes=1"]) == 2
    assert "looks like a Hugging Face hub id; Tessera downloads nothing" in capsys.readouterr().err


def test_a_tiny_models_step_is_broken_down_in_its_own_unit_and_pipelines_are_named(capsys):
    # A 7 ms step printed "0.007 s (compute 0.005, ...)" and communication rows of 0.000; a dp=8,pp=2 plan read "DDP".
    from tessera.cost_models import Strategy

    code, out, _ = run(["plan", "--model", "gpt-tiny", "--cluster", "cpu:ranks=2", "--global-batch", "8",
                        "--seq-len", "32"], capsys)
    assert code == 0 and " ms  (compute " in out and "1 strategies" not in out
    assert Strategy.parse("dp=8,pp=2,zero=0").name == "DDP+PP" and Strategy.parse("dp=1,tp=2").name == "TP"


def test_hugging_face_keys_a_config_does_not_have_point_at_the_right_one(capsys):
    code, _, err = run(["plan", "--model", "hf:gemma3:num_hidden_layers=4", "--cluster", "cpu:ranks=2"], capsys)
    assert code == 2 and "its language model's fields are in text_config (model type 'gemma3_text')" in error_line(err)
    code, _, err = run(["plan", "--model", "hf:llama:num_layers=4", "--cluster", "cpu:ranks=2"], capsys)
    assert code == 2 and "did you mean num_hidden_layers?" in error_line(err)


def test_a_world_of_the_wrong_size_is_told_the_torchrun_shape_of_the_cluster():
    from tessera.api import _torchrun_shape
    from tessera.topology import load_cluster

    assert _torchrun_shape(load_cluster("dgx-h100:nodes=2")) == "torchrun --nnodes 2 --nproc-per-node 8"
    assert _torchrun_shape(load_cluster("cpu:ranks=4")) == "torchrun --nproc-per-node 4"
