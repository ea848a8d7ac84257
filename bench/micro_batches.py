"""Micro-batches by count vs by tokens (verl's ``use_dynamic_bsz``) on a batch of very uneven lengths: the old-log-prob
pass and one actor update, in this process, on a Qwen2-shaped model built in code.

    python bench/micro_batches.py [--rows 64] [--short 8] [--long 192] [--micro 4] [--repeats 3]

Half the responses are ``--short`` tokens, half ``--long`` (alternating, as a batch of mixed prompts comes), after a
16-token prompt. By count: ``--micro`` rows a micro-batch (what fits the long ones). By tokens: a budget of ``--micro``
long sequences' tokens. Both with and without padding-free forward passes (``use_remove_padding``). Prints a table and,
last, one JSON line with the seconds (medians of ``--repeats``) and the speed-ups.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from flows.config import compose_config
from rl_core.batch import Batch
from rl_core.batch_fields import (
    ADVANTAGES,
    ATTENTION_MASK,
    INPUT_IDS,
    OLD_LOG_PROBS,
    POSITION_IDS,
    PROMPTS,
    RESPONSE_MASK,
    RESPONSES,
)
from rl_core.models.tiny import make_tiny_model
from rl_core.workers import ActorRolloutRefWorker

PROMPT = 16


def uneven_batch(rows: int, short: int, long: int, vocab: int) -> Batch:
    """``rows`` sequences [prompt | response], right-padded to ``long``; every other response ``short`` tokens."""
    generator = torch.Generator().manual_seed(0)
    responses = torch.randint(5, vocab, (rows, long), generator=generator)
    lengths = torch.tensor([short if r % 2 else long for r in range(rows)])
    response_mask = (torch.arange(long)[None, :] < lengths[:, None]).long()
    prompts = torch.randint(5, vocab, (rows, PROMPT), generator=generator)
    attention = torch.cat([torch.ones(rows, PROMPT, dtype=torch.long), response_mask], dim=1)
    return Batch(
        {
            PROMPTS: prompts,
            RESPONSES: responses,
            INPUT_IDS: torch.cat([prompts, responses], dim=1),
            ATTENTION_MASK: attention,
            POSITION_IDS: torch.clamp(attention.cumsum(-1) - 1, min=0),
            RESPONSE_MASK: response_mask,
            ADVANTAGES: torch.randn(rows, 1, generator=generator) * response_mask,
        }
    )


def seconds(model: Path, batch: Batch, settings: list[str], repeats: int) -> dict[str, float]:
    """Median seconds of the old-log-prob pass and of one update, under the overrides ``settings``."""
    config = compose_config(
        [
            f"actor_rollout_ref.model.path={model}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={len(batch)}",  # one optimizer step
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.fsdp_config.dtype=float32",  # verl's bf16 is a GPU's
            f"data.max_prompt_length={PROMPT}",  # the lengths the token budgets are checked against
            f"data.max_response_length={batch.tensors[RESPONSES].shape[1]}",
            *settings,
        ]
    )
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout")
    worker.init_model()
    batch.tensors[OLD_LOG_PROBS] = worker.compute_log_prob(batch).tensors[OLD_LOG_PROBS]  # warm-up, and the old ones
    log_prob, update = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        worker.compute_log_prob(batch)
        log_prob.append(time.perf_counter() - started)
        started = time.perf_counter()
        worker.update_actor(batch)
        update.append(time.perf_counter() - started)
    return {"log_prob_s": statistics.median(log_prob), "update_s": statistics.median(update)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=192)
    parser.add_argument("--micro", type=int, default=4, help="rows a micro-batch by count")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(Path(folder) / "model", hidden_size=256, num_layers=4)
        vocab = len(json.loads((model / "tokenizer.json").read_text())["model"]["vocab"])
        batch = uneven_batch(args.rows, args.short, args.long, vocab)
        budget = args.micro * (PROMPT + args.long)
        micro = [
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro}",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        ]
        results = {}
        for padding_free in (True, False):
            for dynamic in (False, True):
                name = f"{'by tokens' if dynamic else 'by count'}, {'padding-free' if padding_free else 'padded'}"
                results[name] = seconds(
                    model,
                    batch,
                    [
                        *micro,
                        f"actor_rollout_ref.actor.use_dynamic_bsz={str(dynamic).lower()}",
                        f"actor_rollout_ref.model.use_remove_padding={str(padding_free).lower()}",
                    ],
                    args.repeats,
                )
    print(f"{'micro-batches':<28}{'log-prob pass (s)':>20}{'update (s)':>14}")
    for name, result in results.items():
        print(f"{name:<28}{result['log_prob_s']:>20.3f}{result['update_s']:>14.3f}")
    speedup = {
        mode: round(
            (results[f"by count, {mode}"]["log_prob_s"] + results[f"by count, {mode}"]["update_s"])
            / (results[f"by tokens, {mode}"]["log_prob_s"] + results[f"by tokens, {mode}"]["update_s"]),
            3,
        )
        for mode in ("padding-free", "padded")
    }
    print(
        json.dumps(
            {
                "rows": args.rows,
                "short": args.short,
                "long": args.long,
                "budget_tokens": budget,
                "seconds": results,
                "speedup": speedup,
            }
        )
    )


if __name__ == "__main__":
    main()
