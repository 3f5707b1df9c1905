"""Held-out evaluation: greedy accuracy and pass@k, scored with the training rewards.

Training rollout rewards are not accuracy (they are sampled, on the training split, and may include shaping terms);
this evaluates a model folder on the evaluation split (or the file ``eval.path``: a JSONL training file has no
held-out split, :func:`eval_dataset`) with greedy decoding and with k samples per example, and says what it
evaluated (:func:`describe`, the result's ``evaluated``).

With ``generator.environment`` set, the same environment runs (generator/multiturn.py): every trajectory is scored
as in training (the reward functions on the whole trajectory's text, or the environment's reward with ``reward:
environment``, whose component is then ``environment``), and the result adds the tool-call rate (greedy
trajectories with at least one observation appended), turns per trajectory and environment failures. With
``generator.agent`` the agent's episodes are the trajectories (generator/agent/runner.py, through an endpoint of the
evaluation's own), scored as in training (``reward: agent``: component ``agent``).

It says how far it is (logger ``grpo.eval``, a line every :data:`PROGRESS_EVERY_S` seconds with the percentage and
the time left): on a CPU the demo's 500 examples take a while.

Completions are scored chunk by chunk as they are generated (:class:`EvalScoring`), under training's rule for user
code that fails (generator/failures.py, ``generator.failures``): a reward or environment that fails on too much of
what it is given stops the evaluation at its first chunk, exit 2, with the first failure's traceback and file:line,
instead of an accuracy computed from on_error scores; a reward service that is down pauses the evaluation until it
answers.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from generator.datasets import kind_traits, load_examples, path_kinds, render_example, system_prompt_for
from generator.environments.base import prompt_tools
from generator.failures import FailureRule, ServicePause
from generator.loop import environment_rewards
from generator.main import build_engine
from generator.rewards import RewardSet
from generator.rewards.reward_set import GroupScores
from shared.config.schema import GRPOConfig
from shared.config.schema.generator import DatasetConfig, FailuresConfig
from shared.errors import UsageError
from shared.progress import Ticker
from shared.protocol.records import SamplingParams

log = logging.getLogger("grpo.eval")

PROGRESS_EVERY_S = 5.0


@dataclass
class EvalResult:
    greedy_accuracy: float
    pass_at_k: float
    k: int
    num_examples: int
    greedy_mean_reward: float
    greedy_rewards: dict[str, float]
    accuracy_reward: str
    evaluated: str                              # what: "the first 200 examples of data/eval.jsonl"
    # multi-turn only (None without an environment), over the greedy trajectories
    tool_call_rate: float | None = None         # share with >= 1 observation appended
    turns_per_trajectory: float | None = None   # model turns
    env_errors: int | None = None               # trajectories failed by their environment

    def as_dict(self) -> dict:
        out = {"greedy_accuracy": self.greedy_accuracy, f"pass@{self.k}": self.pass_at_k, "k": self.k,
               "num_examples": self.num_examples, "greedy_mean_reward": self.greedy_mean_reward,
               "greedy_rewards": self.greedy_rewards, "accuracy_reward": self.accuracy_reward,
               "evaluated": self.evaluated}
        if self.tool_call_rate is not None:
            out.update(tool_call_rate=self.tool_call_rate, turns_per_trajectory=self.turns_per_trajectory,
                       env_errors=self.env_errors)
        return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


ChunkDone = Callable[[int, list], object]   # (index of the chunk's first prompt, the chunk's results)


def generate_in_chunks(engine, prompts: list[list[int]], sampling: SamplingParams, n: int, seed: int | None,
                       progress: Callable[[int], object], on_chunk: ChunkDone | None = None) -> list:
    """``engine.generate(prompts, sampling, n, seed)``, with ``on_chunk(start, results)`` and then
    ``progress(sequences done)`` after each chunk.

    The transformers engine is called with the chunks it would cut itself (``max_batch_sequences // n`` prompts)
    and the seed on the first only: its random stream then runs on as in one call, so the samples are the same.
    An engine that seeds each request (vLLM) is called once."""
    size = getattr(engine, "max_batch_sequences", None)
    on_chunk = on_chunk or (lambda start, chunk: None)
    if size is None:
        results = engine.generate(prompts, sampling, n, seed=seed)
        on_chunk(0, results)
        progress(len(prompts) * n)
        return results
    per_call = max(1, size // max(n, 1))
    results: list = []
    for start in range(0, len(prompts), per_call):
        chunk = engine.generate(prompts[start:start + per_call], sampling, n, seed=seed if start == 0 else None)
        on_chunk(start, chunk)
        results += chunk
        progress(len(results) * n)
    return results


def rollouts_in_chunks(runner, samples: list[dict], prompts: list[list[int]], sampling: SamplingParams, n: int,
                       seed: int | None, progress: Callable[[int], object], per_call: int = 64,
                       on_chunk: ChunkDone | None = None) -> list:
    """Multi-turn: ``runner.generate`` (a MultiTurnRollouts) over ``per_call`` prompts at a time, with
    ``on_chunk(start, trajectories)`` and ``progress(trajectories done)`` after each chunk; chunk ``c`` is seeded
    ``seed + c``."""
    results: list = []
    for c, start in enumerate(range(0, len(prompts), per_call)):
        _, groups = runner.generate(samples[start:start + per_call], prompts[start:start + per_call], sampling, n,
                                    seed=None if seed is None else seed + c)
        if on_chunk is not None:
            on_chunk(start, groups)
        results += groups
        progress(len(results) * n)
    return results


class EvalScoring:
    """The scores of each example's greedy completion and of its k samples, computed chunk by chunk as they are
    generated, under the failure rule and the service pause of training (generator/failures.py): the rule is checked
    after each chunk, so a reward that fails everywhere stops the evaluation at its first one."""

    def __init__(self, rewards: RewardSet, tokenizer, examples: list, environment, failures: FailuresConfig) -> None:
        self.rewards, self.tokenizer, self.examples, self.environment = rewards, tokenizer, examples, environment
        self.rule = FailureRule(failures.window, failures.max_rate)
        self.pause = ServicePause(failures.service_retry_s, paused="evaluation")
        self.never = threading.Event()   # no stop but Ctrl-C (KeyboardInterrupt ends a pause's wait)
        self.greedy: list[GroupScores] = []
        self.sampled: list[GroupScores] = []

    def into(self, scores: list[GroupScores]) -> ChunkDone:
        """The ``on_chunk`` of a pass: its chunks' scores appended to ``scores``, then the rule checked."""
        def on_chunk(start: int, chunk: list) -> None:
            for example, completions in zip(self.examples[start:start + len(chunk)], chunk):
                scores.append(self.score(example, completions))
            self.rule.check()
        return on_chunk

    def score(self, example, completions: list) -> GroupScores:
        """One example's completions, as training scores them (multi-turn: the whole trajectory's text; with
        ``reward: environment`` the environment's, as component ``environment``; ``on_error`` for failures)."""
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
        scores = self.pause.call(lambda: self.rewards.score_group(example.question, texts, example.data,
                                                                  [c.token_ids for c in completions]), self.never)
        environment = self.environment
        self.rule.record_group([t.name for t in self.rewards.terms], scores.failures,
                               environment.name if environment is not None else None,
                               [c.env_failure for c in completions])
        if environment is not None:
            environment_rewards(scores, completions, environment)
        return scores


def sample(engine, examples: list, prompts: list[list[int]], config: GRPOConfig, ticker: Ticker,
           scoring: EvalScoring):
    """The greedy completions (one per prompt), the k samples of each, and (multi-turn: the EnvStats of the greedy
    trajectories, else None), each chunk scored into ``scoring`` as it comes. With an environment every completion
    is a trajectory of generator/multiturn.py."""
    cfg, gen, environment = config.eval, config.generator, config.generator.environment
    greedy_sampling = SamplingParams(temperature=0.0, max_tokens=gen.sampling.max_tokens)
    sampling = SamplingParams(temperature=cfg.temperature, top_p=gen.sampling.top_p, top_k=gen.sampling.top_k,
                              max_tokens=gen.sampling.max_tokens)
    on_greedy = lambda done: ticker.update(done, "greedy")  # noqa: E731
    on_sampled = lambda done: ticker.update(len(prompts) + done, f"pass@{cfg.k} samples")  # noqa: E731
    if environment is None and gen.agent is None:
        greedy = generate_in_chunks(engine, prompts, greedy_sampling, 1, None, on_greedy, scoring.into(scoring.greedy))
        return greedy, generate_in_chunks(engine, prompts, sampling, cfg.k, config.seed, on_sampled,
                                          scoring.into(scoring.sampled)), None
    samples = [{"question": e.question, **e.data} for e in examples]
    runner = multi_turn_runner(engine, config, greedy_sampling)
    try:
        greedy = rollouts_in_chunks(runner, samples, prompts, greedy_sampling, 1, config.seed, on_greedy,
                                    on_chunk=scoring.into(scoring.greedy))
        greedy_env = replace(runner.stats)
        sampled = rollouts_in_chunks(runner, samples, prompts, sampling, cfg.k, config.seed, on_sampled,
                                     on_chunk=scoring.into(scoring.sampled))
    finally:
        if hasattr(runner, "close"):
            runner.close()
    return greedy, sampled, greedy_env


def multi_turn_runner(engine, config: GRPOConfig, sampling: SamplingParams):
    """What makes the trajectories of an evaluation: the environment's (generator/multiturn.py), or the episodes of
    ``generator.agent`` through its own endpoint (generator/agent/runner.py; started here, closed by the caller),
    each pass with its own sampling (greedy, then ``eval.temperature``)."""
    gen = config.generator
    if gen.agent is None:
        from generator.multiturn import MultiTurnRollouts

        return MultiTurnRollouts(engine, engine.tokenizer, gen.environment)
    if not (gen.agent.fn or gen.agent.verifiers is not None):
        raise UsageError("grpo eval with generator.agent needs an agent to run: generator.agent.fn (or a verifiers "
                         "environment); an external agent process (fn: null) drives the endpoint itself, so "
                         "evaluate with it, or set generator.agent.fn")
    if not hasattr(engine, "generate_turns"):
        raise UsageError(f"generator.agent: the {engine.name} engine cannot sample turns (eval.engine)")
    from generator.agent.runner import AgentRollouts

    # the evaluation's own endpoint, for its own agent only: loopback, any free port (a training generator may hold
    # the configured one)
    own = gen.agent.model_copy(update={"host": "127.0.0.1", "port": 0})
    return AgentRollouts(engine, engine.tokenizer, own, sampling, seed=config.seed)


def eval_dataset(config: GRPOConfig) -> DatasetConfig:
    """The dataset ``grpo eval`` reads: the training dataset's ``eval.split``, or the file/dataset ``eval.path``
    names (for the kinds that read a path: their :class:`DatasetKind` checks it). A source without a held-out part
    (a JSONL training file: its first lines as test examples would report training accuracy) needs ``eval.path``:
    without it, it is refused, naming the key."""
    cfg, dataset = config.eval, config.generator.dataset
    kind = kind_traits(dataset.kind)
    update: dict = {"split": cfg.split, "arithmetic_pool": min(dataset.arithmetic_pool, cfg.num_examples)}
    if cfg.path is not None:
        if kind.eval_path is None:
            raise UsageError(f"eval.path applies to generator.dataset.kind {' or '.join(path_kinds())}, not "
                             f"{dataset.kind!r}: the {dataset.kind} task's held-out examples are eval.split (now "
                             f"{cfg.split!r})")
        update.update(kind.eval_path(dataset, cfg.path))
    elif not kind.heldout_split:
        raise UsageError(f"generator.dataset is the {dataset.kind} source {dataset.path}, which has no held-out split: "
                         "set eval.path to a file of evaluation examples (grpo eval --path FILE, or --set "
                         f"eval.path=FILE); --path {dataset.path} evaluates the training file's first lines")
    return dataset.model_copy(update=update)


def describe(dataset: DatasetConfig, count: int, training: DatasetConfig) -> str:
    """What is evaluated, for the progress line and the result: the file, or the dataset and split, and how many
    (each kind's own words where it declares them)."""
    kind = kind_traits(dataset.kind)
    if kind.describe is not None:
        return kind.describe(dataset, count, training)
    return f"{count} examples of the {dataset.kind} task's {dataset.split!r} split"


@dataclass
class EvalPlan:
    """What an evaluation reads, once per process: the examples, the rewards and the one that judges correctness.
    :func:`evaluate_engine` evaluates a loaded engine with it, as often as its weights change (generator/evaluator.py)."""

    examples: list
    evaluated: str
    rewards: RewardSet
    names: list[str]
    judge: str


def plan_eval(config: GRPOConfig) -> EvalPlan:
    """The examples, rewards and judge of ``config``; an ``eval.accuracy_reward`` that is no reward is refused."""
    cfg, gen = config.eval, config.generator
    dataset = eval_dataset(config)
    examples = load_examples(dataset, seed=config.seed + 1)[:cfg.num_examples]
    evaluated = describe(dataset, len(examples), gen.dataset)
    rewards = RewardSet.from_specs(gen.rewards, config.learner.max_steps)
    rollouts = gen.environment or gen.agent   # an agent's episodes are scored as an environment's trajectories
    names = [rollouts.reward] if rollouts is not None and rollouts.reward in ("environment", "agent") else \
        [t.name for t in rewards.terms]
    judge = cfg.accuracy_reward or names[0]
    if judge not in names:
        raise UsageError(f"eval.accuracy_reward {judge!r} is not one of the generator's rewards {names}"
                         + (" (generator.environment.reward: environment scores with 'environment' only)"
                            if names == ["environment"] else
                            " (generator.agent.reward: agent scores with 'agent' only)" if names == ["agent"] else ""))
    return EvalPlan(examples, evaluated, rewards, names, judge)


def eval_engine(config: GRPOConfig, model_dir: str):
    """The engine ``grpo eval`` evaluates ``model_dir`` with (``eval.engine``)."""
    gen = config.generator
    return build_engine(config.model_copy(update={"generator": gen.model_copy(update={"model": model_dir,
                                                                                      "engine": config.eval.engine})}))


def evaluate(config: GRPOConfig, model_dir: str) -> EvalResult:
    plan = plan_eval(config)
    engine = eval_engine(config, model_dir)
    try:
        return evaluate_engine(config, engine, plan, model_dir)
    finally:
        engine.close()


def evaluate_engine(config: GRPOConfig, engine, plan: EvalPlan, label: str) -> EvalResult:
    """``plan`` evaluated with the weights ``engine`` holds now (``label``: what they are, for the progress line)."""
    cfg, gen = config.eval, config.generator
    examples, evaluated, rewards, names, judge = plan.examples, plan.evaluated, plan.rewards, plan.names, plan.judge
    environment = gen.environment
    tokenizer = engine.tokenizer
    system = system_prompt_for(gen.dataset)
    chat = gen.dataset.template is None and bool(getattr(tokenizer, "chat_template", None))
    tools = prompt_tools(environment)   # tool calling: the schemas the chat template shows
    prompts = [tokenizer(render_example(tokenizer, e, system, gen.dataset.template, tools),
                         add_special_tokens=not chat)["input_ids"] for e in examples]
    ticker = Ticker(f"evaluating {label} on {evaluated}", len(prompts) * (1 + cfg.k),
                    log.info, every_s=PROGRESS_EVERY_S, unit="sequences")
    scoring = EvalScoring(rewards, tokenizer, examples, environment or gen.agent, gen.failures)
    greedy, sampled, greedy_env = sample(engine, examples, prompts, config, ticker, scoring)
    correct = 0
    totals: dict[str, float] = dict.fromkeys(names, 0.0)
    counts: dict[str, int] = dict.fromkeys(names, 0)   # greedy completions each reward applied to
    total_reward = 0.0
    pass_sum = 0.0
    for s, scores, sample_scores in zip(sampled, scoring.greedy, scoring.sampled):
        # a TRL-style reward's None ("not applicable") is no hit, and is left out of that reward's mean
        correct += scores.applicable(judge)[0] and scores.components[judge][0] >= cfg.threshold
        total_reward += scores.total[0]
        for name in names:
            if scores.applicable(name)[0]:
                totals[name] += scores.components[name][0]
                counts[name] += 1
        hits = sum(ok and v >= cfg.threshold
                   for ok, v in zip(sample_scores.applicable(judge), sample_scores.components[judge]))
        pass_sum += pass_at_k(len(s), hits, cfg.k)
    n = len(examples)
    result = EvalResult(correct / n, pass_sum / n, cfg.k, n, total_reward / n,
                        {k: v / max(counts[k], 1) for k, v in totals.items()}, judge, evaluated)
    if greedy_env is not None:
        result.tool_call_rate = sum(0 in (g[0].mask or []) for g in greedy) / n
        result.turns_per_trajectory = greedy_env.turns / max(greedy_env.trajectories, 1)
        result.env_errors = greedy_env.env_errors
    return result

