"""``learner.keep_checkpoints`` is what stays on disk: each checkpoint written prunes the complete ones beyond the
newest N (and an older one left half-written), with a real DeepSpeed engine writing real checkpoints."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.checkpoint import MARKER, complete_tags, load_latest, save_checkpoint
from learner.engine import create_engine
from shared.config.schema import LearnerConfig


@pytest.mark.slow
@pytest.mark.parametrize("keep", [1, 2])
def test_only_the_newest_keep_checkpoints_stay(distributed, tiny_model_dir, tmp_path, keep):
    cfg = LearnerConfig(model=str(tiny_model_dir), tensorboard_dir=None, metrics_jsonl=None, keep_checkpoints=keep)
    engine = create_engine(cfg, AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                           torch.device("cpu"))
    root = tmp_path / "ckpt"
    (root / "step00000000").mkdir(parents=True)  # a checkpoint a kill interrupted: never complete
    (root / "step00000000" / "mp_rank_00_model_states.pt").write_bytes(b"half")
    for step in (1, 2, 3, 4):
        save_checkpoint(engine, root, step=step, version=step, keep=cfg.keep_checkpoints, rank=0)
        assert complete_tags(root) == [f"step{s:08d}" for s in range(max(1, step - keep + 1), step + 1)]
    assert sorted(p.name for p in root.iterdir()) == [f"step{s:08d}" for s in range(5 - keep, 5)]
    assert json.loads((root / "step00000004" / MARKER).read_text()) == {"step": 4, "version": 4}
    assert load_latest(engine, root)["step"] == 4  # what is kept still resumes


@pytest.mark.slow
def test_the_training_loops_controls_resume_with_the_checkpoint(distributed, tiny_model_dir, tmp_path):
    """The adaptive entropy coefficient travels in the checkpoint (client state), so ``--resume`` goes on with it;
    a checkpoint written without controls gives none back."""
    from learner.entropy_control import EntropyControl
    from shared.config.schema.algorithm import EntropyConfig

    cfg = LearnerConfig(model=str(tiny_model_dir), tensorboard_dir=None, metrics_jsonl=None)
    engine = create_engine(cfg, AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                           torch.device("cpu"))
    entropy_cfg = EntropyConfig(coef=0.01, target=2.0, adapt_rate=0.01)
    control = EntropyControl(entropy_cfg)
    control.after_step({"entropy": 0.5})   # 0.01 + 0.01 * 1.5
    save_checkpoint(engine, tmp_path / "a", step=1, version=1, keep=2, rank=0,
                    controls={"entropy": control.state()})
    state = load_latest(engine, tmp_path / "a")
    assert EntropyControl(entropy_cfg, state["controls"]["entropy"]).coef == pytest.approx(0.025)
    save_checkpoint(engine, tmp_path / "b", step=1, version=1, keep=2, rank=0)
    assert load_latest(engine, tmp_path / "b")["controls"] == {}
