"""The learner section (learner/): the DeepSpeed engine, the GRPO step, publishing, checkpoints and metrics."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shared.config.schema.base import StrictModel
from shared.config.schema.paths import template_help


class LoraConfig(StrictModel):
    """LoRA adapters (peft) on the policy: only the adapters are trained; the base weights stay frozen."""

    r: int = Field(16, ge=1, description="Adapter rank (>= 1).")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the adapter's output is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input during training.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Linear layers that get adapters, by the last part(s) of their module name (peft's "
        "target_modules), or 'all-linear' (every linear layer but the LM head). Each name must match a linear "
        "layer of the model; checked when the learner starts.")
    reference: Literal["hub", "learner"] = Field(
        "hub", description="Where reference logprobs (beta > 0 or kl.in_reward) come from: 'hub' (the ref "
        "server scores with its own copy of the base model), or 'learner' (the learner's own model with the "
        "adapters switched off: one copy of the weights, one extra no-grad forward per batch in the learner).")
    publish: Literal["adapter", "merged"] = Field(
        "adapter", description="What each weights publish sends: 'adapter' (only lora_A/lora_B and the scaling; "
        "generators apply them onto the base weights of their model folder, which must be learner.model; the "
        "transformers engine merges each version in place, over every transport; the vllm engine serves it as a "
        "LoRARequest, from the HTTP relay, with LoRA enabled at start from this section of the same config; "
        "docs/lora.md 'Transports'), or 'merged' (the whole policy with the adapters merged "
        "in, on every transport and engine). docs/lora.md.")

    @model_validator(mode="after")
    def _checks(self) -> LoraConfig:
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("target_modules is empty: name at least one linear layer, or 'all-linear'")
        return self


class LearnerConfig(StrictModel):
    """The learner: pulls batches from the hub, applies the GRPO step with DeepSpeed, publishes weights."""

    model: str | None = Field(None, description="Initial policy folder (the same model the generators start from).")
    hub_url: str = Field("http://127.0.0.1:8470", description="The ref server's address; when not set, the "
                         "address of this config's ref_server (host and port), so --set ref_server.port=N moves it "
                         "too.")
    groups_per_step: int = Field(4, ge=1, description="Groups each rank pulls per optimizer step (the global "
                                 "batch is groups_per_step x ranks).")
    micro_batches: int = Field(1, ge=1, description="Gradient accumulation: each rank's batch is split into this "
                               "many micro-batches (by groups); the loss is normalised by the global token count. "
                               "With micro_batch_tokens set, the least number of micro-batches instead.")
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="Token budget of one micro-batch (verl's dynamic batch size): rows, of any groups, "
        "are packed into as few micro-batches as keep each within this many tokens (prompt + completion summed "
        "over its rows when packing is not 'padded', rows x longest row when it is; a longer row goes alone), "
        "and at least micro_batches of them; every rank runs as many as the rank that needs the most. Null: "
        "split by groups into exactly micro_batches. The loss keeps the global token-count normaliser either "
        "way.")
    packing: Literal["auto", "packed", "padded"] = Field(
        "auto", description="Padding-free forward: a micro-batch's rows concatenated into one sequence with "
        "per-row position ids (transformers keeps them apart: flash-attention varlen, flex, or a block-diagonal "
        "SDPA/eager mask). 'packed': whenever the model passes a one-time probe; 'auto': packed when the probe "
        "passes and it is estimated cheaper (always with flash/flex attention; with SDPA/eager, whose packed "
        "mask costs N^2 attention, only for rows of mixed lengths); 'padded': never. The log says which is used.")
    prefix_sharing: Literal["auto", "on", "off"] = Field(
        "auto", description="One forward of each group's prompt for all of its completions: the completions run on "
        "the prompt's cached keys/values and the gradients add up in the one prompt pass (exact, "
        "shared/forward/prefix_sharing.py); with G completions per prompt it saves (G - 1) prompt passes. 'auto': on when a "
        "micro-batch holds at least two rows per distinct prompt, packing is not 'packed' and gradient "
        "checkpointing is off; 'on': whenever rows share a prompt (not with gradient_checkpointing); 'off': never.")
    updates_per_batch: int = Field(1, ge=1, description="mu: optimizer steps on each pulled batch, with the old "
                                   "logprobs kept fixed (GRPO's iterations).")
    old_logprobs: Literal["behaviour", "recompute"] | None = Field(
        None, description="Deprecated: algorithm.off_policy.bypass ('behaviour' is bypass true, 'recompute' false), "
        "which a value set here becomes. Setting both differently is an error.")
    mask_truncated: bool = Field(False, description="Completions cut at max_tokens contribute no loss.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (null: until "
                                  "stopped).")
    lr: float = Field(1e-6, gt=0, description="Peak learning rate.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="After warm-up: constant, cosine decay to min_lr_ratio, or linear decay to 0 "
        "(cosine and linear need max_steps).")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up steps.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine schedule's final lr as a fraction of lr.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0 disables).")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage.")
    offload_optimizer: bool = Field(False, description="Keep optimizer states in CPU memory (ZeRO >= 1).")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="'auto': bf16 on GPU, fp32 on CPU.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    deepspeed_config: str | None = Field(
        None, description="A raw DeepSpeed JSON file used instead of the one generated from these fields "
        "(batch sizes and accumulation are still set from groups_per_step / micro_batches).")
    publish_every: int = Field(1, ge=1, description="Publish weights to the hub every K optimizer steps.")
    checkpoint_every: int | None = Field(
        50, ge=1, description="DeepSpeed checkpoint (weights and optimizer state, what `grpo run --resume` continues "
        "from) every N steps, at the end, and when stopped by a signal; null: only when stopped by a signal (a run "
        "that finishes leaves no checkpoint, only the model in output_dir).")
    checkpoint_dir: str | None = Field(
        "<run_dir>/checkpoints", description=template_help(
            "Where checkpoints go", "<run_dir>/checkpoints",
            "an error when a checkpoint is due (set run.run_dir or this)"))
    keep_checkpoints: int = Field(2, ge=1, description="Complete checkpoints to keep.")
    output_dir: str | None = Field(
        "<run_dir>/model", description=template_help(
            "The trained model, a Hugging Face folder written at the end (and when stopped)", "<run_dir>/model",
            "an error at start (set run.run_dir or this)"))
    metrics_jsonl: str | None = Field(
        "<run_dir>/metrics.jsonl", description=template_help(
            "One JSON line of metrics per step", "<run_dir>/metrics.jsonl", "off"))
    advantages_jsonl: str | None = Field(
        None, description="Debugging: append one JSON line per pulled batch with the advantages the loss uses: "
        "{step, rank, batch_id, supervision, scale, kl_in_reward, rows: [{row, group_id, group_index, row_in_group, "
        "completion_length, reward, truncated, in_loss, step_ends, step_rewards, advantages}]}, where advantages "
        "holds one rounded float per completion token (the outcome advantage repeated under outcome supervision); "
        "rows of a multi-turn batch add completion_ids and mask (1 = the model wrote the token). "
        "Rank r > 0 writes to this path + '.rank<r>'. Null: off.")
    tensorboard_dir: str | None = Field(
        "<run_dir>/tensorboard", description=template_help("TensorBoard logs", "<run_dir>/tensorboard", "off"))
    wandb_project: str | None = Field(None, description="Weights & Biases project (null: off).")
    log_entropy: bool = Field(True, description="Compute the policy's per-token entropy for the metrics.")
    max_nonfinite_steps: int = Field(3, ge=1, description="Stop after this many NaN/inf losses in a row.")
    batch_wait_s: float = Field(10.0, ge=0, description="Long-poll wait of one batch request.")
    retry_max_s: float = Field(300.0, gt=0, description="How long an unreachable hub is retried before failing.")
    rendezvous_timeout_s: float = Field(
        300.0, gt=0, allow_inf_nan=False, description="Several ranks (RANK/WORLD_SIZE set by torchrun, deepspeed or "
        "the Slurm template): how long a rank other than 0 waits for rank 0's rendezvous at MASTER_ADDR:MASTER_PORT "
        "to accept connections before failing with that address in the error (rank 0 checks at once that "
        "MASTER_ADDR is one of its own addresses). Collectives after start are bounded by collective_timeout_s.")
    collective_timeout_s: float = Field(
        300.0, gt=0, allow_inf_nan=False, description="Several ranks: how long a rank waits for its peers in any "
        "collective after start-up (gradient all-reduce, the ranks' agreement on each batch, checkpoints) before it "
        "fails with this setting named and exits 1, instead of hanging for DeepSpeed's 10-minute default when a "
        "peer died, hangs or is cut off (the Slurm template's --kill-on-bad-exit then ends the others). Must exceed "
        "the longest a rank can legitimately be ahead of another: a checkpoint save, the final export, the slowest "
        "step, the difference in model loading between ranks at start. It also bounds how long rank 0 waits at start "
        "for the other ranks to connect (torch's init_process_group; how long they try to reach it is "
        "rendezvous_timeout_s). Waiting for groups from the hub is not such a wait (the ranks agree every few seconds "
        "while they wait).")
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda' (each rank uses its LOCAL_RANK GPU).")
    attn_implementation: str | None = Field(
        None, description="Attention kernel of the policy, set on the loaded model (transformers' "
        "attn_implementation): 'sdpa', 'eager', 'flash_attention_2' (needs the flash-attn package; variable-length "
        "kernel, so packed rows cost no N^2 mask), 'flex_attention'. Null: transformers' default (sdpa).")
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters instead of every weight (null: full fine-tuning). Generators and "
        "the final folder get the merged weights.")
    logprob_chunk_tokens: int | None = Field(None, ge=1, description="Tokens per LM-head chunk in the logprob "
                                             "computation (null: 128 MiB of fp32 logits per chunk on CPU, 512 "
                                             "MiB on a GPU, less when its free memory is short).")

    @property
    def reference_in_learner(self) -> bool:
        """Reference logprobs come from the learner's model with the adapters off (learner.lora.reference)."""
        return self.lora is not None and self.lora.reference == "learner"

    @model_validator(mode="after")
    def _checks(self) -> LearnerConfig:
        if self.micro_batches > self.groups_per_step:
            raise ValueError(f"micro_batches ({self.micro_batches}) cannot exceed groups_per_step "
                             f"({self.groups_per_step}): a micro-batch holds at least one group")
        if self.prefix_sharing == "on" and self.gradient_checkpointing:
            raise ValueError("prefix_sharing 'on' needs gradient_checkpointing off (checkpointed layers do not keep the "
                             "prompt's key/value cache): set one of them differently")
        if self.lr_schedule != "constant" and self.max_steps is None:
            raise ValueError(f"lr_schedule {self.lr_schedule!r} needs max_steps")
        return self

    @property
    def publishes_adapter(self) -> bool:
        """LoRA with ``publish: adapter``: publishes carry only the adapters (shared/weight_sync/params.py)."""
        return self.lora is not None and self.lora.publish == "adapter"
