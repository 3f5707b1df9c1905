"""The engines of bench/rollout_schedule.py: how an arm builds its engine, and the engine driven alone on both
schedules (``--engine-only``), without the generator loop around it."""

from __future__ import annotations

import time
from pathlib import Path


def build_engine(args, model: Path):
    if args.engine == "vllm":
        from generator.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model, device=args.device)
    from generator.engines.hf import TransformersEngine

    return TransformersEngine(model, device="cpu" if args.device == "auto" else args.device)


def engine_only_arm(args, schedule: str, model: Path) -> dict:
    """The engine alone, no hub, rewards, uploads or weights: ``batch`` makes calls of ``prompts_per_batch`` x G
    until ``groups`` groups are sampled; ``continuous`` keeps ``prompts_per_batch`` x G sequences in flight and
    replaces each as it finishes until as many sequences are done (those still running are aborted, not counted).
    What the schedules' loops add to the engine is the difference from ``rollout_schedule.run_arm``."""
    from transformers import AutoTokenizer

    from generator.continuous.engines import continuous_engine
    from generator.engines.base import SequenceRequest
    from shared.protocol.records import SamplingParams

    engine = build_engine(args, model)
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    prompt = AutoTokenizer.from_pretrained(model).encode("12+34=")
    slots, wanted = args.prompts_per_batch * args.group_size, args.groups * args.group_size
    tokens = done = 0
    try:
        started = time.perf_counter()
        if schedule == "batch":
            for call in range(args.groups // args.prompts_per_batch):
                groups = engine.generate([prompt] * args.prompts_per_batch, sampling, args.group_size, seed=call)
                tokens += sum(len(c.token_ids) for group in groups for c in group)
                done += args.prompts_per_batch * args.group_size
        else:
            wrapped, ids = continuous_engine(engine, slots), iter(range(10**9))
            new = lambda count: [SequenceRequest(f"{i}/0", prompt, sampling, i)  # noqa: E731
                                 for i in (next(ids) for _ in range(count))]
            wrapped.submit(new(slots))
            while done < wanted:
                finished = wrapped.step()
                tokens += sum(len(f.completion.token_ids) for f in finished[:wanted - done])
                done += len(finished)
                if finished:
                    wrapped.submit(new(len(finished)))
        wall = time.perf_counter() - started
        if schedule != "batch":   # the sequences still running when enough were done
            wrapped.abort([f"{i}/0" for i in range(next(ids))])
    finally:
        engine.close()
    return {"schedule": schedule, "sequences": min(done, wanted), "completion_tokens": tokens,
            "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1)}
