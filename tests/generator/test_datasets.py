import json
import re

import pytest
from transformers import AutoTokenizer

from generator.datasets import (
    DATASETS,
    R1_SYSTEM_PROMPT,
    REASONING_GYM_SYSTEM_PROMPT,
    DatasetError,
    Example,
    PromptStream,
    arithmetic_examples,
    hf_examples,
    jsonl_examples,
    render_prompt,
    system_prompt_for,
)
from generator.tasks.arithmetic import ArithmeticTask
from shared.config.schema.generator import DatasetConfig


def test_jsonl_keeps_every_field_and_maps_the_answer(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "1+1?", "sol": "#### 2", "tests": ["assert True"]}) + "\n\n"
                    + json.dumps({"q": "2+2?", "sol": "4"}) + "\n")
    examples = jsonl_examples(path, question_field="q", answer_field="sol")
    assert [e.question for e in examples] == ["1+1?", "2+2?"]
    assert examples[0].data["answer"] == "#### 2" and examples[0].data["tests"] == ["assert True"]
    assert examples[1].example_id == "d.jsonl:3"


@pytest.mark.parametrize("content, message", [
    ('{"question": "q", "answer": 1}\n{not json\n', "d.jsonl:2: not valid JSON"),
    ('{"question": "q"}\n', "no 'answer' field"),
    ('{"text": "q", "answer": 1}\n', "no 'question' field (fields: ['answer', 'text'])"),
    ('[1, 2]\n', "expected a JSON object"),
    ("\n", "holds no examples"),
])
def test_jsonl_errors_name_file_line_and_field(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=re.escape(message)):
        jsonl_examples(path)
    with pytest.raises(DatasetError, match="cannot read dataset file"):
        jsonl_examples(tmp_path / "absent.jsonl")


def test_hf_dataset_from_a_local_folder_in_gsm8k_layout(tmp_path):
    import datasets

    rows = {"question": ["Tom has 3 apples and buys 4. How many?", "What is 6 * 7?"],
            "answer": ["3 + 4 = 7\n#### 7", "#### 42"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "gsm"))
    examples = hf_examples(str(tmp_path / "gsm"), split="train")
    assert [e.question for e in examples] == rows["question"]
    assert examples[1].data["answer"] == "#### 42"
    with pytest.raises(DatasetError, match="cannot load dataset"):
        hf_examples(str(tmp_path / "gsm"), split="validation")


def test_arithmetic_examples_come_from_the_requested_split():
    task = ArithmeticTask()
    examples = arithmetic_examples(task, "test", 50, seed=3)
    assert len(examples) == 50 and all(e.data["answer"] for e in examples)
    assert all(e.question.endswith("=") for e in examples)
    assert examples == arithmetic_examples(task, "test", 50, seed=3)


def test_prompt_streams_are_private_per_generator_and_cover_each_epoch():
    pool = [Example(f"q{i}", {"answer": str(i)}) for i in range(20)]
    a = PromptStream(pool, seed=0, generator_id="a").take(20)
    b = PromptStream(pool, seed=0, generator_id="b").take(20)
    assert a != b and sorted(e.question for e in a) == sorted(e.question for e in pool)
    assert a == PromptStream(pool, seed=0, generator_id="a").take(20)
    assert a != PromptStream(pool, seed=1, generator_id="a").take(20)


def test_render_prompt_with_and_without_chat_template(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert render_prompt(tokenizer, "12+3=", None) == "12+3="
    assert render_prompt(tokenizer, "q", "sys") == "sys\nq"
    assert render_prompt(tokenizer, "q", "sys", "<s>{system}|{question}") == "<s>sys|q"
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}")
    assert render_prompt(tokenizer, "q", R1_SYSTEM_PROMPT).startswith("[system]You are a helpful assistant.")
    assert render_prompt(tokenizer, "q", None) == "[user]q[assistant]"


def test_each_dataset_kind_declares_its_default_system_prompt_where_it_is_registered():
    """The default system prompt is a trait of the kind's entry (@dataset_kind beside @DATASETS.register), not a
    table of kind names: a new kind that declares none fails here."""
    undeclared = [kind for kind in DATASETS if not hasattr(DATASETS.get(kind), "traits")]
    assert undeclared == []
    defaults = {kind: system_prompt_for(DatasetConfig.model_construct(kind=kind, system_prompt=None))
                for kind in DATASETS}
    assert defaults == {"arithmetic": None, "arithmetic_words": None, "chain": None, "jsonl": R1_SYSTEM_PROMPT,
                        "hf": R1_SYSTEM_PROMPT, "verifiers": R1_SYSTEM_PROMPT,
                        "reasoning_gym": REASONING_GYM_SYSTEM_PROMPT}
    chosen = DatasetConfig(kind="arithmetic", system_prompt="Answer.")
    assert system_prompt_for(chosen) == "Answer."
    assert system_prompt_for(chosen.model_copy(update={"system_prompt": ""})) is None
