"""The continuous wrapper of an engine (the ContinuousEngine contract of generator/engines/base.py)."""

from __future__ import annotations

from generator.engines.base import ContinuousEngine


def continuous_engine(engine, max_in_flight: int) -> ContinuousEngine:
    """``engine`` (a TransformersEngine or VLLMEngine) driven one sequence at a time; its weights are still loaded
    through ``engine`` (the weight-sync receiver talks to it), the wrapper recomputes what they change."""
    if engine.name == "vllm":
        from generator.engines.vllm_continuous import ContinuousVLLM

        return ContinuousVLLM(engine)   # vLLM schedules its own batch; the schedule caps what is in flight
    if engine.name == "transformers":
        from generator.engines.hf_continuous import ContinuousTransformers

        return ContinuousTransformers(engine, max_in_flight=max_in_flight)
    raise ValueError(f"generator.schedule.mode 'continuous' has no wrapper for the {engine.name!r} engine")
