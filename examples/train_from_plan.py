"""The ``train.py`` that ``tessera launch`` and ``tessera resume`` print command lines for: it reads a saved plan,
applies it to the model the plan was made for, trains, checkpoints, and resumes from the newest checkpoint.

    tessera plan --model gpt-tiny:layers=2 --cluster cpu:ranks=2 --global-batch 8 --seq-len 64 --json plan.json
    tessera launch plan.json --script examples/train_from_plan.py    # prints: torchrun ... --plan plan.json
    torchrun --standalone --nnodes=1 --nproc-per-node=2 examples/train_from_plan.py --plan plan.json --steps 3 \\
        --checkpoints ckpt
    torchrun ... examples/train_from_plan.py --plan plan.json --resume-from ckpt --steps 3   # after a failure

The model is rebuilt from the plan's model spec on the meta device (only this rank's shards are allocated): a
preset, ``hf:...`` or ``file.py:factory``; for your own model object, build it here instead and keep the rest. The data are random token ids: put your loader in
``batches``, and store its position in ``data_state`` (a resumed run gets it back in ``pm.resumed.data_state``).
"""

from __future__ import annotations

import argparse
import shlex

import torch
import torch.distributed as dist

from tessera.api import model_to_train
from tessera.planner.model_source import absolute_spec, runs_user_code
from tessera.planner.plan import Plan
from tessera.runtime.apply import apply_plan
from tessera.runtime.elastic import resume_if_possible
from tessera.runtime.targets import output_classes


def batches(plan: Plan, start: int, vocab: int):
    """Global batches of next-token pairs, from step ``start`` on (the same on every rank)."""
    step = start
    while True:
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(vocab, (plan.training.global_batch, plan.training.seq_len + 1), generator=generator)
        yield step, (tokens[:, :-1], tokens[:, 1:])
        step += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="plan JSON written by tessera plan --json")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run (default 10)")
    parser.add_argument("--checkpoints", help="folder to save a checkpoint into after the last step")
    parser.add_argument("--resume-from", help="checkpoint folder to resume from (its newest intact checkpoint)")
    parser.add_argument("--model", help="the plan's model spec, given here to allow a file.py:factory it names (a "
                        "plan file alone never runs code)")
    args = parser.parse_args()
    plan = Plan.from_json(args.plan)
    if runs_user_code(plan.model_name) and absolute_spec(args.model or "") != absolute_spec(plan.model_name):
        parser.error(f"the plan names the factory {plan.model_name!r}, which runs code; pass --model "
                     f"{shlex.quote(plan.model_name)} if you trust it, or build your model in this script")

    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    torch.manual_seed(0)  # every rank initialises its shards as the whole model would be
    model = model_to_train(plan.model_name, plan.training.seq_len)  # on meta, as the plan was made
    vocab = output_classes(model)  # before the plan splits the head
    pm = apply_plan(model, plan)
    if args.resume_from:
        resume_if_possible(pm, args.resume_from)
    first = pm.step  # 0, or the step the checkpoint was saved at
    for step, batch in batches(plan, first, vocab):
        if step >= first + args.steps:
            break
        loss = pm.train_step(batch)
        if dist.get_rank() == 0:
            print(f"step {pm.step}: loss {loss:.4f}")
    if args.checkpoints:
        pm.save(args.checkpoints, data_state={"next_step": pm.step}).wait()
    pm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
