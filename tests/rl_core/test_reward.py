"""Rule scorers, user scoring functions and the reward manager, on hand-made responses."""

import math
import textwrap
import time

import pytest
import torch

from rl_core.batch import Batch, response_ends
from rl_core.config import DataConfig, OverlongBufferConfig, RewardConfig
from rl_core.reward.custom import load_custom_reward_function
from rl_core.reward.manager import RewardManager, RewardScoringError, RewardTimeoutError
from rl_core.reward.math_rules import last_boxed
from rl_core.reward.scorers import addition_score, default_compute_score


class CharTokenizer:
    """One character per token id (ord), so that tests can write responses as text."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids if not (skip_special_tokens and int(i) == 0))


def response_batch(texts, data_sources, truths, length=12):
    responses = torch.zeros(len(texts), length, dtype=torch.long)
    mask = torch.zeros(len(texts), length, dtype=torch.long)
    for row, text in enumerate(texts):
        ids = [ord(c) for c in text][: length - 1] + [0]  # EOS
        responses[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
    return Batch(
        {"responses": responses, "response_mask": mask},
        {
            "data_source": data_sources,
            "reward_model": [{"ground_truth": t} for t in truths],
            "extra_info": [{"i": i} for i in range(len(texts))],
        },
    )


def test_rule_scorers_by_hand():  # verl's gsm8k/MATH/DAPO rules: tests/rl_core/test_reward_parity.py
    assert last_boxed(r"so \boxed{\frac{1}{2}} then \boxed{3}") == r"\boxed{3}"
    assert last_boxed(r"\boxed{\frac{1}{2}}") == r"\boxed{\frac{1}{2}}" and last_boxed("no box") is None
    assert addition_score("19", "19") == 1.0 and addition_score("191", "19") == 0.0 and addition_score("", "3") == 0.0
    assert default_compute_score("openai/gsm8k", "#### 5", "5") == 1.0
    # the tool demo: a trajectory's last assistant message, else the response itself
    assert default_compute_score("ppoflow/calc", "<call>37*48</call>...1776", "1776", {"final_answer": " 1776"}) == 1.0
    assert default_compute_score("ppoflow/calc", "1776", "1776", {"final_answer": "<call>37*48</call>"}) == 0.0
    assert default_compute_score("ppoflow/calc", "1776", "1776", None) == 1.0
    with pytest.raises(ValueError, match="no rule scorer for data_source='my/task'.*custom_reward_function.path"):
        default_compute_score("my/task", "x", "y")


def test_score_lands_on_the_last_valid_response_token():
    batch = response_batch(["12", "7", "99"], ["ppoflow/addition"] * 3, ["12", "8", "99"])
    result = RewardManager(CharTokenizer())(batch)
    expected = torch.zeros(3, 12)
    expected[0, 2], expected[2, 2] = 1.0, 1.0  # "12" + EOS: index 2; "7" wrong
    assert torch.equal(result.token_level_scores, expected)
    assert result.metrics["reward/score_failures"] == 0


def test_a_multi_turn_response_is_scored_on_its_last_policy_token_and_read_through_the_tool_output():
    """Tool output inside a response is masked 0: the score still goes on the last policy token (not on the token
    the mask's sum points at), and the solution text runs through the tool output up to it."""
    batch = response_batch(["1+1", "x"], ["ppoflow/addition"] * 2, ["1+12", "x"])
    tool_output = "=2"  # the policy wrote "1+1", a tool answered "=2", the policy wrote "2" + EOS
    batch.tensors["responses"][0, :7] = torch.tensor([ord(c) for c in "1+1" + tool_output + "2"] + [0])
    batch.tensors["response_mask"][0, :7] = torch.tensor([1, 1, 1, 0, 0, 1, 1])
    seen = []

    def score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(solution_str)
        return 1.0

    result = RewardManager(CharTokenizer(), compute_score=score)(batch)
    assert seen == ["1+1=22", "x"]
    assert result.token_level_scores[0].nonzero().flatten().tolist() == [6]  # the EOS after "2", not index 4


@pytest.mark.parametrize("seed", range(3))
def test_response_ends_by_a_plain_loop(seed):
    mask = (torch.rand(16, 9, generator=torch.Generator().manual_seed(seed)) > 0.6).long()
    expected = [max((i + 1 for i in range(9) if row[i]), default=0) for row in mask.tolist()]
    assert response_ends(mask).tolist() == expected


def test_custom_function_from_a_file_with_dict_results(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        textwrap.dedent("""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            correct = solution_str.strip() == ground_truth
            return {"score": 2.0 if correct else -1.0, "acc": correct}
    """)
    )
    fn = load_custom_reward_function(str(path), "compute_score")
    result = RewardManager(CharTokenizer(), fn)(response_batch(["ab", "x"], ["my/task"] * 2, ["ab", "y"]))
    assert result.token_level_scores.sum(-1).tolist() == [2.0, -1.0]
    assert result.extra_info["acc"] == [True, False]
    with pytest.raises(AttributeError, match="'nope' is not a function.*compute_score"):
        load_custom_reward_function(str(path), "nope")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_custom_reward_function(str(tmp_path / "missing.py"))


def test_a_raising_scorer_names_the_sample_or_scores_zero():
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise KeyError("missing field")
        return 1.0

    batch = response_batch(["ok", "boom", "ok"], ["a", "b", "c"], ["", "", ""])
    with pytest.raises(
        RewardScoringError, match=r"'flaky' failed on sample 1 \(data_source='b'\): KeyError.*reward.on_error=zero"
    ):
        RewardManager(CharTokenizer(), flaky)(batch)
    result = RewardManager(CharTokenizer(), flaky, RewardConfig(on_error="zero"))(batch)
    assert result.token_level_scores.sum(-1).tolist() == [1.0, 0.0, 1.0]
    assert result.metrics["reward/score_failures"] == 1


@pytest.mark.parametrize("bad", [None, "1.0", math.nan, {"acc": 1}, [1.0]])
def test_non_numbers_are_errors(bad):
    with pytest.raises(RewardScoringError, match="sample 0"):
        RewardManager(CharTokenizer(), lambda **kw: bad)(response_batch(["x"], ["a"], ["x"]))


def test_batch_mode_gets_lists():
    calls = []

    def batch_score(data_sources, solution_strs, ground_truths, extra_infos):
        calls.append(len(solution_strs))
        return [float(s == t) for s, t in zip(solution_strs, ground_truths)]

    result = RewardManager(CharTokenizer(), batch_score, RewardConfig(reward_manager="batch"))(
        response_batch(["a", "b", "c"], ["d"] * 3, ["a", "x", "c"])
    )
    assert calls == [3] and result.token_level_scores.sum(-1).tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(RewardScoringError, match="returned 1 scores for 3 samples"):
        RewardManager(CharTokenizer(), lambda **kw: [1.0], RewardConfig(reward_manager="batch"))(
            response_batch(["a", "b", "c"], ["d"] * 3, ["a"] * 3)
        )


def test_dapo_overlong_penalty_by_hand():
    # max length 12, buffer 4: lengths up to 8 are free; length 10 (9 chars + EOS) pays (10 - 8) / 4 = 0.5
    batch = response_batch(["1234567", "123456789"], ["a", "a"], ["", ""])
    manager = RewardManager(
        CharTokenizer(),
        lambda **kw: 1.0,
        RewardConfig(overlong_buffer=OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)),
        DataConfig(max_response_length=12),
    )
    result = manager(batch)
    assert result.token_level_scores.sum(-1).tolist() == pytest.approx([1.0, 0.5])
    assert result.extra_info["overlong"] == [False, True]


def test_reward_model_scores_are_used_when_present():
    batch = response_batch(["ab"], ["a"], ["ab"])
    rm_scores = torch.tensor([[0.0, 0.0, 0.7] + [0.0] * 9])
    result = RewardManager(CharTokenizer())(batch, rm_scores)
    assert result.token_level_scores[0, 2].item() == pytest.approx(0.7) and result.metrics["reward/score_failures"] == 0


def test_the_overlong_penalty_applies_to_reward_model_scores_too():
    batch = response_batch(["1234567", "123456789"], ["a", "a"], ["", ""])
    rm_scores = torch.zeros(2, 12)
    rm_scores[0, 7], rm_scores[1, 9] = 2.0, 2.0  # on each response's last token
    manager = RewardManager(
        CharTokenizer(),
        None,
        RewardConfig(overlong_buffer=OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)),
        DataConfig(max_response_length=12),
    )
    result = manager(batch, rm_scores)
    assert result.token_level_scores.sum(-1).tolist() == pytest.approx([2.0, 1.5]) and result.extra_info[
        "overlong"
    ] == [False, True]


def test_a_hanging_scorer_fails_the_batch_naming_the_sample_within_the_timeout():
    def hangs_on_b(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "b":
            time.sleep(600)  # abandoned in its daemon thread
        return 1.0

    started = time.monotonic()
    with pytest.raises(
        RewardTimeoutError,
        match=r"'hangs_on_b' did not return within reward.timeout_s=0.5s \(on sample 1 of 3, "
        r"data_source='d'\)",
    ):
        RewardManager(CharTokenizer(), hangs_on_b, RewardConfig(timeout_s=0.5))(
            response_batch(["a", "b", "c"], ["d"] * 3, ["a"] * 3)
        )
    assert time.monotonic() - started < 2
    scored = RewardManager(CharTokenizer(), lambda **kw: 2.0, RewardConfig(timeout_s=None))(
        response_batch(["a"], ["d"], ["a"])
    )
    assert scored.token_level_scores.sum().item() == 2.0  # no limit: scored in the caller's thread
