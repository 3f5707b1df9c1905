"""deploy/bench_all.py (``make bench``, ``grpo bench``): the one list of benchmarks, the table and its section."""

from pathlib import Path

import pytest

from deploy import bench_all
from deploy.bench_all import BENCHMARKS, Bench, by_name, last_json, run_one, table, write_section
from deploy.cli import main as grpo
from shared.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
COLUMNS = ["benchmark", "figure", "value", "ratio", "machine", "date", "command", "status, s"]


def test_every_entry_is_a_script_of_bench_and_every_script_an_entry():
    names = [b.name for b in BENCHMARKS]
    assert len(names) == len(set(names))
    scripts = {p.stem for p in (REPO / "bench").glob("*.py")}
    assert set(names) <= scripts
    # helpers of other scripts, not benchmarks of their own (and the lora helpers' scripts, added after merging);
    # standalone studies of many minutes of real runs each (their docs pages give the commands)
    assert scripts - set(names) <= {"procmem", "vs_trl_trl", "vs_trl_runs", "lora_curves", "scorers", "hub_load",
                                    "hub_process", "learner_throughput_child", "weight_sync_processes",
                                    "training_controls", "distill", "calc_agent", "rollout_engines",
                                    "rollout_report"}


def test_the_gpu_command_fits_the_lent_machine_and_the_cpu_run_is_bounded():
    shared = [b for b in BENCHMARKS if b.cuda is not None and not b.alone_on("cuda")]
    assert 0 < sum(b.cuda_limit_s for b in shared) <= 540  # 10 minutes a command, minus start-up
    assert all(b.cuda_limit_s <= 540 for b in BENCHMARKS if b.cuda is not None)
    assert all("cuda" in b.cuda for b in BENCHMARKS if b.cuda is not None)
    assert sum(b.cpu_limit_s for b in BENCHMARKS if b.cpu is not None) <= 30 * 60
    assert all(b.why for b in BENCHMARKS if b.cpu is None or b.cuda is None or b.alone)


def test_an_unknown_benchmark_is_refused_by_name(capsys):
    with pytest.raises(UsageError, match="unknown benchmark nope .*hub_capacity"):
        by_name(["hub_capacity", "nope"])
    assert [b.name for b in by_name(["ref_server", "hub_capacity"])] == ["ref_server", "hub_capacity"]
    assert grpo(["bench", "--only", "nope", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown benchmark nope" in err[0]


def test_the_table_has_every_column_for_every_entry(tmp_path):
    records = [run_one(b, device, tmp_path, lambda: "unused") for device in ("cpu", "cuda") for b in BENCHMARKS
               if b.args(device) is None or b.alone_on(device)]
    assert {r["name"] for r in records} == {b.name for b in BENCHMARKS if b.cpu is None or b.cuda is None or b.alone}
    text = table(records, "cpu", "2026-11-26 07:00 UTC", "2-core CPU")
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == COLUMNS
    body = lines[2:]
    assert len(body) == len(records)
    for line, record in zip(body, records):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(COLUMNS)
        assert cells[0] == record["name"] and cells[4] == "2-core CPU" and cells[5] == "2026-11-26 07:00 UTC"
        assert cells[6] == f"`python bench/{record['name']}.py`" and cells[7].startswith("not run")


@pytest.mark.slow  # child processes (a few tiny scripts, ~2 s)
def test_a_summary_becomes_rows_and_a_failure_a_row_that_says_so(tmp_path, monkeypatch):
    script = tmp_path / "bench" / "fake.py"
    script.parent.mkdir()
    script.write_text("import sys\nprint('noise')\nprint('BENCH_JSON {\"x\": {\"speed\": 12.5, \"ratio\": 0.5}}')\n"
                      "sys.exit(int(sys.argv[1]))\n")
    monkeypatch.setattr(bench_all, "REPO", tmp_path)
    fake = Bench("fake", ("0",), ("1",), bench_all._generic({"speed": (("x", "speed"), ("x", "ratio"))}), 30, 30)
    ok = run_one(fake, "cpu", tmp_path, lambda: "unused")
    assert ok["status"] == "ok" and ok["rows"] == [("speed", "12.5", "0.5")]
    assert ok["command"] == "python bench/fake.py 0"
    failed = run_one(fake, "cuda", tmp_path, lambda: "unused")
    assert failed["status"] == "exit 1" and failed["rows"] == [("speed", "12.5", "0.5")]
    script.write_text("print('no summary')\nraise SystemExit(3)\n")
    broken = run_one(fake, "cpu", tmp_path, lambda: "unused")
    assert broken["status"] == "exit 3" and broken["rows"][0][0].startswith("no figures (exit 3")


def test_last_json_takes_the_last_summary_line():
    assert last_json('{"a": 1}\nBENCH_JSON {"b": 2}\ntrailing words\n') == {"b": 2}
    assert last_json('[bench] x\n{"a": 1}\n') == {"a": 1}
    assert last_json("no json\n{broken\n") is None


def test_the_section_is_replaced_in_place_and_the_rest_kept(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nhand-written\n")
    write_section(doc, "cpu", "table one\n")
    write_section(doc, "cuda", "gpu table\n")
    write_section(doc, "cpu", "table two\n")
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nhand-written\n")
    assert "table two" in text and "table one" not in text and "gpu table" in text
    assert text.count("<!-- bench-all:cpu start -->") == 1 and text.count("## Every benchmark") == 2
    assert text.index("bench-all:cpu") < text.index("bench-all:cuda")
