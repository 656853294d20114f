"""Every rank must apply the same plan (``runtime.materialize.plan_digest``): what runs is compared, not where each
node planned from."""

import tessera
from tessera.runtime.materialize import plan_digest


def test_a_factory_planned_from_other_folders_is_the_same_plan_and_another_strategy_is_not():
    plan = tessera.plan("gpt-tiny", "cpu:ranks=2", global_batch=4, seq_len=16, strategy="dp=2,zero=0,mbs=2")
    on_node = [plan.model_copy(update={"model_name": f"{folder}/model.py:make"}) for folder in ("/scratch/a", "/b")]
    assert plan_digest(on_node[0]) == plan_digest(on_node[1])
    assert plan_digest(on_node[0]) != plan_digest(on_node[0].model_copy(update={"model_name": "/a/other.py:make"}))
    other = tessera.plan("gpt-tiny", "cpu:ranks=2", global_batch=4, seq_len=16, strategy="dp=2,zero=0,mbs=1")
    assert plan_digest(plan) != plan_digest(other)
