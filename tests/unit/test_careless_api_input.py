"""Careless input to the Python API, found by trying it as a new user would (2026-12-07): each case once planned
something the runtime then refused, accepted nonsense or failed deep inside torch. In-process, on meta models;
nothing spawns (the refusals come before any process group)."""

from __future__ import annotations

import datetime
import hashlib
import json
import pathlib
import shutil

import numpy as np

import pytest
import torch

import tessera
from tessera.errors import CheckpointError, ConfigError, ModelSpecError, NotModelledError
from tessera.runtime.checkpoint_files import MANIFEST, MARKER, read_manifest
from tessera.runtime.file_records import sha256_text

transformers = pytest.importorskip("transformers")


def llama(**fields) -> torch.nn.Module:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, **fields)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def test_a_pinned_tp_must_divide_the_key_value_heads_too():
    """The runtime splits key/value heads by tp; a plan that does not would be refused after planning."""
    with pytest.raises(ConfigError, match=r"tp=4 does not divide the attention heads \(query and key/value\) \[2, 4\]"):
        tessera.plan(llama(), "cpu:ranks=4", global_batch=8, seq_len=16, strategy="tp=4")


def test_a_learned_position_table_bounds_the_sequence_a_rotary_model_does_not():
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ModelSpecError, match="learned position table transformer.wpe covers 64 positions .* seq_len=128"):
        tessera.plan(gpt2, "cpu:ranks=2", global_batch=8, seq_len=128)
    assert tessera.plan(llama(), "cpu:ranks=2", global_batch=8, seq_len=128).training.seq_len == 128  # RoPE


def test_a_tp_plan_entry_matching_no_module_is_named():
    with pytest.raises(ConfigError, match="tp_plan entries 'nothing.\\*' match no module of the model"):
        tessera.plan(llama(), "cpu:ranks=2", global_batch=8, seq_len=16, strategy="tp=2", tp_plan={"nothing.*": "colwise"})


def test_uniform_offload_pinned_is_planned():
    plan = tessera.plan(llama(), "cpu:ranks=2", global_batch=8, seq_len=16, strategy="recompute=offload")
    assert plan.strategy.recompute == "offload"


def test_auto_parallelize_refuses_fp16_before_it_plans(monkeypatch):
    monkeypatch.setattr(tessera.api, "plan", lambda *a, **k: pytest.fail("planned before refusing fp16"))
    with pytest.raises(NotModelledError, match="precision fp16 needs dynamic loss scaling"):
        tessera.auto_parallelize(llama(), "cpu:ranks=1", global_batch=8, seq_len=16, precision="fp16")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"model": None}, "model must be an nn.Module or a spec"),
    ({"global_batch": True}, "field 'global_batch': Value error, must be a whole number, not a bool"),
    ({"seq_len": "16"}, "field 'seq_len': Value error, must be a whole number, not a str .'16'."),
    ({"strategy": 7}, "strategy must be a Strategy, a string such as 'tp=8,pp=4' or a dict of its fields, got int"),
])
def test_values_of_the_wrong_kind_are_one_line(kwargs, message):
    arguments = {"model": "llama-tiny", "cluster": "cpu:ranks=2", "global_batch": 8, "seq_len": 16, **kwargs}
    with pytest.raises(ConfigError, match=message):
        tessera.plan(**arguments)


def test_a_strategy_may_be_a_dict_of_its_fields():
    assert tessera.plan("llama-tiny", "cpu:ranks=2", global_batch=8, seq_len=16, strategy={"dp": 2, "mbs": 2}
                        ).strategy.micro_batch == 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    pm = tessera.auto_parallelize("llama-tiny", "cpu:ranks=1", global_batch=2, seq_len=16)
    return pm, pm.save(root).wait()


@pytest.mark.parametrize(("change", "message"), [
    ({"step": -5}, "step: Input should be greater than or equal to 0"),
    ({"step": "0"}, "step: Input should be a valid integer"),
    ({"step": 3}, "its manifest.json says step 3, its folder name step 0"),
])
def test_a_hand_edited_manifest_is_refused_even_when_resealed(saved, tmp_path, change, message):
    """A sender can recompute the marker's hash; the manifest's values are still checked, and must agree with
    the folder's name."""
    pm, folder = saved
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    manifest = json.loads((copy / MANIFEST).read_text()) | change
    text = json.dumps(manifest, indent=2)
    (copy / MANIFEST).write_text(text)
    (copy / MARKER).write_text(sha256_text(text))
    with pytest.raises(CheckpointError, match=message):
        pm.load(copy)
    assert read_manifest(folder).step == 0  # the original is untouched


def test_resuming_a_model_objects_checkpoint_asks_for_the_model(saved, tmp_path):
    pm, folder = saved
    copy = tmp_path / "module" / folder.name
    shutil.copytree(folder, copy)
    plan = json.loads((copy / "plan.json").read_text()) | {"model_name": "LlamaForCausalLM"}
    (copy / "plan.json").write_text(json.dumps(plan))
    manifest = json.loads((copy / MANIFEST).read_text())  # resealed, as a nn.Module run's own save would be
    data = (copy / "plan.json").read_bytes()
    manifest["files"]["plan.json"].update(size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    text = json.dumps(manifest, indent=2)
    (copy / MANIFEST).write_text(text)
    (copy / MARKER).write_text(sha256_text(text))
    with pytest.raises(CheckpointError, match=r"saved from a model object \('LlamaForCausalLM'\).*model=your_model"):
        tessera.resume(copy, "cpu:ranks=1")


def test_a_slower_runner_up_is_said_to_lose_on_a_term_that_grew():
    """A term that shrank most (here the exposed communication, -3 s) is not why a runner-up is slower (+1 s):
    the compute that grew (+2 s) is."""
    from tessera.planner.compare import why_it_lost

    _, estimate = tessera.evaluate("gpt-tiny", "cpu:ranks=2", global_batch=8, seq_len=32, strategy="dp=2,recompute=none")
    kinds = {"dp_allreduce": 3.0}
    best = estimate.model_copy(update={"compute_time_s": 1.0, "exposed_comm_time_s": 3.0, "comm_time_by_kind_s": kinds,
                                       "bubble_time_s": 0.0, "step_time_s": 10.0})
    runner_up = best.model_copy(update={"compute_time_s": 3.0, "exposed_comm_time_s": 0.0, "bubble_time_s": 2.0,
                                        "step_time_s": 11.0})
    said = why_it_lost(runner_up, best, "10% slower", values=False)
    assert "most: compute +2.000 s" in said, said


def test_tesseras_own_model_declares_its_classes_so_the_whole_batch_is_checked(saved):
    """Built-in models keep their projection in ``head``: the step checks the global batch against its 256 classes
    before any rank runs it (no per-micro-batch host sync in the loss)."""
    pm, _ = saved
    tokens = torch.randint(256, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[1, 3] = 256
    with pytest.raises(ConfigError, match="target 256 is not below the model's 256 classes"):
        pm.train_step((inputs, targets))
    assert pm._check_targets.keywords == {"classes": 256}


def test_pins_hold_the_values_the_fields_take():
    """``tp=1.0`` pins the int 1 (its checks compare numbers); ``ep=2.0`` is ep 2."""
    from tessera.cost_models.types import Strategy

    assert Strategy.parse_fields("tp=1.0,sp=yes,ep=2.0") == {"tp": 1, "sp": True, "ep": 2}
    with pytest.raises(ConfigError, match="sp=true splits activations over the tensor-parallel ranks, and tp=1"):
        tessera.plan("llama-tiny", "cpu:ranks=2", global_batch=8, seq_len=16, strategy="sp=true,tp=1.0")


def test_a_checkpoint_whose_strategy_a_later_version_wrote_still_loads(saved, tmp_path):
    """The manifest's strategy is a later Tessera's text to an earlier one: not parsed, so a good checkpoint is not
    taken for a corrupt one and set aside."""
    pm, folder = saved
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    text = json.dumps(json.loads((copy / MANIFEST).read_text()) | {"strategy": "dp=1,future_axis=2"}, indent=2)
    (copy / MANIFEST).write_text(text)
    (copy / MARKER).write_text(sha256_text(text))
    assert pm.load(copy).saved_strategy == "dp=1,future_axis=2"
    pm.step = 0


def test_a_strategy_object_pins_what_it_holds():
    """A plan's own strategy passed back (its empty per-block lists are no pins) is evaluated as itself."""
    plan = tessera.plan("llama-tiny", "cpu:ranks=2", global_batch=8, seq_len=16)
    strategy, _ = tessera.evaluate("llama-tiny", "cpu:ranks=2", global_batch=8, seq_len=16, strategy=plan.strategy)
    assert strategy == plan.strategy
    comparison = tessera.compare("llama-tiny", "cpu:ranks=2", global_batch=8, seq_len=16, baselines=[plan.strategy])
    assert comparison.baselines[0].error is None


def test_recomputation_pinned_with_a_pipeline_gets_a_schedule_that_recomputes():
    """The runtime cannot recompute under zero-bubble's split backward: a pinned recomputation leaves it out unless
    zero-bubble is pinned too (then the runtime says why)."""
    plan = tessera.plan("gpt-tiny:layers=4", "cpu:ranks=2", global_batch=8, seq_len=16, strategy="pp=2,recompute=full")
    assert plan.strategy.schedule != "zero-bubble"
    blocks = tessera.plan("gpt-tiny:layers=4", "cpu:ranks=2", global_batch=8, seq_len=16,
                          strategy="pp=2,block_recompute=2xfull/2xnone")
    assert blocks.strategy.schedule != "zero-bubble"


def test_zero_bubble_with_sharded_zero3_is_neither_planned_nor_applied():
    """It trained differently from one process on gloo (dp=2, pp=2): the search leaves it out, a pin of both is
    refused naming the pins that turn it off, and apply_plan refuses a plan written with it."""
    from tessera.errors import NotModelledError
    from tessera.runtime.apply import check_supported

    plan = tessera.plan("gpt-tiny:layers=4", "cpu:ranks=4", global_batch=8, seq_len=16,
                          strategy="dp=2,pp=2,zero=3,recompute=none")
    assert plan.strategy.schedule != "zero-bubble"
    with pytest.raises(ConfigError, match="zero-bubble together with zero-3; pin one of them off \\(e.g. zero=2 or "
                                          "schedule=1f1b\\)"):
        tessera.plan("gpt-tiny:layers=4", "cpu:ranks=4", global_batch=8, seq_len=16,
                     strategy="dp=2,pp=2,zero=3,schedule=zero-bubble")
    edited = plan.model_copy(update={"strategy": plan.strategy.model_copy(update={"schedule": "zero-bubble"})})
    with pytest.raises(NotModelledError, match="schedule=zero-bubble with ZeRO-3 over 2 ranks: it trains differently"):
        check_supported(edited)
    one_rank = tessera.plan("gpt-tiny:layers=4", "cpu:ranks=2", global_batch=8, seq_len=16,
                            strategy="pp=2,zero=3,schedule=zero-bubble")
    assert one_rank.strategy.schedule == "zero-bubble"  # ZeRO-3 over one rank shards nothing


def test_a_pinned_context_parallel_degree_must_split_the_sequence():
    with pytest.raises(ConfigError, match="cp=2 cuts each sequence into 2 x cp = 4 chunks .* seq_len 250"):
        tessera.plan("llama-tiny:layers=4,seq=256", "cpu:ranks=2", global_batch=8, seq_len=250, strategy="cp=2")


def test_a_built_in_rotary_model_runs_at_the_length_it_was_planned_for():
    """Capture extends a built-in RoPE model's tables to a longer seq_len; the model auto_parallelize builds has the
    same tables (it had the preset's 64 and failed in its first step)."""
    torch.manual_seed(0)
    pm = tessera.auto_parallelize("llama-tiny", "cpu:ranks=1", global_batch=1, seq_len=128)
    tokens = torch.randint(256, (1, 129), generator=torch.Generator().manual_seed(0))
    assert pm.train_step((tokens[:, :-1], tokens[:, 1:])) > 0


@pytest.mark.parametrize("value", [np.int64(3), datetime.date(2026, 12, 7), pathlib.Path("x")])
def test_a_data_state_no_resume_could_read_is_refused_when_saved(saved, tmp_path, value):
    pm, _ = saved
    with pytest.raises(CheckpointError, match="data_state holds .*, which a resume would refuse to unpickle"):
        pm.save(tmp_path / "c", data_state={"position": value})
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").glob("step-*"))


def test_an_export_into_a_checkpoint_is_refused(saved, tmp_path):
    from tessera.runtime.checkpoint import export_model_state_dict

    _, folder = saved
    with pytest.raises(CheckpointError, match="is inside the checkpoint"):
        export_model_state_dict(folder, folder / MANIFEST, overwrite=True)
    assert read_manifest(folder).step == 0


def test_an_async_save_in_flight_when_a_script_ends_is_committed(tmp_path):
    """The README's loop saves in the background and may end without pm.close(): the last save is committed at
    exit (it was left as a .partial folder, never loaded), with a warning to close."""
    import subprocess
    import sys

    script = ("import torch, tessera\n"
              "pm = tessera.auto_parallelize('llama-tiny', 'cpu:ranks=1', global_batch=1, seq_len=16)\n"
              f"pm.save({str(tmp_path / 'ckpt')!r}, async_save=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "ckpt" / "step-00000000" / MARKER).exists()
    assert "still in flight when the program ended" in done.stderr


class _SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = torch.nn.Linear(8, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(images))


def test_a_model_that_takes_no_token_ids_is_planned_from_its_example_inputs():
    """Capture feeds token ids unless told otherwise: a CNN then fails, and the error says how to feed it."""
    from tessera.errors import CaptureError

    with pytest.raises(CaptureError, match="does not take token ids of shape \\(1, 1\\), pass example_inputs="):
        tessera.plan(_SmallCNN(), "cpu:ranks=2", global_batch=8, seq_len=1)
    plan = tessera.plan(_SmallCNN(), "cpu:ranks=2", global_batch=8, seq_len=1,
                        example_inputs=torch.zeros(1, 3, 16, 16))
    assert plan.strategy.dp == 2 and plan.estimate.step_time_s > 0
    with pytest.raises(ConfigError, match="example_inputs go with a model object"):
        tessera.plan("gpt-tiny", "cpu:ranks=2", global_batch=8, seq_len=16, example_inputs=torch.zeros(1, 3))


def test_a_model_whose_apply_failed_before_changing_it_can_be_applied_again():
    """apply_plan claims a model only once it starts changing it: a launch mistake found first (no process group
    for a 2-rank plan) leaves it free for the corrected call; a second apply of a changed model is refused."""
    from tessera.errors import RuntimeSetupError
    from tessera.models import build_model
    from tessera.runtime.apply import apply_plan

    model = build_model("gpt-tiny:layers=2")
    with pytest.raises(RuntimeSetupError, match="no process group is initialised"):
        apply_plan(model, tessera.plan(model, "cpu:ranks=2", global_batch=8, seq_len=16, strategy="dp=2"))
    one = tessera.plan(model, "cpu:ranks=1", global_batch=8, seq_len=16)
    apply_plan(model, one)
    with pytest.raises(ConfigError, match="already parallelised"):
        apply_plan(model, one)


def test_several_inputs_are_named_where_train_step_cannot_take_them():
    from types import SimpleNamespace

    from tessera.runtime.parallel_model import ParallelModel, _inputs_and_targets

    ids, features, targets = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.long)
    assert _inputs_and_targets(([ids, features], targets))[0] == (ids, features)  # a list is the tuple form
    with pytest.raises(ConfigError, match="a tuple .positional. or dict .keyword arguments. of tensors .*holding a "
                                          "float"):
        _inputs_and_targets(((ids, 0.5), targets))
    for strategy, axis in (("dp=1,pp=2", "pipeline parallelism"), ("dp=1,cp=2", "context parallelism")):
        owner = SimpleNamespace(plan=SimpleNamespace(strategy=tessera.Strategy.parse(strategy)))
        with pytest.raises(ConfigError, match=f"train_step got 2 input tensors, and {axis}.* takes one"):
            ParallelModel._check_several_inputs_supported(owner, (ids, features))


def test_resuming_from_a_folder_that_does_not_exist_says_so(saved, tmp_path, caplog):
    from tessera.runtime.elastic import resume_if_possible

    pm, _ = saved
    assert resume_if_possible(pm, tmp_path / "ckk") is None  # a typo of ckpt: training starts from step 0
    assert "no checkpoint in" in caplog.text and "no such folder" in caplog.text


def test_saving_into_a_file_says_it_is_a_file_and_leaves_it(saved, tmp_path):
    pm, _ = saved
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(CheckpointError, match="it is a file, not a checkpoint folder"):
        pm.save(notes)
    assert notes.read_text() == "mine"
