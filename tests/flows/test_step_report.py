"""The samples table the inspector reads: token texts that join to the decoded response (no U+FFFD for a character
split over byte tokens), whole GRPO groups, the question without the chat template, the ground truth."""

import base64
import io

import numpy as np
import torch
from PIL import Image

from flows.step_report import samples_table, token_texts, validation_images
from rl_core.batch import Batch
from rl_core.batch_fields import (
    ADVANTAGES,
    ATTENTION_MASK,
    MULTI_MODAL_DATA,
    PROMPTS,
    RAW_PROMPT,
    RESPONSE_MASK,
    RESPONSES,
    REWARD_MODEL,
    TOKEN_LEVEL_SCORES,
    UID,
)
from rl_core.models.tiny import build_tokenizer

TEXTS = ["the answer is 12 #### 12", "what is 3 + 4? think step by step", "ok → fine, café"]


def test_token_texts_join_to_the_decoded_text_and_never_show_a_broken_byte():
    tokenizer = build_tokenizer(TEXTS, vocab_size=300)
    text = "café → 7 ✓ and 中文"  # 2-, 3- and 4-byte... characters the BPE never merged: one byte token each
    ids = tokenizer.encode(text, add_special_tokens=False)
    alone = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in alone)  # the defect this fixes: a byte token decoded alone
    texts = token_texts(tokenizer, ids)
    assert len(texts) == len(ids) and "".join(texts) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in texts)
    assert texts[:2] == [tokenizer.decode([ids[0]]), tokenizer.decode([ids[1]])]  # whole tokens keep their own text


def test_a_response_cut_inside_a_character_keeps_what_it_has():
    tokenizer = build_tokenizer(TEXTS, vocab_size=300)
    ids = tokenizer.encode("a中", add_special_tokens=False)[:-1]  # the last byte of 中 cut off
    assert len(token_texts(tokenizer, ids)) == len(ids)


def grpo_batch(tokenizer, prompts=6, n=4, width=5):
    """``prompts`` groups of ``n`` responses, each response a different length; scores = the row number."""
    rows = prompts * n
    prompt_ids = torch.tensor([tokenizer.encode("what is 3 + 4?")[-3:]] * rows)
    responses = torch.randint(5, 50, (rows, width))
    lengths = torch.tensor([1 + r % width for r in range(rows)])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    scores = torch.zeros(rows, width)
    scores[torch.arange(rows), lengths - 1] = torch.arange(rows, dtype=torch.float)
    tensors = {
        PROMPTS: prompt_ids,
        RESPONSES: responses,
        RESPONSE_MASK: mask,
        ATTENTION_MASK: torch.cat([torch.ones_like(prompt_ids), mask], dim=1),
        TOKEN_LEVEL_SCORES: scores,
        ADVANTAGES: torch.randn(rows, 1).expand(rows, width) * mask,
    }
    objects = {
        UID: [f"p{r // n}" for r in range(rows)],
        RAW_PROMPT: [
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{r // n}"}] for r in range(rows)
        ],
        REWARD_MODEL: [{"ground_truth": str(r // n)} for r in range(rows)],
    }
    return Batch(tensors, objects)


def test_the_table_keeps_whole_groups_with_their_question_and_ground_truth():
    tokenizer = build_tokenizer(TEXTS, vocab_size=300)
    table = samples_table(grpo_batch(tokenizer), tokenizer, count=8)
    assert table["uid"] == ["p0"] * 4 + ["p3"] * 4  # two whole groups, spread over the six
    assert table["question"] == ["q0"] * 4 + ["q3"] * 4 and table["ground_truth"] == ["0"] * 4 + ["3"] * 4
    assert table["response_length"] == [1, 2, 3, 4, 3, 4, 5, 1]  # rows 0-3 and 12-15: 1 + row % 5
    assert table["score"] == [0.0, 1.0, 2.0, 3.0, 12.0, 13.0, 14.0, 15.0]
    assert [len(tokens) for tokens in table["response_tokens"]] == table["response_length"]
    assert all(len(a) == n for a, n in zip(table["token_advantages"], table["response_length"]))


def test_samples_with_images_carry_thumbnails_and_validation_logs_them_whole():
    tokenizer = build_tokenizer(TEXTS, vocab_size=300)
    batch = grpo_batch(tokenizer, prompts=2, n=2)
    wide = Image.new("RGB", (300, 150), (40, 80, 220))
    batch.non_tensors[MULTI_MODAL_DATA] = np.array([{"image": [wide]}, {"image": [wide]}, None, None], dtype=object)
    table = samples_table(batch, tokenizer, count=4)
    decoded = [[base64.b64decode(url.split(",", 1)[1]) for url in row] for row in table["images"]]
    thumbnails = [[Image.open(io.BytesIO(png)) for png in row] for row in decoded]
    assert [[image.size for image in row] for row in thumbnails] == [[(96, 48)], [(96, 48)], [], []]  # the aspect kept
    assert thumbnails[0][0].getpixel((10, 10)) == (40, 80, 220)
    logged = validation_images(batch, tokenizer, count=8)
    assert logged["image"] == [wide, wide] and logged["question"] == ["q0", "q0"]  # the rows with images only
    assert logged["ground_truth"] == ["0", "0"] and logged["score"] == [0.0, 1.0]
    assert validation_images(grpo_batch(tokenizer), tokenizer, count=8) is None
