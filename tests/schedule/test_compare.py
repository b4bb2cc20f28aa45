"""The policy comparison and `tidal simulate`: fair by construction, JSON as documented."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tidal.cli import app
from tidal.schedule.compare import Scenario, compare
from tidal.schedule.workload import LognormalWorkload


@pytest.fixture(scope="module")
def result() -> dict:
    return compare(Scenario(n_devices=16, slots_per_device=2, steps=4, seed=3,
                            workload=LognormalWorkload(sigma=0.8)))


def test_every_policy_trains_the_same_samples_on_the_same_workload(result: dict) -> None:
    target = result["scenario"]["target_samples"]
    assert target == 4 * 16 * 2
    for name, p in result["policies"].items():
        assert p["trained"] == target, name
    # synchronous training takes sessions in order: it can never beat the fluid bound
    bound = result["fluid_bound_samples_per_hour"]
    assert result["policies"]["colocated"]["samples_per_hour"] <= bound
    col = result["policies"]["colocated"]
    assert col["trained_mean_duration_h"] == pytest.approx(col["started_mean_duration_h"])


def test_async_baseline_is_the_best_split_tried(result: dict) -> None:
    a = result["policies"]["async"]
    tried = a["splits_tried"]
    assert a["samples_per_hour"] == max(tried.values())
    assert str(a["n_train"]) in tried and len(tried) >= 5
    assert result["policies"]["async_50_50"]["split"] == "8/8"


def test_speedups_are_ratios_of_throughput(result: dict) -> None:
    p = result["policies"]
    e = p["elastic"]["samples_per_hour"]
    assert result["speedup_vs_colocated"] == pytest.approx(e / p["colocated"]["samples_per_hour"])
    assert result["speedup_vs_async"] == pytest.approx(e / p["async"]["samples_per_hour"])
    assert p["colocated"]["staleness"]["max"] == 0
    assert p["elastic"]["staleness"]["max"] <= result["scenario"]["max_staleness"]
    assert set(result["targets"]["met"]) == {"speedup_vs_colocated", "speedup_vs_async",
                                             "utilization"}


def test_cli_simulate_json() -> None:
    out = CliRunner().invoke(app, ["simulate", "--json", "-n", "8", "--slots", "2",
                                   "--steps", "3", "--sigma", "0.6"])
    assert out.exit_code == 0, out.output
    r = json.loads(out.stdout)
    for name in ("colocated", "async", "elastic"):
        assert {"samples_per_hour", "utilization"} <= set(r["policies"][name])
    assert r["speedup_vs_colocated"] > 0 and r["speedup_vs_async"] > 0
    human = CliRunner().invoke(app, ["simulate", "-n", "8", "--slots", "2", "--steps", "2",
                                     "--p99-hours", "5"])
    assert human.exit_code == 0, human.output
    assert "elastic vs colocated" in human.stdout
