"""How long `transformer-cls`'s bag of word pieces is beside its [CLS] states, the measurement behind
options.lexical_norm's length: the Euclidean length of the raw bag (no options.lexical_norm) at each window, and of the
centred [CLS] states, over the first documents of a dataset's training split.

    python benchmarks/bag_lengths.py DATASET [--documents 256] [--windows 128 512] [--buckets 4096] [--threads 2]

DATASET: a name or folder `xmcbench run` reads. The encoder is lightxml's default (all-MiniLM-L6-v2, 5 layers), in
eval mode (no dropout); the bag comes from the encoder's own `lexical_bag`.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from xmcbench.formats import open_dataset
from xmcbench.registry import build_registry
from xmcbench_lightxml.encoder import TransformerClsEncoder
from xmcbench_lightxml.methods import FLAT_LEXICAL_BUCKETS, LIGHTXML_DEFAULTS


def percentiles(values: torch.Tensor) -> str:
    return " / ".join(f"{value:.1f}" for value in np.percentile(values.numpy(), [10, 50, 90]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset")
    parser.add_argument("--documents", type=int, default=256)
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--buckets", type=int, default=FLAT_LEXICAL_BUCKETS)
    parser.add_argument("--threads", type=int, default=2)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    texts = open_dataset(build_registry(), arguments.dataset).train_texts[:arguments.documents]
    encoder = TransformerClsEncoder(LIGHTXML_DEFAULTS["model_name"], num_layers=LIGHTXML_DEFAULTS["num_layers"],
                                    lexical_buckets=arguments.buckets).eval()
    print(f"{len(texts)} training documents of {arguments.dataset}; lengths at the 10th / 50th / 90th percentile")
    with torch.no_grad():
        batch = encoder.tokenizer(texts, truncation=True, max_length=128, padding=True, return_tensors="pt")
        summary = encoder(batch["input_ids"], batch["attention_mask"])[:, :-arguments.buckets]   # (N, 5 x 384)
        print(f"centred [CLS] states, 128 tokens: {percentiles((summary - summary.mean(dim=0)).norm(dim=1))}")
        for window in arguments.windows:
            batch = encoder.tokenizer(texts, truncation=True, max_length=window, padding=True, return_tensors="pt")
            bag = encoder.lexical_bag(batch["input_ids"], batch["attention_mask"])                 # (N, F)
            print(f"raw bag of {arguments.buckets} buckets, {window} tokens: {percentiles(bag.norm(dim=1))}")


if __name__ == "__main__":
    main()
