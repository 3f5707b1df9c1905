"""TRL's side of ``bench/vs_trl.py``: ``GRPOTrainer`` in a process of its own, started like ``grpo run``.

    python bench/vs_trl_trl.py REQUEST.json      # written by bench/vs_trl.py; not meant to be run by hand

A user of TRL waits for ``python train.py``: the interpreter, the imports of torch, transformers, TRL and
datasets, the model load, the trainer's construction, then the steps. ``bench/vs_trl.py`` starts its clock when
it launches this process (as it does for ``grpo run``), so all of that counts. This process only reports
``time.time()`` stamps (its first line, imports done, trainer built, the end of every step, training done) and
the seconds spent saving a snapshot at each evaluation step; the parent subtracts.

It writes one JSON file (:class:`TRLResult`), nothing pickled. Snapshots are Hugging Face folders (model and
tokenizer files) that the parent evaluates after the run.

The module level imports only the standard library, so that the parent can import :data:`MAPPING` and
:func:`trl_settings` without importing TRL, and so that this process's import time is measured in :func:`main`.
"""

from __future__ import annotations

import time

STARTED_AT = time.time()  # first statement: what comes before it is the interpreter's own start-up

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from dataclasses import asdict, dataclass, field, fields  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if TYPE_CHECKING:
    from shared.config.schema import GRPOConfig

# grpo config field -> TRL GRPOConfig field, and what it means. Values are read from the grpo config (after
# --steps), so the two runs use the same numbers; the rows marked "no equivalent" are differences, stated.
MAPPING = [
    ("generator.group_size", "num_generations", "G: completions per prompt"),
    ("learner.groups_per_step", "per_device_train_batch_size (= G x prompts)", "prompts per optimizer step"),
    ("learner.lr", "learning_rate", "peak learning rate"),
    ("learner.lr_schedule", "lr_scheduler_type", "schedule ('constant' -> 'constant', or "
     "'constant_with_warmup' with warm-up steps; cosine with min_lr_ratio -> 'cosine_with_min_lr')"),
    ("learner.warmup_steps", "warmup_steps", "lr warm-up steps"),
    ("learner.weight_decay", "weight_decay", "AdamW weight decay"),
    ("learner.adam_betas", "adam_beta1, adam_beta2", "AdamW betas"),
    ("learner.adam_eps", "adam_epsilon", "AdamW epsilon"),
    ("learner.grad_clip", "max_grad_norm", "gradient clipping"),
    ("algorithm.loss.eps_low", "epsilon", "lower clip range"),
    ("algorithm.loss.eps_high", "epsilon_high", "upper clip range (clip-higher)"),
    ("algorithm.loss.aggregation", "loss_type", "'token-mean' -> 'dapo' (global token count)"),
    ("algorithm.loss.beta", "beta", "KL weight (0: no reference model)"),
    ("algorithm.advantage.scale", "scale_rewards", "'group' -> 'group', 'batch' -> 'batch', 'none' -> 'none'"),
    ("learner.updates_per_batch", "num_iterations", "mu: optimizer steps per batch"),
    ("learner.mask_truncated", "mask_truncated_completions", "truncated completions out of the loss"),
    ("generator.sampling.max_tokens", "max_completion_length", "new tokens per completion"),
    ("generator.sampling.temperature", "temperature", "sampling temperature"),
    ("generator.sampling.top_p", "top_p", "nucleus sampling"),
    ("generator.sampling.top_k", "top_k", "top-k (-1 -> 0: off)"),
    ("learner.max_steps", "max_steps", "optimizer steps (--steps)"),
    ("seed", "seed", "seed"),
    ("generator.drop_constant_groups", "(no equivalent)", "ours drops zero-variance groups before the learner "
     "(DAPO dynamic sampling); TRL trains on them (zero advantage, counted in the token mean)"),
    ("ref_server.max_staleness", "(no equivalent)", "ours samples ahead of the learner (off-policy, ratio against "
     "the behaviour logprobs); TRL is on-policy"),
]
_AGGREGATION = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}


def trl_schedule(learner) -> dict:
    """Our schedule as transformers names it: our 'constant' warms up first (transformers' 'constant' would
    skip the warm-up), our cosine ends at ``min_lr_ratio`` x lr."""
    if learner.lr_schedule == "constant":
        return {"lr_scheduler_type": "constant_with_warmup" if learner.warmup_steps else "constant"}
    if learner.lr_schedule == "cosine" and learner.min_lr_ratio > 0:
        return {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": learner.min_lr_ratio}}
    return {"lr_scheduler_type": learner.lr_schedule}


def trl_settings(config: GRPOConfig, device: str, out: Path) -> dict:
    """TRL ``GRPOConfig`` keyword arguments with the grpo config's numbers (see :data:`MAPPING`); a setting TRL
    has no counterpart for stops here (SystemExit naming the key)."""
    gen, learner, loss = config.generator, config.learner, config.algorithm.loss
    if loss.aggregation not in _AGGREGATION:
        raise SystemExit(f"algorithm.loss.aggregation {loss.aggregation!r} has no TRL loss_type here")
    return dict(
        output_dir=str(out), num_generations=gen.group_size,
        per_device_train_batch_size=gen.group_size * learner.groups_per_step, gradient_accumulation_steps=1,
        learning_rate=learner.lr, **trl_schedule(learner), warmup_steps=learner.warmup_steps,
        weight_decay=learner.weight_decay, adam_beta1=learner.adam_betas[0], adam_beta2=learner.adam_betas[1],
        adam_epsilon=learner.adam_eps, max_grad_norm=learner.grad_clip, optim="adamw_torch",
        epsilon=loss.eps_low, epsilon_high=loss.eps_high, loss_type=_AGGREGATION[loss.aggregation],
        beta=loss.beta, scale_rewards=config.algorithm.advantage.scale, num_iterations=learner.updates_per_batch,
        mask_truncated_completions=learner.mask_truncated, max_completion_length=gen.sampling.max_tokens,
        temperature=gen.sampling.temperature, top_p=gen.sampling.top_p, top_k=max(gen.sampling.top_k, 0),
        max_steps=learner.max_steps, seed=config.seed, use_cpu=device == "cpu", bf16=device == "cuda",
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )


def trl_dataset(config: GRPOConfig, tokenizer):
    from datasets import Dataset

    from generator.datasets import load_examples, render_prompt, system_prompt_for

    dataset = config.generator.dataset
    system = system_prompt_for(dataset)
    examples = load_examples(dataset, config.seed)
    prompts = [render_prompt(tokenizer, e.question, system, dataset.template) for e in examples]
    check_prompt_tokens(tokenizer, prompts[:64], chat=dataset.template is None and bool(tokenizer.chat_template))
    return Dataset.from_list([{"prompt": p, "question": e.question, "data": json.dumps(e.data)}
                              for p, e in zip(prompts, examples)])


def check_prompt_tokens(tokenizer, prompts: list[str], chat: bool) -> None:
    """TRL tokenizes a text prompt with ``add_special_tokens=True``; our generator leaves special tokens out of a
    rendered chat template (it has its own). A tokenizer that adds a BOS would give TRL a second one: stop."""
    for prompt in prompts:
        trl_ids = tokenizer(text=[prompt])["input_ids"][0]
        ours = tokenizer(prompt, add_special_tokens=not chat)["input_ids"]
        if list(trl_ids) != list(ours):
            raise SystemExit(f"TRL would tokenize the prompt differently from our generator ({len(trl_ids)} vs "
                             f"{len(ours)} tokens, first {list(trl_ids[:3])} vs {list(ours[:3])}): this tokenizer "
                             "adds special tokens to a rendered chat template; the comparison would not be fair")


def trl_reward(config: GRPOConfig):
    """The config's rewards (the project's functions, weighted as our generator weighs them) as a TRL reward."""
    from generator.rewards import RewardSet

    rewards = RewardSet.from_specs(config.generator.rewards)

    def project_reward(prompts, completions, question, data, **_):
        return [rewards.score_group(q, [c], json.loads(d)).total[0] for q, c, d in zip(question, completions, data)]

    return project_reward


# -- what crosses the process boundary (JSON files) ----------------------------------------------------------
@dataclass
class TRLRequest:
    """What the parent asks for: the grpo config (after --steps / --set, as JSON), the start model, where to
    write. ``out_dir`` gets ``trainer/`` (TRL's output_dir) and ``snapshots/stepNNNNNN``."""

    config: dict
    model_dir: str
    device: str
    eval_steps: list[int]
    out_dir: str
    result_path: str

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> TRLRequest:
        return cls(**json.loads(path.read_text()))


@dataclass
class TRLResult:
    """What the child reports. Stamps are ``time.time()`` of this process; the parent subtracts its launch
    stamp. ``save_s[step]``: seconds the snapshot at ``step`` took (after ``step_end_at[step]``)."""

    started_at: float  # the child's first statement (interpreter start-up is before it)
    imports_done_at: float  # torch, transformers, trl, datasets and the project's task/reward code imported
    trainer_ready_at: float  # tokenizer and model loaded, dataset rendered, GRPOTrainer built
    train_done_at: float  # trainer.train() returned
    step_end_at: dict[int, float]  # optimizer step -> stamp at its end (before its snapshot, if any)
    save_s: dict[int, float]  # eval step -> seconds spent saving its snapshot
    snapshots: dict[int, str]  # eval step -> Hugging Face folder
    rewards: list[float | None]  # TRL's logged mean reward per step
    versions: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> TRLResult:
        """Read a result file; a missing field is a ValueError naming it (JSON object keys come back as ints)."""
        data = json.loads(text)
        missing = [f.name for f in fields(cls) if f.name not in data and f.name != "versions"]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        for name in ("step_end_at", "save_s", "snapshots"):
            data[name] = {int(k): v for k, v in data[name].items()}
        return cls(**data)


# -- the run --------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("request", type=Path, help="TRLRequest JSON written by bench/vs_trl.py.")
    request = TRLRequest.read(parser.parse_args(argv).request)

    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    import generator.datasets  # noqa: F401  the task and reward code a train.py would import
    import generator.main  # noqa: F401
    import generator.rewards  # noqa: F401
    from shared.config.schema import GRPOConfig
    imports_done_at = time.time()

    config = GRPOConfig.model_validate(request.config)
    out = Path(request.out_dir)
    settings = trl_settings(config, request.device, out / "trainer")
    eval_steps = set(request.eval_steps)
    step_end_at: dict[int, float] = {}
    save_s: dict[int, float] = {}
    snapshots: dict[int, str] = {}

    tokenizer = AutoTokenizer.from_pretrained(request.model_dir)

    class Snapshots(TrainerCallback):
        """Stamps each step's end; at an eval step saves the policy as a Hugging Face folder, timed."""

        def on_step_end(self, args, state, control, model=None, **kwargs):
            now = time.time()
            step_end_at[state.global_step] = now
            if state.global_step in eval_steps:
                folder = out / "snapshots" / f"step{state.global_step:06d}"
                model.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
                snapshots[state.global_step] = str(folder)
                save_s[state.global_step] = time.time() - now

    model = AutoModelForCausalLM.from_pretrained(request.model_dir, dtype=torch.float32)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=trl_reward(config), args=trl.GRPOConfig(**settings),
                              train_dataset=trl_dataset(config, tokenizer), processing_class=tokenizer,
                              callbacks=[Snapshots()])
    trainer_ready_at = time.time()
    trainer.train()
    train_done_at = time.time()

    result = TRLResult(
        started_at=STARTED_AT, imports_done_at=imports_done_at, trainer_ready_at=trainer_ready_at,
        train_done_at=train_done_at, step_end_at=step_end_at, save_s=save_s, snapshots=snapshots,
        rewards=[h.get("reward") for h in trainer.state.log_history if "reward" in h],
        versions={"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                  "datasets": datasets.__version__})
    Path(request.result_path).write_text(result.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
