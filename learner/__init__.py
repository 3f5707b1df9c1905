"""The learner: DeepSpeed GRPO training loop, weight publishing, checkpoints and metrics."""
