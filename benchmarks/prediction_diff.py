"""Every published run's prediction at full precision, and which ones moved against another checkout's.

``benchmarks/published.py`` prints step times to two decimals; a change to capture or the cost model can move a
prediction below that. This writes ``{run id: [strategy, step s, peak bytes]}`` for one checkout and, given a
second file, lists the runs whose figures differ (relative change of the step time).

    # from the repository root ($REPO); the earlier checkout importable as ``tessera`` ahead of the editable install
    git worktree add /tmp/before e8efac5 && mkdir -p /tmp/before-pkg && ln -s /tmp/before /tmp/before-pkg/tessera
    (cd /tmp && PYTHONPATH=/tmp/before-pkg $REPO/.venv/bin/python $REPO/benchmarks/prediction_diff.py /tmp/before \
        /tmp/before.json)
    (cd /tmp && $REPO/.venv/bin/python $REPO/benchmarks/prediction_diff.py $REPO /tmp/after.json \
        --against /tmp/before.json)

(Run from ``/tmp`` so the current folder does not shadow the package.) About three minutes per checkout on two
cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def predictions(tree: Path) -> dict[str, list]:
    sys.path.insert(0, str(tree / "benchmarks"))
    import published  # noqa: PLC0415 -- the checkout's own, from the path above

    found = {}
    for run in published.measured_runs():
        strategy, estimate = published.plan_run(run, published.GPU_CALIBRATION)
        found[run["id"]] = [strategy.to_string(), estimate.step_time_s, estimate.peak_memory_bytes]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path, help="the checkout whose benchmarks/published.py to run")
    parser.add_argument("out", type=Path, help="JSON file to write")
    parser.add_argument("--against", type=Path, help="an earlier file of this script's to compare with")
    args = parser.parse_args()
    found = predictions(args.tree.resolve())
    args.out.write_text(json.dumps(found, indent=1))
    if args.against is None:
        return
    before = json.loads(args.against.read_text())
    moved = [run for run in found if before.get(run) != found[run]]
    print(f"{len(found) - len(moved)} of {len(found)} runs identical")
    for run in moved:
        old, new = before.get(run), found[run]
        change = f"{new[1] / old[1] - 1:+.4%}" if old else "new"
        print(f"{run}: {change} step time; {old} -> {new}")


if __name__ == "__main__":
    main()
