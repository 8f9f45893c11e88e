"""FedDAR-WA and FedDAR-SA: the spec's test oracles (specs/feddar.md section 8), the synthetic
end-to-end result through real secure sums, the payload sizes and the privacy rule."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tally.algorithms.base import flatten
from tally.algorithms.fedavg import FedAvgClient, FedAvgOptions, FedAvgServer
from tally.algorithms.feddar import (
    DOMAIN_WEIGHTS,
    ENCODER,
    HEADS,
    FedDARClient,
    FedDAROptions,
    FedDARSAOptions,
    FedDARSAServer,
    FedDARWAServer,
    SingularHeadSystem,
    domain_weights,
)
from tally.codec import packed_size, wire_width
from tally.datasets.domain_linear import domain_linear, federation, subspace_distance
from tally.models.domain import linear_encoder, mlp_encoder
from tally.secagg import ThreatModel
from tally.sim.rounds import SecureSum, plain_sum, run_rounds
from tally.training.domain import DomainTrainer, initial_params

CPU = torch.device("cpu")
EXACT = {"head_solver": "newton", "head_epochs": 1, "damping": 0.0}
fast = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


pytestmark = pytest.mark.usefixtures("one_thread")


def _devices(splits, domains, loss="squared", outputs=1, dim=None, rank=2):
    dim = dim or splits[0][0].shape[1]
    factory = lambda: linear_encoder(dim, rank, seed=0)  # noqa: E731
    devices = [DomainTrainer(factory, x, y, z, domains, loss, outputs, seed=i, device=CPU)
               for i, (x, y, z) in enumerate(splits)]
    return devices, factory


def _random_splits(rng, sizes, domains, dim, classes=None):
    out = []
    for n in sizes:
        x = rng.standard_normal((n, dim))
        z = rng.integers(0, domains, n)
        y = rng.integers(0, classes, n) if classes else rng.standard_normal(n)
        out.append((x, y, z))
    return out


def _features(params, x):
    """φ(x) with the bias feature, computed here independently of the device."""
    f = x @ params["encoder.weight"].T
    return np.hstack([f, np.ones((len(x), 1))])


def _head_round(server, client, devices, params, sum_fn=plain_sum):
    """One heads step by hand: broadcast, contributions, one sum, apply."""
    state = server.init(params)
    step = server.steps(state)[0]
    broadcast = server.broadcast(state, HEADS)
    contributions = {i: client.contribute(HEADS, broadcast, d, None)[0] for i, d in enumerate(devices)}
    total, _ = sum_fn(0, step, contributions)
    return server.apply(state, HEADS, total), contributions


def _pooled(splits, domain):
    x = np.vstack([s[0][s[2] == domain] for s in splits])
    y = np.concatenate([s[1][s[2] == domain] for s in splits])
    return x, y


# -- oracle 1 and 2: SA on squared loss is pooled least squares ----------------------------------


@fast
@given(seed=st.integers(0, 2**16), sizes=st.lists(st.integers(1, 6), min_size=3, max_size=8),
       start=st.sampled_from(["zero", "global"]))
def test_sa_equals_pooled_least_squares(seed, sizes, start):
    """Oracle 1: any local minimisers (min-norm from scratch, or a Newton step from the global
    head), even from a single example, give exactly the pooled least-squares head."""
    rng = np.random.default_rng(seed)
    splits = _random_splits(rng, sizes, 2, 5)
    for m in range(2):
        x, _ = _pooled(splits, m)
        assume(len(x) >= 5)
    devices, factory = _devices(splits, 2)
    params = initial_params(factory(), 2, 1, seed=seed)
    opts = FedDARSAOptions(**EXACT, head_start=start)
    state, _ = _head_round(FedDARSAServer(opts), FedDARClient(opts), devices, params)
    assert state.wa_fallbacks == 0
    for m in range(2):
        x, y = _pooled(splits, m)
        expected = np.linalg.lstsq(_features(params, x), y, rcond=None)[0]
        np.testing.assert_allclose(state.params[HEADS][m, 0], expected, atol=1e-9)


def test_wa_is_not_least_squares_and_algorithm2_statistics_agree():
    """Oracle 1's contrast (WA of scratch heads is off by O(0.1)) and oracle 2: per device
    c·H·w = c·Z^T y / L at a local optimum, so (Σ A)^{-1} Σ a with A = Z^T Z, a = Z^T y is SA."""
    rng = np.random.default_rng(3)
    splits = _random_splits(rng, [3, 2, 4, 3, 2, 5], 2, 5)
    devices, factory = _devices(splits, 2)
    params = initial_params(factory(), 2, 1, seed=1)
    sa_cfg = FedDARSAOptions(**EXACT, head_start="zero")
    sa, contributions = _head_round(FedDARSAServer(sa_cfg), FedDARClient(sa_cfg), devices, params)
    wa_cfg = FedDAROptions(head_solver="newton", head_epochs=1, head_start="zero")
    wa, _ = _head_round(FedDARWAServer(wa_cfg), FedDARClient(wa_cfg), devices, params)
    for m in range(2):
        stats_a, stats_b = np.zeros((3, 3)), np.zeros(3)
        for i, (x, y, z) in enumerate(splits):
            f = _features(params, x[z == m])
            stats_a += f.T @ f
            stats_b += f.T @ y[z == m]
            if len(f):
                weight = contributions[i]["weights"][m]
                np.testing.assert_allclose(contributions[i]["hessian_heads"][m], weight * f.T @ y[z == m] / len(f),
                                           atol=1e-10)
        np.testing.assert_allclose(sa.params[HEADS][m, 0], np.linalg.solve(stats_a, stats_b), atol=1e-10)
    assert np.abs(wa.params[HEADS] - sa.params[HEADS]).max() > 0.05


# -- oracle 3: SA is one global Newton step ----------------------------------------------------


def test_sa_with_global_hessians_is_the_pooled_newton_step():
    rng = np.random.default_rng(7)
    splits = _random_splits(rng, [12, 7, 20, 9, 15], 3, 6, classes=2)
    devices, factory = _devices(splits, 3, loss="logistic")
    params = initial_params(factory(), 3, 1, scale=0.5, seed=2)
    opts = FedDARSAOptions(**EXACT, hessian_at="global")
    state, _ = _head_round(FedDARSAServer(opts), FedDARClient(opts), devices, params)
    for m in range(3):
        x, y = _pooled(splits, m)
        f = _features(params, x)
        w = params[HEADS][m, 0]
        mu = 1 / (1 + np.exp(-f @ w))
        grad = f.T @ (mu - y) / len(y)
        hessian = f.T @ (f * (mu * (1 - mu))[:, None]) / len(y)
        np.testing.assert_allclose(state.params[HEADS][m, 0], w - np.linalg.solve(hessian, grad), atol=1e-10)


# -- oracles 4 and 5: SA against WA, and how Hessian scale matters ------------------------------


def _one_domain_total(heads, hessians, counts):
    """The head step's sum for one domain from per-device heads (n, P) and Hessians (n, P, P)."""
    weights = counts / 1000.0
    return {
        "counts": np.array([counts.sum()]),
        "weights": np.array([weights.sum()]),
        "weighted_heads": (weights[:, None] * heads).sum(0)[None],
        "hessians": sum(w * h[np.triu_indices(h.shape[0])] for w, h in zip(weights, hessians))[None],
        "hessian_heads": sum(w * h @ v for w, h, v in zip(weights, hessians, heads))[None],
    }


def _aggregate(server, total, previous):
    params = {"encoder.weight": np.zeros((1, 1)), HEADS: previous.reshape(1, 1, -1)}
    return server.apply(server.init(params), HEADS, total).params[HEADS][0, 0]


def _sa_and_wa_from(heads, hessians, counts):
    total = _one_domain_total(heads, hessians, counts)
    previous = np.zeros(heads.shape[1])
    return [_aggregate(s, total, previous) for s in (FedDARSAServer(FedDARSAOptions(damping=0.0)), FedDARWAServer())]


@fast
@given(seed=st.integers(0, 2**16), clients=st.integers(2, 6), size=st.integers(1, 4),
       scale=st.floats(0.01, 100.0))
def test_sa_reduces_to_wa_for_equal_or_isotropic_hessians(seed, clients, size, scale):
    """Oracle 4."""
    rng = np.random.default_rng(seed)
    heads = rng.standard_normal((clients, size))
    counts = rng.integers(1, 50, clients).astype(float)
    a = rng.standard_normal((size, size))
    common = a @ a.T + np.eye(size)
    for hessians in (np.repeat(common[None], clients, 0), scale * np.repeat(np.eye(size)[None], clients, 0)):
        sa, wa = _sa_and_wa_from(heads, hessians, counts)
        np.testing.assert_allclose(sa, wa, atol=1e-8)


@fast
@given(seed=st.integers(0, 2**16), factor=st.floats(0.1, 10.0))
def test_sa_is_invariant_to_a_common_hessian_scale_only(seed, factor):
    """Oracle 5: catches X^T X versus X^T X / L (a per-client scale changes the answer)."""
    assume(abs(factor - 1) > 0.05)
    rng = np.random.default_rng(seed)
    heads = rng.standard_normal((4, 3))
    counts = rng.integers(1, 50, 4).astype(float)
    hessians = np.stack([(lambda a: a @ a.T + 0.1 * np.eye(3))(rng.standard_normal((3, 3))) for _ in range(4)])
    base, _ = _sa_and_wa_from(heads, hessians, counts)
    common, _ = _sa_and_wa_from(heads, factor * hessians, counts)
    np.testing.assert_allclose(common, base, atol=1e-8)
    one = hessians.copy()
    one[0] *= factor
    assert np.abs(_sa_and_wa_from(heads, one, counts)[0] - base).max() > 1e-6


def test_damping_pulls_toward_the_previous_head_and_keeps_the_fixed_point():
    """(S + λI) h = b + λ h_prev with λ = damping·trace(S)/P: no pull at S h = b, all pull as λ grows."""
    rng = np.random.default_rng(2)
    heads = rng.standard_normal((5, 3))
    counts = rng.integers(1, 30, 5).astype(float)
    hessians = np.stack([(lambda a: a @ a.T)(rng.standard_normal((3, 2))) for _ in range(5)])  # rank 2 each
    total = _one_domain_total(heads, hessians, counts)
    system, rhs = np.zeros((3, 3)), total["hessian_heads"][0]
    system[np.triu_indices(3)] = total["hessians"][0]
    system = system + np.triu(system, 1).T
    previous = rng.standard_normal(3)
    damped = _aggregate(FedDARSAServer(FedDARSAOptions(damping=0.3)), total, previous)
    lam = 0.3 * np.trace(system) / 3
    np.testing.assert_allclose(damped, np.linalg.solve(system + lam * np.eye(3), rhs + lam * previous), atol=1e-12)
    exact = np.linalg.solve(system, rhs)
    kept = _aggregate(FedDARSAServer(FedDARSAOptions(damping=0.3)), total, exact)
    np.testing.assert_allclose(kept, exact, atol=1e-10)
    np.testing.assert_allclose(_aggregate(FedDARSAServer(FedDARSAOptions(damping=1e9)), total, previous), previous,
                               atol=1e-6)


# -- oracle 6: sample re-weighting makes every domain weigh the same -----------------------------


@fast
@given(seed=st.integers(0, 2**16), clients=st.integers(1, 8), domains=st.integers(1, 5))
def test_reweighting_identity(seed, clients, domains):
    """Σ_i (L_i/L) Σ_m (L_im/L_i) u_m R_im = (1/M) Σ_m Σ_i (L_im/L_m) R_im for the u_m the server
    derives from summed counts (M = domains present)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 5, (clients, domains))
    assume(counts.sum() > 0)
    risks = rng.random((clients, domains))
    u = domain_weights(counts.sum(0))
    total = counts.sum()
    lhs = sum((counts[i].sum() / total) * sum(counts[i, m] / counts[i].sum() * u[m] * risks[i, m]
                                             for m in range(domains))
              for i in range(clients) if counts[i].sum())
    present = np.flatnonzero(counts.sum(0))
    rhs = np.mean([sum(counts[i, m] / counts[:, m].sum() * risks[i, m] for i in range(clients)) for m in present])
    assert lhs == pytest.approx(rhs, rel=1e-12)


def test_devices_minimise_the_domain_balanced_objective():
    """The same identity on the devices: the L_i/L-weighted mean of their re-weighted losses, with
    the u_m broadcast after the heads sum, is the mean over domains of the pooled domain loss."""
    rng = np.random.default_rng(11)
    splits = _random_splits(rng, [30, 4, 12, 25], 3, 5)
    splits[1] = (splits[1][0], splits[1][1], np.zeros(4, dtype=int))  # a rare domain mix
    devices, factory = _devices(splits, 3)
    params = initial_params(factory(), 3, 1, seed=5)
    server, client = FedDARWAServer(), FedDARClient()
    state, _ = _head_round(server, client, devices, params)
    broadcast = server.broadcast(state, ENCODER)
    model = {k: v for k, v in broadcast.items() if k != DOMAIN_WEIGHTS}
    sizes = np.array([d.num_examples for d in devices])
    client_losses = [d.train_encoder(model, broadcast[DOMAIN_WEIGHTS], 1, 0.0, 1000)[1] for d in devices]
    evals = [d.evaluate_domains(model) for d in devices]
    per_domain = sum(e.loss_sum for e in evals) / sum(e.count for e in evals)
    assert sizes @ client_losses / sizes.sum() == pytest.approx(per_domain.mean(), rel=1e-10)
    assert not np.isclose(sizes @ client_losses / sizes.sum(), sum(e.loss_sum.sum() for e in evals) / sizes.sum())


# -- oracle 7: softmax Hessians are singular; SA needs damping -----------------------------------


def test_softmax_hessian_null_space_and_damping():
    rng = np.random.default_rng(5)
    k, classes = 4, 3
    splits = _random_splits(rng, [40, 35, 50], 2, 8, classes=classes)
    devices, factory = _devices(splits, 2, loss="softmax", outputs=classes, rank=k)
    params = initial_params(factory(), 2, classes, scale=0.3, seed=0)
    _, hessians = devices[0].head_derivatives(params)
    h = hessians[0]
    features = k + 1
    v = rng.standard_normal(features)
    np.testing.assert_allclose(h @ np.tile(v, classes), 0.0, atol=1e-12)  # H (1_N ⊗ v) = 0
    assert np.linalg.matrix_rank(h) == classes * features - features
    undamped = FedDARSAOptions(head_solver="sgd", head_epochs=2, head_lr=0.5, damping=0.0)
    with pytest.warns(SingularHeadSystem):
        state, _ = _head_round(FedDARSAServer(undamped), FedDARClient(undamped), devices, params)
    assert state.wa_fallbacks == 2
    damped = FedDARSAOptions(head_solver="sgd", head_epochs=2, head_lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SingularHeadSystem)
        state, _ = _head_round(FedDARSAServer(damped), FedDARClient(damped), devices, params)
    assert state.wa_fallbacks == 0
    before = sum(d.evaluate(params)[0] for d in devices)
    assert sum(d.evaluate(state.params)[0] for d in devices) < before


# -- oracle 8: SA from the two sums equals SA from individual uploads ----------------------------


def test_sa_from_secure_sums_equals_sa_from_individual_uploads():
    rng = np.random.default_rng(9)
    splits = _random_splits(rng, [15, 9, 22, 6, 18, 11], 3, 6, classes=2)
    splits.append((rng.standard_normal((8, 6)), rng.integers(0, 2, 8), np.zeros(8, dtype=int)))  # only domain 0

    def fresh(part=splits):  # same seeds, so the same SGD order in every run
        return _devices(part, 3, loss="logistic")[0]

    params = initial_params(linear_encoder(6, 2, seed=0), 3, 1, scale=0.5, seed=4)
    opts = FedDARSAOptions(head_solver="sgd", head_epochs=3, head_lr=0.5, damping=0.0)
    plain, _ = _head_round(FedDARSAServer(opts), FedDARClient(opts), fresh(), params)
    secure, _ = _head_round(FedDARSAServer(opts), FedDARClient(opts), fresh(), params,
                            SecureSum(ThreatModel(0.0, 0.0, malicious_server=False)))
    # Per-device uploads, as the paper sends them: local heads and Hessians, then Eq. 8.
    devices = fresh()
    local_heads = [d.train_heads(params, 3, 0.5, opts.batch_size) for d in devices]
    hessians = [d.head_derivatives({**params, HEADS: w})[1] for d, w in zip(devices, local_heads)]
    for m in range(3):
        counts = [d.domain_counts()[m] for d in devices]
        system = sum(c * h[m] for c, h in zip(counts, hessians))
        rhs = sum(c * h[m] @ w[m].ravel() for c, h, w in zip(counts, hessians, local_heads))
        expected = np.linalg.solve(system, rhs)
        np.testing.assert_allclose(plain.params[HEADS][m].ravel(), expected, atol=1e-10)
        np.testing.assert_allclose(secure.params[HEADS][m].ravel(), expected, atol=1e-4)
    assert np.abs(secure.params[HEADS] - plain.params[HEADS]).max() > 0  # it really went through the codec
    # A device without domain m leaves head m unchanged; the last device holds only domain 0.
    without, _ = _head_round(FedDARSAServer(opts), FedDARClient(opts), fresh(splits[:-1]), params)
    np.testing.assert_array_equal(without.params[HEADS][1:], plain.params[HEADS][1:])
    assert np.abs(without.params[HEADS][0] - plain.params[HEADS][0]).max() > 1e-6


# -- oracle 9: the synthetic experiment, through real secure sums --------------------------------

SYNTHETIC = {"head_solver": "newton", "head_epochs": 1, "head_start": "zero",
             "encoder_epochs": 5, "encoder_lr": 0.5, "batch_size": 1000}
ROUNDS = 30


@pytest.mark.full
def test_feddar_sa_reaches_the_noise_floor_where_fedavg_cannot():
    """d = 20, k = 2, M = 5, n = 100, L = 20, σ = 1e-3, masking on: SA ½MSE <= 1e-6 with
    dist(B, B*) < 1e-3, FedAvg (same data, rounds and local work) >= 1e-2."""
    data = domain_linear(clients=100, samples=20, seed=0)
    masked = SecureSum(ThreatModel(0.0, 0.0, malicious_server=False), seed=0)
    sa = federation(data, heads=5)
    opts = FedDARSAOptions(**SYNTHETIC)
    state, logs = run_rounds(FedDARSAServer(opts), FedDARClient(opts), sa.devices, sa.initial, ROUNDS, 100, masked)
    assert all(len(c) == 100 for log in logs for c in log.contributors.values())
    sa_metrics = sa.final_metrics(state.params)
    avg = federation(data, heads=1)
    fedavg_cfg = FedAvgOptions(local_epochs=5, local_lr=0.5, batch_size=1000)
    fedavg_state, _ = run_rounds(FedAvgServer(fedavg_cfg), FedAvgClient(fedavg_cfg), avg.devices, avg.initial,
                                 ROUNDS, 100, masked)
    fedavg_metrics = avg.final_metrics(fedavg_state.params)
    print(f"\nFedDAR-SA ½MSE {sa_metrics['test_loss']:.3g} dist {sa_metrics['subspace_distance']:.3g}; "
          f"FedAvg ½MSE {fedavg_metrics['test_loss']:.3g}")
    assert sa_metrics["test_loss"] <= 1e-6 and sa_metrics["worst_domain_loss"] <= 1e-5
    assert sa_metrics["subspace_distance"] < 1e-3
    assert fedavg_metrics["test_loss"] >= 1e-2
    assert fedavg_metrics["test_loss"] / sa_metrics["test_loss"] >= 1e4


def test_wa_with_scratch_heads_stalls_at_five_samples():
    """Oracle 9's last point: WA of min-norm local heads does not converge at L = 5."""
    data = domain_linear(clients=100, samples=5, seed=0)
    fed = federation(data, heads=5)
    opts = FedDAROptions(**SYNTHETIC)
    state, _ = run_rounds(FedDARWAServer(opts), FedDARClient(opts), fed.devices, fed.initial, ROUNDS, 100, plain_sum)
    loss = fed.evaluate(state.params)[0]
    print(f"\nFedDAR-WA (scratch heads, L = 5) ½MSE {loss:.3g}")
    assert loss >= 1e-6


def test_default_options_learn_a_concept_shift_that_one_model_cannot():
    """Softmax heads with the default (Algorithm 1) options, a projection to k = 4 and damped SA,
    through masked sums: each domain relabels the same clusters, so per-domain heads reach ~100 %
    while FedAvg's single head cannot beat the labels the domains share."""
    rng = np.random.default_rng(0)
    domains, classes, dim = 3, 4, 10
    centres = 2.0 * rng.standard_normal((classes, dim))
    relabel = np.stack([np.arange(classes), np.roll(np.arange(classes), 1), rng.permutation(classes)])

    def split(n, mixture):
        z, c = rng.choice(domains, n, p=mixture), rng.integers(0, classes, n)
        return centres[c] + 0.5 * rng.standard_normal((n, dim)), relabel[z, c], z

    train = [split(40, p) for p in rng.dirichlet(np.full(domains, 0.5), 10)]
    test_x, test_y, test_z = split(600, np.full(domains, 1 / domains))
    factory = lambda: mlp_encoder(dim, 32, projection=4, seed=0)  # noqa: E731
    test = DomainTrainer(factory, test_x, test_y, test_z, domains, "softmax", classes, device=CPU)
    masked = SecureSum(ThreatModel(0.0, 0.0, malicious_server=False), seed=0)
    accuracy = {}
    for name, heads in (("sa", domains), ("fedavg", 1)):
        devices = [DomainTrainer(factory, *split_, domains, "softmax", classes, seed=i, device=CPU)
                   for i, split_ in enumerate(train)]
        if name == "sa":
            opts = FedDARSAOptions(projection=4)
            server, client = FedDARSAServer(opts), FedDARClient(opts)
        else:
            opts = FedAvgOptions(local_epochs=1, local_lr=0.1, batch_size=32)
            server, client = FedAvgServer(opts), FedAvgClient(opts)
        initial = initial_params(factory(), heads, classes, scale=0.1)
        state, _ = run_rounds(server, client, devices, initial, 8, 10, masked)
        accuracy[name] = test.evaluate(server.model(state))[1]
    print(f"\nconcept shift: FedDAR-SA accuracy {accuracy['sa']:.3f}, FedAvg {accuracy['fedavg']:.3f}")
    assert accuracy["sa"] >= 0.95 and accuracy["fedavg"] <= 0.6


# -- the privacy rule ------------------------------------------------------------------------------


class _RecordingServer:
    """The server half as the simulator sees it, recording what crosses into it and out of it."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.totals, self.broadcasts = [], []

    def init(self, params):
        return self.inner.init(params)

    def steps(self, state):
        return self.inner.steps(state)

    def broadcast(self, state, step):
        out = self.inner.broadcast(state, step)
        self.broadcasts.append((step, out))
        return out

    def apply(self, state, step, total):
        self.totals.append((step, {k: np.array(v) for k, v in total.items()}))
        return self.inner.apply(state, step, total)

    def model(self, state):
        return self.inner.model(state)


class _RecordingClient:
    def __init__(self, inner, devices):
        self.inner, self.devices, self.sent = inner, devices, []

    def contribute(self, step, broadcast, device, local_state):
        payload, local_state = self.inner.contribute(step, broadcast, device, local_state)
        self.sent.append((step, self.devices.index(device), payload))
        return payload, local_state


@pytest.mark.parametrize("variant", ["wa", "sa"])
def test_server_half_receives_only_sums(variant):
    """With masking and dropouts: every total the server half gets is the sum over that step's
    contributors (exact for counts, within the codec's bound for reals); the broadcasts carry only
    the model and u_m, which is a function of summed counts; and the result does not depend on
    which device is which."""
    data = domain_linear(clients=12, samples=10, seed=3)
    opts = (FedDARSAOptions if variant == "sa" else FedDAROptions)(head_solver="newton", encoder_lr=0.1)
    server_type = FedDARSAServer if variant == "sa" else FedDARWAServer
    fed = federation(data, heads=5)
    server = _RecordingServer(server_type(opts))
    client = _RecordingClient(FedDARClient(opts), fed.devices)
    masked = SecureSum(ThreatModel(0.2, 0.0, malicious_server=False), dropout=0.2, seed=1)
    _, logs = run_rounds(server, client, fed.devices, fed.initial, 3, 12, masked)
    assert len(server.totals) == 6
    assert any(len(c) < 12 for log in logs for c in log.contributors.values()), "dropouts must happen"
    sent = iter(client.sent)
    state = server.inner.init(fed.initial)
    for index, (step, total) in enumerate(server.totals):
        log = logs[index // 2]
        payloads = {device: payload for _, device, payload in (next(sent) for _ in range(12))}
        contributors = log.contributors[step]
        schema = {s.name: s.schema for s in server.steps(state)}[step]
        bound = schema.quantisation_bound(len(contributors))
        for f in schema.fields:  # the codec clips reals at f.clip (and counts it); counts are exact
            expected = sum(np.clip(np.asarray(payloads[d][f.name], dtype=np.float64), -f.clip, f.clip)
                           for d in contributors)
            assert total[f.name].shape == f.shape
            np.testing.assert_allclose(total[f.name], expected, rtol=0, atol=bound[f.name] + 1e-12)
    # Broadcasts: the model, plus (encoder step) u_m computed from the heads step's summed counts.
    assert [step for step, _ in server.broadcasts] == [step for step, _ in server.totals]
    for (step, broadcast), (_, previous_total) in zip(server.broadcasts, [(None, None)] + server.totals):
        if step == HEADS:
            assert set(broadcast) == set(fed.initial)
        else:
            assert set(broadcast) == set(fed.initial) | {DOMAIN_WEIGHTS}
            np.testing.assert_array_equal(broadcast[DOMAIN_WEIGHTS], domain_weights(previous_total["counts"]))
    # Relabelling the devices changes nothing: only the multiset of contributions matters.
    runs = []
    for order in (slice(None), slice(None, None, -1)):
        fresh = federation(data, heads=5)
        devices = fresh.devices[order]
        state, _ = run_rounds(server_type(opts), FedDARClient(opts), devices, fresh.initial, 2, 12, plain_sum)
        runs.append(flatten(state.params))
    np.testing.assert_allclose(runs[0], runs[1], rtol=0, atol=1e-10)


# -- sizes, projection, options, data ---------------------------------------------------------------


def test_payload_report_counts_hessians_and_bytes():
    fed = federation(domain_linear(clients=3, samples=5), heads=5)
    sa = FedDARSAServer(FedDARSAOptions(projection=2))
    report = sa.payload_report(sa.init(fed.initial), cohort_size=100)
    # k = 2 features + bias, N = 1: P = 3, 6 unique Hessian entries per domain, 5 domains.
    sizes = ("head_params", "hessian_entries_per_domain", "hessian_unique_per_domain")
    assert tuple(report[k] for k in sizes) == (3, 9, 6)
    assert report["hessian_values_per_device"] == 30 and report["encoder_params"] == 40
    heads = report["steps"][HEADS]
    assert heads["values"] == 5 + 5 + 5 * 3 + 30 + 5 * 3
    assert heads["upload_bytes"] == packed_size(heads["values"], wire_width(heads["ring_bits"]))
    assert report["hessian_bytes_per_device"] == packed_size(30, heads["wire_bits"])
    wa = FedDARWAServer()
    wa_report = wa.payload_report(wa.init(fed.initial), cohort_size=100)
    assert wa_report["hessian_values_per_device"] == 0 == wa_report["hessian_bytes_per_device"]
    assert wa_report["steps"][HEADS]["values"] == 5 + 5 + 15
    # The spec's FairFace age setting: a projection to k = 8, N = 9 classes, 7 domains.
    encoder = mlp_encoder(64, 32, projection=8)
    big = FedDARSAServer(FedDARSAOptions(projection=8))
    report = big.payload_report(big.init(initial_params(encoder, 7, 9)), cohort_size=5)
    assert report["head_params"] == 9 * 9 and report["hessian_unique_per_domain"] == 81 * 82 // 2
    assert report["hessian_values_per_device"] == 7 * 3321


def test_projection_option_fixes_the_head_width():
    projected = initial_params(mlp_encoder(64, 32, projection=8), 3, 4)
    assert projected[HEADS].shape == (3, 4, 9)
    FedDARSAServer(FedDARSAOptions(projection=8)).init(projected)
    with pytest.raises(ValueError, match="projection"):
        FedDARSAServer(FedDARSAOptions(projection=8)).init(initial_params(mlp_encoder(64, 32), 3, 4))


def test_options_are_validated():
    assert FedDARSAOptions.from_dict({"damping": 0.1}).damping == 0.1
    with pytest.raises(ValueError, match="unknown"):
        FedDAROptions.from_dict({"damping": 0.1})  # an SA option is not a WA option
    with pytest.raises(ValueError, match="head_solver"):
        FedDAROptions.from_dict({"head_solver": "adam"})
    with pytest.raises(ValueError, match="hessian_at"):
        FedDARSAOptions.from_dict({"hessian_at": "anywhere"})


def test_domain_linear_generator():
    data = domain_linear(clients=7, domains=4, alpha=0.4, samples=9, noise=1e-3, seed=5, dim=12, rank=3)
    again = domain_linear(clients=7, domains=4, alpha=0.4, samples=9, noise=1e-3, seed=5, dim=12, rank=3)
    np.testing.assert_array_equal(data.train[3].x, again.train[3].x)
    np.testing.assert_allclose(data.encoder.T @ data.encoder, np.eye(3), atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(data.heads, axis=1), 1.0)
    assert data.mixtures.shape == (7, 4) and np.allclose(data.mixtures.sum(1), 1)
    for train, test in zip(data.train, data.test):
        assert train.x.shape == (9, 12) and test.x.shape == (100, 12)
        clean = np.einsum("nk,nk->n", test.x @ data.encoder, data.heads[test.z])
        np.testing.assert_allclose(test.y, clean, atol=1e-12)
        noise = train.y - np.einsum("nk,nk->n", train.x @ data.encoder, data.heads[train.z])
        assert 0 < np.abs(noise).max() < 6e-3
    assert subspace_distance(data.encoder @ np.diag([2.0, 1.0, 0.5]), data.encoder) < 1e-12
    assert subspace_distance(np.random.default_rng(0).standard_normal((12, 3)), data.encoder) > 0.1


def test_a_non_finite_sum_is_refused():
    server = FedDARWAServer()
    state = server.init(initial_params(linear_encoder(4, 2), 2, 1))
    with pytest.raises(ValueError, match="not finite"):
        server.apply(state, ENCODER, {"weighted_delta": np.full(8, np.nan), "weight": np.float64(1.0)})
