"""README.md's "Train on your own data" section, run as a user would: its files written from its code blocks into an
empty folder, its commands run there, and the run checked to have trained with the user's data and reward.

Two departures from the text, both needed to test it here: the model folder the section asks for (e.g. `grpo
fetch-model smollm2-135m-instruct`, minutes on a CPU) is the 1M-parameter tiny model, and the hub gets a free port
(`--set ref_server.port=N`) so the test cannot collide with a server already on the default one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests import service_forks as forks

ROOT = Path(__file__).resolve().parents[2]
GRPO = str(Path(sys.executable).parent / "grpo")
HEADING = "## Train on your own data"
EXTENSIONS = {"json": ".jsonl", "python": ".py", "yaml": ".yaml"}


def section(readme: str) -> str:
    start = readme.index(HEADING)
    end = readme.find("\n## ", start + len(HEADING))
    return readme[start:end if end >= 0 else len(readme)]


def code_blocks(text: str) -> list[tuple[str, str, str]]:
    """(language, body, the text before the block) of every fenced block."""
    blocks, position = [], 0
    for match in re.finditer(r"```(\w+)\n(.*?)```", text, re.DOTALL):
        blocks.append((match.group(1), match.group(2), text[position:match.start()]))
        position = match.end()
    return blocks


def file_name(language: str, before: str) -> str:
    """The last `name.ext` the text names before a block, for the block's language."""
    names = re.findall(r"`([\w./-]+" + re.escape(EXTENSIONS[language]) + ")`", before)
    assert names, f"the README names no {EXTENSIONS[language]} file before its {language} block"
    return names[-1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_section_is_short_and_names_its_files():
    text = section((ROOT / "README.md").read_text())
    assert len(text.splitlines()) <= 60
    blocks = code_blocks(text)
    assert [language for language, _, _ in blocks] == ["json", "python", "yaml", "bash"]
    assert [file_name(language, before) for language, _, before in blocks[:3]] == [
        "data.jsonl", "my_reward.py", "my-run.yaml"]


@pytest.mark.slow
def test_the_readme_section_trains_as_written(tmp_path, tiny_model_dir):
    blocks = code_blocks(section((ROOT / "README.md").read_text()))
    commands = []
    for language, body, before in blocks:
        if language == "bash":
            commands += [line.split("#")[0].strip() for line in body.splitlines() if line.split("#")[0].strip()]
        else:
            (tmp_path / file_name(language, before)).write_text(body)
    config = yaml.safe_load((tmp_path / "my-run.yaml").read_text())
    model = tmp_path / config["generator"]["model"]
    assert config["learner"]["model"] == config["generator"]["model"]
    shutil.copytree(tiny_model_dir, model)   # the section's model folder (see the module docstring)
    assert [c.split()[:2] for c in commands] == [["grpo", "check-config"], ["grpo", "run"]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = free_port()
    for command in commands:
        argv = [GRPO, *shlex.split(command)[1:], "--set", f"ref_server.port={port}"]
        started = time.perf_counter()
        result = forks.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
        assert result.returncode == 0, f"{command}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        print(f"{command}: {time.perf_counter() - started:.1f} s")
    steps = config["learner"]["max_steps"]
    # where the section says the run's files land: under the default run folder, runs/<config name>
    text = section((ROOT / "README.md").read_text())
    assert all(f"`runs/my-run/{name}`" in text for name in ("model", "metrics.jsonl", "logs/"))
    run_dir = tmp_path / "runs" / "my-run"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all("reward/python" in m for m in metrics)   # the user's reward scored every batch
    output = run_dir / "model"
    assert (output / "config.json").exists() and (output / "model.safetensors").exists()
    logs = run_dir / "logs"
    assert "failed on" not in (logs / "gen-0.log").read_text()
