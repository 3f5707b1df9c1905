"""A pytest plugin that keeps `pytest -m "not slow"` (`make test-fast`) quick: it FAILS a test not marked
``@pytest.mark.slow`` that

* starts something expensive: a subprocess (``subprocess.Popen``, which ``run``/``check_output`` and the ``grpo``
  CLI go through; ``os.fork``/``os.system``/``os.posix_spawn``; a ``multiprocessing`` process), a DeepSpeed engine
  (``deepspeed.initialize``, also when learner code calls it) or a uvicorn server (``uvicorn.Server.startup``, also
  in another thread such as tests/live_server.py's ``LiveServer``). This check is structural, not timed, so a
  loaded machine cannot make it flaky. A fixture that starts one of these while it is set up (a module-scoped
  live server, say) makes every test that uses it count as starting it, not only the first one;
* or spends more than ``slow_guard_limit_s`` (ini option, default 10 s) in its call phase: wall time, less the
  time the test's thread was runnable but waiting for a CPU (Linux schedstat), so that other processes on a
  shared machine do not make it flaky; sleeping and waiting on I/O or locks count.

Loaded by tests/conftest.py. The patches are process-wide and installed once; they report to the guard of the
innermost running pytest session, so in-process ``pytester`` runs (tests/test_slow_guard.py) are judged by their
own guard. ``-p no:tests.slow_guard`` switches it off.
"""

from __future__ import annotations

import importlib.abc
import os
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass

import pytest

HINT = "mark it @pytest.mark.slow (`make test-fast` runs -m \"not slow\" and must stay quick)"


@dataclass
class Start:
    what: str  # e.g. "a subprocess (subprocess.Popen ['grpo', 'run'])"
    where: str  # the test-side line that led to it, or the thread it happened in


def _describe_args(args) -> str:
    if isinstance(args, (list, tuple)):
        args = [str(a) for a in args[:4]] + (["..."] if len(args) > 4 else [])
    text = repr(args)
    return text if len(text) <= 120 else text[:117] + "..."


def _where(item: pytest.Item) -> str:
    """The line a reader of the failure should look at: the innermost frame in the test's own file, else in the
    project (not pytest, not an installed package, not the standard library); in another thread, its name."""
    root = str(item.config.rootpath)
    stack = [f for f in traceback.extract_stack() if f.filename != __file__]
    own = [f for f in stack if f.filename == str(item.path)]
    project = [f for f in stack if f.filename.startswith(root) and "site-packages" not in f.filename]
    frame = (own or project or [None])[-1]
    where = os.path.relpath(frame.filename, root) + f":{frame.lineno}" if frame else "?"
    if threading.current_thread() is not threading.main_thread():
        where += f" (thread {threading.current_thread().name!r})"
    return where


def _cpu_wait_s() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (Linux schedstat's run delay; 0 elsewhere)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class SlowGuard:
    """Per-session state: the test phase running now, what was started in it, and which fixtures start things."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.item: pytest.Item | None = None  # the item whose setup/call/teardown is running, for every thread
        self.fixtures: list = []  # the FixtureDefs being set up right now, innermost last
        self.starts: list[Start] = []  # what the current phase started
        self.fixture_starts: dict = {}  # FixtureDef -> what its setup started (in any test, marked or not)
        self.call_cpu_wait_s = 0.0  # how long the last call phase's thread was runnable but not on a CPU

    def record(self, what: str) -> None:
        item = self.item
        if item is None:
            return  # collection, session start/finish: no test to blame
        start = Start(what, _where(item))
        self.starts.append(start)
        if self.fixtures:
            self.fixture_starts.setdefault(self.fixtures[-1], start)

    # the current item, for patches called from any thread
    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item):
        return (yield from self._phase(item))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item):
        before = _cpu_wait_s()
        try:
            return (yield from self._phase(item))
        finally:
            self.call_cpu_wait_s = _cpu_wait_s() - before

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item):
        return (yield from self._phase(item))

    def _phase(self, item):
        self.item, self.starts = item, []
        try:
            return (yield)
        finally:
            self.item = None

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        self.fixtures.append(fixturedef)
        try:
            return (yield)
        finally:
            self.fixtures.pop()

    def _fixture_starts_of(self, item):
        """(name, what it started) for the fixtures this test uses that started something when they were set up
        (by this test or an earlier one: a module- or session-scoped fixture is set up once)."""
        name2defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        for name in item.fixturenames:
            for fixturedef in name2defs.get(name, ()):
                if fixturedef in self.fixture_starts:
                    yield name, self.fixture_starts[fixturedef]
                    break

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if item.get_closest_marker("slow") is not None:
            return report
        problems = []
        seen = set()
        for start in self.starts:
            if start.what not in seen:
                seen.add(start.what)
                problems.append(f"{item.nodeid} started {start.what} at {start.where} but is not marked slow")
            if len(seen) == 3:
                break
        if call.when == "setup":
            for name, start in self._fixture_starts_of(item):
                if start.what not in seen:
                    seen.add(start.what)
                    problems.append(f"{item.nodeid} uses fixture {name!r}, which started {start.what} (at "
                                    f"{start.where}), but is not marked slow")
        # other processes' load is not the test's cost: the time its thread waited for a CPU is not counted
        own_s = report.duration - self.call_cpu_wait_s
        if call.when == "call" and self.limit_s > 0 and own_s > self.limit_s:
            waited = self.call_cpu_wait_s
            waited = f" ({waited:.1f} s of it waiting for a CPU, not counted)" if waited >= 0.1 else ""
            problems.append(f"{item.nodeid} took {report.duration:.1f} s in its call phase{waited}, over the "
                            f"{self.limit_s:g} s limit (slow_guard_limit_s) for tests not marked slow")
        self.starts = []
        if problems:
            message = "\n".join(f"slow guard: {p}: {HINT}" for p in problems)
            if report.failed:
                report.sections.append(("slow guard", message))
            else:
                report.outcome, report.longrepr = "failed", message
                if hasattr(report, "wasxfail"):
                    del report.wasxfail
        return report


_ACTIVE: list[SlowGuard] = []  # one per running session; in-process pytester runs push their own


def _record(what: str) -> None:
    if _ACTIVE:
        _ACTIVE[-1].record(what)


def _patch_subprocesses() -> None:
    popen_init = subprocess.Popen.__init__

    def __init__(self, args, *a, **kw):
        _record(f"a subprocess (subprocess.Popen {_describe_args(args)})")
        popen_init(self, args, *a, **kw)

    subprocess.Popen.__init__ = __init__

    for name in ("fork", "system", "posix_spawn", "posix_spawnp"):
        original = getattr(os, name, None)
        if original is None:
            continue

        def wrapper(*a, _original=original, _name=name, **kw):
            _record(f"a subprocess (os.{_name}{' ' + _describe_args(a[0]) if a and _name != 'fork' else ''})")
            return _original(*a, **kw)

        setattr(os, name, wrapper)

    import multiprocessing.process

    start = multiprocessing.process.BaseProcess.start

    def process_start(self):
        _record(f"a subprocess (multiprocessing {type(self).__name__}.start, target {self._target!r})")
        return start(self)

    multiprocessing.process.BaseProcess.start = process_start


def _patch_deepspeed(module) -> None:
    initialize = module.initialize

    def patched_initialize(*a, **kw):
        _record("a DeepSpeed engine (deepspeed.initialize)")
        return initialize(*a, **kw)

    module.initialize = patched_initialize


def _patch_uvicorn(module) -> None:
    startup = module.Server.startup

    async def patched_startup(self, *a, **kw):
        _record("a uvicorn server (uvicorn.Server.startup)")
        return await startup(self, *a, **kw)

    module.Server.startup = patched_startup


# deepspeed (seconds to import) and uvicorn are patched when something imports them, not imported here
_PATCH_ON_IMPORT = {"deepspeed": _patch_deepspeed, "uvicorn.server": _patch_uvicorn}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch) -> None:
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        patch = _PATCH_ON_IMPORT.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


_installed = False


def _install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    _patch_subprocesses()
    for name, patch in _PATCH_ON_IMPORT.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _PatchOnImport())


def pytest_addoption(parser) -> None:
    parser.addini("slow_guard_limit_s", "tests not marked slow fail when their call phase takes longer than this "
                  "many seconds (tests/slow_guard.py; 0 turns the time check off)", default="10")


def pytest_configure(config) -> None:
    _install()
    guard = SlowGuard(float(config.getini("slow_guard_limit_s")))
    config.stash[_GUARD] = guard
    config.pluginmanager.register(guard, "slow-guard-session")
    _ACTIVE.append(guard)


def pytest_unconfigure(config) -> None:
    guard = config.stash.get(_GUARD, None)
    if guard is not None and guard in _ACTIVE:
        _ACTIVE.remove(guard)


_GUARD = pytest.StashKey[SlowGuard]()
