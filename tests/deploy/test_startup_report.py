"""`grpo run`'s start-up lines (deploy/startup_report.py) from the services' real log formats, on a fake clock; the
console of a real run: tests/e2e/test_run.py::test_grpo_run_trains_publishes_and_shuts_down."""

import logging
import threading
import time

from deploy.startup_report import StartupReport
from shared.progress import PROGRESS_MARK, READY, startup_phase


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def logged(logger: str, message: str, level: str = "INFO") -> str:
    """A line as the services' logging writes it (deploy/services.py's format)."""
    return f"2026-11-28 04:05:06,789 {logger} {level} {message}"


def phase_line(logger: str, phase: str, caplog) -> str:
    """The line :func:`startup_phase` writes (through logging, as the services do)."""
    with caplog.at_level(logging.INFO, logger=logger):
        startup_phase(logging.getLogger(logger), phase)
    return logged(logger, caplog.records[-1].getMessage())


def test_the_report_names_what_each_service_does_and_for_how_long(caplog):
    clock = Clock()
    report = StartupReport(lambda text: None, 10.0, clock=clock)
    for name in ("ref-server", "learner", "gen-0"):
        report.started(name)
    clock.now += 4
    report.line("learner", phase_line("grpo.learner", "loading the model m", caplog))
    report.line("ref-server", phase_line("grpo.ref_server", READY, caplog))
    report.line("gen-0", logged("grpo.generator", "start-up: not a phase", "WARNING"))   # INFO lines only
    report.line("gen-0", "start-up: unformatted output is no phase either")
    clock.now += 7
    assert report.report() == ("== start-up 11s: learner: loading the model m (7s); gen-0: starting (11s)")
    report.line("gen-0", phase_line("grpo.generator", "generating the first groups", caplog))
    report.line("learner", phase_line("grpo.learner", "waiting for the first batch", caplog))
    clock.now += 65
    assert report.report() == ("== start-up 1m16s: learner: waiting for the first batch (1m05s); gen-0: generating "
                               "the first groups (1m05s)")
    report.ready("gen-0")
    report.ready("learner")
    assert report.report() == "== start-up 1m16s: every service is ready"


def test_lines_come_every_interval_and_stop_at_the_learners_first_progress_line():
    said: list[str] = []
    report = StartupReport(said.append, 0.05)
    report.started("learner")
    report.start()
    try:
        deadline = time.monotonic() + 10
        while len(said) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        report.line("gen-0", logged("grpo.generator", PROGRESS_MARK + "not the learner's"))
        assert not report.first_step.is_set()
        report.line("learner", logged("grpo.learner", PROGRESS_MARK + "step 1/5 | loss 0.1"))
        count = len(said)   # after line() returns, no report line follows the progress line
        time.sleep(0.3)
        assert len(said) == count and all(s.startswith("== start-up ") and "learner: starting (" in s for s in said)
        assert not [t for t in threading.enumerate() if t.name == "startup-report"]   # the thread ended
        report.line("learner", logged("grpo.learner", "start-up: training step 2"))   # ignored once trained
        assert report.phases["learner"][0] == "starting"
    finally:
        report.close()


def test_interval_0_reports_nothing():
    said: list[str] = []
    report = StartupReport(said.append, 0)
    report.started("learner")
    report.start()
    time.sleep(0.1)
    report.close()
    assert said == [] and not [t for t in threading.enumerate() if t.name == "startup-report"]
