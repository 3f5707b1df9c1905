"""`grpo run` with several reference GPUs: one joined scorer per GPU, the hub on none (the plan, not real GPUs)."""

from pathlib import Path

from deploy.launcher import cpu_threads, plan, resolve_config
from shared.config.loader import load_config

ROOT = Path(__file__).resolve().parents[2]


def placed(tmp_path, ref_gpus, *overrides):
    config = load_config(ROOT / "deploy" / "configs" / "qwen2.5-7b-gsm8k.yaml",
                         [f"run.placement.ref_server={ref_gpus}", f"run.run_dir={tmp_path}", *overrides])
    return resolve_config(config)


def test_several_reference_gpus_start_one_scorer_each_and_the_hub_loads_no_model(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(8, 16)))
    config = placed(tmp_path, "[0, 7]")
    assert config.ref_server.local_scoring is False  # written to the run's config.yaml that the hub reads
    services = {s.name: s for s in plan(config, tmp_path / "c.yaml", tmp_path)}
    assert services["ref-server"].env["CUDA_VISIBLE_DEVICES"] == ""
    assert [services[f"scorer-{i}"].env["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["8", "15"]
    command = services["scorer-1"].command
    assert command[command.index("scorer"):] == ["scorer", "--config", str(tmp_path / "c.yaml"), "--hub",
                                                 "http://127.0.0.1:8470", "--id", "scorer-1", "--device", "cuda:0"]
    assert list(services)[:2] == ["ref-server", "learner"]  # the launcher's order: ref server, learner, the rest


def test_local_scoring_true_keeps_the_first_reference_gpu_for_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(8)))
    config = placed(tmp_path, "[0, 7]", "ref_server.local_scoring=true")
    services = {s.name: s for s in plan(config, tmp_path / "c.yaml", tmp_path)}
    assert services["ref-server"].env["CUDA_VISIBLE_DEVICES"] == "0"
    assert services["scorer-0"].env["CUDA_VISIBLE_DEVICES"] == "7" and "scorer-1" not in services


def test_one_reference_gpu_is_todays_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(8)))
    config = placed(tmp_path, "[0]")
    assert config.ref_server.local_scoring is None
    services = {s.name: s for s in plan(config, tmp_path / "c.yaml", tmp_path)}
    assert services["ref-server"].env["CUDA_VISIBLE_DEVICES"] == "0"
    assert not [name for name in services if name.startswith("scorer")]


def test_a_hub_without_local_scoring_takes_no_core_share(tmp_path):
    config = load_config(None, ["algorithm.loss.beta=0.04", "ref_server.model=m", "run.num_generators=1"])
    off = load_config(None, ["algorithm.loss.beta=0.04", "ref_server.model=m", "run.num_generators=1",
                             "ref_server.local_scoring=false"])
    assert (cpu_threads(config, 6), cpu_threads(off, 6)) == (2, 3)
