"""xmcbench.testing's behaviour checks: components that pass the shape, determinism and state rules while
being wrong. Each broken component here is one people write (an encoder that ignores the attention mask, a
ranker that forgets which label a candidate is, an export that loses the tokenizer, a float32 constant inside
forward), and the check that catches it is named in the failure; the built-in components still pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from xmcbench.config import TrainConfig
from xmcbench.interfaces import Encoder
from xmcbench.registry import build_registry
from xmcbench.testing import (check_component, check_encoder, check_ranker, check_recaller, check_sampler,
                              tiny_config)
from xmcbench.tokenization import load_tokenizer
from xmcbench_lightxml.encoder import TransformerClsEncoder, build_transformer_cls
from xmcbench_lightxml.ranker import BottleneckRanker
from xmcbench_lightxml.recaller import ClusterLinearRecaller
from xmcbench_lightxml.sampler import build_dynamic, build_static

REGISTRY = build_registry()


@pytest.fixture(scope="module")
def config(tiny_model_dir) -> TrainConfig:
    return tiny_config(tiny_model_dir)


@pytest.fixture(scope="module")
def pretrained_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny transformer with its (random) weights saved, so pretrained_weights=True loads offline."""
    from transformers import AutoConfig, AutoModel

    folder = tmp_path_factory.mktemp("tiny-pretrained") / "model"
    shutil.copytree(tiny_model_dir, folder)
    torch.manual_seed(0)
    AutoModel.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    return folder


def caught(check, factory, config, rule: str) -> str:
    """The check fails on `factory` with `rule` (a regular expression) in its "kind factory: rule: detail"
    message, which names the factory."""
    with pytest.raises(AssertionError, match=rule) as failure:
        check(factory, config)
    message = str(failure.value)
    assert message.split(": ")[0].endswith(f"tests.test_behaviour_checks.{factory.__qualname__}"), message
    return message


# -- the built-in components pass -----------------------------------------------------------------------

def test_the_transformer_cls_encoder_passes(config):
    check_encoder(build_transformer_cls, config)


def test_the_transformer_cls_encoder_passes_from_pretrained_weights(pretrained_dir):
    check_encoder(build_transformer_cls, tiny_config(pretrained_dir, pretrained_weights=True))
    # random weights, but a folder with weights: the rebuild from export is tried with pretrained_weights=True too
    check_encoder(build_transformer_cls, tiny_config(pretrained_dir))


def test_the_transformer_cls_encoder_passes_on_the_bundled_minilm():
    # real pretrained weights, offline (xmcbench.tokenization.resolve_model_path), 2 of its 6 layers
    check_encoder(build_transformer_cls, tiny_config("all-MiniLM-L6-v2", pretrained_weights=True))


@pytest.mark.parametrize("kind, name", [("recaller", "cluster-linear"), ("ranker", "bottleneck"),
                                        ("sampler", "dynamic"), ("sampler", "static")])
def test_the_builtin_heads_and_samplers_pass(kind, name, config):
    check_component(kind, REGISTRY.component(kind, name), config)


def test_the_dense_scoring_path_of_the_bottleneck_ranker_passes(config):
    # many distinct candidates per document: BottleneckRanker scores pair by pair (bmm) instead of through
    # the unique labels, and must still follow permutations of its candidates
    check_ranker(REGISTRY.component("ranker", "bottleneck"), config, num_labels=400, batch_sizes=(24,),
                 candidate_counts=(1, 9))


def test_the_samplers_still_pass_by_name(config):
    check_sampler(build_dynamic, config)
    check_sampler(build_static, config)


# -- a small encoder to break ---------------------------------------------------------------------------

class BagEncoder(Encoder):
    """Token embeddings through a linear layer, averaged over the real tokens (the mask's 1s): correct for
    padding on either side, in any dtype."""

    def __init__(self, config, dim: int = 6, **exported) -> None:
        super().__init__()
        self.tokenizer = load_tokenizer(exported.get("model_name", config.model_name))
        self.out_dim = dim
        self.embedding = nn.Embedding(len(self.tokenizer), dim)
        self.project = nn.Linear(dim, dim)

    def weights(self, attention_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return attention_mask.unsqueeze(-1).to(like.dtype)

    def forward(self, input_ids, attention_mask):
        hidden = self.project(self.embedding(input_ids))                      # (B, T, D)
        weights = self.weights(attention_mask, hidden)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)

    def export(self, directory: Path) -> dict:
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(directory)
        return {"model_name": str(directory)}


def left_padding_bag_encoder(config, **exported):
    encoder = BagEncoder(config, **exported)
    encoder.tokenizer.padding_side = "left"
    return encoder


def test_a_correct_encoder_passes_with_padding_on_either_side(config):
    check_encoder(BagEncoder, config)
    check_encoder(left_padding_bag_encoder, config)


# -- 1. masked padding ----------------------------------------------------------------------------------

class UnmaskedMeanEncoder(BagEncoder):
    """Averages over every position, padding included."""

    def weights(self, attention_mask, like):
        return torch.ones_like(like[..., :1])


class MasklessTransformer(TransformerClsEncoder):
    """Never passes the attention mask on: the real tokens attend to the padding."""

    def forward(self, input_ids, attention_mask):
        return super().forward(input_ids, torch.ones_like(attention_mask))


def maskless_transformer(config, **exported):
    return MasklessTransformer(exported.get("model_name", config.model_name), config.num_layers, config.dropout,
                               exported.get("pretrained_weights", config.pretrained_weights))


def left_padded_transformer_cls(config, **exported):
    """transformer-cls on a BERT tokenizer set to pad on the left: it reads position 0, now a pad token."""
    encoder = build_transformer_cls(config, **exported)
    encoder.tokenizer.padding_side = "left"
    return encoder


PADDING_RULE = "masked padding must not change the output"


def test_an_encoder_averaging_over_padding_is_caught(config):
    message = caught(check_encoder, UnmaskedMeanEncoder, config, PADDING_RULE)
    assert message.startswith("encoder tests.test_behaviour_checks.UnmaskedMeanEncoder: "), message
    assert "pad tokens on the right" in message


def test_an_encoder_ignoring_the_attention_mask_is_caught(config):
    caught(check_encoder, maskless_transformer, config, PADDING_RULE)


def test_an_encoder_reading_token_0_under_left_padding_is_caught(config):
    message = caught(check_encoder, left_padded_transformer_cls, config, PADDING_RULE)
    assert "pad tokens on the left" in message


# -- 2. outputs respond to the inputs -------------------------------------------------------------------

class LengthOnlyEncoder(BagEncoder):
    """Pools the mask instead of the token embeddings: the text's length is all it sees."""

    def forward(self, input_ids, attention_mask):
        lengths = attention_mask.sum(dim=1, keepdim=True).to(self.project.weight.dtype)
        return self.project(lengths.expand(-1, self.out_dim) / 8) + 0 * self.embedding.weight.sum()


class ConstantRecaller(ClusterLinearRecaller):
    """Returns the layer's bias: the representation is never applied."""

    def __init__(self, config, in_dim, num_clusters):
        super().__init__(in_dim, num_clusters)

    def forward(self, representation):
        return self.linear.bias.expand(representation.shape[0], -1)


class PopularityRanker(BottleneckRanker):
    """Scores each candidate by a learned per-label prior only, whatever the document."""

    def __init__(self, config, in_dim, num_labels):
        super().__init__(in_dim, num_labels, config.hidden_size)

    def forward(self, representation, candidate_labels):
        return self.label_embedding(candidate_labels).sum(dim=-1) + 0 * self.hidden.weight.sum()


def test_outputs_that_ignore_the_inputs_are_caught(config):
    caught(check_encoder, LengthOnlyEncoder, config, "the output must depend on the token ids")
    caught(check_recaller, ConstantRecaller, config, "the output must depend on the representation")
    caught(check_ranker, PopularityRanker, config, "the scores must depend on the representation")


# -- 3. rankers score candidates by their ids -----------------------------------------------------------

class LabelZeroRanker(BottleneckRanker):
    """Looks up label 0's embedding for every candidate (an index taken from the wrong tensor)."""

    def __init__(self, config, in_dim, num_labels):
        super().__init__(in_dim, num_labels, config.hidden_size)

    def forward(self, representation, candidate_labels):
        return super().forward(representation, torch.zeros_like(candidate_labels))


class SlotRanker(BottleneckRanker):
    """Scores slots, not labels: a linear layer with one output per candidate position."""

    def __init__(self, config, in_dim, num_labels):
        super().__init__(in_dim, num_labels, config.hidden_size)
        self.slots = nn.Linear(in_dim, 32)

    def forward(self, representation, candidate_labels):
        return self.slots(representation)[:, :candidate_labels.shape[1]] + 0 * self.label_embedding.weight.sum()


class UnsortingRanker(BottleneckRanker):
    """Sorts the candidates to score them and returns the scores in sorted order, not the caller's."""

    def __init__(self, config, in_dim, num_labels):
        super().__init__(in_dim, num_labels, config.hidden_size)

    def forward(self, representation, candidate_labels):
        return super().forward(representation, candidate_labels.sort(dim=1).values)


IDS_RULE = "the scores must depend on the candidate label ids"


class IdBlindRanker(BottleneckRanker):
    """One score per document, the same for every candidate."""

    def __init__(self, config, in_dim, num_labels):
        super().__init__(in_dim, num_labels, config.hidden_size)

    def forward(self, representation, candidate_labels):
        score = self.hidden(representation).sum(dim=1, keepdim=True) + 0 * self.label_embedding.weight.sum()
        return score.expand(-1, candidate_labels.shape[1])


PERMUTATION_RULE = "permuting the candidates must permute their scores the same way"


def test_a_ranker_that_ignores_candidate_ids_is_caught(config):
    message = caught(check_ranker, LabelZeroRanker, config, IDS_RULE)
    assert "outputs did not change" in message
    caught(check_ranker, IdBlindRanker, config, IDS_RULE)


def test_a_ranker_whose_scores_do_not_follow_its_candidates_is_caught(config):
    caught(check_ranker, UnsortingRanker, config, PERMUTATION_RULE)
    caught(check_ranker, SlotRanker, config, PERMUTATION_RULE)


# -- 4. export rebuilds the tokenizer too ---------------------------------------------------------------

def five_token_tokenizer(pad_token_id: int):
    """What a forgetful export leaves behind: a word-level vocabulary of the special tokens and one word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["[UNK]", "[CLS]", "[SEP]", "the"]
    vocabulary = {token: index for index, token in enumerate(special[:pad_token_id] + ["[PAD]"]
                                                             + special[pad_token_id:])}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]")


class TokenizerForgettingEncoder(BagEncoder):
    """export writes the encoder's settings and a placeholder tokenizer instead of its own."""

    def export(self, directory: Path) -> dict:
        directory.mkdir(parents=True, exist_ok=True)
        five_token_tokenizer(int(self.tokenizer.pad_token_id)).save_pretrained(directory)
        (directory / "bag.json").write_text(json.dumps({"vocabulary": len(self.tokenizer)}))
        return {"model_name": str(directory)}

    def __init__(self, config, **exported):
        super().__init__(config, **exported)
        if exported:   # the embedding table keeps its size, so the weights load and ids give equal outputs
            size = json.loads((Path(exported["model_name"]) / "bag.json").read_text())["vocabulary"]
            self.embedding = nn.Embedding(size, self.out_dim)


def test_an_export_that_loses_the_tokenizer_is_caught(config):
    message = caught(check_encoder, TokenizerForgettingEncoder, config,
                     "the encoder rebuilt from export must tokenize texts as the original")
    assert "'python bindings for the " in message


def test_the_placeholder_tokenizer_really_turns_words_into_unk(config):
    tokenizer = five_token_tokenizer(0)
    assert len(tokenizer) == 5 and tokenizer("python the")["input_ids"] == [1, 4]


def weights_forgetting_transformer(config, **exported):
    """export returns the folder but not pretrained_weights=False: a pretrained config then looks for
    weights in the exported folder, which holds none (the pipeline saves them apart)."""
    encoder = build_transformer_cls(config, **exported)
    export = encoder.export
    encoder.export = lambda directory: {"model_name": export(directory)["model_name"]}
    return encoder


def test_an_export_that_rebuilds_only_without_pretrained_weights_is_caught(config, pretrained_dir):
    check_encoder(weights_forgetting_transformer, config)   # a folder without weights: nothing to load offline
    caught(check_encoder, weights_forgetting_transformer, tiny_config(pretrained_dir),
           r"factory\(config, \*\*exported\) with config.pretrained_weights=True \(the model folder holds weights\) "
           r"must work: raised OSError")
    caught(check_encoder, weights_forgetting_transformer, tiny_config(pretrained_dir, pretrained_weights=True),
           r"the pipeline's factory call factory\(config, \*\*exported\) must work: raised OSError")


# -- 5. no dtype fixed inside forward -------------------------------------------------------------------

class Float32MaskEncoder(BagEncoder):
    """mask.float(): right in float32, promoted away in float64, a float32 output in half precision."""

    def weights(self, attention_mask, like):
        return attention_mask.unsqueeze(-1).float()


class ScaledRecaller(ClusterLinearRecaller):
    """Divides by sqrt(D) held in a new float32 tensor of shape (1,)."""

    def __init__(self, config, in_dim, num_clusters):
        super().__init__(in_dim, num_clusters)

    def forward(self, representation):
        return super().forward(representation) / torch.sqrt(torch.tensor([float(representation.shape[1])]))


class MaskedRanker(BottleneckRanker):
    """Multiplies the scores by a float32 tensor made from the candidate ids."""

    def __init__(self, config, in_dim, num_labels):
        super().__init__(in_dim, num_labels, config.hidden_size)

    def forward(self, representation, candidate_labels):
        return super().forward(representation, candidate_labels) * (candidate_labels >= 0).float()


def test_a_float32_tensor_made_inside_forward_is_caught(config):
    caught(check_encoder, Float32MaskEncoder, config,
           r"outputs must follow \.to\(torch\.bfloat16\).*: torch.float32 for B=1, T=1")
    caught(check_recaller, ScaledRecaller, config, r"outputs must follow \.to\(torch\.bfloat16\)")
    caught(check_ranker, MaskedRanker, config, r"outputs must follow \.to\(torch\.bfloat16\)")


def test_a_zero_dimensional_constant_is_harmless_and_passes(config):
    class HalvedRecaller(ClusterLinearRecaller):
        def __init__(self, config, in_dim, num_clusters):
            super().__init__(in_dim, num_clusters)

        def forward(self, representation):   # a 0-d tensor does not promote the input's dtype
            return super().forward(representation) * torch.tensor(0.5)

    check_recaller(HalvedRecaller, config)
