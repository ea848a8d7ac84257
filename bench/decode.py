"""What the HF rollout's decoding costs: transformers' ``generate`` against the KV-cache loop that replaces it for
the families it runs (``rl_core/rollout/kv_decode.py``), on the demo's model or a tiny one of another family; and a
sampled token's draw, ``torch.multinomial`` against the loop's inverse transform (``draw_categorical``), at the demo's
vocabulary and at Qwen2.5's.

    python bench/decode.py [--rows 64] [--tokens 16] [--repeats 20] [--cache .ppoflow] [--family gemma3 |
                           --compute-bound] [--lengths uniform]

Both decoders run the same model from the same left-padded prompts, sampling (no stop token: every row runs to
``--tokens``; with ``--lengths uniform`` each row ends at its own length, drawn uniformly from 1 to ``--tokens``, as
responses of varied lengths end), alternated; the draws are timed on random scores. ``--family`` decodes with a
randomly initialised model of that family (``rl_core.models.families``) of the demo's sizes (2 layers of 64) instead
of the demo's trained Qwen2; ``--compute-bound`` with ``vs_trl.py --compute-bound``'s random ~24M-parameter Qwen2.
Prints a table of medians (ms) and, last, one JSON line. Seconds on 2 cores: run it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vs_trl import demo_assets  # noqa: E402

from rl_core.models.families import FAMILIES  # noqa: E402
from rl_core.models.loading import NO_HUB_KERNELS  # noqa: E402
from rl_core.models.tiny import make_tiny_model  # noqa: E402
from rl_core.rollout.kv_decode import draw_categorical, kv_generate  # noqa: E402

QWEN25_VOCABULARY = 151_936


class EndAtLengths(StoppingCriteria):
    """Ends each row once it holds its own number of new tokens (``lengths``, after ``width`` prompt columns)."""

    def __init__(self, lengths: torch.Tensor, width: int) -> None:
        self.lengths, self.width = lengths, width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return input_ids.shape[1] - self.width >= self.lengths


def median_ms(run, repeats: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per row")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cache", default=str(ROOT / ".ppoflow"), help="where the demo model is built")
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--family", choices=sorted(FAMILIES), help="a random tiny model of this family instead")
    models.add_argument("--compute-bound", action="store_true", help="vs_trl.py --compute-bound's ~24M Qwen2")
    parser.add_argument("--lengths", choices=["budget", "uniform"], default="budget", help="where each row ends")
    args = parser.parse_args()
    model_kind = args.family or ("compute_bound" if args.compute_bound else "demo")

    with tempfile.TemporaryDirectory(prefix="ppoflow-decode-") as folder:
        model_dir = (
            make_tiny_model(folder, family=args.family)
            if args.family
            else demo_assets(args.cache, args.compute_bound)[0]
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, **NO_HUB_KERNELS).eval()
    vocabulary = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocabulary, (args.rows, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[: args.rows // 8, :3] = 0  # some rows left-padded
    no_stop = [vocabulary]  # an id no model draws: every row runs to the budget, or to its own length
    lengths = torch.randint(1, args.tokens + 1, (args.rows,), generator=generator)
    ends = StoppingCriteriaList([EndAtLengths(lengths, input_ids.shape[1])] if args.lengths == "uniform" else [])

    def with_generate() -> None:
        with torch.no_grad():
            model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=args.tokens,
                do_sample=True,
                top_k=0,
                eos_token_id=no_stop,
                pad_token_id=0,
                stopping_criteria=ends,
            )

    def with_kv_loop() -> None:
        kv_generate(
            model,
            input_ids,
            attention_mask,
            args.tokens,
            True,
            LogitsProcessorList(),
            ends,
            no_stop,
            0,
            generator,
        )

    rows = []
    decode_times = {"generate": [], "kv loop": []}
    for _ in range(2):  # alternated
        decode_times["generate"].append(median_ms(with_generate, args.repeats))
        decode_times["kv loop"].append(median_ms(with_kv_loop, args.repeats))
    decode = {name: statistics.median(times) for name, times in decode_times.items()}
    model_name = {"demo": "the demo's model", "compute_bound": "the ~24M Qwen2"}.get(model_kind, f"a tiny {model_kind}")
    label = f"{args.rows} rows x {'1-' * (args.lengths == 'uniform')}{args.tokens} sampled tokens, {model_name}"
    rows.append((label, decode["generate"], decode["kv loop"]))
    draws = {}
    for size in (vocabulary, QWEN25_VOCABULARY):
        scores = torch.randn(args.rows, size, generator=generator)
        multinomial = median_ms(lambda s=scores: torch.multinomial(s.softmax(-1), 1, generator=generator), args.repeats)
        inverse = median_ms(lambda s=scores: draw_categorical(s, generator), args.repeats)
        draws[size] = {"multinomial_ms": round(multinomial, 3), "inverse_transform_ms": round(inverse, 3)}
        rows.append((f"one draw, {args.rows} rows x {size:,} tokens", multinomial, inverse))

    print(f"{'what':58s} {'generate / multinomial':>24s} {'kv loop / inverse':>18s}")
    for what, before, after in rows:
        print(f"{what:58s} {before:21.2f} ms {after:15.2f} ms")
    result = {
        "family": model_kind,
        "rows": args.rows,
        "lengths": args.lengths,
        "tokens": args.tokens,
        "generate_ms": round(decode["generate"], 2),
        "kv_loop_ms": round(decode["kv loop"], 2),
        "ratio_kv_over_generate": round(decode["kv loop"] / decode["generate"], 3),
        "draws": draws,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
