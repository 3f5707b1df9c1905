"""The generator section (generator/): engine, sampling, prompts, rewards and the rollout loop."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from shared.config.schema.agent import AgentConfig, agent_conflict
from shared.config.schema.base import StrictModel, check_registered
from shared.config.schema.paths import template_help
from shared.config.schema.reasoning_gym import SPLITS, reasoning_gym_args
from shared.config.schema.verifiers import VerifiersConfig, environment_as_agent


class SamplingConfig(StrictModel):
    """How completions are sampled. The ref server and learner use the same temperature for their logprobs."""

    temperature: float = Field(1.0, ge=0, description="Softmax temperature; 0 is greedy (evaluation only).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: keep the smallest set of tokens with this "
                         "much probability. 1 disables it.")
    top_k: int = Field(-1, ge=-1, description="Keep only the k most likely tokens; -1 disables it.")
    max_tokens: int = Field(64, ge=1, description="Most tokens generated per completion (then finish_reason "
                            "'length').")


class RewardSpec(StrictModel):
    """One reward function of the weighted sum."""

    name: str = Field(description="Registered reward: format, math, arithmetic, final_number, code, python (a "
                      "function of yours), http (a reward service), prm (a process reward model, step rewards), "
                      "chain and chain_steps (the chain task's outcome and steps), reasoning_gym, soft_overlong or "
                      "group_length (length penalties).")
    label: str | None = Field(None, description="Name used in metrics (default: name); needed when one reward "
                              "appears twice.")
    weight: float = Field(1.0, description="Weight in the total reward.")
    on_error: float = Field(0.0, description="Score given when the reward raises or returns a non-finite value.")
    timeout_s: float | None = Field(None, ge=0, allow_inf_nan=False, description="Wall-clock limit of one call of "
                                    "the reward on a group; a call past it fails the group (on_error, under "
                                    "generator.failures' rule, with the line it was running) and is abandoned. "
                                    "null: 300 for python (your code), no limit for the built-in rewards (each "
                                    "bounded by its own timeouts); 0: no limit, called on the generator's thread.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the reward's factory, "
                                 "e.g. {match: 1.25, mismatch: -1} for format or {function: 'my_reward.py:score'} (or "
                                 "'package.module:score') for python.")

    @field_validator("name")
    @classmethod
    def _known(cls, value: str) -> str:
        return check_registered("generator.rewards", "REWARDS", value)


class ChainOptions(StrictModel):
    """The built-in multi-step task (generator/tasks/chain.py): ``17+25-8+40=`` solved one running total per line."""

    min_value: int = Field(0, description="Smallest operand.")
    max_value: int = Field(9, description="Largest operand (>= min_value).")
    ops: list[Literal["+", "-"]] = Field(["+", "-"], min_length=1, description="Operators drawn between operands; "
                                         "the chain is worked left to right.")
    num_operands: int = Field(4, ge=2, description="Operands per problem; a solution has num_operands - 1 lines.")
    heldout_fraction: float = Field(0.1, ge=0, le=1, description="Share of expressions in the held-out 'test' "
                                    "split (a salted hash of the expression).")
    split_salt: str = Field("grpo-chain", description="Salt of the split's hash; changing it reshuffles the split.")
    template: str | None = Field(None, description="Prompt wording with {expression} (e.g. 'Work out {expression} "
                                 "...') for chat models; null: the bare expression '3+5-2+7=' for the tiny model.")

    @model_validator(mode="after")
    def _consistent(self) -> ChainOptions:
        if self.min_value > self.max_value:
            raise ValueError(f"min_value {self.min_value} > max_value {self.max_value}")
        if self.template is not None and "{expression}" not in self.template:
            raise ValueError(f"template must contain {{expression}}, got {self.template!r}")
        return self


class DatasetConfig(StrictModel):
    """Where prompts come from and how they are rendered."""

    kind: str = Field(
        "arithmetic", description="'arithmetic' (built-in task), 'arithmetic_words' (the same in words for chat "
        "models: 'What is 23 plus 58? Reply with only the number.'), 'chain' (built-in multi-step task: "
        "'3+5-2=' -> '8\\n6', one running total per line; see the chain block), 'jsonl' (a file), 'hf' (through "
        "Hugging Face datasets, offline: a .jsonl/.json/.csv/.parquet/.arrow file, a folder of such files, a "
        "save_to_disk folder, or a dataset name in the local datasets cache), 'reasoning_gym' (reasoning-gym's "
        "procedural tasks, the optional extra grpo-stack[reasoning-gym]; see args) or 'verifiers' (a verifiers "
        "environment's rows).")
    path: str | None = Field(None, description="The JSONL file; for 'hf' the data file, folder or cached dataset "
                             "name.")
    split: str = Field("train", description="Dataset split to train on ('train' or 'test' for arithmetic; a data "
                       "file or a saved Dataset has the one split 'train'; a folder of files: the split each file "
                       "names, e.g. test.jsonl). Evaluation reads eval.split or eval.path, never this split.")
    subset: str | None = Field(None, description="Hugging Face dataset configuration, e.g. 'main' for gsm8k.")
    question_field: str = Field(
        "question", description="Field holding the prompt: a string (the question), or a list of {role, content} "
        "messages (TRL's conversational format, rendered with the chat template). Left at 'question' for a dataset "
        "without that field, TRL's 'prompt' column is read; a 'question' field wins over 'prompt'.")
    answer_field: str | None = Field("answer", description="Field holding the reference answer (null: none); it "
                                     "is copied to 'answer', where the rewards read it.")
    columns: dict[str, str] = Field(
        default_factory=dict, description="Columns renamed before anything reads them, dataset column -> name "
        "here, e.g. {solution: answer}. Every other column is kept as it is: the rewards receive all of them.")
    system_prompt: str | None = Field(
        None, description="System prompt; null means none for arithmetic, reasoning-gym's own (the answer in "
        "<answer> tags) for reasoning_gym and the R1-style prompt otherwise. Use "
        "an empty string for no system prompt with other datasets. A conversational prompt with a system message "
        "keeps its own and gets none added.")
    template: str | None = Field(
        None, description="Python format string with {question} and {system}; overrides the chat template (string "
        "prompts only: a conversational dataset is refused with one).")
    arithmetic: dict[str, Any] = Field(
        default_factory=dict, description="ArithmeticTask settings: min_value, max_value, ops, num_operands, "
        "heldout_fraction (arithmetic_words also takes template, with {expression}).")
    arithmetic_pool: int = Field(20000, ge=1, description="Arithmetic (and chain) problems drawn (with a fixed "
                                 "seed) into the training pool.")
    chain: ChainOptions = Field(default_factory=ChainOptions, description="Settings of the 'chain' task (used "
                                "only with kind 'chain').")
    verifiers: VerifiersConfig | None = Field(None, description="kind 'verifiers': the environment whose rows are "
                                              "the examples (split 'train': its dataset, 'eval' or 'test': its "
                                              "eval_dataset); filled from generator.agent.verifiers.")
    args: dict[str, Any] = Field(
        default_factory=dict, description="Arguments of kind 'reasoning_gym' (refused with other kinds): {task: a "
        "task name, a list or {name: weight}, size: 1000, seed: 0, eval_seed: null (seed + size), eval_size: 200, "
        "config: the task's own settings}; split 'train' is seed's examples, 'test' eval_seed's, never overlapping "
        "(docs/reasoning-gym.md).")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        return check_registered("generator.datasets", "DATASETS", value)

    @model_validator(mode="after")
    def _path_when_needed(self) -> DatasetConfig:
        if self.kind in ("jsonl", "hf") and not self.path:
            raise ValueError(f"dataset kind {self.kind!r} needs a path")
        if self.kind == "verifiers" and self.verifiers is None:
            raise ValueError("dataset kind 'verifiers' needs its environment: generator.environment {name: verifiers, "
                             "args: {env_id: ...}} (or generator.dataset.verifiers)")
        if self.kind == "reasoning_gym":
            reasoning_gym_args(self.args)
            if self.split not in SPLITS:
                raise ValueError(f"dataset kind 'reasoning_gym' has the splits {list(SPLITS)}, not {self.split!r}")
        elif self.args:
            raise ValueError(f"args apply to dataset kind 'reasoning_gym' only, not {self.kind!r}")
        return self


# -- step rewards (process supervision, issue 23) -------------------------------------------------------------------
class StepRewardsConfig(StrictModel):
    """How a group whose rewards scored steps is uploaded (generator/step_tokens.py, generator/rewards/).

    A reward returns per completion a float (an outcome score) or step scores (generator.rewards.steps.StepScores).
    The outcome total (the weighted sum of the outcome scores) always travels as the group's rewards, for metrics
    and outcome-supervised training. Groups whose rewards scored no steps are uploaded outcome-only, whatever this
    says. For the others each completion carries its steps (end token, weighted step reward summed over the step
    rewards) and ``outcome`` says whether the outcome total joins them."""

    outcome: Literal["final_step", "none"] = Field(
        "final_step", description="'final_step': outcome_weight x the completion's outcome total is added to the "
        "reward of the step ending at its last token (a step is appended there when none ends there, so a "
        "completion without steps gets one); the process advantage then credits every token with the outcome as "
        "well as the steps after it. 'none': the steps carry only step rewards, DeepSeekMath's process supervision "
        "(4.1.3); the outcome total still travels as the rewards, so a learner estimator that adds outcome "
        "advantages to process advantages can use both.")
    outcome_weight: float = Field(1.0, allow_inf_nan=False, description="Weight of the outcome total in its final "
                                  "step ('final_step' only).")


class CurriculumConfig(StrictModel):
    """A difficulty curriculum (generator/curriculum.py): each prompt's solved share (the share of its group whose
    total reward >= threshold) over its last ``window`` groups; a prompt solved always (every share 1) or never
    (every share 0) in at least ``min_appearances`` of them carries no signal and is skipped (or, with mode
    'downweight', drawn with probability keep_prob). When every prompt is settled they are drawn as usual."""

    enabled: bool = Field(False, description="Track pass rates and pass over settled prompts.")
    window: int = Field(4, ge=1, description="The last appearances of a prompt that count.")
    min_appearances: int = Field(2, ge=1, description="Appearances before a prompt can be settled.")
    threshold: float = Field(1.0, allow_inf_nan=False, description="A completion is solved when its total reward "
                             "is >= this.")
    mode: Literal["skip", "downweight"] = Field("skip", description="'skip' settled prompts, or 'downweight' them.")
    keep_prob: float = Field(0.1, ge=0, le=1, description="'downweight': the chance a settled prompt is drawn.")
    shared: bool = Field(True, description="Keep the pass rates in the hub's table, shared by every generator "
                         "reporting to it and kept in its spool folder across restarts (a hub without it: the "
                         "generator's own); false: this generator's own table, in memory.")


class FailuresConfig(StrictModel):
    """The rule for user code that fails (generator/failures.py): each reward and the environment keep the outcome of
    their last ``window`` completions or trajectories; a failure there (an exception, a timeout, a value that is no
    number, a reward service answering garbage) is scored ``on_error`` and the run goes on, until a full window
    holds ``max_rate`` failures or more, or everything given so far failed (a broken reward's first batch): the
    generator then stops, exit 2, with the first failure's file:line, and `grpo run` with it. A reward service that
    does not answer (connection refused, timeout, 5xx, 429) is down, not failing: generation pauses and retries."""

    window: int = Field(64, ge=0, description="Completions (rewards) or trajectories (the environment) each "
                        "source's failure rate is measured over, the most recent ones. 0: never stop (every failure "
                        "is still scored on_error and counted).")
    max_rate: float = Field(0.5, gt=0, le=1, description="Stop when at least this share of a full window failed "
                            "(1: only when every one in it failed).")
    service_retry_s: float = Field(10.0, gt=0, allow_inf_nan=False, description="While a PRM or HTTP reward "
                                   "service is down, how often the group waiting for it is scored again (generation "
                                   "is paused meanwhile; it resumes when the service answers).")


class EnvironmentConfig(StrictModel):
    """Multi-turn rollouts (generator/multiturn.py, docs/multi-turn.md): the model's turns alternate with an
    environment's observations, appended as tokens, and only the model's tokens are trained on."""

    name: str = Field(description="The environment: 'calculator', 'guess' or 'tools' (built-in, generator/"
                      "environments/calculator.py, guess.py, tools.py: chat tool calling, args.tools naming typed "
                      "functions) or a user class as 'package.module:Class' or 'path/to/file.py:Class' (instantiated once per "
                      "trajectory with args as keyword arguments).")
    max_turns: int = Field(4, ge=1, description="Most model turns per trajectory; after the last one the "
                           "environment is still called (for its reward) but its observation is not appended.")
    max_turn_tokens: int | None = Field(None, ge=1, description="Most tokens of one model turn (null: "
                                        "generator.sampling.max_tokens).")
    max_env_tokens: int = Field(64, ge=1, description="Most tokens of one observation; a longer one fails the "
                                "trajectory (counted in env_errors).")
    max_total_tokens: int = Field(256, ge=1, description="Most completion tokens (model and environment together) "
                                  "of a trajectory; one that reaches it ends with finish reason 'length'.")
    timeout_s: float = Field(5.0, gt=0, description="Wall-clock limit of one reset() or step() call; a call past "
                             "it fails the trajectory (counted in env_errors; the call's thread is abandoned).")
    stop: list[str] | None = Field(None, description="Strings that end a model turn (e.g. ['</calc>']; one string "
                                   "alone is one stop string, not its characters); null: the environment class's "
                                   "own 'stop' attribute.")
    reward: Literal["environment", "rewards"] = Field(
        "rewards", description="'rewards': the configured reward functions score the whole trajectory's text "
        "(model and environment tokens); 'environment': the sum of the rewards its step() returned.")
    on_error: float = Field(0.0, allow_inf_nan=False, description="Reward of a trajectory whose environment "
                            "raised, hung, or returned something other than text (it ends there).")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment's class "
                                 "(checked against its constructor at start-up: an unknown one is named).")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        """``stop: "</answer>"`` is the one stop string users mean (a list of its characters would end every turn
        at its first '<')."""
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop_string(cls, value: list[str] | None) -> list[str] | None:
        """An empty stop string would end every turn before its first token (the class's own is checked at
        start: generator.environments.base.stop_strings)."""
        if value is not None and "" in value:
            raise ValueError("an empty string is no stop string: it would end every turn before its first token")
        return value

    @field_validator("name")
    @classmethod
    def _known_environment(cls, value: str) -> str:
        return check_registered("generator.environments.base", "ENVIRONMENTS", value,
                                user_code="a class as 'package.module:Class' or 'path/to/file.py:Class'")


class ScheduleConfig(StrictModel):
    """How the engine is fed (generator/continuous/): call at a time, or kept full."""

    mode: Literal["batch", "continuous"] = Field(
        "batch", description="'batch': one engine call of prompts_per_batch prompts x G at a time; it waits for its "
        "longest completion and new weights are loaded between calls. 'continuous': sequences are submitted one by "
        "one and replaced as they finish, each group is scored and uploaded as soon as its G completions are done, "
        "and new weights are taken between two decoding steps (unfinished sequences continue with them; every token "
        "records the version that sampled it). With an environment, each model turn is a sequence of its own and "
        "the environment's calls run off the engine loop.")
    max_in_flight: int | None = Field(
        None, ge=1, description="continuous: the most sequences in the engine at once (null: prompts_per_batch x "
        "group_size, what one engine call holds in 'batch'). At least one group's G. With an environment: "
        "trajectories, one waiting for its environment counted.")
    upload_interval_s: float = Field(
        0.5, ge=0, description="continuous: the least time between two uploads; complete groups wait and go "
        "together (keeps the hub's request rate sane).")
    on_weights: Literal["recompute", "keep"] = Field(
        "recompute", description="continuous: what a weight switch does to the sequences in flight. 'recompute': "
        "their prefix (prompt + tokens so far) is encoded again by the new weights, one prefill, so each token is "
        "exactly what its version samples from that prefix (AReaL's interruptible generation). 'keep' "
        "(transformers engine only): the keys and values the old weights computed stay, so a switch costs no "
        "prefill, and the tokens after it are sampled by the new weights over a prefix the old ones encoded; their "
        "behaviour logprobs are what the engine sampled with, so algorithm.off_policy sees the difference as "
        "mismatch.")
    check_interval_s: float = Field(
        0.2, gt=0, description="continuous: how often the hub is asked for a new weights version and for its "
        "budget while the engine runs (each is one small request).")
    max_switch_share: float = Field(
        0.25, gt=0, le=1, description="continuous: the most of the wall time weight switches may take. A switch "
        "costs its load and, with on_weights recompute, one prefill of the unfinished prefixes (both measured); "
        "after one that cost c seconds the next waits c x (1 - share) / share seconds and then takes the newest "
        "version, so a learner publishing faster than the generator can load cannot turn it into a weight loader. "
        "1: every version at the next check.")


class GeneratorConfig(StrictModel):
    """A generator: samples groups of completions, scores them and uploads them to the hub."""

    model: str | None = Field(None, description="Model folder to generate with (the initial policy).")
    engine: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="'vllm' (GPU), 'transformers' (CPU or one GPU), or 'auto': vLLM when importable "
        "and a GPU is visible, else transformers.")
    id: str | None = Field(None, description="Generator name in provenance and logs (default: host-pid). Also "
                           "seeds its prompt order, so two generators draw different prompts.")
    hub_url: str = Field("http://127.0.0.1:8470", description="The ref server's address; when not set, the "
                         "address of this config's ref_server (host and port), so --set ref_server.port=N moves it "
                         "too.")
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda:N' (N indexes the node's visible GPUs).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The engine's weights and compute dtype: 'auto' is bfloat16 on a GPU (vLLM: the model's "
        "own) and float32 on the CPU. A lower precision than the learner's (learner.precision) makes the behaviour "
        "logprobs drift from the learner's: algorithm.off_policy measures and corrects it.")
    group_size: int = Field(8, ge=1, description="G: completions sampled per prompt.")
    prompts_per_batch: int = Field(4, ge=1, description="Prompts generated together in one engine call.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling parameters.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="How the engine is fed: one call "
                                     "at a time, or kept full with weights updated in flight.")
    dataset: DatasetConfig = Field(default_factory=DatasetConfig, description="Prompt source.")
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="arithmetic")],
        description="Rewards, summed with their weights; each is reported separately too. With "
        "environment.reward 'environment' the environment's rewards alone score (none of these runs): listing "
        "rewards there is an error.")
    drop_constant_groups: bool = Field(
        False, description="Dynamic sampling: do not upload groups without signal, counted: their outcome totals "
        "are all equal and, when they carry steps, their step rewards have fewer than two distinct values.")
    step_rewards: StepRewardsConfig = Field(default_factory=StepRewardsConfig, description="How step rewards "
                                            "(process supervision) and the outcome are uploaded together.")
    environment: EnvironmentConfig | None = Field(None, description="Multi-turn rollouts with an environment "
                                                  "(null: one completion per rollout).")
    agent: AgentConfig | None = Field(None, description="A user's agent as the rollout, through the generator's "
                                      "OpenAI-compatible endpoint (docs/agents.md); null: none.")
    max_groups: int | None = Field(None, ge=1, description="Stop after uploading this many groups (null: run "
                                   "until stopped).")
    wait_for_budget: bool = Field(
        True, description="Before each engine call, ask the hub how many groups of this generator's policy version "
        "the learner can still train within ref_server.max_staleness (GET /v1/rollouts/budget) and wait while the "
        "answer is 0 (new weights end the wait). False: generate continuously; groups past the bound are then "
        "dropped as stale by the hub (wasted generation).")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel size.")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM's share of GPU memory.")
    max_model_len: int | None = Field(None, ge=1, description="vLLM context length (default: the model's).")
    weights_dir: str | None = Field(
        "<run_dir>/generator/weights", description=template_help(
            "Where downloaded weight versions are kept (the newest only)", "<run_dir>/generator/weights",
            "a temporary folder removed when the generator exits"))
    retry_max_s: float = Field(600.0, gt=0, description="How long to keep retrying an unreachable hub before "
                               "exiting with an error (finished groups are kept meanwhile).")
    max_refused_in_a_row: int = Field(
        64, ge=0, description="Stop (exit 2, with the hub's reason) after this many groups in a row were refused "
        "(by the hub, or by the generator's own check of what the hub would refuse) with none accepted: no group of "
        "this config can be accepted (e.g. an environment's reset() text that fills max_total_tokens). Each "
        "refused group is counted and dropped, never sent again. Also the most groups in a row, sampled from one "
        "policy version, that drop_constant_groups may drop with none accepted (a constant reward would otherwise "
        "sample forever: the learner gets no batch, so the policy cannot change). 0: never stop.")
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig, description="Skip prompts the policy "
                                         "always or never solves (pass rates shared through the hub).")
    failures: FailuresConfig = Field(default_factory=FailuresConfig, description="Rewards and environments that "
                                     "fail (raise, time out, return garbage) score on_error, until a full window "
                                     "holds max_rate failures or everything so far failed: the generator then stops, "
                                     "exit 2, with the first failure's file:line. A PRM or HTTP reward service that "
                                     "is down (connection refused, timeout, 5xx, 429) pauses generation instead.")

    @model_validator(mode="before")
    @classmethod
    def _verifiers_environment(cls, value: Any) -> Any:
        return environment_as_agent(value)   # environment: {name: verifiers} is an agent (shared/config/schema/verifiers.py)

    @model_validator(mode="after")
    def _one_source_of_rewards(self) -> GeneratorConfig:
        """``environment.reward: environment`` scores with the environment's step rewards alone: the default reward
        list is not run (it was, and a reward for another task then failed the run); rewards listed explicitly
        beside it are a contradiction, named. Otherwise at least one reward is needed."""
        by_environment = self.environment is not None and self.environment.reward == "environment"
        if self.agent is not None:
            agent_problem = agent_conflict(self)
            if agent_problem:
                raise ValueError(agent_problem)
            by_environment = self.agent.reward == "agent"
        if by_environment and "rewards" in self.model_fields_set and self.rewards:
            names = [spec.label or spec.name for spec in self.rewards]
            raise ValueError(f"generator.rewards lists {names}, but generator.environment.reward is 'environment', "
                             "which scores trajectories by the environment's step rewards alone: remove "
                             "generator.rewards, or set generator.environment.reward: rewards to score with them")
        if by_environment:
            self.__dict__["rewards"] = []   # not through validate_assignment: it would run this validator again
        elif not self.rewards:
            raise ValueError("generator.rewards is empty: at least one reward is needed (or a multi-turn "
                             "environment with reward: environment)")
        return self
