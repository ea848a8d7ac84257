"""Small builders shared by the rl_core tests."""

from rl_core.data.dataset import RLDataset, write_rows
from rl_core.data.synthetic import addition_rows


def addition_dataset(tmp_path, tokenizer, data_config, count=16, split="train"):
    path = write_rows(addition_rows(count, seed=0, split=split), tmp_path / f"{split}.parquet")
    return RLDataset(str(path), tokenizer, data_config)
