"""``benchmarks/goal_stats.py``: the held-out median's interval and the distance to issue #19's goals."""

import importlib.util
import random
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def goal_stats():
    spec = importlib.util.spec_from_file_location("goal_stats", BENCHMARKS / "goal_stats.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_median_interval_is_the_tabulated_order_statistics(goal_stats):
    # n = 99: the 40th and 60th of the sorted sample (coverage 95.6%); n = 10: the 2nd and 9th (97.9%)
    assert goal_stats.median_interval(list(range(99, 0, -1))) == (40, 60)
    assert goal_stats.median_interval([float(v) for v in range(1, 11)]) == (2.0, 9.0)
    assert goal_stats.median_interval([0.3]) == (0.3, 0.3)  # too few for 95%: the whole range
    assert goal_stats.median_interval(list(range(1, 100)), confidence=0.5)[0] > 40  # less confidence, narrower


def test_the_interval_covers_the_median_about_as_often_as_it_says(goal_stats):
    rng = random.Random(0)
    hits = sum(low <= 1.0 <= high for low, high in (
        goal_stats.median_interval([rng.expovariate(1.0) * 1.4427 for _ in range(99)]) for _ in range(400)))
    assert 0.92 <= hits / 400 <= 0.99  # exponential of median ln 2 / ln 2 = 1: a skewed law, the interval holds


def test_rows_short_of_the_goal_count_what_the_median_needs(goal_stats):
    assert goal_stats.rows_short_of_median_goal([0.01] * 49 + [0.05] * 50) == 1
    assert goal_stats.rows_short_of_median_goal([0.01] * 50 + [0.05] * 49) == 0
    assert goal_stats.rows_short_of_median_goal([0.05] * 4) == 3
    # an even count's median averages the middle two: met already here, though only half are within the goal
    assert goal_stats.rows_short_of_median_goal([0.035, 0.045]) == 0
    assert goal_stats.rows_short_of_median_goal([0.01] * 50 + [0.05] * 50) == 0


def test_the_coverage_is_exact_for_any_sample_size(goal_stats):
    assert goal_stats.interval_coverage(5, 1) == pytest.approx(1 - 2 / 32)
    assert goal_stats.interval_coverage(105, goal_stats.interval_rank(105)) == pytest.approx(0.969, abs=5e-4)
    assert goal_stats.interval_coverage(105, goal_stats.interval_rank(105) + 1) < 0.95  # the next rank falls short
    assert goal_stats.median_interval(list(range(5000)))[0] > 2400  # no float overflow past 1,023 values


def test_the_summary_line_names_each_goal(goal_stats):
    line = goal_stats.goal_summary([0.01, 0.03, 0.05, 0.2, 0.3])
    assert "the median's 93.8% interval 1.00% to 30.00% over 5 runs" in line  # 5 runs reach no more than that
    assert "1 more within 4% would meet the median goal" in line and "2 beyond 15%" in line


def test_bad_input_is_refused_with_the_fix(goal_stats):
    with pytest.raises(ValueError, match="at least one value"):
        goal_stats.median_interval([])
    with pytest.raises(ValueError, match="between 0 and 1"):
        goal_stats.median_interval([1.0], confidence=95)


@pytest.fixture(scope="module")
def published_plot(goal_stats):
    import sys
    sys.modules.setdefault("goal_stats", goal_stats)  # the chart's own import of its sibling script
    spec = importlib.util.spec_from_file_location("published_plot", BENCHMARKS / "published_plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_chart_draws_every_run_and_names_the_held_out_misses_apart(published_plot, tmp_path):
    from matplotlib.figure import Figure

    Point = published_plot.Point
    points = [Point("a", True, "fsdp", 10.0, 11.0), Point("b", False, "fsdp", 5.0, 4.0),
              Point("c", True, "moe", 20.0, 8.0), Point("d", True, "moe", 20.0, 8.2), Point("e", True, "cp", 3.0, 4.0)]
    written = published_plot.write_chart(points, tmp_path / "chart.png")
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = Figure().subplots()
    published_plot._name_runs(axes, [(0.0, -60.0, "c"), (0.0, -59.0, "d"), (1.0, 33.0, "e")])
    heights = sorted(text.get_position()[1] for text in axes.texts)
    assert heights[1] - heights[0] >= published_plot.LABEL_GAP  # two close misses pushed apart
    assert {text.get_text() for text in axes.texts} == {"c", "d", "e"}
