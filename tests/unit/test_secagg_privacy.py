"""The one rule (DESIGN.md section 1) at the protocol level: what the server receives
reveals no single device's input."""

from __future__ import annotations

import random

import numpy as np
import pytest
from scipy import stats

from support.secagg import lax_client, lax_cohort, make_config, random_inputs
from tally.codec import unpack
from tally.secagg import Dropout, SessionAbortedError
from tally.secagg.messages import MaskedInputResponse, UnmaskRequest, UnmaskResponse


def seeded_entropy(seed: int):
    sources: dict[int, random.Random] = {}

    def entropy(device: int, size: int) -> bytes:
        return sources.setdefault(device, random.Random(seed * 100_003 + device)).randbytes(size)

    return entropy


def test_server_never_receives_seed_and_key_shares_of_one_device():
    config = make_config(12, 6, 4, sums=(("a", 5, 16), ("b", 5, 16)))
    inputs = random_inputs(config, np.random.default_rng(0))
    received = []
    dropouts = {2: Dropout("masked_input", "a"), 5: Dropout("unmask", "a"), 9: Dropout("masked_input", "b")}
    run = lax_cohort(config, inputs, dropouts, observe=received.append)
    assert run.aborted is None
    for spec in config.sums:
        seeds, keys = set(), set()
        for m in received:
            if isinstance(m, UnmaskResponse) and m.sum_id == spec.sum_id:
                seeds |= set(m.seed_owners)
                keys |= set(m.key_owners)
        assert seeds and keys
        assert not seeds & keys, "the server got both kinds of shares of one device"
        assert run.server.revealed_seeds[spec.sum_id] == set(run.results[spec.sum_id].contributors)
        assert run.server.revealed_keys[spec.sum_id] <= set(run.results[spec.sum_id].dropped)


def _masked_inputs(config, inputs, seed):
    received = []
    lax_cohort(config, inputs, observe=received.append, entropy=seeded_entropy(seed))
    spec = config.sums[0]
    return {
        m.sender: unpack(m.data, spec.wire_bits, spec.dim).astype(np.int64)
        for m in received
        if isinstance(m, MaskedInputResponse)
    }


def test_masked_inputs_are_uniform_whatever_the_input():
    bits, dim = 16, 8192
    config = make_config(10, 9, 6, sums=(("s", dim, bits),))
    # The most structured inputs possible: all zeros, and a ramp.
    inputs = {i: {"s": np.zeros(dim, dtype=np.uint32)} for i in range(1, 11)}
    inputs[3] = {"s": (np.arange(dim) % (1 << bits)).astype(np.uint32)}
    masked = _masked_inputs(config, inputs, seed=1)
    bins = 64
    for device, values in masked.items():
        counts = np.bincount(values >> (bits - 6), minlength=bins)
        p = stats.chisquare(counts).pvalue
        assert p > 1e-4, f"device {device}: masked input is not uniform (p={p:.2e})"
        # And the low bits, where a structured input would show first.
        low = np.bincount(values & (bins - 1), minlength=bins)
        assert stats.chisquare(low).pvalue > 1e-4
        # Masked and clear input are uncorrelated.
        r = np.corrcoef(values, inputs[device]["s"].astype(np.int64) + 1e-9 * np.arange(dim))[0, 1]
        assert abs(r) < 0.06


def test_one_masked_input_does_not_distinguish_two_inputs():
    bits, dim = 12, 8192
    config = make_config(6, 5, 4, sums=(("s", dim, bits),))
    zeros = {i: {"s": np.zeros(dim, dtype=np.uint32)} for i in range(1, 7)}
    maxed = dict(zeros)
    maxed[1] = {"s": np.full(dim, (1 << bits) - 1, dtype=np.uint32)}
    a = _masked_inputs(config, zeros, seed=7)[1]
    b = _masked_inputs(config, maxed, seed=8)[1]
    table = np.stack([np.bincount(a >> 6, minlength=64), np.bincount(b >> 6, minlength=64)])
    p = stats.chi2_contingency(table).pvalue
    assert p > 1e-4, f"masked inputs of different inputs are distinguishable (p={p:.2e})"


def test_masks_cancel_only_in_the_total():
    config = make_config(8, 7, 5, sums=(("s", 64, 20),))
    inputs = random_inputs(config, np.random.default_rng(2))
    received = []
    run = lax_cohort(config, inputs, observe=received.append, entropy=seeded_entropy(3))
    masked = [m for m in received if isinstance(m, MaskedInputResponse)]
    # Any strict subset of masked inputs sums to something unrelated to the inputs' sum.
    partial_total = sum(unpack(m.data, config.sums[0].wire_bits, 64).astype(np.int64) for m in masked[:-1]) % (1 << 20)
    clear_partial = sum(inputs[m.sender]["s"].astype(np.int64) for m in masked[:-1]) % (1 << 20)
    assert np.mean(partial_total == clear_partial) < 0.05
    full = sum(inputs[i]["s"].astype(np.int64) for i in range(1, 9)) % (1 << 20)
    assert np.array_equal(run.results["s"].total.astype(np.int64), full)


def test_device_answers_unmask_once_and_refuses_an_isolating_survivor_set():
    from tally.secagg import OutOfPhase
    from tally.secagg.server import SecAggServer

    config = make_config(6, 5, 3, sums=(("s", 4, 16),))
    inputs = random_inputs(config, np.random.default_rng(4))
    server = SecAggServer(config)
    clients = {i: lax_client(config, i) for i in range(1, 7)}
    for i, c in clients.items():
        c.provide_input("s", inputs[i]["s"])
    inbox = [m for c in clients.values() for m in c.start()]
    unmask_requests = {}
    while inbox:
        out = []
        for m in inbox:
            out += server.receive(m)
        inbox = []
        for o in out:
            if isinstance(o.message, UnmaskRequest):
                unmask_requests[o.recipient] = o.message
                continue
            inbox += clients[o.recipient].receive(o.message)
    # A server that claims almost everyone dropped, to learn device 1's input: refused.
    lying = UnmaskRequest(config.ref, "s", (1, 2))
    with pytest.raises(SessionAbortedError, match="threshold"):
        clients[2].receive(lying)
    # An honest request is answered once; asking again (with any set) is refused.
    clients[3].receive(unmask_requests[3])
    with pytest.raises(OutOfPhase):
        clients[3].receive(UnmaskRequest(config.ref, "s", (1, 3, 4, 5, 6)))
