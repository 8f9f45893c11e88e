"""What every algorithm option means and which values it takes.

One table for all algorithms: an option means the same wherever it appears (``local_lr`` is the
device's learning rate in each), so it is written once. The job spec checks each option's range
at ``tally job validate`` and at submit, naming the option (a device never sees a value the
coordinator would refuse), and ``docs/job-spec.md`` shows the meaning and the range beside the
type. A test keeps every option of every algorithm in this table. Choices among words (a solver,
a CDF) and relations between options are the algorithm's own checks, reported as ``options: ...``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    meaning: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def bounds(self) -> dict[str, float]:
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le), ("lt", self.lt)) if v is not None}


_FRACTION_BITS = 48  # fixed-point fraction bits: beyond this the 64-bit ring has no room for the sum

OPTIONS: dict[str, Option] = {
    # Local training and the server step, shared by most algorithms.
    "local_epochs": Option("passes over the device's own data per round", ge=1),
    "local_lr": Option("the device's learning rate", gt=0),
    "batch_size": Option("examples per local step", ge=1),
    "server_lr": Option("the server's step along the averaged update (1: plain averaging)", gt=0),
    "momentum": Option("momentum of the optimizer it applies to (0: none)", ge=0, lt=1),
    "lr_decay": Option("factor applied to the learning rate as rounds pass (1: constant)", gt=0, le=1),
    "weight_decay": Option("L2 penalty on the device's weights", ge=0),
    # The codec: what a device's contribution is clipped to and how finely it is encoded.
    "delta_clip": Option("bound on each value of a device's update; larger values are clipped (and counted)", gt=0),
    "frac_bits": Option("fraction bits of the fixed-point encoding of real values", ge=1, le=_FRACTION_BITS),
    "example_cap": Option("a device's examples count up to this many in its weight", ge=1),
    "loss_clip": Option("bound on a device's reported loss", gt=0),
    # AgnosticFedAvg.
    "domains": Option("number of domains whose worst mixture is optimised", ge=1),
    "domain_lr": Option("step of the domain weights (gamma_lambda)", gt=0),
    "window": Option("rounds of domain counts averaged into the weights (r)", ge=1),
    "initial_weights": Option("starting domain weights (lambda_0; default uniform)"),
    "initial_counts": Option("starting domain counts (N_0; default ones)"),
    "server_optimizer": Option("the server's optimizer: sgd or adam"),
    "nesterov": Option("Nesterov momentum for the server's sgd"),
    "adam_beta1": Option("the server's adam first-moment decay", ge=0, lt=1),
    "adam_beta2": Option("the server's adam second-moment decay", ge=0, lt=1),
    "adam_eps": Option("the server's adam denominator guard", gt=0),
    "loss_frac_bits": Option("fraction bits of the per-domain loss sums", ge=1, le=_FRACTION_BITS),
    "count_clip": Option("bound on a device's per-domain example count", ge=1),
    # AAggFF.
    "num_clients": Option("K, the whole population the fairness weights range over (required)", ge=2),
    "lr_decay_every": Option("rounds between decays of the device's learning rate by lr_decay (0: never)", ge=0),
    "cdf": Option("the CDF that maps a device's loss ratio to its response"),
    "c1": Option("lower end of a device's response range"),
    "c2": Option("upper end of a device's response range (default: the sampling rate C)"),
    "weight_clip": Option("bound on a device's fairness weight (its update is weighted by it)", gt=0),
    "code_deviations": Option("named departures from the paper that the authors' code makes, to reproduce it"),
    "cohort_size": Option("floor(C K), the devices sampled per round (default K: full participation)", ge=1),
    "solver": Option("the online solver: ons or separable"),
    # FedDAR.
    "head_solver": Option("how a device fits its domain heads: sgd (epochs) or newton (iterations)"),
    "head_start": Option("where head fitting starts: global (last round's heads) or zero"),
    "head_epochs": Option("epochs (sgd) or iterations (newton) of head fitting", ge=1),
    "head_lr": Option("the head fitting's learning rate", gt=0),
    "encoder_epochs": Option("passes of encoder training per round", ge=1),
    "encoder_lr": Option("the encoder's learning rate", gt=0),
    "projection": Option("encoder output width the heads must take (0: not checked)", ge=0),
    "head_clip": Option("bound on each weighted head value a device sends", gt=0),
    "max_examples": Option("most examples a device may count", ge=1),
    "hessian_at": Option("where a head's Hessian is taken: local (the device's fitted head) or global"),
    "damping": Option("ridge added to the head systems, relative to their trace", ge=0),
    "max_condition": Option("worst condition number of a head system solved as is; beyond it damping grows", gt=1),
    "hessian_clip": Option("bound on each weighted Hessian entry a device sends", gt=0),
    # LG-FedAvg.
    "global_patterns": Option("parameter-name patterns of the shared (global) layers; the rest stay local"),
    "warmup_rounds": Option("rounds of plain FedAvg over the whole model before the split", ge=0),
    # SuPerFed.
    "mixing": Option("how the personal and federated models mix: model or layer"),
    "start_round": Option("L: rounds of FedProx, the personal model frozen, before mixing starts", ge=0),
    "mu": Option("weight of the proximity regulariser", ge=0),
    "nu": Option("weight of the connectivity (low-loss subspace) regulariser", ge=0),
    "prox_form": Option("the proximity term: thesis (whole model) or code (per layer)"),
    "mix_biases": Option("biases get a personal twin too (false: weights only, as the authors' code)"),
    # FedEvg.
    "classes": Option("classes of the energy model (L)", ge=1),
    "inputs": Option("input features of the energy model (D)", ge=1),
    "per_class": Option("synthetic samples per class the server keeps", ge=1),
    "step_start": Option("the server's SGLD step at the first round", gt=0),
    "step_end": Option("the server's SGLD step after schedule_rounds", gt=0),
    "schedule_rounds": Option("rounds over which the SGLD step decays", ge=1),
    "noise": Option("the server's SGLD noise", ge=0),
    "input_range": Option("[low, high] the synthetic inputs are clipped to (none: unclipped)"),
    "local_iterations": Option("local steps per round", ge=1),
    "sgld_step": Option("the device's SGLD step", gt=0),
    "sgld_noise": Option("the device's SGLD noise", ge=0),
    "synthetic_weight": Option("weight of the synthetic samples' energy term (lambda)", ge=0),
    "persistent_model": Option("keep the energy model across rounds (false: re-initialise, as the code)"),
    "gradient_clip": Option("bound on each uploaded energy gradient value", gt=0),
    "weighting": Option("how samples are weighted: sign or exact"),
    "logit_clamp": Option("bound on the logit before exp() (exact weighting only)", gt=0),
    "seed": Option("seed of the server's synthetic samples", ge=0),
}
