"""learner.schedule: transformers' schedule functions, composed, give exactly the documented schedule."""

import itertools
import math

import pytest
import torch

from learner.schedule import lr_multiplier, lr_schedule


def closed_form(step, schedule, warmup_steps, max_steps, min_lr_ratio):
    """The schedule as written before it used the library (the reference, bit for bit)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min((step - warmup_steps) / max(max_steps - warmup_steps, 1), 1.0)
    if schedule == "cosine":
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0 - progress


def test_equals_the_closed_form_bit_for_bit_at_every_step():
    for schedule, warmup, max_steps, ratio in itertools.product(
            ("constant", "cosine", "linear"), (0, 1, 3, 10, 20), (1, 4, 7, 20, 100, 1000), (0.0, 0.1, 0.33, 1.0)):
        for step in range(max_steps + warmup + 30):
            want = closed_form(step, schedule, warmup, max_steps, ratio)
            got = lr_multiplier(step, schedule=schedule, warmup_steps=warmup, max_steps=max_steps, min_lr_ratio=ratio)
            assert got == want, (schedule, warmup, max_steps, ratio, step, got, want)


def test_hand_computed_values():
    def cosine(step):  # warm-up 10, decay to 0.1 at step 100
        return lr_multiplier(step, schedule="cosine", warmup_steps=10, max_steps=100, min_lr_ratio=0.1)

    assert cosine(0) == 0.1                          # warm-up start: 1/10, never 0
    assert cosine(4) == 0.5
    assert cosine(9) == 1.0 and cosine(10) == 1.0     # end of warm-up: the full rate
    assert cosine(55) == pytest.approx(0.55)          # mid-decay: 0.1 + 0.9 * (1 + cos(pi / 2)) / 2
    assert cosine(100) == pytest.approx(0.1)          # the floor at max_steps ...
    assert cosine(150) == cosine(100) == cosine(10**6)  # ... and past it (transformers' cosine would rise again)

    def linear(step):  # no warm-up, to 0 at step 4
        return lr_multiplier(step, schedule="linear", warmup_steps=0, max_steps=4)

    assert [linear(s) for s in range(7)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0]
    assert [lr_multiplier(s, schedule="constant", warmup_steps=4, max_steps=None) for s in range(6)] == [
        0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="needs max_steps"):
        lr_multiplier(3, schedule="cosine", warmup_steps=0, max_steps=None)


def test_lr_schedule_drives_the_optimizer():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = lr_schedule(optimizer, schedule="cosine", warmup_steps=2, max_steps=6, min_lr_ratio=0.5)
    seen = []
    for _ in range(8):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == [2.0 * closed_form(s, "cosine", 2, 6, 0.5) for s in range(8)]
