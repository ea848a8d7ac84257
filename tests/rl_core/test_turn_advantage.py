"""Turn-level advantages (``algorithm.adv_estimator=turn_rloo``, rl_core/algos/advantage.py): turns read off the
response mask, the estimator against a plain loop on random multi-turn batches, RLOO exactly on single turns, and its
unbiasedness when the policy decides when to stop, by exact enumeration of every group of a small two-turn task
(beside MT-GRPO's per-turn-index construction, which verl's RFC #7244 found biased and which is, here too)."""

import itertools
import math
import random

import pytest
import torch

from rl_core.algos.advantage import compute_rloo_outcome_advantage, compute_turn_rloo_advantage
from rl_core.batch import response_turns


def test_turns_are_the_runs_of_the_response_mask():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]])
    assert response_turns(mask).tolist() == [
        [0, 0, -1, -1, 1, -1, 2, 2],
        [0, 0, 0, -1, -1, -1, -1, -1],
        [-1] * 8,
    ]


def reference(rewards: torch.Tensor, mask: torch.Tensor, index: list) -> torch.Tensor:
    """The docstring's definition, one sample, turn and token at a time."""
    turns_of = []
    for row in range(len(index)):
        turns, previous = [], 0
        for position in range(mask.shape[1]):
            if mask[row, position] and not previous:
                turns.append([])
            if mask[row, position]:
                turns[-1].append(position)
            previous = int(mask[row, position])
        turns_of.append(turns)
    turn_rewards = [[sum(float(rewards[row, p]) for p in turn) for turn in turns] for row, turns in enumerate(turns_of)]

    def to_go(row, t):
        return sum(turn_rewards[row][t:])

    advantages = torch.zeros_like(rewards)
    for row, turns in enumerate(turns_of):
        for t, positions in enumerate(turns):
            others = [j for j in range(len(index)) if j != row and index[j] == index[row] and len(turns_of[j]) > t]
            baseline = sum(to_go(j, t) for j in others) / len(others) if others else 0.0
            for position in positions:
                advantages[row, position] = to_go(row, t) - baseline
    return advantages


def random_multi_turn_batch(rng: random.Random, rows: int, length: int):
    mask = torch.zeros(rows, length, dtype=torch.long)
    rewards = torch.zeros(rows, length)
    for row in range(rows):
        position = 0
        for _ in range(rng.randint(0, 4)):  # turns, separated by a masked answer
            size = rng.randint(1, 4)
            if position + size > length:
                break
            mask[row, position : position + size] = 1
            rewards[row, position + rng.randrange(size)] = rng.choice([0.0, 1.0, -0.5, rng.uniform(-1, 1)])
            position += size + rng.randint(1, 3)
    index = [f"p{rng.randrange(3)}" for _ in range(rows)]
    return rewards, mask, index


@pytest.mark.parametrize("seed", range(20))
def test_the_estimator_equals_the_plain_loop_on_random_multi_turn_batches(seed):
    rewards, mask, index = random_multi_turn_batch(random.Random(seed), rows=9, length=24)
    advantages, returns = compute_turn_rloo_advantage(rewards, mask, index)
    assert torch.allclose(advantages, reference(rewards, mask, index), atol=1e-6)
    assert torch.equal(advantages, returns)
    assert torch.all(advantages[mask == 0] == 0)


def test_one_turn_each_is_rloo():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 12, (8,), generator=generator)
    mask = (torch.arange(12) < lengths[:, None]).long()
    rewards = torch.zeros(8, 12)
    rewards[torch.arange(8), lengths - 1] = torch.randn(8, generator=generator)
    index = ["a", "a", "a", "b", "b", "c", "c", "c"]
    turn, _ = compute_turn_rloo_advantage(rewards, mask, index)
    rloo, _ = compute_rloo_outcome_advantage(rewards, mask, index)
    assert torch.allclose(turn, rloo, atol=1e-6)


# ---------------------------------------------------------------------------------------------- unbiasedness
# A two-turn task: turn 0 answers at once (A, reward 0.3, the end) or calls a tool (B, a tool reward of 0.5 at the
# turn's end, then turn 1); turn 1 answers right (C, 1.0) or wrong (D, 0.0). pi(B) = sigmoid(x), pi(C) = sigmoid(y).
# Each trajectory as tokens: a turn is two policy tokens, its reward on the second; one masked token between turns.
TRAJECTORIES = {
    "A": ([1, 1, 0, 0, 0], [0, 0.3, 0, 0, 0]),
    "BC": ([1, 1, 0, 1, 1], [0, 0.5, 0, 0, 1.0]),
    "BD": ([1, 1, 0, 1, 1], [0, 0.5, 0, 0, 0.0]),
}
FIRST_TOKEN_OF_TURN = (0, 3)


def probabilities(x: float, y: float) -> dict[str, float]:
    b, c = 1 / (1 + math.exp(-x)), 1 / (1 + math.exp(-y))
    return {"A": 1 - b, "BC": b * c, "BD": b * (1 - c)}


def score_function(name: str, x: float, y: float) -> list[tuple[float, float]]:
    """grad (d/dx, d/dy) of log pi of each turn's action."""
    b, c = 1 / (1 + math.exp(-x)), 1 / (1 + math.exp(-y))
    if name == "A":
        return [(-b, 0.0)]
    return [(1 - b, 0.0), (0.0, 1 - c if name == "BC" else -c)]


def mt_grpo(rewards: torch.Tensor, mask: torch.Tensor, index: list) -> torch.Tensor:
    """MT-GRPO's per-turn-index construction (leave-one-out means, no std): A_{i,t} = sum_{k=t}^{T_i-1} (r_{i,k} -
    mean of r_{j,k} over the others that reached turn k)."""
    turns = response_turns(mask)
    per_turn = [
        [float(rewards[row][turns[row] == k].sum()) for k in range(int(turns[row].max()) + 1)]
        for row in range(len(index))
    ]
    advantages = torch.zeros_like(rewards)
    for row in range(len(index)):
        for t in range(len(per_turn[row])):
            total = 0.0
            for k in range(t, len(per_turn[row])):
                others = [per_turn[j][k] for j in range(len(index)) if j != row and len(per_turn[j]) > k]
                total += per_turn[row][k] - (sum(others) / len(others) if others else 0.0)
            advantages[row][turns[row] == t] = total
    return advantages


def expected_gradient(estimator, x: float, y: float, n: int) -> tuple[float, float]:
    """E[(1/n) sum_i sum_t grad log pi(a_{i,t}) A_{i,t}] over every group of n trajectories, exactly."""
    p = probabilities(x, y)
    expected = [0.0, 0.0]
    for group in itertools.product(TRAJECTORIES, repeat=n):
        chance = math.prod(p[name] for name in group)
        mask = torch.tensor([TRAJECTORIES[name][0] for name in group])
        rewards = torch.tensor([TRAJECTORIES[name][1] for name in group], dtype=torch.float64)
        advantages = estimator(rewards, mask, ["q"] * n)
        for row, name in enumerate(group):
            for turn, grad in enumerate(score_function(name, x, y)):
                advantage = float(advantages[row, FIRST_TOKEN_OF_TURN[turn]])
                expected[0] += chance * grad[0] * advantage / n
                expected[1] += chance * grad[1] * advantage / n
    return expected[0], expected[1]


@pytest.mark.parametrize("x, y, n", [(0.3, -0.2, 3), (-1.0, 1.5, 2), (2.0, 0.0, 4)])
def test_turn_rloo_is_unbiased_when_the_policy_decides_when_to_stop(x, y, n):
    b, c = 1 / (1 + math.exp(-x)), 1 / (1 + math.exp(-y))
    # J = (1 - b) 0.3 + b (0.5 + c): the exact gradient
    true = (b * (1 - b) * (0.5 + c - 0.3), b * c * (1 - c))
    ours = expected_gradient(lambda r, m, i: compute_turn_rloo_advantage(r, m, i)[0], x, y, n)
    assert ours == pytest.approx(true, abs=1e-9)
    theirs = expected_gradient(mt_grpo, x, y, n)
    assert theirs[1] == pytest.approx(true[1], abs=1e-9)  # the last turn's baseline does not depend on stopping
    assert abs(theirs[0] - true[0]) > 0.01  # the first turn's does: its baseline counts the turns sample i took
