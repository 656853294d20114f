"""Guard for speed-only changes to the planner: the plans it chooses must not move.

``--record FILE`` plans a fixed set of cases (search_time's four targets and a few varied ones) and writes each
plan (strategy, estimate, per-layer decisions, runners-up; everything but timings) as JSON; ``--check FILE``
plans them again and lists every difference (floats equal within 1e-9 relative). Each case runs in this process,
one after another (several minutes for all).

    .venv/bin/python benchmarks/plan_identity.py --record /tmp/plans.json
    ... change the planner's code ...
    .venv/bin/python benchmarks/plan_identity.py --check /tmp/plans.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ONE_T = "gpt:layers=128,hidden=25600,heads=160,vocab=51200,seq=2048"
# (name, model, cluster, global batch, seq_len, pinned strategy or None)
CASES = [
    ("gpt3-175b", "gpt3-175b", "dgx-a100:nodes=128", 1536, 2048, None),
    ("1T", ONE_T, "dgx-a100:nodes=384", 3072, 2048, None),
    ("llama3-405b", "llama3-405b", "dgx-h100:nodes=2048", 2048, 8192, None),
    ("deepseek-v3", "deepseek-v3", "dgx-h100:nodes=256", 15360, 4096, None),
    ("gpt3-2.7b/1 node", "gpt3-2.7b", "dgx-a100:nodes=1", 64, 2048, None),
    ("llama3-8b/2 nodes", "llama3-8b", "dgx-h100:nodes=2", 128, 8192, None),
    ("llama3-70b/32 nodes", "llama3-70b", "dgx-h100:nodes=32", 512, 8192, None),
    ("mixtral-8x7b/8 nodes", "mixtral-8x7b", "dgx-h100:nodes=8", 256, 4096, None),
    ("gemma3-27b/4 nodes", "gemma3-27b", "dgx-h100:nodes=4", 128, 8192, None),
    ("llama3-70b pinned tp=8,pp=4", "llama3-70b", "dgx-h100:nodes=16", 256, 8192, "tp=8,pp=4"),
    ("deepseek-v3:layers=8/16 nodes", "deepseek-v3:layers=8", "dgx-h100:nodes=16", 1024, 4096, None),
]
TIMINGS = {"search_time_s": True, "capture_time_s": True, "solver": {"ilp_time_s"}}
"""Plan fields that are wall-clock measurements, not decisions: left out of the comparison."""


def plan_case(model: str, cluster: str, batch: int, seq_len: int, strategy: str | None) -> dict:
    import tessera

    plan = tessera.plan(model, cluster, global_batch=batch, seq_len=seq_len, strategy=strategy)
    dumped = without_timings(plan.model_dump(mode="json"))
    dumped["strategy_text"] = plan.strategy.to_string()
    return dumped


def without_timings(plan: dict) -> dict:
    """The plan's JSON without ``TIMINGS`` (so records made with timings in compare too)."""
    solver = {k: v for k, v in plan.get("solver", {}).items() if k not in TIMINGS["solver"]}
    return {**{k: v for k, v in plan.items() if k not in TIMINGS}, "solver": solver}


def differences(old, new, path: str = "") -> list[str]:
    """Paths where ``new`` differs from ``old`` (floats within 1e-9 relative)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = [f"{path}.{k}: only in one" for k in old.keys() ^ new.keys()]
        for key in old.keys() & new.keys():
            out += differences(old[key], new[key], f"{path}.{key}")
        return out
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{path}: length {len(old)} -> {len(new)}"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in differences(a, b, f"{path}[{i}]")]
    if isinstance(old, float) and isinstance(new, (int, float)) and not isinstance(new, bool):
        return [] if math.isclose(old, new, rel_tol=1e-9, abs_tol=1e-300) else [f"{path}: {old!r} -> {new!r}"]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def summary_change(old: dict, new: dict) -> str:
    """The plan's strategy and predicted step time against the record's, in one phrase."""
    strategy = "same strategy" if old["strategy"] == new["strategy"] else "strategy changed"
    return f"{strategy}, step {old['estimate']['step_time_s']:.3f} -> {new['estimate']['step_time_s']:.3f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", type=Path)
    mode.add_argument("--check", type=Path)
    parser.add_argument("--only", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    names = set(args.only.split(",")) if args.only else None
    recorded = json.loads(args.check.read_text()) if args.check else {}
    results, failed = {}, 0
    for name, model, cluster, batch, seq, strategy in CASES:
        if names and name not in names:
            continue
        start = time.process_time()
        results[name] = plan_case(model, cluster, batch, seq, strategy)
        note = f"{time.process_time() - start:6.1f} cpu s  {results[name]['strategy_text']}"
        if args.check:
            old = without_timings(recorded[name]) if name in recorded else None
            diffs = differences(old, results[name]) if old is not None else ["not recorded"]
            failed += bool(diffs)
            same = "identical bit for bit" if old == json.loads(json.dumps(results[name])) else "identical within 1e-9"
            note += f"  {same}" if not diffs else f"  DIFFERS ({summary_change(old, results[name])}):\n    " + "\n    ".join(diffs[:20])
        print(f"{name:32s} {note}", flush=True)
    if args.record:
        args.record.write_text(json.dumps(results, indent=1, sort_keys=True))
        print(f"recorded {len(results)} plans in {args.record}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
