"""The options LightXML's components declare, in a module of their own: the plugin registers them without
importing the components (torch), see plugin.py."""

from xmcbench.config import Option

POSITIVE_WEIGHT = Option("positive_weight", str, "none", "weight of a label's positives in the recall loss: none, or "
                         "propensity (its inverse propensity, 1/p_l of PSP@k: about 1 for the most frequent labels, "
                         "up to about 10 for labels seen once); propensity needs a flat run (one label per cluster)",
                         choices=("none", "propensity"))
HEAD_INIT = Option("head_init", str, "random", "how each label's row of a flat recaller starts: random (nn.Linear's "
                   "default); pifa: the mean of its training documents' representations under the pretrained "
                   "encoder (centred, unit length, as PECOS's PIFA), its bias at the label's log-odds prior, so a "
                   "label seen once starts at its one document (needs a flat run: one label per cluster); auto "
                   "(lightxml's default): pifa where the run is flat (one row per label), random otherwise",
                   choices=("random", "pifa", "auto"))
PIFA_SCALE = Option("pifa_scale", float, 5.0, "how many logits a PIFA row adds for a cosine of 1 with its label's "
                    "documents (the centred representations divided by their mean length): a label seen once starts "
                    "about this far above its prior on its own document. Smaller starts rare labels closer to their "
                    "prior, 0 starts every row at zero and every label at its prior. Needs PIFA rows (head_init pifa, "
                    "or auto on a flat run)", minimum=0.0)
PIFA_LENGTH = Option("pifa_length", str, "unit", "the length of each PIFA row before options.pifa_scale: unit (every "
                     "row the same: the direction of its documents' mean); agreement (the length of the mean of its "
                     "documents' unit vectors: 1 for a label seen once, near 0 for a label whose many documents "
                     "point every way, so a frequent label starts with little of a direction that barely tells its "
                     "documents apart). Needs PIFA rows (head_init pifa, or auto on a flat run)",
                     choices=("unit", "agreement"))
LOGIT_ADJUSTMENT = Option("logit_adjustment", float, 0.0, "tau of the logit-adjusted recall loss (Menon et al., ICLR "
                          "2021): training reads each label's logit plus tau x the log-odds of its prior, prediction "
                          "the logit alone, so a rare label's row learns to score as if the labels were balanced to "
                          "the power tau (0: the plain loss; 1: fully balanced). The PIFA start's bias keeps (1 - tau) "
                          "of the log-odds, so the adjusted loss starts where PIFA does. Needs PIFA rows "
                          "(head_init pifa, or auto on a flat run)", minimum=0.0, maximum=1.0)
HOLD_PRIOR = Option("hold_prior", bool, False, "keep each label's score at the mean document where the PIFA start puts "
                    "it, (1 - logit_adjustment) x the log-odds of its prior: the flat recaller scores the "
                    "representation less the mean representation (a training batch's own; in prediction a running "
                    "mean of the training batches), and its bias is not trained, so training moves only the rows' "
                    "direction and length and cannot learn the prior again through them. Needs PIFA rows "
                    "(head_init pifa, or auto on a flat run)")
ROW_LR_DOCUMENTS = Option("row_lr_documents", int, 0, "K > 0: each row of a flat recaller learns at head_lr x "
                          "min(1, its label's training documents / K), so a label seen once learns K times slower "
                          "than one with K documents or more. Adam moves every row about head_lr a step whatever the "
                          "size of its gradient, so a rare label's row, which its many negatives alone push, can lose "
                          "its PIFA start within an epoch. 0: every row learns at head_lr. Needs PIFA rows (head_init "
                          "pifa, or auto on a flat run)", minimum=0)
CALIBRATION = Option("calibration", str, "none", "how a flat recaller's label logits are put on one scale before "
                     "they are ranked: none; bins: once training ends (and before each validation), a Platt fit "
                     "sigmoid(a z + c) per bin of training documents on the validation rows (xmcbench.calibration), "
                     "so a bin of frequent labels the model is over-confident on and one of rare labels it is timid "
                     "on rank by their probability of being relevant. Needs a flat run and a validation split; "
                     "auto: bins where the run has both, none otherwise",
                     choices=("none", "bins", "auto"))
LEXICAL_BUCKETS = Option("lexical_buckets", int, 0, "F > 0: the encoder appends to its [CLS] states a bag of the "
                         "window's word pieces, 1 + log(count) of each piece's id modulo F (special tokens left out), "
                         "so the heads read the words themselves beside the transformer's summary of them, as a linear "
                         "method does (XR-Transformer concatenates TF-IDF and neural features the same way); the "
                         "representation grows by F, and so does every head row: with 20,813 labels a CPU trains 2.8 "
                         "times slower and holds 7 GB at F = 4,096, 5.6 times and 18 GB at 16,384; at 8,192 over a "
                         "512-token window, 1.3 to 1.4 times the 4,096 run's time and 12 GB (BENCHMARKS.md "
                         "section 10). 0: the [CLS] states alone; lightxml derives 8,192 for a flat run on a "
                         "dataset it has no preset for (rule version 7; 4,096 under version 6)",
                         minimum=0)
LEXICAL_WINDOW = Option("lexical_window", int, 0, "W > max_length: the bag of word pieces (options.lexical_buckets) "
                        "reads the first W word pieces of each document while the transformer still reads max_length, "
                        "so a text longer than the transformer's window still gives the heads all of its words, as a "
                        "linear method reads them; documents are tokenized to W and cut to max_length (ended as the "
                        "tokenizer ends a text it truncates) before the transformer. The bag costs little per token, "
                        "the transformer pays for every one. 0 (or at most max_length): the bag reads the "
                        "transformer's window; lightxml derives 512 (or the encoder's limit) where its bag is "
                        "derived and max_length is shorter (rule version 7). Needs options.lexical_buckets > 0 and a "
                        "tokenizer that pads and truncates on the right",
                        minimum=0)
LEXICAL_NORM = Option("lexical_norm", float, 0.0, "N > 0: each document's bag of word pieces (options.lexical_buckets) "
                      "is scaled to Euclidean length N, as a linear method makes each document's TF-IDF row unit "
                      "length, so a long text's words weigh no more in the heads than a short one's; N sets the bag's "
                      "weight beside the [CLS] states (on debian-builddeps the raw bag of a 128-token window has a "
                      "median length of 12, the centred [CLS] states of all-MiniLM-L6-v2 about 4: "
                      "benchmarks/bag_lengths.py). 0: the raw bag, whose length grows with the text; lightxml "
                      "derives 4 where its bag is derived (rule version 7). Needs options.lexical_buckets > 0",
                      minimum=0.0)
ENCODER_OPTIONS = (LEXICAL_BUCKETS, LEXICAL_WINDOW, LEXICAL_NORM)
RECALLER_OPTIONS = (POSITIVE_WEIGHT, HEAD_INIT, PIFA_SCALE, PIFA_LENGTH, LOGIT_ADJUSTMENT, HOLD_PRIOR, ROW_LR_DOCUMENTS,
                    CALIBRATION)
