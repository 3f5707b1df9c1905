"""Publishing from a ZeRO-3 engine: parameters are partitioned (empty outside a gather), so the publisher must
gather each one into the send buffer; the generator ends up with the full, trained weights."""

import deepspeed
import pytest
import torch

from learner.engine import create_engine, ensure_single_process_env, init_distributed
from shared.config.schema import LearnerConfig
from shared.weight_sync.params import iter_parameters
from tests.live_server import LiveServer, make_config
from tests.weight_sync.test_weight_sync import Generator, make_publisher

pytestmark = pytest.mark.slow  # a ZeRO-3 DeepSpeed engine and a live hub (~70 s)


@pytest.fixture
def restore_functional_linear():
    original = torch.nn.functional.linear  # ZeRO-3 swaps it process-wide
    yield
    torch.nn.functional.linear = original


def test_a_zero3_engine_publishes_its_gathered_parameters(tiny_model_dir, tmp_path, restore_functional_linear):
    from transformers import AutoModelForCausalLM

    ensure_single_process_env()
    init_distributed(torch.device("cpu"))
    cfg = LearnerConfig(model=str(tiny_model_dir), zero_stage=3, tensorboard_dir=None, metrics_jsonl=None)
    engine = create_engine(cfg, AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                           torch.device("cpu"))
    partitioned = [p for p in engine.module.parameters() if hasattr(p, "ds_id")]
    assert partitioned and all(p.numel() == 0 or p.numel() < p.ds_numel for p in partitioned)
    with torch.no_grad():  # weights that differ from the generator's starting ones
        for p in partitioned:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                p.mul_(1.5)
    with LiveServer(make_config(tmp_path)) as live:
        publisher = make_publisher(engine.module, live.url)
        try:
            gen = Generator(tiny_model_dir, live.url, "gen", tmp_path)
            gen.connect()
            publisher.publish(1)
            gen.sync_until(1)
            served = dict(gen.engine.model.named_parameters())
            gathered = dict(iter_parameters(engine.module))
            assert set(gathered) <= set(served)
            for name, value in gathered.items():
                assert torch.equal(served[name], value), name
            starting = AutoModelForCausalLM.from_pretrained(tiny_model_dir).model.norm.weight
            assert torch.equal(served["model.norm.weight"], starting * 1.5)
        finally:
            publisher.close()
