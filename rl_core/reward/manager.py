"""The reward manager: a batch of responses -> token-level scores (the score sits on the last response token).

Scores come from, in order of precedence: a reward model (its ``rm_scores``, as verl does), a user function
(``custom_reward_function``), or the rule scorers (:func:`default_compute_score`).
Modes: ``naive`` calls ``fn(data_source, solution_str, ground_truth, extra_info)`` once per sample; ``batch``
calls ``fn(data_sources, solution_strs, ground_truths, extra_infos)`` once with lists. A result is a number or a
dict with a numeric ``score`` (its other keys become per-sample extra info, e.g. ``acc``).

A scorer that raises or returns a non-number fails the step with a message naming the sample and its
data_source (``on_error=raise``), or scores that sample 0 and counts it in ``reward/score_failures``
(``on_error=zero``). A batch's scoring that takes longer than ``reward.timeout_s`` fails the step naming the sample it
was on: it runs in a thread of its own, which is abandoned (a daemon: it ends with the process; a thread cannot be
killed, so a long-lived process — a served deployment — keeps a hung one until it restarts). DAPO's overlong penalty
(``overlong_buffer``) subtracts up to ``penalty_factor`` linearly
over the last ``len`` tokens before ``max_response_length``, a reward model's scores included (verl's reward
managers return a reward model's scores untouched).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_core.batch import Batch, response_ends, response_turns
from rl_core.batch_fields import (
    EXTRA_INFO,
    MULTI_TURN,
    NUM_TURNS,
    RESPONSE_MASK,
    RESPONSES,
    REWARD_MODEL,
    VALIDATE,
)
from rl_core.config import DataConfig, RewardConfig
from rl_core.reward.scorers import default_compute_score


class RewardScoringError(RuntimeError):
    """A scoring function raised or returned something that is not a number."""


class RewardTimeoutError(TimeoutError):
    """A batch's scoring did not finish within ``reward.timeout_s``."""


@dataclass
class RewardResult:
    token_level_scores: torch.Tensor  # (B, R)
    extra_info: dict[str, list] = field(default_factory=dict)  # per-sample values reported by the scorer
    metrics: dict[str, float] = field(default_factory=dict)


def _as_score(result: Any) -> tuple[float, dict]:
    """(score, extra) from a scorer's return value; ValueError when it is not a finite number."""
    extra: dict = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"returned a dict without a 'score' key: {sorted(result)}")
        extra = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    if isinstance(result, torch.Tensor) and result.numel() == 1:
        result = result.item()
    if isinstance(result, bool) or not isinstance(result, (int, float)) or not math.isfinite(float(result)):
        raise ValueError(f"returned {result!r} ({type(result).__name__}), not a finite number")
    return float(result), extra


class RewardManager:
    """Scores responses (see the module doc). ``reward_config`` / ``data_config`` are the ``reward`` and ``data``
    config nodes; None takes rl_core.config's defaults."""

    def __init__(
        self, tokenizer: Any, compute_score: Callable | None = None, reward_config: Any = None, data_config: Any = None
    ):
        reward_config = reward_config if reward_config is not None else RewardConfig()
        data_config = data_config if data_config is not None else DataConfig()
        if reward_config.reward_manager not in ("naive", "batch"):
            raise ValueError(f"reward.reward_manager={reward_config.reward_manager!r}; choose naive or batch")
        if reward_config.on_error not in ("raise", "zero"):
            raise ValueError(f"reward.on_error={reward_config.on_error!r}; choose raise or zero")
        if reward_config.reward_manager == "batch" and compute_score is None:
            raise ValueError("reward.reward_manager=batch needs custom_reward_function.path (a function taking lists)")
        self.tokenizer = tokenizer
        self.compute_score = compute_score or functools.partial(
            default_compute_score, lenient=bool(reward_config.lenient_answers)
        )
        self.score_name = (
            getattr(compute_score, "__name__", "compute_score") if compute_score else "default_compute_score"
        )
        self.mode, self.reward_fn_key, self.on_error = (
            reward_config.reward_manager,
            data_config.reward_fn_key,
            reward_config.on_error,
        )
        self.timeout_s = reward_config.timeout_s
        self.turn_rewards = bool(reward_config.turn_rewards)
        overlong = reward_config.overlong_buffer
        self.overlong_enabled = bool(overlong.enable)
        self.overlong_len = int(overlong.len)
        self.overlong_penalty = float(overlong.penalty_factor)
        self.max_response_length = int(data_config.max_response_length)
        if self.overlong_enabled and not 0 < self.overlong_len < self.max_response_length:
            raise ValueError(
                f"reward.overlong_buffer.len={self.overlong_len} must be in (0, "
                f"data.max_response_length={self.max_response_length})"
            )

    def __call__(self, batch: Batch, rm_scores: torch.Tensor | None = None) -> RewardResult:
        """Score ``batch``'s responses: the reward model's ``rm_scores`` (B, R) when given, else the scoring function;
        then DAPO's overlong penalty (either way)."""
        response_mask = batch.tensors[RESPONSE_MASK]
        lengths = response_mask.sum(dim=-1).long()  # the policy's tokens (the overlong penalty counts them)
        ends = response_ends(response_mask)  # the text and the score run to the last policy token
        if rm_scores is not None:
            scores_t, extra_info, failures = rm_scores.float().sum(-1), {}, 0
        else:
            rows = batch.tensors[RESPONSES].tolist()  # decoding Python lists: half the time of tensor rows
            solutions = [
                self.tokenizer.decode(row[:end], skip_special_tokens=True) for row, end in zip(rows, ends.tolist())
            ]
            sources = [str(s) for s in batch.non_tensors[self.reward_fn_key]]
            truths = [
                rm.get("ground_truth") if isinstance(rm, dict) else None for rm in batch.non_tensors[REWARD_MODEL]
            ]
            extras = list(batch.non_tensors[EXTRA_INFO]) if EXTRA_INFO in batch.non_tensors else [{}] * len(batch)
            if NUM_TURNS in batch.non_tensors:  # a multi-turn trajectory: its turns, calls and final answer too
                turns, trajectories = batch.non_tensors[NUM_TURNS], batch.non_tensors[MULTI_TURN]
                extras = [{**e, **t, NUM_TURNS: n} for e, t, n in zip(extras, trajectories, turns)]
            scores, extra_info, failures = self._score_in_time(sources, solutions, truths, extras)
            scores_t = torch.tensor(scores, dtype=torch.float32)
        metrics = {"reward/score_failures": float(failures)}
        if self.overlong_enabled:
            expected = self.max_response_length - self.overlong_len
            penalty = torch.clamp(-(lengths - expected).float() / self.overlong_len * self.overlong_penalty, max=0.0)
            scores_t = scores_t + penalty
            extra_info["overlong_reward"] = penalty.tolist()
            extra_info["overlong"] = (penalty < 0).tolist()
            metrics["reward/overlong_ratio"] = float((penalty < 0).float().mean())
        token_level_scores = torch.zeros(response_mask.shape, dtype=torch.float32)
        rows = torch.arange(len(batch))
        token_level_scores[rows, (ends - 1).clamp(min=0)] = scores_t * (ends > 0).float()
        if self.turn_rewards and MULTI_TURN in batch.non_tensors and not batch.meta_info.get(VALIDATE):
            metrics |= add_turn_rewards(token_level_scores, response_mask, batch.non_tensors[MULTI_TURN])
        return RewardResult(token_level_scores, extra_info, metrics)

    def _score_in_time(
        self, sources: list[str], solutions: list[str], truths: list, extras: list
    ) -> tuple[list[float], dict[str, list], int]:
        """:meth:`_score` within ``timeout_s`` (in a daemon thread that is abandoned when it takes longer)."""
        if self.timeout_s is None:
            return self._score(sources, solutions, truths, extras)
        progress: dict[str, Any] = {"sample": 0}
        outcome: dict[str, Any] = {}

        def score() -> None:
            try:
                outcome["result"] = self._score(sources, solutions, truths, extras, progress)
            except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
                outcome["error"] = error

        thread = threading.Thread(target=score, name="ppoflow-reward", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            where = (
                f"the batch of {len(sources)}"
                if self.mode == "batch"
                else f"sample {progress['sample']} of {len(sources)}, data_source={sources[progress['sample']]!r}"
            )
            raise RewardTimeoutError(
                f"reward function {self.score_name!r} did not return within reward.timeout_s={self.timeout_s:g}s (on "
                f"{where}): it hangs or is too slow; fix it, or raise reward.timeout_s (null: no limit)"
            )
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def _score(
        self,
        sources: list[str],
        solutions: list[str],
        truths: list,
        extras: list,
        progress: dict[str, Any] | None = None,
    ) -> tuple[list[float], dict[str, list], int]:
        """Score each sample (``progress["sample"]`` says which one is being scored)."""
        progress = progress if progress is not None else {}
        n = len(sources)
        if self.mode == "batch":
            try:
                results = self.compute_score(
                    data_sources=sources, solution_strs=solutions, ground_truths=truths, extra_infos=extras
                )
                if len(results) != n:
                    raise ValueError(f"returned {len(results)} scores for {n} samples")
            except Exception as error:
                return self._fail_all(error, n)
        scores, extra_info, failures = [], {}, 0
        for i in range(n):
            progress["sample"] = i
            try:
                result = (
                    results[i]
                    if self.mode == "batch"
                    else self.compute_score(
                        data_source=sources[i], solution_str=solutions[i], ground_truth=truths[i], extra_info=extras[i]
                    )
                )
                score, extra = _as_score(result)
            except Exception as error:
                if self.on_error == "raise":
                    raise RewardScoringError(
                        f"reward function {self.score_name!r} failed on sample {i} (data_source={sources[i]!r}): "
                        f"{type(error).__name__}: {error}. Fix the scorer, or set reward.on_error=zero to score such "
                        "samples 0"
                    ) from error
                score, extra, failures = 0.0, {}, failures + 1
            scores.append(score)
            for key, value in extra.items():
                extra_info.setdefault(key, [None] * n)[i] = value
        return scores, extra_info, failures

    def _fail_all(self, error: Exception, n: int) -> tuple[list[float], dict[str, list], int]:
        if self.on_error == "raise":
            raise RewardScoringError(
                f"batch reward function {self.score_name!r} failed on a batch of {n}: {type(error).__name__}: {error}. "
                "Fix the scorer, or set reward.on_error=zero to score such batches 0"
            ) from error
        return [0.0] * n, {}, n


def add_turn_rewards(token_level_scores: torch.Tensor, response_mask: torch.Tensor, trajectories: Any) -> dict:
    """Each trajectory's ``turn_rewards[k]`` added on the last token of its policy turn k (in place); the metrics
    ``reward/turn_<k>/mean`` over the samples that reached turn k."""
    turns = response_turns(response_mask)
    by_turn: dict[int, list[float]] = {}
    for row, trajectory in enumerate(trajectories):
        for turn, reward in enumerate(trajectory.get("turn_rewards") or []):
            positions = (turns[row] == turn).nonzero()
            if len(positions) == 0:  # a turn cut off by the response's length
                continue
            token_level_scores[row, positions[-1, 0]] += float(reward)
            by_turn.setdefault(turn, []).append(float(reward))
    return {f"reward/turn_{turn}/mean": sum(values) / len(values) for turn, values in sorted(by_turn.items())}


def build_reward_manager(config: Any, tokenizer: Any, compute_score: Callable | None = None) -> RewardManager:
    """The reward manager described by the root config (``reward``, ``data``)."""
    return RewardManager(tokenizer, compute_score, config.reward, config.data)
