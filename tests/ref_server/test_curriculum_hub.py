"""The curriculum's table on the hub (POST /v1/curriculum): shared by every generator, read by version, kept in the
spool folder across a restart, refused when the rule differs, and absent on an older hub (the generator's own)."""

import json

import pytest
from fastapi import FastAPI

from generator.curriculum import CurriculumStream, HubPassRateTable
from generator.datasets.base import Example, PromptStream
from ref_server.hub.curriculum import FILE_NAME, SharedCurriculum
from shared.protocol.client import HubClient, HubError, RetryPolicy
from shared.protocol.curriculum_messages import CurriculumReport
from tests.live_server import AppServer, LiveServer, make_config


def client(live) -> HubClient:
    return HubClient(live.url, retry=RetryPolicy(max_retry_s=5, initial_backoff_s=0.05))


def report(shares=(), since=None, window=2, min_appearances=2, drawn=0, skipped=0) -> CurriculumReport:
    return CurriculumReport(window=window, min_appearances=min_appearances, shares=list(shares), since=since,
                            drawn=drawn, skipped=skipped)


@pytest.mark.slow  # a live server
def test_two_generators_fill_one_table_and_read_its_settled_set_by_version(tmp_path):
    with LiveServer(make_config(tmp_path)) as live:
        a, b = client(live), client(live)
        first = a.curriculum_report(report([("p1", 1.0), ("p2", 0.5)]))
        assert first.settled == [] and first.tracked == 2
        # p1's second appearance comes from the other generator: together they settle it
        second = b.curriculum_report(report([("p1", 1.0), ("p3", 0.0)], since=first.version))
        assert second.settled == ["p1"] and second.version != first.version and second.tracked == 3
        unchanged = a.curriculum_report(report([("p3", 0.5)], since=second.version))
        assert unchanged.settled is None and unchanged.version == second.version   # nothing new: no list sent
        stale = a.curriculum_report(report([("p3", 0.0), ("p3", 0.0)], since=first.version))
        assert stale.settled == ["p1", "p3"]
        assert live.state.curriculum.rates.shares("p1") == [1.0, 1.0]


@pytest.mark.slow  # a live server
def test_draws_reach_the_metrics_as_the_skipped_share(tmp_path):
    with LiveServer(make_config(tmp_path)) as live:
        a, b = client(live), client(live)
        a.curriculum_report(report(drawn=30, skipped=10))
        b.curriculum_report(report(drawn=10, skipped=0))
        stats = a._request("GET", "/v1/curriculum").json()
        metrics = live.get("/metrics").text
    assert (stats["drawn"], stats["skipped"], stats["skipped_share"]) == (40, 10, 0.25)
    assert "grpo_curriculum_skipped_share 0.25" in metrics and "grpo_curriculum_prompts_skipped 10.0" in metrics


@pytest.mark.slow  # a live server
def test_the_table_survives_a_hub_restart_in_its_spool_folder(tmp_path):
    config = make_config(tmp_path)
    with LiveServer(config) as live:
        client(live).curriculum_report(report([("p1", 1.0), ("p1", 1.0), ("p2", 0.0)], drawn=5, skipped=2))
    saved = json.loads((tmp_path / "spool" / FILE_NAME).read_text())
    assert saved["shares"] == {"p1": [1.0, 1.0], "p2": [0.0]} and saved["window"] == 2
    with LiveServer(config) as live:
        answer = client(live).curriculum_report(report([("p2", 0.0)]))
        assert answer.settled == ["p1", "p2"] and answer.tracked == 2
        assert (live.state.curriculum.drawn, live.state.curriculum.skipped) == (5, 2)


def test_a_reloaded_table_takes_the_first_reports_rule_and_then_refuses_another(tmp_path):
    table = SharedCurriculum(tmp_path)
    table.report(report([("p", 1.0), ("p", 1.0), ("p", 0.0)], window=3, min_appearances=2))
    table.close()
    reloaded = SharedCurriculum(tmp_path)
    # window 1 keeps p's last share only (0.0): settled as never solved
    assert reloaded.report(report(window=1, min_appearances=1)).settled == ["p"]
    with pytest.raises(ValueError, match="window=1, min_appearances=1.*window=2, min_appearances=2"):
        reloaded.report(report(window=2, min_appearances=2))


@pytest.mark.slow  # a live server
def test_another_rule_is_a_409_naming_both(tmp_path):
    with LiveServer(make_config(tmp_path)) as live:
        client(live).curriculum_report(report(window=2))
        with pytest.raises(HubError) as refused:
            client(live).curriculum_report(report(window=4))
    assert refused.value.status == 409 and "window=2" in str(refused.value) and "window=4" in str(refused.value)


@pytest.mark.slow  # a live server
@pytest.mark.parametrize("body, field", [
    ({"window": 2, "min_appearances": 2, "shares": [["p", 1.5]]}, "shares"),
    ({"window": 0, "min_appearances": 1}, "window"),
    ({"window": 2, "min_appearances": 2, "shares": [["", 1.0]]}, "shares"),
    ({"window": 2, "min_appearances": 2, "extra": 1}, "extra")])
def test_bad_reports_are_422_naming_the_field(tmp_path, body, field):
    with LiveServer(make_config(tmp_path)) as live:
        answer = live.post("/v1/curriculum", json=body)
        assert answer.status_code == 422 and field in answer.text
        assert live.state.curriculum.tracked() == 0


def test_an_unreadable_table_is_moved_aside_and_the_hub_starts_empty(tmp_path, caplog):
    (tmp_path / FILE_NAME).write_text('{"format": 1, "window": 2, "min_appearances": 2, "shares": {"p": [7]}}')
    table = SharedCurriculum(tmp_path)
    assert table.tracked() == 0 and (tmp_path / (FILE_NAME + ".corrupt")).exists()
    assert not (tmp_path / FILE_NAME).exists() and "unreadable" in caplog.text and "'p'" in caplog.text


def test_writes_wait_for_the_interval_and_a_clean_stop_writes_the_rest(tmp_path):
    table = SharedCurriculum(tmp_path, save_interval_s=3600)
    table.report(report([("p", 1.0)]))
    assert not (tmp_path / FILE_NAME).exists()        # within the interval: not yet
    table.close()
    assert json.loads((tmp_path / FILE_NAME).read_text())["shares"] == {"p": [1.0]}


def examples(n: int) -> list[Example]:
    return [Example(f"q{i}", {"answer": str(i)}, f"ex{i}") for i in range(n)]


@pytest.mark.slow  # a live server
def test_a_generator_skips_what_another_settled_on_the_hub(tmp_path):
    with LiveServer(make_config(tmp_path)) as live:
        streams = [CurriculumStream(PromptStream(examples(4), seed=0, generator_id=g),
                                    HubPassRateTable(client(live), sync_interval_s=0, window=2, min_appearances=2))
                   for g in ("a", "b")]
        for _ in range(2):
            streams[0].observe(examples(4)[0], [1.0, 1.0])   # generator a: ex0 solved by every completion, twice
        streams[0].take(1)                                   # a's sync reports them
        drawn_b = streams[1].take(12)                        # b's sync reads the settled set first
        assert "ex0" not in {e.example_id for e in drawn_b} and streams[1].skipped >= 2
        drawn, skipped = streams[1].drawn, streams[1].skipped
        streams[1].take(1)                                   # b reports its draws with its next sync
        assert (live.state.curriculum.drawn, live.state.curriculum.skipped) == (drawn, skipped)


@pytest.mark.slow  # a live server
def test_an_older_hub_leaves_the_generator_its_own_table(caplog):
    with AppServer(FastAPI()) as old:   # answers 404 to every path, as a hub from before the curriculum
        table = HubPassRateTable(HubClient(old.url), sync_interval_s=0, window=2, min_appearances=2)
        stream = CurriculumStream(PromptStream(examples(3), seed=0, generator_id="g"), table)
        stream.take(1)
        assert not table.on_hub and "older hub" in caplog.text
        for _ in range(2):
            stream.observe(examples(3)[1], [0.0, 0.0])
        drawn = stream.take(10)
    assert table.is_settled("ex1") and "ex1" not in {e.example_id for e in drawn}


def test_a_failed_write_keeps_the_reports_and_the_next_write_has_them(tmp_path, caplog):
    (tmp_path / "file").write_text("x")
    table = SharedCurriculum(tmp_path / "file" / "spool", save_interval_s=0)   # a folder under a file: no write
    answer = table.report(report([("p", 1.0), ("p", 1.0)]))
    assert answer.settled == ["p"] and "cannot write" in caplog.text
    table.path = tmp_path / FILE_NAME
    table.close()
    assert json.loads(table.path.read_text())["shares"] == {"p": [1.0, 1.0]}
