"""SFT: the loss covers response tokens only, and training on the demo task makes the tiny model answer."""

import pytest
import torch

from rl_core.config import ModelConfig
from rl_core.data.synthetic import addition_rows
from rl_core.models.loading import load_policy_model
from rl_core.sft import SFTExample, collate, encode_example, run_sft, sft_loss


def test_loss_mask_covers_the_response_and_eos_only(tiny_model_path):
    _, tokenizer = load_policy_model(ModelConfig(path=str(tiny_model_path)))
    ids, mask = encode_example(tokenizer, SFTExample([{"role": "user", "content": "2+3="}], "5"))
    response = [i for i, m in zip(ids, mask) if m]
    assert response == tokenizer("5", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode([i for i, m in zip(ids, mask) if not m]).endswith("assistant\n")


def test_sft_loss_is_the_mean_response_nll(tiny_model_path):
    model, tokenizer = load_policy_model(ModelConfig(path=str(tiny_model_path)))
    batch = collate(
        [encode_example(tokenizer, SFTExample("1+1=", "2")), encode_example(tokenizer, SFTExample("10+10=", "20"))],
        tokenizer.pad_token_id,
    )
    with torch.no_grad():
        loss = sft_loss(model, batch)
        # plain loop: each sequence alone, sum of -log p over its response tokens
        total, count = 0.0, 0
        for row in range(2):
            n = int(batch["attention_mask"][row].sum())
            ids = batch["input_ids"][row, :n]
            log_probs = torch.log_softmax(model(input_ids=ids.unsqueeze(0)).logits[0], -1)
            for t in range(1, n):
                if batch["loss_mask"][row, t]:
                    total -= log_probs[t - 1, ids[t]].item()
                    count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-5)


def test_sft_lowers_the_loss_on_the_demo_task(tiny_model_path):
    model, tokenizer = load_policy_model(ModelConfig(path=str(tiny_model_path)))
    examples = [SFTExample(r["prompt"], r["reward_model"]["ground_truth"]) for r in addition_rows(200, seed=0)]
    losses = run_sft(model, tokenizer, examples, steps=40, batch_size=32, lr=3e-3)
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
