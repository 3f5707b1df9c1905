import re
import subprocess
from pathlib import Path

import pytest

from deploy.launcher import plan
from shared.config.loader import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "deploy" / "configs").glob("*.yaml"))


def test_the_shipped_configs_exist():
    assert {p.name for p in CONFIGS} == {"tiny-cpu.yaml", "qwen2.5-0.5b-gsm8k.yaml", "qwen2.5-7b-gsm8k.yaml",
                                         "smollm2-arithmetic.yaml", "smollm2-arithmetic-cpu.yaml",
                                         "smollm2-arithmetic-lora-cpu.yaml", "tiny-chain-cpu.yaml",
                                         "smollm2-chain-cpu.yaml", "smollm2-calculator-cpu.yaml",
                                         "tiny-calculator-cpu.yaml", "smollm2-reasoning-gym-cpu.yaml",
                                         "smollm2-reasoning-gym-arithmetic-cpu.yaml",
                                         "smollm2-reasoning-gym-chain-sum-cpu.yaml",
                                         "smollm2-reasoning-gym-letter-counting-cpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    config = load_config(path)
    assert config.generator.model and config.learner.model


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_typo_in_a_shipped_config_names_the_key(path, tmp_path):
    broken = tmp_path / path.name
    broken.write_text(path.read_text().replace("group_size:", "group_sise:", 1))
    with pytest.raises(ConfigError, match="generator.group_sise: unknown key"):
        load_config(broken)


def test_eight_gpu_placement_maps_indices_to_visible_gpus(tmp_path, monkeypatch):
    # the node exposes physical GPUs 8-15 to us: index i means the i-th of those, for every service
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(8, 16)))
    config = load_config(ROOT / "deploy" / "configs" / "qwen2.5-7b-gsm8k.yaml")
    services = {s.name: s for s in plan(config, tmp_path / "c.yaml", tmp_path)}
    assert services["ref-server"].env["CUDA_VISIBLE_DEVICES"] == "8"
    assert services["gen-0"].env["CUDA_VISIBLE_DEVICES"] == "9,10"
    assert services["gen-1"].env["CUDA_VISIBLE_DEVICES"] == "11,12"
    assert services["learner"].env["CUDA_VISIBLE_DEVICES"] == "13,14,15"
    assert "--nproc_per_node" in services["learner"].command and "3" in services["learner"].command


def test_placement_beyond_the_node_is_refused(tmp_path, monkeypatch):
    from deploy.launcher import LaunchError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    config = load_config(ROOT / "deploy" / "configs" / "qwen2.5-7b-gsm8k.yaml")
    with pytest.raises(LaunchError, match="the learner is placed on GPU index 5, but this node has 2 visible GPUs"):
        plan(config, tmp_path / "c.yaml", tmp_path)


@pytest.mark.slow
def test_slurm_template_is_valid_bash_and_uses_real_commands():
    script = ROOT / "deploy" / "slurm" / "grpo-multinode.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for command in ('"$GRPO" ref-server', '"$GRPO" generator', 'learner-rank.sh "$GRPO" learner', '"$GRPO" scorer'):
        assert command in text
    assert re.search(r"^GRPO=\$\{GRPO:-grpo\}", text, re.M)
    default = re.search(r"CONFIG=\$\{CONFIG:-([^}]+)\}", text).group(1)
    load_config(ROOT / default)


def test_cpu_services_split_the_cores_between_them(tmp_path, monkeypatch):
    from deploy import launcher

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(launcher, "usable_cores", lambda: 8)
    config = load_config(ROOT / "deploy" / "configs" / "tiny-cpu.yaml")  # beta 0: the ref server only runs the hub
    data = config.model_dump(mode="json")
    data["run"]["num_generators"] = 3
    config = type(config).model_validate(data)
    services = {s.name: s for s in plan(config, tmp_path / "c.yaml", tmp_path)}
    # learner + 3 generators compute on the CPU: 8 cores / 4
    assert {name: s.env["OMP_NUM_THREADS"] for name, s in services.items()} == {
        "ref-server": "2", "learner": "2", "gen-0": "2", "gen-1": "2", "gen-2": "2"}
    data["algorithm"]["loss"]["beta"] = 0.04  # the ref server now scores on the CPU too: 8 // 5
    services = plan(type(config).model_validate(data), tmp_path / "c.yaml", tmp_path)
    assert {s.env["OMP_NUM_THREADS"] for s in services} == {"1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice wins
    assert {s.env["OMP_NUM_THREADS"] for s in plan(config, tmp_path / "c.yaml", tmp_path)} == {"3"}


def test_gpu_services_keep_their_threads(tmp_path, monkeypatch):
    from deploy import launcher

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(8)))
    monkeypatch.setattr(launcher, "usable_cores", lambda: 64)
    config = load_config(ROOT / "deploy" / "configs" / "qwen2.5-7b-gsm8k.yaml")
    assert all("OMP_NUM_THREADS" not in s.env for s in plan(config, tmp_path / "c.yaml", tmp_path))


def test_an_all_cpu_run_does_not_look_for_gpus_and_hides_them(tmp_path, monkeypatch):
    """Counting GPUs imports torch in the launcher (1.5-2 s before any service starts): a run that places nothing on
    a GPU never asks, and its services see no GPU whatever the node has."""
    from deploy import launcher

    def no_lookup():
        raise AssertionError("an all-CPU run looked up the node's GPUs")

    monkeypatch.setattr(launcher, "visible_gpus", no_lookup)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    config = load_config(ROOT / "deploy" / "configs" / "tiny-cpu.yaml")
    services = plan(config, tmp_path / "c.yaml", tmp_path)
    assert [s.name for s in services] == ["ref-server", "learner", "gen-0"]
    assert {s.env["CUDA_VISIBLE_DEVICES"] for s in services} == {""}
