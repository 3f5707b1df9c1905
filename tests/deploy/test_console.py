"""What the `grpo run` console shows of the services' output (deploy/console.py), and a console that goes away."""

import io
import os

from hypothesis import given
from hypothesis import strategies as st

from deploy.console import REPEATS_SHOWN, ConsoleWriter, LineFilter, parse

# Lines as the services print them (taken from a real `grpo run` of the tiny model).
UVICORN_ACCESS = 'INFO:     127.0.0.1:50558 - "POST /v1/rollouts/batch HTTP/1.1" 200 OK'
LEARNER_STEP = ("2026-11-26 03:39:48,527 grpo.learner INFO progress: step 2/6 (33%) | reward -0.100 | batch accuracy "
                "0.0% | loss 0 | 357 tokens/s | ETA 1s")
RUN = [
    "INFO:     Started server process [9748]",
    "2026-11-26 03:37:06,154 grpo.ref_server INFO ref-server ready on http://127.0.0.1:18501 (model: m, beta=0.0, "
    "hub capacity 4)",
    UVICORN_ACCESS,
    "[2026-11-26 03:37:11,060] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. If you "
    "have GPU or other accelerator, we were unable to detect it.",
    "",
    "Loading weights:   0%|          | 0/20 [00:00<?, ?it/s]",
    "2026-11-26 03:37:12,734 grpo.generator INFO generator gen-0: engine transformers, G=4, 2 prompts per batch, hub "
    "http://127.0.0.1:18501",
    "2026-11-26 03:37:13,601 grpo.client WARNING http://127.0.0.1:18501/v1/rollouts/batch answered 429: rollout queue "
    "is full (4 groups); retrying in 1.0s",
    "2026-11-26 03:37:14,041 grpo.learner INFO learner: 1 rank(s) on cpu, ZeRO-0, torch.float32, step 0, version 0",
    "2026-11-26 03:37:14,068 grpo.ref_server.weight_sync INFO weight-sync sender vm-1 registered (gloo at 127.0.0.1)",
    LEARNER_STEP,
    "2026-11-26 03:37:16,288 grpo.learner INFO checkpoint step00000006 written",
    "2026-11-26 03:37:17,825 grpo.generator INFO done: 16 groups uploaded, 0 dropped (constant reward)",
    "INFO:     Shutting down",
    "2026-11-26 03:37:18,318 grpo.ref_server INFO ref-server stopped (SIGTERM)",
]


def shown(lines, mode="progress"):
    keep = LineFilter(mode, "logs/x.log")
    return [text for text in map(keep.shown, lines) if text is not None]


def test_progress_mode_shows_steps_milestones_and_no_chatter():
    assert shown(RUN) == [
        "ref-server ready on http://127.0.0.1:18501 (model: m, beta=0.0, hub capacity 4)",
        "generator gen-0: engine transformers, G=4, 2 prompts per batch, hub http://127.0.0.1:18501",
        "learner: 1 rank(s) on cpu, ZeRO-0, torch.float32, step 0, version 0",
        "step 2/6 (33%) | reward -0.100 | batch accuracy 0.0% | loss 0 | 357 tokens/s | ETA 1s",
        "checkpoint step00000006 written",
        "done: 16 groups uploaded, 0 dropped (constant reward)",
        "ref-server stopped (SIGTERM)",
    ]
    assert shown(RUN, "full") == RUN


def test_a_traceback_is_shown_whole_and_what_follows_it_is_filtered_again():
    lines = [
        "2026-11-26 03:37:14,041 grpo.learner ERROR the step failed",
        "Traceback (most recent call last):",
        '  File "learner/main.py", line 12, in run',
        "    self.train_on(batch)",
        "ValueError: loss is nan",
        UVICORN_ACCESS,
        "grpo learner: error: the hub stayed unreachable",
        "Loading weights: 100%|##########| 20/20",
    ]
    assert shown(lines) == [lines[0], *lines[1:5], "grpo learner: error: the hub stayed unreachable"]


def test_a_python_warning_comes_with_its_source_line_and_loading_bars_do_not():
    lines = ["/venv/lib/site-packages/x.py:12: FutureWarning: `foo` is deprecated",
             "  warnings.warn(",
             "Loading weights:   0%|          | 0/20"]
    assert parse(lines[0]).level == "WARNING"
    assert shown(lines) == lines[:2]


def test_the_same_warning_again_and_again_is_shown_three_times_then_left_to_the_log():
    lines = [f"2026-11-26 03:37:{10 + i},000 grpo.generator.rewards WARNING reward <lambda> failed on completion {i}: "
             f"TypeError" for i in range(10)]
    lines.insert(5, "2026-11-26 03:37:14,000 grpo.generator WARNING another warning")
    out = shown(lines)
    assert len(out) == REPEATS_SHOWN + 1
    assert out[REPEATS_SHOWN - 1].endswith("[repeated: further ones only in logs/x.log]")
    assert "another warning" in out[REPEATS_SHOWN]


@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=200))
def test_the_console_shows_a_part_of_each_line_or_nothing_and_full_mode_shows_it_as_is(line):
    line = line.replace("\n", " ").replace("\r", " ")
    text = LineFilter("progress", "x.log").shown(line)
    assert text is None or text in line or text.startswith(line)  # a repeat marker is only ever appended
    assert LineFilter("full", "x.log").shown(line) == line


def test_parse_reads_each_log_format():
    assert parse(LEARNER_STEP).level == "INFO" and parse(LEARNER_STEP).message.startswith("progress: step 2/6")
    assert parse(UVICORN_ACCESS).level == "INFO" and parse(UVICORN_ACCESS).message.startswith("127.0.0.1:50558 -")
    assert parse("ERROR:    [Errno 98] address already in use").level == "ERROR"
    assert parse("[2026-11-26 03:37:11,060] [INFO] [engine.py:1:f] zero stage 0").message == "zero stage 0"
    assert parse("Loading weights: 5%").level is None


def test_a_console_whose_reader_went_away_drops_lines_without_raising():
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # like `tee` killed by Ctrl-C: every write now fails with EPIPE (SIGPIPE is ignored)
    stream = os.fdopen(write_fd, "w", buffering=1)
    console = ConsoleWriter(stream)
    assert console.write("first") is False and console.gone
    assert console.write("second") is False
    # the descriptor now points at /dev/null: what is still buffered flushes without an error at exit
    stream.write("still buffered")
    stream.flush()
    stream.close()


def test_a_working_console_gets_every_line():
    out = io.StringIO()
    console = ConsoleWriter(out)
    assert console.write("a") and console.write("b")
    assert out.getvalue() == "a\nb\n" and not console.gone
