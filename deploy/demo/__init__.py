"""The demo: the tiny local model, its warm-up, and `grpo demo` (model -> evaluate -> grpo run -> evaluate)."""
