"""`cluster-linear`: LightXML's generator, one linear layer from the representation to cluster logits."""

import numpy as np
import torch
from torch import nn

from xmcbench.calibration import fit_bin_calibration
from xmcbench.errors import RefusedSetting, XmcError
from xmcbench.interfaces import EpochContext, LabelInfo, Recaller
from xmcbench_lightxml.options import (CALIBRATION, HEAD_INIT, HOLD_PRIOR, LOGIT_ADJUSTMENT, PIFA_LENGTH,
                                       PIFA_SCALE, POSITIVE_WEIGHT, ROW_LR_DOCUMENTS)

# A PIFA row scores a document by options.pifa_scale x its cosine to the label's documents (the centred
# representations divided by their mean length). The divisor is at least PIFA_MIN_SPREAD x the representations' own
# mean length: where documents barely differ (an untrained encoder), dividing by their tiny spread would give rows so
# long that dropout's noise on the representation alone moved logits by hundreds. Pretrained MiniLM's spread is 0.22
# of its length on the Debian sets.
PIFA_MIN_SPREAD = 0.1
# hold_prior's running mean of the training representations moves this far toward each training batch's mean: about
# the last 100 batches count, so it follows the encoder as it trains without taking one batch's noise.
CENTRE_MOMENTUM = 0.01
CALIBRATION_NEEDS_VALIDATION = ("options.calibration=bins fits its scales on the validation rows, and this run has "
                                "none: --set validation_size=N (e.g. 10 % of the training documents), or drop the "
                                "option")


class ClusterLinearRecaller(Recaller):
    """(B, D) -> (B, K) cluster logits.

    With calibration (options.calibration=bins; auto on a flat run with a validation split): in eval mode the
    logits are a_l z_l + c_l, the (L,)
    buffers `calibration_scales` and `calibration_offsets`, which `finalize` fits on the validation rows
    (xmcbench.calibration) before each validation and once training ends; training reads z_l itself."""

    def __init__(self, in_dim: int, num_clusters: int, bias: bool = True) -> None:
        super().__init__()
        self.num_clusters = num_clusters
        self.linear = nn.Linear(in_dim, num_clusters, bias=bias)
        self.calibrated = False

    def add_calibration(self) -> None:
        """Register the calibration buffers (only then: the checkpoints of runs without it keep their tensors)."""
        self.calibrated = True
        self.register_buffer("calibration_scales", torch.ones(self.num_clusters))
        self.register_buffer("calibration_offsets", torch.zeros(self.num_clusters))

    def logits(self, representation: torch.Tensor) -> torch.Tensor:
        """(B, D) -> (B, K) the uncalibrated logits, which training reads."""
        return self.linear(representation)

    def forward(self, representation: torch.Tensor) -> torch.Tensor:
        logits = self.logits(representation)
        if self.calibrated and not self.training:
            logits = (logits * self.calibration_scales.to(logits.dtype)
                      + self.calibration_offsets.to(logits.dtype))
        return logits

    @torch.no_grad()
    def finalize(self, context: EpochContext) -> None:
        if not self.calibrated:
            return
        if context.validation_labels is None:
            raise XmcError(CALIBRATION_NEEDS_VALIDATION)
        if context.validation_labels.shape[1] != self.num_clusters:
            return   # calibration=auto on label clusters (check_cluster_linear refuses bins there)
        logits = self.logits(context.validation_embeddings().to(self.linear.weight))                 # (V, L)
        scales, offsets, _ = fit_bin_calibration(logits.float().cpu(), context.validation_labels,
                                                 context.label_info.counts)
        self.calibration_scales.copy_(scales.to(self.calibration_scales))
        self.calibration_offsets.copy_(offsets.to(self.calibration_offsets))

    def rows(self) -> torch.Tensor:
        """(K, D) the rows the logits use."""
        return self.linear.weight


class PropensityWeightedRecaller(ClusterLinearRecaller):
    """A flat `cluster-linear` whose recall loss weighs each label's positives by its inverse propensity
    (options.positive_weight=propensity): a label seen once counts about ten times a frequent one where it is
    positive, against the negatives every document gives it. The (L,) weights come from the run's LabelInfo when
    an epoch starts and are kept as a buffer, so a run resumed inside an epoch has them."""

    def __init__(self, in_dim: int, num_clusters: int, bias: bool = True) -> None:
        super().__init__(in_dim, num_clusters, bias)
        self.register_buffer("positive_weights", torch.ones(num_clusters))

    def start_epoch(self, context: EpochContext) -> None:
        weights = torch.as_tensor(context.label_info.inverse_propensities, dtype=torch.float32)
        self.positive_weights.copy_(weights.to(self.positive_weights.device))
        super().start_epoch(context)

    def loss(self, logits: torch.Tensor, cluster_targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(logits.float(), cluster_targets,
                                                              pos_weight=self.positive_weights)


class PifaInitialisedRecaller(ClusterLinearRecaller):
    """A flat `cluster-linear` whose rows start where PECOS's PIFA puts labels (options.head_init=pifa): row l is
    the mean of the unit-length, centred representations of l's training documents under the encoder as training
    begins, as a unit vector (options.pifa_length=unit) or at that mean's own length (agreement), times
    pifa_scale (options.pifa_scale) / the representations' spread, and its bias the log-odds of l's prior, less the
    row's score of the mean representation. A label seen once then starts at its one document instead of at random.
    This happens once, when the first epoch begins; the buffer `initialised` travels with checkpoints, so neither a
    resumed run nor a later stage redoes it. With head_init=auto on a run with label clusters (one row per cluster,
    not per label) the rows stay random.

    logit_adjustment = tau > 0 (options.logit_adjustment): the recall loss reads logit_l + tau x log-odds_l, l's
    prior's log-odds, kept as the (L,) buffer `loss_offsets`; forward, and so prediction, returns logit_l alone.
    The bias then starts at (1 - tau) x log-odds_l, so the adjusted logits start where PIFA's do.

    hold_prior (options.hold_prior): logit_l = w_l . (x - centre) + held_bias_l. held_bias (L,) is (1 - tau) x
    log-odds_l, a buffer, not trained. In training the centre is the batch's mean (a batch of one document gives
    its rows no gradient); in prediction the buffer centre (D,), which starts at the PIFA pass's mean
    representation and moves CENTRE_MOMENTUM toward each training batch's mean. Without the option a rare label's
    many negatives pull its row against the mean representation, w_l . mean acts as a second bias, and training
    learns the prior's gap again, and more: on debian-debtags, -14.1 against -4.8 at the mean document for labels
    with 1-3 and >1,000 training documents, while the rows' cosine still ranks the rare labels' positives near the
    top (BENCHMARKS.md section 10).

    row_lr_documents = K > 0 (options.row_lr_documents): row l learns at head_lr x s_l, s_l = min(1, max(1, n_l) / K)
    for a label with n_l training documents. Adam's step does not grow with the gradient, so a per-row learning rate
    cannot come from scaling gradients; the row is kept as w_l / s_l in `linear.weight` and its score multiplied
    by s_l, the (L,) buffer `row_scales`, which makes Adam's step on w_l s_l times head_lr. AdamW's weight decay
    stays head_lr x weight_decay for every row. `rows()` gives the rows the scores use."""

    def __init__(self, in_dim: int, num_clusters: int, logit_adjustment: float = 0.0,
                 hold_prior: bool = False, row_lr_documents: int = 0,
                 pifa_scale: float = PIFA_SCALE.default, pifa_length: str = PIFA_LENGTH.default) -> None:
        super().__init__(in_dim, num_clusters, bias=not hold_prior)
        self.pifa_scale = pifa_scale
        self.pifa_length = pifa_length
        self.logit_adjustment = logit_adjustment
        self.hold_prior = hold_prior
        self.row_lr_documents = row_lr_documents
        self.register_buffer("initialised", torch.zeros((), dtype=torch.bool))
        if logit_adjustment > 0:   # only then: the checkpoints of runs without it keep their tensors
            self.register_buffer("loss_offsets", torch.zeros(num_clusters))
        if hold_prior:
            self.register_buffer("centre", torch.zeros(in_dim))
            self.register_buffer("held_bias", torch.zeros(num_clusters))
        if row_lr_documents > 0:
            self.register_buffer("row_scales", torch.ones(num_clusters))

    def rows(self) -> torch.Tensor:
        """(L, D) `linear.weight`, times `row_scales` under row_lr_documents."""
        if not self.row_lr_documents:
            return super().rows()
        return self.linear.weight * self.row_scales[:, None]

    def row_scores(self, representation: torch.Tensor) -> torch.Tensor:
        """(B, D) -> (B, L): each row's product with the representation, plus the trained bias if there is one."""
        if not self.row_lr_documents:
            return self.linear(representation)
        scores = nn.functional.linear(representation, self.linear.weight) * self.row_scales.to(representation.dtype)
        return scores if self.linear.bias is None else scores + self.linear.bias

    def logits(self, representation: torch.Tensor) -> torch.Tensor:
        """(B, D) -> (B, L) label logits, uncalibrated."""
        if not self.hold_prior:
            return self.row_scores(representation)
        if self.training and bool(self.initialised):
            # centred on the batch's own mean, with its gradient, as BatchNorm does in training: a shift of every
            # representation then changes no logit, so the encoder is not driven to move all documents away from
            # a running mean that lags behind them (which it was, with the loss rising through the first epoch)
            batch_mean = representation.mean(dim=0)
            with torch.no_grad():
                self.centre.lerp_(batch_mean.detach().to(self.centre.dtype), CENTRE_MOMENTUM)
            return self.row_scores(representation - batch_mean) + self.held_bias
        return self.row_scores(representation - self.centre.to(representation.dtype)) + self.held_bias

    def loss(self, logits: torch.Tensor, cluster_targets: torch.Tensor) -> torch.Tensor:
        if self.logit_adjustment > 0:
            logits = logits + self.loss_offsets
        return super().loss(logits, cluster_targets)

    def start_epoch(self, context: EpochContext) -> None:
        if not bool(self.initialised):
            if context.training_labels is not None and context.training_labels.shape[1] != self.num_clusters:
                self.initialised.fill_(True)   # head_init=auto on label clusters: rows stay random (check_* refuses pifa)
            else:
                self.initialise(context)
        super().start_epoch(context)

    @torch.no_grad()
    def initialise(self, context: EpochContext) -> None:
        if context.training_labels is None:
            raise XmcError("options.head_init=pifa needs the training documents' labels, which this trainer does not "
                           "hand to start_epoch (EpochContext.training_labels); drop the option")
        documents = context.document_embeddings().float()                                    # (N, D)
        labels = context.training_labels.tocsr().astype(np.float32)                          # (N, L)
        mean = documents.mean(dim=0)                                                         # (D,)
        centred = documents - mean
        lengths = centred.norm(dim=1, keepdim=True)
        unit = centred / lengths.clamp_min(1e-12)
        sums = torch.from_numpy(np.asarray(labels.T @ unit.numpy(), dtype=np.float32))       # (L, D)
        spread = torch.maximum(lengths.mean(), PIFA_MIN_SPREAD * documents.norm(dim=1).mean()).clamp_min(1e-12)
        counts = torch.from_numpy(np.asarray(labels.sum(axis=0), dtype=np.float32).ravel())   # (L,)
        directions = (nn.functional.normalize(sums, dim=1) if self.pifa_length == "unit"
                      else sums / counts.clamp_min(1.0)[:, None])                                # (L, D)
        rows = directions * (self.pifa_scale / spread)
        prior = (counts + 1.0) / (labels.shape[0] + 2.0)
        log_odds = torch.log(prior / (1 - prior))                                            # (L,)
        weight = self.linear.weight
        if self.row_lr_documents:
            scales = (counts.clamp_min(1.0) / self.row_lr_documents).clamp_max(1.0)                 # (L,)
            self.row_scales.copy_(scales.to(self.row_scales))
            weight.copy_((rows / scales[:, None]).to(weight))
        else:
            weight.copy_(rows.to(weight))
        if self.hold_prior:
            self.centre.copy_(mean.to(self.centre))
            self.held_bias.copy_(((1.0 - self.logit_adjustment) * log_odds).to(self.held_bias))
        else:
            self.linear.bias.copy_(((1.0 - self.logit_adjustment) * log_odds - rows @ mean).to(self.linear.bias))
        if self.logit_adjustment > 0:
            self.loss_offsets.copy_((self.logit_adjustment * log_odds).to(self.loss_offsets))
        self.initialised.fill_(True)


class PifaPropensityRecaller(PifaInitialisedRecaller, PropensityWeightedRecaller):
    """Both options: PIFA rows and propensity-weighted positives."""


def build_cluster_linear(config, in_dim: int, num_clusters: int) -> ClusterLinearRecaller:
    propensity = POSITIVE_WEIGHT.value_of(config) == "propensity"
    pifa = HEAD_INIT.value_of(config) in ("pifa", "auto")   # auto: whether the run is flat is known at start_epoch
    kind = {(False, False): ClusterLinearRecaller, (True, False): PropensityWeightedRecaller,
            (False, True): PifaInitialisedRecaller, (True, True): PifaPropensityRecaller}[propensity, pifa]
    recaller = (kind(in_dim, num_clusters, LOGIT_ADJUSTMENT.value_of(config), HOLD_PRIOR.value_of(config),
                     ROW_LR_DOCUMENTS.value_of(config), PIFA_SCALE.value_of(config), PIFA_LENGTH.value_of(config))
                if pifa else kind(in_dim, num_clusters))
    calibration = CALIBRATION.value_of(config)
    if calibration == "bins" or (calibration == "auto" and config.validation_size):
        recaller.add_calibration()   # auto on label clusters: finalize leaves the logits as they are
    return recaller


def check_cluster_linear(config, label_info: LabelInfo) -> None:
    """Refuses, before a run starts, propensity weights, PIFA rows and the options built on PIFA rows where a
    cluster holds several labels (one weight or one row would stand for labels of every frequency), and those
    options where the rows start at random."""
    flat = config.cluster_size == 1 or config.num_clusters == len(label_info.names)
    if POSITIVE_WEIGHT.value_of(config) == "propensity" and not flat:
        raise RefusedSetting("options.positive_weight=propensity weighs each label's positives, so it needs one label "
                             "per cluster (a flat run: --set cluster_size=1); drop it for a run with label clusters")
    needs_pifa_rows = {
        "options.logit_adjustment": (LOGIT_ADJUSTMENT.value_of(config) > 0,
                                     "offsets each label's logit by its prior and starts from PIFA rows"),
        "options.hold_prior": (HOLD_PRIOR.value_of(config),
                               "keeps each label's score at the mean document where the PIFA start puts it"),
        "options.row_lr_documents": (ROW_LR_DOCUMENTS.value_of(config) > 0,
                                     "sets each row's learning rate where the PIFA start sets the row"),
        "options.pifa_scale": (PIFA_SCALE.value_of(config) != PIFA_SCALE.default,
                               "sets the length of each PIFA row"),
        "options.pifa_length": (PIFA_LENGTH.value_of(config) != PIFA_LENGTH.default,
                                "sets the length of each PIFA row"),
    }
    for option, (is_set, why) in needs_pifa_rows.items():
        if is_set and (HEAD_INIT.value_of(config) == "random" or not flat):
            raise RefusedSetting(f"{option} {why}, so it needs a flat run (--set cluster_size=1) and head_init pifa "
                                 "or auto; drop it otherwise")
    if CALIBRATION.value_of(config) == "bins" and not flat:
        raise RefusedSetting("options.calibration=bins fits each bin of label frequencies on its labels' logits, so it "
                             "needs one label per cluster (a flat run: --set cluster_size=1); drop it for a run with "
                             "label clusters")
    if CALIBRATION.value_of(config) == "bins" and not config.validation_size:
        raise RefusedSetting(CALIBRATION_NEEDS_VALIDATION)
    if HEAD_INIT.value_of(config) == "pifa" and not flat:
        raise RefusedSetting("options.head_init=pifa starts each label's row at its documents, so it needs one label "
                             "per cluster (a flat run: --set cluster_size=1); drop it for a run with label clusters")
