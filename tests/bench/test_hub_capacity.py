"""bench/hub_capacity.py: its arguments, and a toy run against a real hub (its accounting and its latencies)."""

import json

import pytest

from bench.hub_capacity import main, parse_args, percentile
from deploy.bench_all import BENCHMARKS


def test_defaults_are_the_issues_workload_and_bad_sizes_are_refused():
    args = parse_args([])
    assert (args.group_size, args.completion_len, args.generators) == (16, 512, 80)
    assert args.rate * args.group_size * args.completion_len == pytest.approx(20000)  # 20k tokens/s a generator
    assert args.phases == ["spool", "nospool"]
    for bad in (["--generators", "0"], ["--rate", "-1"], ["--duration", "0"], ["--phases", "disk"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_percentile_is_nearest_rank_on_sorted_values():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 99) == 99.0 and percentile(values, 0) == 1.0 and percentile(values, 100) == 100.0


@pytest.mark.slow  # a hub and two generator processes for a few seconds
def test_a_toy_run_accounts_for_every_group(tmp_path, capsys):
    out = tmp_path / "hub.json"
    command = ["--generators", "4", "--rate", "0",
               "--groups-per-upload", "2", "--group-size", "4", "--completion-len", "64", "--prompt-len", "8",
               "--batch-groups", "3", "--groups-per-step", "6", "--max-staleness", "1", "--duration", "2",
               "--warmup", "0.5", "--phases", "spool", "--json-out", str(out)]
    assert main(command) == 0  # the generators in forked processes, the hub in a child process
    result = json.loads(out.read_text())
    assert result == json.loads(capsys.readouterr().out.strip().splitlines()[-1].removeprefix("BENCH_JSON "))
    (phase,) = result["phases"]
    books = phase["accounting"]
    assert books["accepted"] > 0 and books["leased_acked"] > 0
    # every accepted group was trained (acknowledged), is still queued or leased, or was dropped as stale
    assert books["accepted"] == (books["consumed"] + books["queued"] + books["leased_unacked"]
                                 + books["dropped_stale"])
    assert books["leased_acked"] == books["consumed"] and books["holds"] and result["accounting_holds"]
    assert phase["upload_requests"] > 0 and phase["upload_p99_ms"] >= phase["upload_p50_ms"] > 0
    assert phase["lease_p99_ms"] >= phase["lease_p50_ms"] > 0
    assert phase["accepted_groups_per_s"] > 0 and phase["leased_groups_per_s"] > 0
    assert phase["accepted_tokens_per_s"] == pytest.approx(phase["accepted_groups_per_s"] * 4 * 64, rel=0.02)
    assert phase["hub_cpu_pct"] > 0 and phase["hub_cpu_ms_per_group"] > 0 and phase["upload_failures"] == {}
    assert {"spool write+fsync", "group decode+validate", "batch serialisation"} <= set(phase["stage_pct_of_wall"])
    # the CPU per group, by side and stage (thread CPU time): the parts of the upload are within its whole
    cpu = phase["cpu_ms"]
    assert cpu["upload_per_accepted"] > 0 and cpu["lease_per_leased"] > 0 and cpu["event_loop_per_accepted"] > 0
    upload_parts = sum(cpu[f"  {s}"] for s in ("group decode+validate", "spool write+fsync", "row layout"))
    assert 0 < upload_parts <= cpu["upload_per_accepted"] * 1.05
    assert cpu["  batch assembly"] <= cpu["lease_per_leased"] * 1.05
    assert cpu["leased_per_accepted"] == pytest.approx(books["leased_acked"] / books["accepted"], abs=0.5)
    assert phase["hub_context_switches_per_group"] > 0
    # the runner's table row of it
    (hub,) = [b for b in BENCHMARKS if b.name == "hub_capacity"]
    ((figure, value, ratio),) = hub.figures(result)
    assert figure.startswith("hub, spool on: groups/s accepted (4 generators") and ratio == "unpaced"
    assert float(value.replace(",", "")) == pytest.approx(phase["accepted_groups_per_s"], rel=0.01)
