"""The rollout loop: draw prompts, sample G completions each, score, upload groups with backpressure, and pick up
new policy weights between batches.

Stopping: :meth:`RolloutLoop.run` checks ``stop`` between steps, so Ctrl-C / SIGTERM (which set it) let the
current upload finish. An unreachable hub is retried by the client with backoff while the finished groups wait;
when the retry budget runs out, :class:`shared.protocol.client.HubUnavailable` propagates and the command exits with a
message — never silently.

User code that fails (rewards, the environment) is scored ``on_error`` per completion or trajectory, under one rule
that stops the generator when a source fails too often; a reward service that is down pauses generation on the
group waiting for it (generator/failures.py, ``generator.failures``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from generator.datasets import Example, PromptStream, render_example
from generator.engines.base import Engine, SampledCompletion
from generator.environments.base import prompt_tools
from generator.failures import FailureRateExceeded, FailureRule, ServicePause
from generator.multiturn import MultiTurnRollouts
from generator.progress import Progress
from generator.refusals import GroupsRefused, RefusalCounter
from generator.rewards import GroupScores, RewardSet
from generator.stats import LoopStats
from generator.step_tokens import group_token_steps, tokenizer_decode
from shared.config.schema.generator import EnvironmentConfig, FailuresConfig, StepRewardsConfig
from shared.config.schema.weight_sync import WeightSyncConfig
from shared.protocol.client import HubClient, HubError, HubUnavailable
from shared.protocol.errors import ProtocolError
from shared.protocol.records import RolloutGroup, SamplingParams
from shared.weight_sync.receiver import WeightReceiver

log = logging.getLogger("grpo.generator")


def carries_signal(outcomes: list[float], steps: list[list[tuple[int, float]]] | None) -> bool:
    """Whether a group can teach anything (dynamic sampling keeps it): its outcome totals differ, or its step
    rewards do. Step rewards are normalised over the group's steps (``process_advantages``): fewer than two, or all
    equal, give every token 0, whatever their positions."""
    if len(set(outcomes)) > 1:
        return True
    return steps is not None and len({reward for pairs in steps for _, reward in pairs}) > 1


def uploaded_components(scores: GroupScores, step_only: Sequence[str] = ()) -> dict[str, list[float]]:
    """The per-reward values a group carries: a reward that applied to none of its completions (a TRL-style
    reward's None everywhere) is left out, so the learner's ``reward/NAME`` mean leaves the group out as it does a
    group without that reward; one that applied to some carries 0.0 for the others (the protocol's floats are
    finite). A reward in ``step_only`` (it gave steps and never an outcome, a PRM) is left out too: its 0.0 would be
    no score (its steps are the group's step rewards, the learner's step_reward_mean)."""
    return {name: values for name, values in scores.components.items()
            if not all(scores.not_applicable.get(name, [False])) and name not in step_only}


def environment_rewards(scores, samples: list[SampledCompletion], cfg: EnvironmentConfig) -> None:
    """Multi-turn: the trajectories' rewards, in place in ``scores`` (a RewardSet's group scores). ``reward:
    environment``: the sum of the environment's step rewards (0 when it gave none), as the one component
    ``environment``; ``rewards``: the reward functions' scores of the whole trajectory's text, kept. Either way a
    trajectory its environment failed gets ``on_error``."""
    if cfg.reward in ("environment", "agent"):   # generator.agent's 'agent': the agent's reward, the same way
        scores.total = [s.env_reward or 0.0 for s in samples]
        scores.components = {cfg.reward: list(scores.total)}
        scores.not_applicable = {}
    scores.total = [cfg.on_error if s.env_failed else total for s, total in zip(samples, scores.total)]


def derived_seed(*parts: object) -> int:
    """A reproducible 31-bit seed from ``parts`` (Python's hash() is salted per process)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def sample_versions(samples: list[SampledCompletion], version: int) -> dict:
    """``policy_version`` (and per-token ``versions``) of a group: samples without per-token versions were all
    sampled with ``version``; with them, the group's version is the oldest of its tokens (staleness is judged by
    it) and the per-token ones travel with the group."""
    if all(s.versions is None for s in samples):
        return {"policy_version": version}
    rows = [s.versions if s.versions is not None else [version] * len(s.token_ids) for s in samples]
    oldest = min((v for row in rows for v in row), default=version)
    return {"policy_version": oldest, "versions": rows}


class RolloutLoop:
    def __init__(self, *, engine: Engine, tokenizer, client: HubClient, rewards: RewardSet, prompts: PromptStream,
                 sampling: SamplingParams, group_size: int, prompts_per_batch: int, generator_id: str,
                 weights_dir: str | Path, system_prompt: str | None = None, template: str | None = None,
                 drop_constant_groups: bool = False, seed: int = 0, progress: Progress | None = None,
                 wait_for_budget: bool = True, budget_poll_s: float = 2.0,
                 step_rewards: StepRewardsConfig | None = None,
                 environment: EnvironmentConfig | None = None, max_refused_in_a_row: int = 64,
                 failures: FailuresConfig | None = None) -> None:
        self.engine, self.tokenizer, self.client = engine, tokenizer, client
        self.rewards, self.prompts, self.sampling = rewards, prompts, sampling
        self.group_size, self.prompts_per_batch = group_size, prompts_per_batch
        self.generator_id = generator_id
        self.weights_dir = Path(weights_dir)
        self.system_prompt, self.template = system_prompt, template
        self.drop_constant_groups = drop_constant_groups
        self.step_rewards = step_rewards or StepRewardsConfig()
        self.wait_for_budget = wait_for_budget
        self.budget_poll_s = budget_poll_s
        self.seed = seed
        self.stats = LoopStats()
        self.policy_version = 0
        self.refusals = RefusalCounter(max_refused_in_a_row)   # groups never accepted: dropped once; a livelock stops
        failures = failures or FailuresConfig()
        self.failures = FailureRule(failures.window, failures.max_rate)   # rewards, environments failing too often
        self.service_pause = self.stats.service_pause = ServicePause(failures.service_retry_s)  # a service down
        self.stop = threading.Event()   # run() takes the caller's: a stop ends a pause
        self.progress = progress or Progress(enabled=False)
        self._batch_index = 0
        # group id -> reward name -> completions it applied to, for a group where a TRL-style reward returned None;
        # read when the hub answers (the per-reward means leave "not applicable" out)
        self._applicable: dict[str, dict[str, int]] = {}
        self.kept_fraction = 1.0   # running share of prompts whose group is kept (dynamic sampling drops the rest)
        self.receiver: WeightReceiver | None = None  # generator.main builds it from the weight_sync config
        # multi-turn rollouts with an environment (generator/multiturn.py); None: one completion per rollout
        self.environment = environment
        self.multiturn = MultiTurnRollouts(engine, tokenizer, environment) if environment is not None else None
        self.stats.environment = self.multiturn.stats if self.multiturn is not None else None
        context = getattr(rewards, "context", None)   # TRL-style rewards' log_metric values, for the summaries
        self.stats.logged_metrics = context.log_metric if context is not None else None
        self.prompt_tools = prompt_tools(environment)   # tool calling: the schemas the chat template shows

    @property
    def policy_version(self) -> int:
        """The version the engine serves: what groups are stamped with and TRL-style rewards read as
        ``trainer_state.global_step``."""
        return self._policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self._policy_version = version
        context = getattr(self.rewards, "context", None)
        if context is not None:
            context.trainer_state.global_step = version

    def use_agent(self, rollouts, cfg) -> None:
        """``generator.agent``: the episodes of a user's agent are the rollouts (generator/agent/runner.py), scored
        as an environment's trajectories are (``cfg`` has its ``reward``, ``on_error`` and ``name``)."""
        self.multiturn, self.environment, self.stats.environment = rollouts, cfg, rollouts.stats
        rollouts.stopping = lambda: self.stop.is_set()   # a stop ends the wait on a batch's unfinished episodes

    # -- weights --------------------------------------------------------------------------------------------
    def sync_weights(self) -> bool:
        """Take the newest policy version through the weight-sync receiver (the HTTP relay unless
        ``generator.main`` set one up from the weight_sync config). Returns whether the version changed."""
        if self.receiver is None:
            self.receiver = WeightReceiver(self.engine, self.client, WeightSyncConfig(transport="http"),
                                           self.generator_id, self.weights_dir)
        latest = self.receiver.sync(self.policy_version)
        if latest is None or latest == self.policy_version:
            return False
        log.info("policy version %d -> %d (loaded in %.2fs)", self.policy_version, latest, self.receiver.last_load_s)
        self.policy_version = latest
        self.stats.weight_updates += 1
        return True

    # -- pacing -------------------------------------------------------------------------------------------------
    def hub_wanted(self, wait_s: float) -> int | None:
        """The groups the learner can use within the staleness bound (ref_server/hub/pacing.py), waiting up to
        ``wait_s`` on the hub while it can use none; None: no pacing (switched off, an older hub without the route,
        or a learner that has not said how many groups a step takes yet)."""
        if not self.wait_for_budget:
            return None
        try:
            answer = self.client.rollout_budget(self.policy_version, wait_s=wait_s)
        except HubError as exc:
            if exc.status != 404:
                raise
            log.warning("the hub has no /v1/rollouts/budget (an older ref server): generating without pacing")
            self.wait_for_budget = False
            return None
        return answer["wanted"]

    def prompts_for(self, groups: int) -> int:
        """Prompts to start for ``groups`` kept groups: a prompt gives at most one group and dynamic sampling
        drops some, so divide by the share of prompts whose group is kept."""
        return math.ceil(groups / max(self.kept_fraction, 0.1))

    def prompts_wanted(self) -> int:
        """Prompts for the next engine call: ``prompts_per_batch``, or fewer when the learner can use only that
        many more groups (:meth:`hub_wanted`, divided by the kept share so dynamic sampling does not leave a tail
        of small engine calls); waits up to ``budget_poll_s`` on the hub while it can use none, and then returns
        0 (sync weights and ask again)."""
        started = time.perf_counter()
        wanted = self.hub_wanted(self.budget_poll_s)
        if wanted is None:
            return self.prompts_per_batch
        if wanted > 0:
            return min(self.prompts_per_batch, self.prompts_for(wanted))
        self.stats.budget_waits += 1
        self.stats.budget_wait_s += time.perf_counter() - started
        return 0

    # -- one step -------------------------------------------------------------------------------------------
    def encode_prompt(self, example: Example) -> list[int]:
        text = render_example(self.tokenizer, example, self.system_prompt, self.template, self.prompt_tools)
        chat = self.template is None and bool(getattr(self.tokenizer, "chat_template", None))
        # a chat template already contains the special tokens it wants
        return self.tokenizer(text, add_special_tokens=not chat)["input_ids"]

    def build_group(self, example: Example, prompt_ids: list[int], samples: list[SampledCompletion],
                    policy_version: int | None = None) -> RolloutGroup | None:
        """The group of ``samples``, scored; None when it is not uploaded: no signal (dynamic sampling), or one
        the hub could never accept (counted and dropped here, see generator/refusals.py). ``policy_version``: the
        version that sampled every token (default: the loop's current one) when the samples carry no per-token
        ``versions``; with them (the continuous schedule), the group's version is the oldest of its tokens."""
        unusable = next((s.unusable for s in samples if s.unusable is not None), None)
        if unusable is not None:
            self._unacceptable(unusable)
            return None
        texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
        scores = self.service_pause.call(lambda: self.rewards.score_group(example.question, texts, example.data,
                                                                          [s.token_ids for s in samples]),
                                         self.stop)
        if scores is None:   # stopped while a reward service was down
            return None
        self.prompts.observe(example, scores.total)
        self.stats.prompts_skipped = self.prompts.skipped
        env = self.environment
        self.failures.record_group([term.name for term in self.rewards.terms], scores.failures,
                                   env.name if env is not None else None, [s.env_failure for s in samples])
        if env is not None:
            environment_rewards(scores, samples, env)
        self.stats.reward_errors += sum(scores.errors.values())
        self.stats.step_only_rewards = [t.name for t in self.rewards.terms if t.gives_steps and not t.gives_outcome]
        self.stats.step_reward_errors += scores.step_errors
        steps = None
        if scores.steps is not None:  # a process-supervised group; outcome-only groups skip all of this
            mapped = group_token_steps(tokenizer_decode(self.tokenizer), [s.token_ids for s in samples], texts,
                                       scores.steps, scores.total, self.step_rewards)
            self.stats.step_reward_errors += mapped.errors
            steps = mapped.steps
        elif any(s.token_steps is not None for s in samples):   # an agent's step rewards (generator/agent/)
            steps = [s.token_steps or [] for s in samples]
        if self.drop_constant_groups and not carries_signal(scores.total, steps):
            self.stats.groups_dropped_constant += 1
            self.refusals.constant(self.policy_version if policy_version is None else policy_version, scores.total)
            return None
        group = RolloutGroup.from_samples(
            prompt_ids=prompt_ids, completion_ids=[s.token_ids for s in samples],
            behaviour_logprobs=[s.logprobs for s in samples], rewards=scores.total,
            finish_reasons=[s.finish_reason for s in samples],
            **sample_versions(samples, self.policy_version if policy_version is None else policy_version),
            generator_id=self.generator_id, sampling=self.sampling, reward_components=uploaded_components(scores, self.stats.step_only_rewards),
            task={k: str(v) for k, v in example.data.items() if isinstance(v, (str, int, float))}
                 | {"example_id": example.example_id},
            steps=steps, masks=[s.mask for s in samples] if any(s.mask is not None for s in samples) else None,
        )
        try:  # the hub's own checks of a group's content (its context and temperature are the hub's to check)
            group = group.validate()
        except ProtocolError as exc:
            self._unacceptable(str(exc))
            return None
        if scores.not_applicable:
            self._applicable[group.group_id] = {name: sum(scores.applicable(name)) for name in scores.not_applicable}
        return group

    def _unacceptable(self, reason: str) -> None:
        self.stats.groups_unacceptable += 1
        self.refusals.refused("this generator's check of its groups (the hub would refuse them)", reason)

    def step(self, num_prompts: int | None = None) -> list[RolloutGroup]:
        """One engine call: ``num_prompts`` (default ``prompts_per_batch``) prompts x G completions, scored (not yet
        uploaded)."""
        examples = self.prompts.take(num_prompts or self.prompts_per_batch)
        prompt_ids = [self.encode_prompt(e) for e in examples]
        seed = derived_seed(self.seed, self.generator_id, self._batch_index)
        self._batch_index += 1
        if self.multiturn is not None:
            prompt_ids, samples = self.multiturn.generate([{"question": e.question, **e.data} for e in examples],
                                                          prompt_ids, self.sampling, self.group_size, seed=seed)
        else:
            samples = self.engine.generate(prompt_ids, self.sampling, self.group_size, seed=seed)
        groups = []
        for example, ids, group_samples in zip(examples, prompt_ids, samples):
            if not group_samples:   # an agent's group dropped at a stop (generator/agent/runner.py), counted there
                continue
            group = self.build_group(example, ids, group_samples)
            self.stats.prompts += 1
            self.stats.completion_tokens += sum(len(s.token_ids) for s in group_samples)
            if group is not None:
                groups.append(group)
        self.failures.check()   # a reward or environment failing too often: stop before uploading this batch
        self.record_kept(len(examples), len(groups))
        return groups

    def record_kept(self, prompts: int, kept: int) -> None:
        """The running share of prompts whose group is kept: an exponential average weighted by prompts."""
        weight = min(1.0, prompts / 64)
        self.kept_fraction += weight * (kept / max(prompts, 1) - self.kept_fraction)

    def upload(self, groups: list[RolloutGroup]) -> None:
        """One request for the groups of an engine call (retried by the client on 429 / 5xx / connection errors)."""
        for group, answer in zip(groups, self._upload_within_limit(groups)):
            self._count(group, answer)

    def _upload_within_limit(self, groups: list[RolloutGroup]) -> list[dict]:
        """The hub's answers to ``groups``; a request over its ``ref_server.max_request_bytes`` (413) is sent again
        in halves, and a group over it alone can never be accepted: refused, as the hub refuses a group (it killed
        the generator)."""
        try:
            return self.client.upload_groups(groups)
        except HubError as exc:
            if exc.status != 413 or not groups:
                raise
            if len(groups) == 1:
                return [{"refused": f"the group alone is larger than the hub takes in one request: {exc.detail}",
                         "status": 413}]
            half = len(groups) // 2
            return self._upload_within_limit(groups[:half]) + self._upload_within_limit(groups[half:])

    def _count(self, group: RolloutGroup, answer: dict) -> None:
        self.stats.last_queue_depth = answer.get("queue_depth")
        applicable = self._applicable.pop(group.group_id, {})
        if answer.get("accepted"):
            self.refusals.accepted()
            self.stats.groups_uploaded += 1
            self.stats.reward_sum += float(group.rewards.sum())
            self.stats.reward_count += group.group_size
            if group.step_rewards is not None:
                self.stats.steps_uploaded += int(group.step_rewards.numel())
                self.stats.step_reward_sum += float(group.step_rewards.sum())
                self.stats.groups_with_steps += 1
            for name, values in group.reward_components.items():
                self.stats.component_sums[name] = self.stats.component_sums.get(name, 0.0) + float(values.sum())
                self.stats.component_counts[name] = (self.stats.component_counts.get(name, 0)
                                                     + applicable.get(name, group.group_size))
        elif answer.get("dropped") == "stale":
            self.stats.groups_refused_stale += 1
        elif "refused" in answer:  # the hub refused this group alone (a batch upload); the others went on
            self.stats.groups_refused_invalid += 1
            self.refusals.refused(f"the hub ({answer.get('status')})", str(answer["refused"]))

    # -- the loop -------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event, max_groups: int | None = None) -> LoopStats:
        self.stop = stop
        try:
            self._run(stop, max_groups)
        except HubUnavailable as exc:
            if not stop.is_set():
                raise
            log.warning("stopped while the hub was unreachable (%s)", exc)
        except (GroupsRefused, FailureRateExceeded):
            self.progress.close(self.stats, self.policy_version)  # what was counted, then the reason
            raise
        self.progress.close(self.stats, self.policy_version)
        return self.stats

    def _run(self, stop: threading.Event, max_groups: int | None) -> None:
        self.sync_weights()  # a generator that joins late starts from the current version
        while not stop.is_set() and (max_groups is None or self.stats.groups_uploaded < max_groups):
            num_prompts = self.prompts_wanted()
            if num_prompts == 0:
                self.sync_weights()  # a new learner version ends the wait: its weights raise the budget
                continue
            groups = self.step(num_prompts)
            if max_groups is not None:
                groups = groups[:max(0, max_groups - self.stats.groups_uploaded)]
            self.upload(groups)  # finishes even when a stop was requested meanwhile
            self.progress.update(self.stats, self.policy_version)
            if not stop.is_set():
                self.sync_weights()
