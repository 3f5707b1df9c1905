"""``dataset.kind: hf`` over every local format ``datasets`` reads, TRL's standard and conversational prompt formats,
and the evaluation rows kept out of training."""

import json
import re
import shutil
from pathlib import Path

import datasets
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from generator.datasets import (
    DatasetError,
    Example,
    PromptStream,
    example_from_row,
    hf_examples,
    jsonl_examples,
    load_examples,
    render_example,
)
from shared.config.schema import DatasetConfig, GRPOConfig

ROWS = {"question": ["What is 3 plus 4?", "What is 6 times 7?", "What is 9 minus 2?"],
        "answer": ["7", "42", "7"], "level": [1, 2, 1]}
# a template that shows roles, so a test can see which messages were rendered
ROLE_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")


def write_arrow_file(table: datasets.Dataset, path: Path) -> Path:
    """An Arrow file as ``datasets`` writes one (the shard save_to_disk leaves in its folder)."""
    table.save_to_disk(str(path.parent / "saved"))
    shutil.copy(next((path.parent / "saved").glob("*.arrow")), path)
    return path


WRITERS = {
    "jsonl": lambda t, p: t.to_json(str(p), lines=True),
    "json": lambda t, p: p.write_text(json.dumps([dict(r) for r in t])),
    "csv": lambda t, p: t.to_csv(str(p), index=False),
    "parquet": lambda t, p: t.to_parquet(str(p)),
    "arrow": write_arrow_file,
}


@pytest.mark.parametrize("extension", sorted(WRITERS))
def test_each_data_file_format_loads_with_every_column(tmp_path, extension):
    path = tmp_path / f"data.{extension}"
    WRITERS[extension](datasets.Dataset.from_dict(ROWS), path)
    examples = load_examples(DatasetConfig(kind="hf", path=str(path)), seed=0)
    assert [e.question for e in examples] == ROWS["question"]
    assert [e.data["answer"] for e in examples] == ["7", "42", "7"] if extension != "csv" else [7, 42, 7]
    assert [e.data["level"] for e in examples] == [1, 2, 1]
    assert examples[1].example_id == f"{path}:train:1" and examples[0].prompt_messages is None
    with pytest.raises(DatasetError, match=re.escape(f"dataset {path} is one file, whose one split is 'train', "
                                                     "not 'test'")):
        load_examples(DatasetConfig(kind="hf", path=str(path), split="test"), seed=0)


def test_saved_datasets_and_folders_of_files_give_their_splits(tmp_path):
    train, test = datasets.Dataset.from_dict(ROWS), datasets.Dataset.from_dict({k: v[:1] for k, v in ROWS.items()})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dict"))
    train.save_to_disk(str(tmp_path / "one"))
    (tmp_path / "files").mkdir()
    train.to_json(str(tmp_path / "files" / "train.jsonl"))
    test.to_json(str(tmp_path / "files" / "test.jsonl"))
    for folder in ("dict", "files"):
        assert [e.question for e in hf_examples(str(tmp_path / folder), split="train")] == ROWS["question"]
        assert [e.question for e in hf_examples(str(tmp_path / folder), split="test")] == ROWS["question"][:1]
    assert [e.question for e in hf_examples(str(tmp_path / "one"))] == ROWS["question"]
    with pytest.raises(DatasetError, match=r"its splits are \['test', 'train'\]"):
        hf_examples(str(tmp_path / "dict"), split="validation")
    with pytest.raises(DatasetError, match="one saved Dataset \\(not a DatasetDict\\), whose one split is 'train'"):
        hf_examples(str(tmp_path / "one"), split="test")


def cache_as_if_downloaded(rows: dict, name: str, cache: Path, tmp_path: Path) -> None:
    """``name`` (``org/set``) in the ``datasets`` cache ``cache`` laid out as a download leaves it
    (org___set/CONFIG/VERSION/HASH), built locally by the JSON builder."""
    from datasets.packaged_modules.json.json import Json

    data = tmp_path / "rows.jsonl"
    datasets.Dataset.from_dict(rows).to_json(str(data))
    org, short = name.split("/")
    builder = Json(cache_dir=str(tmp_path / "build"), dataset_name=short, hash="0123abcd",
                   data_files={"train": str(data)})
    builder.download_and_prepare()
    (cache / f"{org}___{short}").mkdir(parents=True)
    next((tmp_path / "build" / short).glob("default-*")).rename(cache / f"{org}___{short}" / "default")


def test_a_dataset_name_is_read_from_the_local_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache_as_if_downloaded(ROWS, "someone/tiny-set", cache, tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)   # offline while loading, whatever the setting
    examples = load_examples(DatasetConfig(kind="hf", path="someone/tiny-set"), seed=0)
    assert [(e.question, e.data["answer"]) for e in examples] == list(zip(ROWS["question"], ROWS["answer"]))
    assert datasets.config.HF_HUB_OFFLINE is False   # the setting restored after loading
    with pytest.raises(DatasetError, match="'someone/other-set' is not a local file or folder"):
        hf_examples("someone/other-set")


def test_what_is_not_local_is_refused_naming_it_without_the_network(tmp_path):
    with pytest.raises(DatasetError, match="'nobody/no-such-dataset' is not a local file or folder .* nor in the "
                                           "local Hugging Face datasets cache .* read offline"):
        hf_examples("nobody/no-such-dataset")
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(DatasetError, match=r"dataset file .*notes.txt: .txt is not one of the formats read here "
                                           r"\(.jsonl, .json, .csv, .parquet, .arrow\)"):
        hf_examples(str(tmp_path / "notes.txt"))


def test_check_config_names_a_missing_dataset_or_eval_file(tmp_path):
    from deploy.preflight import dataset_problems

    data = tmp_path / "train.jsonl"
    datasets.Dataset.from_dict(ROWS).to_json(str(data))
    config = GRPOConfig.model_validate({"generator": {"dataset": {"kind": "hf", "path": str(tmp_path / "no.csv")}},
                                        "eval": {"path": str(tmp_path / "no-eval.parquet")}})
    problems = dataset_problems(config)
    assert problems[0] == f"generator.dataset: no dataset file or folder {tmp_path / 'no.csv'} (from {Path.cwd()})"
    assert problems[1] == f"eval.path: no file or folder {tmp_path / 'no-eval.parquet'} (from {Path.cwd()})"
    fine = GRPOConfig.model_validate({"generator": {"dataset": {"kind": "hf", "path": str(data)}},
                                      "eval": {"path": str(data)}})
    assert dataset_problems(fine) == []


def test_trl_standard_format_prompt_column_and_column_mapping(tmp_path):
    # TRL's standard format: the question is in 'prompt'; a 'question' column wins over it when both are there
    trl = example_from_row({"prompt": "2+2?", "solution": "4", "id": 7}, "question", None, "r:0", "r[0]")
    assert trl == Example("2+2?", {"prompt": "2+2?", "solution": "4", "id": 7}, "r:0")
    both = example_from_row({"prompt": "p", "question": "q"}, "question", None, "r:1", "r[1]")
    assert both.question == "q"
    # columns renames before the fields are read: solution -> answer, where the rewards read it
    renamed = example_from_row({"prompt": "2+2?", "solution": "4"}, "question", "answer", "r:2", "r[2]",
                               {"solution": "answer"})
    assert renamed.data == {"prompt": "2+2?", "answer": "4"}
    with pytest.raises(DatasetError, match=re.escape("r[3]: no 'solution' column to rename to 'answer' "
                                                     "(generator.dataset.columns; columns: ['prompt'])")):
        example_from_row({"prompt": "q"}, "question", None, "r:3", "r[3]", {"solution": "answer"})
    with pytest.raises(DatasetError, match=re.escape("r[4]: generator.dataset.columns renames 'solution' to "
                                                     "'answer', which the row already has")):
        example_from_row({"prompt": "q", "solution": "1", "answer": "2"}, "question", None, "r:4", "r[4]",
                         {"solution": "answer"})
    with pytest.raises(DatasetError, match="r\\[5\\]: no 'answer' field .*answer_field null"):
        example_from_row({"prompt": "q", "solution": "1"}, "question", "answer", "r:5", "r[5]")
    # the same through the config, on a parquet file
    path = tmp_path / "trl.parquet"
    datasets.Dataset.from_dict({"prompt": ["1+1?", "2+3?"], "solution": ["2", "5"]}).to_parquet(str(path))
    cfg = DatasetConfig(kind="hf", path=str(path), columns={"solution": "answer"})
    assert [(e.question, e.data["answer"]) for e in load_examples(cfg, 0)] == [("1+1?", "2"), ("2+3?", "5")]


CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 plus 4?"}],
    [{"role": "system", "content": "Answer in words."}, {"role": "user", "content": "What is 6 times 7?"}],
]


def conversational_jsonl(path: Path, conversations=CONVERSATIONS, answers=("7", "42")) -> Path:
    path.write_text("".join(json.dumps({"prompt": c, "answer": a}) + "\n" for c, a in zip(conversations, answers)))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "hf"])
def test_conversational_prompts_keep_their_messages_and_render_with_the_chat_template(tmp_path, tiny_model_dir,
                                                                                     kind):
    path = conversational_jsonl(tmp_path / "chat.jsonl")
    examples = load_examples(DatasetConfig(kind=kind, path=str(path)), seed=0)
    assert [e.prompt_messages for e in examples] == CONVERSATIONS
    assert [e.data["prompt_messages"] for e in examples] == CONVERSATIONS
    assert examples[1].data["prompt"] == CONVERSATIONS[1]   # every column stays, the prompt's own too
    assert [e.question for e in examples] == ["What is 3 plus 4?", "What is 6 times 7?"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = ROLE_TEMPLATE
    # the configured system prompt is added to a conversation without one; a system message in the data wins
    assert render_example(tokenizer, examples[0], "Be brief.") == "[system]Be brief.[user]What is 3 plus 4?[assistant]"
    assert render_example(tokenizer, examples[0], None) == "[user]What is 3 plus 4?[assistant]"
    assert render_example(tokenizer, examples[1], "Be brief.") == (
        "[system]Answer in words.[user]What is 6 times 7?[assistant]")
    # a string prompt renders as before
    assert render_example(tokenizer, Example("q"), "s") == "[system]s[user]q[assistant]"
    tokenizer.chat_template = None
    with pytest.raises(DatasetError, match=re.escape(f"{examples[0].example_id}: a conversational prompt (a list of "
                                                     "messages) is rendered with the tokenizer's chat template, and "
                                                     "this model's tokenizer has none")):
        render_example(tokenizer, examples[0], None)
    with pytest.raises(DatasetError, match="generator.dataset.template applies to string prompts only"):
        load_examples(DatasetConfig(kind=kind, path=str(path), template="{question}"), seed=0)


@pytest.mark.parametrize("prompt, message", [
    ([{"role": "robot", "content": "hi"}], "prompt message 0 has role 'robot'; a role is one of ['system', 'user', "
                                           "'assistant', 'tool']"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": 3}],
     "prompt message 1 (user) has content of type int, not a string"),
    ([{"role": "user", "content": "hi"}, "hello"], "prompt message 1 is a str, not a {'role': ..., 'content': ...}"),
    ([{"content": "hi"}], "prompt message 0 has role None"),
    ([], "the prompt is an empty list of messages"),
    ([{"role": "system", "content": "s"}], "the prompt's messages have no user message (roles: ['system'])"),
])
def test_bad_messages_are_refused_naming_the_row(tmp_path, prompt, message):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "fine"}], "answer": "1"}) + "\n"
                    + json.dumps({"prompt": prompt, "answer": "2"}) + "\n")
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: {message}")):
        jsonl_examples(path)


def test_an_eval_split_of_the_training_rows_is_refused_at_load():
    with pytest.raises(ValueError, match="eval.split 'train' is generator.dataset.split, the rows training draws "
                                         "prompts from"):
        GRPOConfig.model_validate({"generator": {"dataset": {"kind": "hf", "path": "d", "split": "train"}},
                                   "eval": {"split": "train"}})
    with pytest.raises(ValueError, match="eval.split 'test' is generator.dataset.split"):
        GRPOConfig.model_validate({"generator": {"dataset": {"split": "test"}}})
    # another split, or an evaluation file named on purpose, loads
    GRPOConfig.model_validate({"generator": {"dataset": {"kind": "hf", "path": "d"}}, "eval": {"split": "test"}})
    GRPOConfig.model_validate({"generator": {"dataset": {"kind": "hf", "path": "d"}},
                               "eval": {"split": "train", "path": "e.jsonl"}})


def test_no_eval_example_reaches_the_training_prompt_stream(tmp_path):
    from generator.evaluate import eval_dataset

    questions = [f"What is {i} plus {i}?" for i in range(12)]
    table = datasets.Dataset.from_dict({"question": questions, "answer": [str(2 * i) for i in range(12)]})
    split = table.train_test_split(test_size=4, seed=0)
    split.save_to_disk(str(tmp_path / "d"))
    config = GRPOConfig.model_validate({"generator": {"dataset": {"kind": "hf", "path": str(tmp_path / "d")}},
                                        "eval": {"split": "test"}})
    held_out = {e.question for e in load_examples(eval_dataset(config), seed=1)}
    training = load_examples(config.generator.dataset, seed=0)
    drawn = {e.question for e in PromptStream(training, seed=0, generator_id="g").take(5 * len(training))}
    assert len(held_out) == 4 and len(drawn) == 8 and drawn | held_out == set(questions)
    assert not drawn & held_out
    # an evaluation file given with kind hf is read whole, whatever eval.split says
    eval_file = tmp_path / "eval.csv"
    split["test"].to_csv(str(eval_file), index=False)
    from_file = GRPOConfig.model_validate({"generator": {"dataset": {"kind": "hf", "path": str(tmp_path / "d")}},
                                           "eval": {"path": str(eval_file)}})
    assert {e.question for e in load_examples(eval_dataset(from_file), seed=1)} == held_out
    split["test"].save_to_disk(str(tmp_path / "eval-set"))   # a saved Dataset (what the Python API writes): the same
    from_saved = GRPOConfig.model_validate({"generator": {"dataset": {"kind": "hf", "path": str(tmp_path / "d")}},
                                            "eval": {"path": str(tmp_path / "eval-set")}})
    assert {e.question for e in load_examples(eval_dataset(from_saved), seed=1)} == held_out


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture
def chat_model_dir(tiny_model_dir, tmp_path):
    """The tiny model with a chat template (its character tokenizer has none)."""
    folder = Path(shutil.copytree(tiny_model_dir, tmp_path / "chat-model"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def test_the_rollout_loop_encodes_a_conversational_example_from_its_messages(chat_model_dir, tmp_path):
    from generator.engines.hf import TransformersEngine
    from generator.loop import RolloutLoop
    from generator.rewards import RewardSet
    from shared.config.schema.generator import RewardSpec
    from shared.protocol.client import HubClient
    from shared.protocol.records import SamplingParams

    engine = TransformersEngine(chat_model_dir)
    examples = load_examples(DatasetConfig(kind="jsonl", path=str(conversational_jsonl(tmp_path / "c.jsonl"))), 0)
    loop = RolloutLoop(engine=engine, tokenizer=engine.tokenizer, client=HubClient("http://127.0.0.1:9"),
                       rewards=RewardSet.from_specs([RewardSpec(name="arithmetic")]),
                       prompts=PromptStream(examples, seed=0, generator_id="g"), sampling=SamplingParams(),
                       group_size=2, prompts_per_batch=1, generator_id="g", weights_dir=tmp_path / "w",
                       system_prompt="Be brief.")
    text = "system: Answer in words.\nuser: What is 6 times 7?\nassistant: "   # the data's system message wins
    assert loop.encode_prompt(examples[1]) == engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert engine.tokenizer.decode(loop.encode_prompt(examples[0])) == (
        "system: Be brief.\nuser: What is 3 plus 4?\nassistant: ")


def saw_the_messages(prompt, completion, example):
    """1.0 when the reward received the example's messages and its question is the last user message."""
    messages = example["prompt_messages"]
    return float(messages == example["prompt"] and prompt == messages[-1]["content"])


@pytest.mark.slow  # two `grpo eval` processes of the tiny model
def test_grpo_eval_on_a_conversational_jsonl(chat_model_dir, tiny_model_dir, tmp_path):
    from tests import service_forks as forks
    from tests.generator.test_evaluate import GRPO

    train = conversational_jsonl(tmp_path / "train.jsonl")
    held_out = conversational_jsonl(tmp_path / "eval.jsonl", [
        [{"role": "user", "content": "What is 1 plus 1?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 times 5?"}],
        [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
         {"role": "user", "content": "What is 8 minus 3?"}]], ["2", "10", "5"])
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "generator": {"dataset": {"kind": "hf", "path": str(train)}, "sampling": {"max_tokens": 4},
                      "rewards": [{"name": "python", "args": {
                          "function": f"{Path(__file__).resolve()}:saw_the_messages"}}]},
        "eval": {"k": 1, "engine": "transformers", "path": str(held_out)}}))
    done = forks.run([GRPO, "eval", "--model", str(chat_model_dir), "--config", str(config)], capture_output=True,
                     text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["num_examples"] == 3 and result["greedy_rewards"] == {"python": 1.0}
    assert result["evaluated"] == f"3 examples of {held_out}, split 'train'"
    # a model without a chat template: refused, naming the example and the rule, before any sampling
    refused = forks.run([GRPO, "eval", "--model", str(tiny_model_dir), "--config", str(config)], capture_output=True,
                        text=True, timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert (f"{held_out}:train:0: a conversational prompt (a list of messages) is rendered with the tokenizer's chat "
            "template, and this model's tokenizer has none") in refused.stderr


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=12)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]) | JSON,
                                 "content": st.text(max_size=8) | JSON})


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(MESSAGE | JSON, max_size=4) | JSON)
def test_any_prompt_value_is_an_example_or_refused_naming_the_row(prompt):
    """Whatever a row's prompt holds: a string-like question, valid messages (then the question is the last user
    message), or a DatasetError naming the row, never another exception."""
    try:
        example = example_from_row({"prompt": prompt, "answer": "1"}, "question", "answer", "id", "data.jsonl:7")
    except DatasetError as exc:
        assert str(exc).startswith("data.jsonl:7: ")
        return
    if example.prompt_messages is not None:
        assert example.question == [m for m in example.prompt_messages if m["role"] == "user"][-1]["content"]
        assert example.data["prompt_messages"] == example.prompt_messages
