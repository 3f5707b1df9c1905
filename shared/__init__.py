"""Code that more than one grpo-stack service needs: the GRPO math, per-token logprobs, config schema,
tasks and the tiny local model. Nothing in here imports ref_server, generator, learner or deploy."""
