"""tests/slow_guard.py, run on small test files with pytester (in this process, so each case costs well under a
second): unmarked tests that start subprocesses, servers or engines, or run past the limit, fail and are told to
be marked slow; marked ones pass."""

import pytest

HINT = "mark it @pytest.mark.slow"


@pytest.fixture
def run(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")

    def run(source: str, *args: str) -> pytest.RunResult:
        pytester.makepyfile(test_it=source)
        return pytester.runpytest_inprocess("-p", "tests.slow_guard", "-p", "no:cacheprovider", *args)

    return run


def test_an_unmarked_test_that_starts_a_subprocess_fails_and_a_marked_one_passes(run):
    result = run("""
import subprocess
import pytest

def test_unmarked():
    subprocess.run(["true"], check=True)

@pytest.mark.slow
def test_marked():
    subprocess.run(["true"], check=True)

def test_nothing_started():
    pass
""")
    result.assert_outcomes(passed=2, failed=1)
    assert ("slow guard: test_it.py::test_unmarked started a subprocess (subprocess.Popen ['true']) at "
            f"test_it.py:5 but is not marked slow: {HINT}") in result.stdout.str()


def test_module_pytestmark_counts_as_marked(run):
    run("""
import os
import pytest

pytestmark = pytest.mark.slow

def test_marked_by_module():
    os.system("true")
""").assert_outcomes(passed=1)


def test_every_test_using_a_fixture_that_started_something_fails_not_only_the_first(run):
    """A module-scoped fixture is set up in its first test only; the later ones start nothing themselves."""
    result = run("""
import subprocess
import pytest

@pytest.fixture(scope="module")
def service():
    proc = subprocess.Popen(["sleep", "30"])
    yield proc
    proc.kill()
    proc.wait()

@pytest.mark.slow
def test_first_marked(service):
    pass

def test_second_unmarked(service):
    pass

def test_not_using_it():
    pass
""")
    result.assert_outcomes(passed=2, errors=1)
    assert ("slow guard: test_it.py::test_second_unmarked uses fixture 'service', which started a subprocess "
            f"(subprocess.Popen ['sleep', '30']) (at test_it.py:6), but is not marked slow: {HINT}") in result.stdout.str()


def test_a_fixture_of_the_same_name_elsewhere_that_starts_nothing_is_not_blamed(pytester, run):
    pytester.makepyfile(test_a="""
import subprocess
import pytest

@pytest.fixture(scope="module")
def service():
    subprocess.run(["true"])

@pytest.mark.slow
def test_a(service):
    pass
""")
    run("""
import pytest

@pytest.fixture(scope="module")
def service():
    return "in-process"

def test_b(service):
    pass
""").assert_outcomes(passed=2)


def test_a_uvicorn_server_started_in_a_thread_is_blamed_on_the_running_test(run):
    """tests/live_server.py's LiveServer runs uvicorn in a thread of the test process."""
    result = run("""
import socket
import threading
import time
import uvicorn

async def app(scope, receive, send):
    pass

def test_live_server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="server", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    server.should_exit = True
    thread.join(10)
    sock.close()
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*slow guard: test_it.py::test_live_server started a uvicorn server (uvicorn.Server.startup) at "
        f"* (thread 'server') but is not marked slow: {HINT}*",
    ])


def test_multiprocessing_counts_as_a_subprocess(run):
    result = run("""
import multiprocessing

def test_process():
    process = multiprocessing.get_context("fork").Process(target=int)
    process.start()
    process.join()
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*test_process started a subprocess (multiprocessing ForkProcess.start*{HINT}*"])


def test_an_unmarked_test_past_the_time_limit_fails_and_a_marked_one_passes(run):
    result = run("""
import time
import pytest

def test_slow_unmarked():
    time.sleep(0.3)

@pytest.mark.slow
def test_slow_marked():
    time.sleep(0.3)

def test_quick():
    pass
""", "-o", "slow_guard_limit_s=0.2")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*slow guard: test_it.py::test_slow_unmarked took 0.* s in its call phase, over the 0.2 s limit "
        f"(slow_guard_limit_s) for tests not marked slow: {HINT}*",
    ])


def test_time_spent_waiting_for_a_cpu_is_not_counted(run):
    """Other processes' load on a shared machine: the thread's run-queue wait (Linux schedstat) is subtracted."""
    result = run("""
import time
import tests.slow_guard as guard

def test_starved(monkeypatch):
    real = guard._cpu_wait_s
    monkeypatch.setattr(guard, "_cpu_wait_s", lambda: real() + 1.0)  # as if it had waited 1 s for a CPU
    time.sleep(0.3)
""", "-o", "slow_guard_limit_s=0.2")
    result.assert_outcomes(passed=1)


def test_a_failing_test_keeps_its_own_failure_and_gets_the_guard_as_a_section(run):
    result = run("""
import subprocess

def test_fails():
    subprocess.run(["true"])
    assert 1 == 2
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*assert 1 == 2*", "*slow guard*test_fails started a subprocess*"])


@pytest.mark.slow  # imports DeepSpeed (a few seconds)
def test_an_unmarked_test_that_starts_a_deepspeed_engine_fails(run):
    result = run("""
import pytest

def test_engine():
    import deepspeed  # as learner/engine.py does: imported inside the function that calls initialize
    with pytest.raises(Exception):
        deepspeed.initialize()  # no model: DeepSpeed refuses, after the guard has seen the call
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*test_engine started a DeepSpeed engine (deepspeed.initialize) at *{HINT}*"])
