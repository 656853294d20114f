"""The allocator meter that ``benchmarks/memory_truth.py`` checks the memory model against."""

import importlib.util
import threading
from pathlib import Path

import torch

MiB = 2**20


def load_meter():
    """``benchmarks/`` is scripts, not a package: load the meter from its file."""
    path = Path(__file__).parents[2] / "benchmarks" / "memory_meter.py"
    spec = importlib.util.spec_from_file_location("memory_meter", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_allocator_meter_sees_a_free_on_another_thread():
    # gloo drops some collective buffers on its worker threads, where the profiler records no memory event;
    # a meter summing events would keep the 4 MiB alive and report 4 + 2 MiB here.
    meter_module = load_meter()
    holder = [torch.empty(MiB, dtype=torch.uint8)]
    with meter_module.AllocatorMeter(1000) as meter:
        holder.append(torch.empty(4 * MiB, dtype=torch.uint8))
        freeing = threading.Thread(target=holder.clear)
        freeing.start()
        freeing.join()
        later = torch.empty(2 * MiB, dtype=torch.uint8)
        del later
    # The 1 MiB allocated before the meter started is the baseline's business, not counted again or subtracted.
    assert meter.peak_bytes == 1000 + 4 * MiB
    assert meter.peak_op == "aten::empty"
