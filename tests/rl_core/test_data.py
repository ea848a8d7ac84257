"""verl-format datasets, the resumable sampler, the synthetic task and the GSM8K preprocessor."""

import json

import pytest

from rl_core.config import DataConfig, ModelConfig
from rl_core.data import gsm8k
from rl_core.data.dataset import RLDataset
from rl_core.data.rows import DatasetError, read_rows, write_rows
from rl_core.data.sampler import ResumableSampler
from rl_core.data.synthetic import addition_rows, calc_rows, calc_transcript
from rl_core.models.loading import load_policy_tokenizer, load_tokenizer


@pytest.fixture()
def tokenizer(tiny_model_path):
    return load_tokenizer(str(tiny_model_path))


def data_config(**overrides):
    return DataConfig(
        **{
            "max_prompt_length": 32,
            "filter_overlong_prompts": False,
            "truncation": "error",
            "use_chat_template": True,
            **overrides,
        }
    )


def test_rows_are_chat_templated_and_left_padded(tmp_path, tokenizer):
    path = write_rows(addition_rows(3, seed=0), tmp_path / "train.parquet")
    dataset = RLDataset(str(path), tokenizer, data_config())
    batch = dataset.collate([0, 2], uid_prefix="e0-")
    text = tokenizer.apply_chat_template(
        addition_rows(3, seed=0)[2]["prompt"], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert batch.tensors["input_ids"][1, -len(ids) :].tolist() == ids
    assert batch.tensors["attention_mask"][1].sum() == len(ids) and batch.tensors["attention_mask"][1, 0] == 0
    assert batch.tensors["position_ids"][1, -len(ids) :].tolist() == list(range(len(ids)))
    assert batch.non_tensors["uid"].tolist() == ["e0-0", "e0-2"]
    assert (
        batch.non_tensors["reward_model"][1]["ground_truth"]
        == addition_rows(3, seed=0)[2]["reward_model"]["ground_truth"]
    )


def test_plain_string_prompts_and_base_model_tokenizers_use_raw_text(tmp_path, tokenizer):
    rows = [{"data_source": "x", "prompt": "3+4=", "reward_model": {"ground_truth": "7"}}]
    dataset = RLDataset(str(write_rows(rows, tmp_path / "raw.jsonl")), tokenizer, data_config())
    assert dataset.prompt_ids[0] == tokenizer("3+4=", add_special_tokens=False)["input_ids"]
    tokenizer.chat_template = None  # a base model's tokenizer
    chat_rows = addition_rows(1, seed=0)
    dataset = RLDataset(str(write_rows(chat_rows, tmp_path / "chat.jsonl")), tokenizer, data_config())
    assert (
        dataset.prompt_ids[0] == tokenizer(chat_rows[0]["prompt"][0]["content"], add_special_tokens=False)["input_ids"]
    )


def test_overlong_prompts_are_filtered_truncated_or_an_error(tmp_path, tokenizer):
    long_prompt = [{"role": "user", "content": "1+" * 40}]
    rows = addition_rows(4, seed=0) + [{**addition_rows(1, seed=0)[0], "prompt": long_prompt}]
    path = str(write_rows(rows, tmp_path / "long.parquet"))
    with pytest.raises(DatasetError, match=r"row 4: the prompt has \d+ tokens > data.max_prompt_length=32"):
        RLDataset(path, tokenizer, data_config())
    assert len(RLDataset(path, tokenizer, data_config(filter_overlong_prompts=True))) == 4
    left = RLDataset(path, tokenizer, data_config(truncation="left"))
    full = tokenizer(
        tokenizer.apply_chat_template(long_prompt, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )["input_ids"]
    assert left.prompt_ids[4] == full[-32:]
    assert RLDataset(path, tokenizer, data_config(truncation="right")).prompt_ids[4] == full[:32]


@pytest.mark.parametrize(
    "row,message",
    [
        (
            {"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"}},
            "row 1 has no string 'data_source'",
        ),
        (
            {"data_source": "x", "prompt": [{"text": "hi"}], "reward_model": {"ground_truth": "1"}},
            "row 1: column 'prompt' must be",
        ),
        ({"data_source": "x", "prompt": "hi", "reward_model": {}}, "row 1 has no 'reward_model.ground_truth'"),
    ],
)
def test_malformed_rows_name_file_row_and_column(tmp_path, tokenizer, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(addition_rows(1, seed=0)[0]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=rf"bad.jsonl: {message}"):
        RLDataset(str(path), tokenizer, data_config())


def test_unreadable_files(tmp_path, tokenizer):
    (tmp_path / "broken.jsonl").write_text('{"a": 1}\n{not json\n')
    with pytest.raises(DatasetError, match="line 2 is not valid JSON"):
        read_rows(tmp_path / "broken.jsonl")
    with pytest.raises(DatasetError, match="no such dataset file"):
        read_rows(tmp_path / "missing.parquet")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        (tmp_path / "x.csv").write_text("a")
        read_rows(tmp_path / "x.csv")


def test_sampler_is_deterministic_covers_each_epoch_and_resumes_exactly():
    straight = ResumableSampler(10, 3, shuffle=True, seed=5)
    batches = [straight.next_batch() for _ in range(7)]  # 3 batches per epoch (one row dropped)
    assert len(set(sum(batches[:3], []))) == 9 and batches[:3] != batches[3:6]
    first = ResumableSampler(10, 3, shuffle=True, seed=5)
    head = [first.next_batch() for _ in range(4)]
    resumed = ResumableSampler(10, 3, shuffle=True, seed=5)
    resumed.load_state_dict(first.state_dict())
    assert head + [resumed.next_batch() for _ in range(3)] == batches
    with pytest.raises(ValueError, match="resume with the same data"):
        ResumableSampler(11, 3, seed=5).load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="larger than the dataset"):
        ResumableSampler(2, 3)


def test_synthetic_rows_are_deterministic_and_correct():
    rows = addition_rows(50, seed=3)
    assert rows == addition_rows(50, seed=3) and rows != addition_rows(50, seed=4)
    for row in rows:
        a, b = row["prompt"][0]["content"].rstrip("=").split("+")
        assert int(row["reward_model"]["ground_truth"]) == int(a) + int(b)


def test_gsm8k_preprocessing_of_a_local_copy(tmp_path):
    source = tmp_path / "gsm8k"
    source.mkdir()
    (source / "train.jsonl").write_text(
        json.dumps(
            {"question": "Tom has 2 apples and buys 1,000 more. How many?", "answer": "2 + 1000 = 1002\n#### 1,002"}
        )
        + "\n"
    )
    (source / "test.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    written = gsm8k.preprocess(source, tmp_path / "out")
    train = read_rows(written["train"])
    assert train[0]["reward_model"]["ground_truth"] == "1002" and train[0]["data_source"] == "openai/gsm8k"
    assert train[0]["prompt"][0]["content"].endswith('output the final answer after "####".')
    (source / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(DatasetError, match="test.jsonl: row 0, column 'answer'"):
        gsm8k.preprocess(source, tmp_path / "out2")


def test_custom_chat_template_shapes_the_dataset_prompts(tmp_path, tiny_model_path):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
    tokenizer = load_policy_tokenizer(ModelConfig(path=str(tiny_model_path), custom_chat_template=template))
    rows = addition_rows(2, seed=0)
    dataset = RLDataset(str(write_rows(rows, tmp_path / "train.parquet")), tokenizer, data_config())
    expected = tokenizer("<<" + rows[1]["prompt"][-1]["content"] + ">>=>", add_special_tokens=False)["input_ids"]
    assert dataset.prompt_ids[1] == expected


def test_calc_rows_are_two_digit_products_and_their_transcripts_call_or_answer():
    rows = calc_rows(50, seed=0, split="train")
    assert rows == calc_rows(50, seed=0, split="train") != calc_rows(50, seed=0, split="val")
    for row in rows:
        a, b = (int(x) for x in row["prompt"][0]["content"].removesuffix("=").split("*"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["reward_model"]["ground_truth"] == str(a * b)
    row = {"prompt": [{"role": "user", "content": "37*48="}], "reward_model": {"ground_truth": "1776"}}
    assert calc_transcript(row, use_tool=False) == [{"role": "assistant", "content": "1776"}]
    assert calc_transcript(row, use_tool=True) == [
        {"role": "assistant", "content": "<call>37*48</call>"},
        {"role": "tool", "content": "1776"},
        {"role": "assistant", "content": "1776"},
    ]
