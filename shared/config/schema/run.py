"""The run section: how `grpo run` places and supervises the three services on one node."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shared.config.schema.base import StrictModel


class PlacementConfig(StrictModel):
    """GPU placement. Every index means one thing: an index into this node's visible GPUs (CUDA_VISIBLE_DEVICES as
    `grpo run` found it). Empty lists, or a node without GPUs, put the service on the CPU."""

    ref_server: list[int] = Field(default_factory=list, description="GPU for the reference model: one index (the "
                                  "ref server scores there), or several: `grpo run` starts a reference scorer (`grpo "
                                  "scorer`) on each and the hub loads no model (ref_server.local_scoring).")
    generators: list[list[int]] = Field(
        default_factory=list, description="GPUs of each generator, e.g. [[1], [2]] (several GPUs per generator for "
        "tensor parallelism). Its length must equal num_generators when set.")
    learner: list[int] = Field(default_factory=list, description="GPUs of the learner, one rank per GPU.")


class RunConfig(StrictModel):
    """`grpo run`: one node, all three services."""

    run_dir: str | None = Field(
        None, description="The run's folder: logs, the resolved config, and every state folder whose path holds "
        "<run_dir> (spool, relay, checkpoints, model, metrics; see their keys). Null: `grpo run CONFIG` uses "
        "runs/<CONFIG's file name without .yaml>; a service started on its own keeps no run state (see each path "
        "key). `grpo run` refuses a run_dir that holds an earlier run's state unless given --resume or --fresh.")
    num_generators: int = Field(1, ge=1, description="Generators to start.")
    learner_ranks: int | None = Field(None, ge=1, description="Learner processes; default: one per learner GPU, "
                                      "or 1 on CPU.")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="GPU placement.")
    health_timeout_s: float = Field(300.0, gt=0, description="How long to wait for the ref server's /healthz.")
    stop_grace_s: float = Field(30.0, gt=0, description="After SIGTERM, how long a service may take to exit "
                                "before it is killed.")
    console: Literal["progress", "full"] = Field(
        "progress", description="What the `grpo run` console shows. progress: a line per learner step (step N/M, "
        "reward, batch accuracy, tokens/s, ETA), warnings and errors, and the services' start and stop lines; "
        "full: every line of every service (`grpo run --verbose`). Either way each service's whole output is in "
        "run_dir/logs/NAME.log.")
    tail_lines: int = Field(20, ge=1, description="Log lines of a service that died shown on the console.")
    startup_report_s: float = Field(
        10.0, ge=0, allow_inf_nan=False, description="Until the learner's first step, the `grpo run` console says "
        "this often what each service still does and for how long (`== start-up 35s: learner: waiting for the "
        "first batch (12s); gen-0: generating the first groups (20s)`). 0: no such lines.")
    fork_services: bool = Field(
        True, description="When no service is placed on a GPU: start the learner (one rank) and the generators as "
        "forks of `grpo run` after it imported torch and transformers once, instead of fresh interpreters that each "
        "import them at once on the same cores (about 2.5 s sooner to the first step on 2 cores). Services on GPUs, "
        "a learner of several ranks and vLLM generators always start fresh.")

    @model_validator(mode="after")
    def _placement_matches(self) -> RunConfig:
        if self.placement.generators and len(self.placement.generators) != self.num_generators:
            raise ValueError(f"placement.generators lists {len(self.placement.generators)} generators but "
                             f"num_generators is {self.num_generators}")
        return self
