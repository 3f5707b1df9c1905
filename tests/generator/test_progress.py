"""The generator's closing summary (generator/progress.py): the step-reward line appears only for runs with steps."""

import logging

from generator.progress import Progress
from generator.stats import LoopStats


def test_the_summary_reports_step_rewards_only_when_there_were_some(caplog):
    caplog.set_level(logging.INFO, logger="grpo.generator")
    Progress(enabled=True).close(LoopStats(groups_uploaded=3, groups_refused_invalid=2), version=1)
    assert "step rewards" not in caplog.text and "2 refused as invalid" in caplog.text
    caplog.clear()
    Progress(enabled=True).close(LoopStats(groups_uploaded=4, groups_with_steps=4, steps_uploaded=30,
                                           step_reward_errors=2), version=1)
    assert ("step rewards: 4 groups carried 30 steps (7.50 per group), mean step reward 0.000; 2 completions lost "
            "their steps") in caplog.text
