"""A tokenizer with more (or fewer) tokens than the model's embedding has rows, on checkpoints saved through
transformers' own tokenizer class: which runs go on, which are refused before anything starts, and the message."""

import warnings

import pytest
from transformers import AutoTokenizer

from rl_core.config import ModelConfig
from rl_core.data.rows import write_rows
from rl_core.data.synthetic import addition_rows
from rl_core.input_checks import InputError, check_run_inputs
from rl_core.models.folder import ModelLoadError
from rl_core.models.loading import ModelLoadWarning, load_policy_model, padding_free_works
from rl_core.models.vocabulary import embedding_rows, fed_ids, ids_past_rows, tokenizer_id_bound
from tests.rl_core.transformers_checkpoint import TOKENS, save_user_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """more: one added token past the rows (a fine-tune without resize); fewer: rows to spare (Qwen2.5's shape); short:
    the 256 byte rows only, so the pad token transformers added and the chat template's tokens have none."""
    folder = tmp_path_factory.mktemp("user-checkpoints")
    return {
        "more": save_user_checkpoint(folder / "more", rows=TOKENS, extra_tokens=("<|extra_0|>",)),
        "fewer": save_user_checkpoint(folder / "fewer", rows=320),
        "short": save_user_checkpoint(folder / "short", rows=256),
    }


def test_the_sizes_are_read_from_the_folders_files(checkpoints):
    for name, rows in (("more", TOKENS), ("fewer", 320), ("short", 256)):
        folder = checkpoints[name]
        assert embedding_rows(folder) == rows
        assert tokenizer_id_bound(folder) == len(AutoTokenizer.from_pretrained(folder)) == TOKENS + (name == "more")


def test_the_ids_a_run_feeds_and_those_past_the_rows(checkpoints):
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["short"])
    fed = fed_ids(tokenizer, [[5, 300], [7]], multi_turn=True)
    assert fed[256] == "the eos token" and fed[257] == "the pad token"
    assert fed[5] == fed[300] == "the prompts"
    assert fed[258] == "the chat template's tool turn"  # <|im_start|> before the tool message
    assert ids_past_rows(fed, 256) == {
        256: "the eos token",
        257: "the pad token",
        258: "the chat template's tool turn",
        300: "the prompts",
    }


def test_a_model_loads_when_no_special_token_lies_past_its_rows(checkpoints):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ModelLoadWarning)
        model, tokenizer = load_policy_model(ModelConfig(path=str(checkpoints["more"])))
    said = [str(w.message) for w in caught if w.category is ModelLoadWarning]
    assert said == [
        "the tokenizer has 260 tokens and the model's embedding 259 rows: the tokens from id 259 on ('<|extra_0|>') "
        "have no row; a training run's prompts, special and template tokens are checked for them before it starts"
    ]
    assert padding_free_works(model, "actor_rollout_ref.model.use_remove_padding")  # the self-check draws its ids
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ModelLoadWarning)
        load_policy_model(ModelConfig(path=str(checkpoints["fewer"])))
    assert not [w for w in caught if w.category is ModelLoadWarning]  # rows to spare: nothing to say
    with pytest.raises(ModelLoadError, match=r"256 '<\|im_end\|>' \(the eos token\), 257 '<\|endoftext\|>' \(the pad "):
        load_policy_model(ModelConfig(path=str(checkpoints["short"])))


@pytest.fixture()
def user_run(config, tmp_path):
    rows = addition_rows(12, seed=0, max_operand=9, split="train")
    config.data.train_files = str(write_rows(rows, tmp_path / "train.parquet"))
    config.data.val_files = str(write_rows(rows[:4], tmp_path / "val.parquet"))
    config.data.max_prompt_length = 64
    config.trainer.default_local_dir = str(tmp_path / "checkpoints")
    return config


def test_the_input_checks_refuse_ids_past_the_rows_in_one_line(user_run, checkpoints, tmp_path):
    user_run.actor_rollout_ref.model.path = str(checkpoints["more"])
    check_run_inputs(user_run)  # the added token is never fed
    user_run.actor_rollout_ref.model.path = str(checkpoints["fewer"])
    check_run_inputs(user_run)
    user_run.actor_rollout_ref.model.path = str(checkpoints["short"])
    with pytest.raises(InputError) as refused:
        check_run_inputs(user_run)
    assert str(refused.value) == (
        "actor_rollout_ref.model.path: token ids the run feeds the model lie past its embedding: 256 '<|im_end|>' "
        "(the eos token), 257 '<|endoftext|>' (the pad token), 258 '<|im_start|>' (the prompts); the tokenizer has 259 "
        "tokens, the model's embedding 256 rows; resize the embedding to the tokenizer and save the model "
        "(model.resize_token_embeddings(len(tokenizer)), then save_pretrained), or use the tokenizer it was trained "
        "with"
    )
    # a prompt that spells the added token out is fed it
    user_run.actor_rollout_ref.model.path = str(checkpoints["more"])
    spelled = [{**addition_rows(1, seed=1)[0], "prompt": [{"role": "user", "content": "<|extra_0|> 1+1="}]}] * 12
    user_run.data.train_files = str(write_rows(spelled, tmp_path / "spelled.parquet"))
    with pytest.raises(
        InputError,
        match=r"259 '<\|extra_0\|>' \(the prompts\); the tokenizer has 260 tokens, the "
        r"model's embedding 259 rows",
    ):
        check_run_inputs(user_run)
