#!/usr/bin/env python
"""Secure-sum engine benchmark: client masking and server unmasking vs the PRG limit.

Runs a whole cohort through the real protocol (``tally.secagg.driver.run_cohort``: real keys,
real Shamir shares, real AES-CTR masks, real dropouts) and compares, in the same process on the
same machine, the time the engine spends with the time the unavoidable work takes:

* ``limit_client_s``: one device's AES-128-CTR keystreams (1 self mask + one pairwise mask per
  neighbour that finished ShareKeys), each written with ``update_into`` into a preallocated
  1 MiB buffer and added to a D-long ring vector with numpy, plus the final reduction mod 2^b.
* ``limit_server_s``: the same for the masks the server cannot avoid removing (one self mask per
  surviving device, one pairwise mask per (dropped device, surviving neighbour) edge), plus one
  vector addition per surviving masked input (read from a pool of distinct vectors larger than
  the caches, as the real masked inputs are).

Everything is reported as medians over ``--repeat`` runs and as ratios to those limits
(DESIGN.md section 9). ``correct`` checks the unmasked total integer-exactly against the ring sum
of the contributors' encoded inputs; the exit status is non-zero when it does not hold.

    python bench/secagg_engine.py --clients 1000 --dim 100000 --dropout 0.1 --json out.json
    python bench/secagg_engine.py --grid   # N x D x dropout phase: one JSON and one PNG

``--grid`` runs every point in its own process (one point's memory never weighs on the next)
and skips, with the reason recorded, points whose cohort would not fit ``--max-memory-gib``.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from tally.codec import Field, Kind, PayloadSchema, packed_size, ring_dtype, ring_mask, to_ring, wire_width
from tally.secagg import (
    DevicePolicy,
    Dropout,
    SessionConfig,
    SessionRef,
    SigningKey,
    ThreatModel,
    crypto,
    enrol,
    run_cohort,
)
from tally.secagg.layouts import payload_bytes
from tally.secagg.phases import TIMED, Phase

SUM_ID = "x"
CLIP = 1.0
FRAC_BITS = 19  # 20-bit precision on [-1, 1]: N <= 1024 fits a ring of <= 31 bits
CHUNK_BYTES = 1 << 20  # keystream buffer, as DESIGN.md section 4 prescribes
# At D up to this the PRG limit is tiny, and the issue measures the server against the limit
# with the X25519/HKDF work dropouts need.
KEX_LIMIT_MAX_DIM = 10_000
# Masked inputs the server-limit adds are cycled through a pool at least this large, so the
# additions stream from memory as the real server's do instead of hitting a cached vector.
ADD_POOL_BYTES = 128 << 20
TARGET_SERVER_RATIO = 2.0
TARGET_CLIENT_RATIO = 1.5
PHASE_OF_DROPOUT = {"shares": Phase.MASKED_INPUT, "masked": Phase.UNMASK}
GRID_CLIENTS = [100, 200, 500, 1000, 5000]
GRID_DIMS = [10_000, 100_000, 1_000_000]


def wire_bits(spec) -> int:
    """Bits per value on the wire (the engine may round a ring up to a machine word)."""
    return int(getattr(spec, "wire_bits", spec.bits))


# ---------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--clients", "-n", type=int, help="cohort size N (required without --grid)")
    p.add_argument("--dim", "-d", type=int, help="values per device D (required without --grid)")
    p.add_argument("--dropout", "-f", type=float, default=0.1,
                   help="fraction F of devices that drop (floor(F*N) devices, chosen at random)")
    p.add_argument("--phase", choices=sorted(PHASE_OF_DROPOUT), default="shares",
                   help="shares: drop after ShareKeys, before sending the masked input (the server "
                        "must remove their pairwise masks); masked: drop after the masked input, "
                        "before Unmask")
    p.add_argument("--repeat", "-r", type=int, default=3, help="cohort runs; medians are reported")
    p.add_argument("--corrupt", "-c", type=float, default=0.05,
                   help="corrupt fraction of the threat model that picks k and t")
    p.add_argument("--threat-dropout", type=float, default=None,
                   help="dropout rate of the threat model (default: --dropout)")
    p.add_argument("--semi-honest", action="store_true",
                   help="skip the consistency check, devices declaring the server semi-honest (same k and t): "
                        "what the engine costs without the round that stops a lying server")
    p.add_argument("--k", type=int, default=None, help="override the graph degree")
    p.add_argument("--t", type=int, default=None, help="override the Shamir threshold")
    p.add_argument("--seed", type=int, default=0, help="seed of inputs, dropouts and graph")
    p.add_argument("--limit-repeat", type=int, default=7,
                   help="repetitions of each limit measurement per cohort run")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--cpu-clock", action="store_true",
                   help="time the engine's per-phase steps in process CPU time, not wall time: on a "
                        "machine shared with other load, wall time measures the load")
    p.add_argument("--profile", type=Path, default=None,
                   help="cProfile the first cohort run and dump the stats here (pstats format)")
    grid = p.add_argument_group("grid")
    grid.add_argument("--grid", action="store_true",
                      help="run every (N, D, phase) point of the grid, each in its own process")
    grid.add_argument("--grid-clients", type=int, nargs="+", default=GRID_CLIENTS, metavar="N")
    grid.add_argument("--grid-dims", type=int, nargs="+", default=GRID_DIMS, metavar="D")
    grid.add_argument("--grid-phases", nargs="+", choices=sorted(PHASE_OF_DROPOUT),
                      default=sorted(PHASE_OF_DROPOUT))
    grid.add_argument("--max-memory-gib", type=float, default=12.0,
                      help="skip grid points whose inputs and uploads would need more than this")
    grid.add_argument("--grid-merge", action="store_true",
                      help="replace only the points run now in --out-dir's engine_grid.json, "
                           "keeping the others' earlier measurements (each point records when "
                           "it was measured)")
    grid.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results",
                      help="where --grid writes engine_grid.json, engine_grid.png and its log")
    args = p.parse_args(argv)
    if args.grid:
        return args
    if args.clients is None or args.dim is None:
        p.error("--clients and --dim are required (or run --grid)")
    if args.clients < 2:
        p.error("--clients must be >= 2")
    if args.dim < 1:
        p.error("--dim must be >= 1")
    if not 0.0 <= args.dropout < 1.0:
        p.error("--dropout must lie in [0, 1)")
    if args.repeat < 1 or args.limit_repeat < 1:
        p.error("--repeat and --limit-repeat must be >= 1")
    return args


# ---------------------------------------------------------------------------- inputs


def build_schema(dim: int) -> PayloadSchema:
    return PayloadSchema((Field(SUM_ID, (dim,), Kind.REAL, clip=CLIP, frac_bits=FRAC_BITS),))


def _device_rng(seed: int, rep: int, device: int) -> np.random.Generator:
    return np.random.default_rng([seed, rep, device])


def device_values(seed: int, rep: int, device: int, dim: int) -> tuple[np.ndarray, np.random.Generator]:
    """Device ``device``'s real input, regenerable from (seed, rep, device) alone."""
    rng = _device_rng(seed, rep, device)
    return rng.uniform(-CLIP, CLIP, dim), rng


def make_inputs(schema: PayloadSchema, config: SessionConfig, seed: int, rep: int) -> dict:
    spec = config.sum_spec(SUM_ID)
    inputs = {}
    for i in range(1, config.n + 1):
        values, rng = device_values(seed, rep, i, spec.dim)
        encoded = schema.encode({SUM_ID: values}, rng)  # the rng goes on to drive the rounding
        inputs[i] = {SUM_ID: to_ring(encoded.vector, spec.bits)}
    return inputs


# ---------------------------------------------------------------------------- limits


class MaskLimit:
    """The PRG floor: AES-128-CTR keystream into a preallocated buffer, added with numpy.

    Written here, independently of ``tally.secagg.crypto.MaskExpander``, so that the limit does
    not inherit the engine's overheads.
    """

    def __init__(self, dim: int, dtype: np.dtype, bits: int) -> None:
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.mask = self.dtype.type(ring_mask(bits))
        self.reduce = bits != 8 * self.dtype.itemsize
        item = self.dtype.itemsize
        self.step = max(1, min(dim, CHUNK_BYTES // item))
        self.zeros = bytes(self.step * item)
        self.out = bytearray(self.step * item + 15)
        self.view = np.frombuffer(self.out, dtype=self.dtype, count=self.step)
        # Tail chunk input, sliced once instead of per mask.
        tail = dim % self.step
        self.tail_zeros = self.zeros[: tail * item] if tail else None

    def time(self, n_masks: int, n_adds: int = 0, repeats: int = 5,
             budget_s: float = 60.0) -> list[float]:
        """Seconds for ``n_masks`` keystream masks plus ``n_adds`` vector additions, per repeat."""
        acc = np.zeros(self.dim, dtype=self.dtype)
        pool = None
        if n_adds:
            rows = max(1, min(n_adds, ADD_POOL_BYTES // (self.dim * self.dtype.itemsize)))
            pool = np.random.default_rng(1).integers(0, int(self.mask), (rows, self.dim),
                                                    dtype=self.dtype, endpoint=True)
        times: list[float] = []
        spent = 0.0
        for _ in range(repeats):
            keys = os.urandom(16 * n_masks)
            key_list = [keys[16 * m:16 * m + 16] for m in range(n_masks)]
            nonce = bytes(16)
            out, view, zeros, tail_zeros = self.out, self.view, self.zeros, self.tail_zeros
            step, dim = self.step, self.dim
            add = np.add
            gc.collect()
            start = time.perf_counter()
            if pool is not None:
                rows = len(pool)
                for a in range(n_adds):
                    add(acc, pool[a % rows], out=acc)
            for key in key_list:
                encryptor = Cipher(algorithms.AES(key), modes.CTR(nonce)).encryptor()
                for s in range(0, dim, step):
                    stop = s + step
                    if stop <= dim:
                        encryptor.update_into(zeros, out)
                        part = acc[s:stop]
                        add(part, view, out=part)
                    else:
                        count = dim - s
                        encryptor.update_into(tail_zeros, out)
                        part = acc[s:]
                        add(part, view[:count], out=part)
            if self.reduce:
                np.bitwise_and(acc, self.mask, out=acc)
            elapsed = time.perf_counter() - start
            times.append(elapsed)
            spent += elapsed
            if spent > budget_s and len(times) >= 3:
                break
        return times


def time_key_agreement(n_keys: int, n_edges: int, n_seeds: int = 0, repeats: int = 3,
                       budget_s: float = 60.0) -> list[float]:
    """Seconds for the X25519/HKDF work behind the server's masks, per repeat.

    Not part of ``limit_server_s`` (which is the PRG floor), but just as unavoidable: per dropped
    device, load its reconstructed private key once and check its public key; per (dropped,
    surviving neighbour) edge, one exchange and one HKDF-SHA256 to a 16-byte mask key; per
    surviving device, one HKDF-SHA256 from its rebuilt seed to its self-mask key.
    """
    if n_seeds == 0 and (n_keys == 0 or n_edges == 0):
        return [0.0]
    privates = [X25519PrivateKey.generate().private_bytes_raw() for _ in range(n_keys if n_edges else 0)]
    seeds = [os.urandom(32) for _ in range(n_seeds)]
    publics = [X25519PrivateKey.generate().public_key().public_bytes_raw()
               for _ in range(min(n_edges, 256))]
    per_key = [n_edges // n_keys + (1 if j < n_edges % n_keys else 0) for j in range(len(privates))]
    times: list[float] = []
    spent = 0.0
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        for seed in seeds:
            HKDF(hashes.SHA256(), 16, None, b"bench/self-mask").derive(seed)
        e = 0
        for private, count in zip(privates, per_key):
            sk = X25519PrivateKey.from_private_bytes(private)
            sk.public_key().public_bytes_raw()
            for _ in range(count):
                peer = X25519PublicKey.from_public_bytes(publics[e % len(publics)])
                secret = sk.exchange(peer)
                HKDF(hashes.SHA256(), 16, None, b"bench/pairwise-mask").derive(secret)
                e += 1
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        spent += elapsed
        if spent > budget_s and len(times) >= 2:
            break
    return times


# ---------------------------------------------------------------------------- one run


def authentication_cost(n: int, k: int, sums: int, survivors: int, repeats: int) -> dict:
    """What authenticating keys and checking rebuilt secrets costs, from the primitives' own
    timings (medians) times how often each side runs them per session.

    A device signs its AdvertiseKeys once and commits to one seed per sum, and verifies each of
    its k neighbours' signatures; the server verifies every AdvertiseKeys signature, checks
    2 keys per sum and device for small order, and checks one seed commitment per survivor and
    sum. (ConsistencyCheck adds one signature and up to t verifications per device.)
    """
    identity = SigningKey.generate()
    message = b"x" * 200
    signature = identity.sign(message)
    public = crypto.KeyPair(os.urandom(32)).public
    seed = crypto.random_scalar()

    def per_call(fn: Callable[[], object], calls: int = 200) -> float:
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - start) / calls)
        return _median(samples)

    sign = per_call(lambda: identity.sign(message))
    verify = per_call(lambda: crypto.verify_signature(identity.public, signature, message))
    key_check = per_call(lambda: crypto.check_public_key(public))
    commit = per_call(lambda: crypto.public_of_scalar(seed))
    client = sign + sums * commit + k * verify
    server = n * (verify + 2 * sums * key_check) + survivors * sums * commit
    return {
        "ed25519_sign_s": sign, "ed25519_verify_s": verify, "x25519_order_check_s": key_check,
        "seed_commitment_s": commit, "client_per_device_s": client, "server_per_session_s": server,
    }


def _median(xs) -> float:
    xs = list(xs)
    return float(statistics.median(xs)) if xs else float("nan")


def run_once(args: argparse.Namespace, schema: PayloadSchema, rep: int,
             on_message: Callable[[object], None] | None, log: Callable[[str], None]) -> dict:
    n, dim = args.clients, args.dim
    threat = ThreatModel(
        dropout_rate=args.dropout if args.threat_dropout is None else args.threat_dropout,
        corrupt_rate=args.corrupt,
    )
    plan_rng = np.random.default_rng([args.seed, rep])
    identities = enrol(n)
    config = SessionConfig.plan(
        SessionRef("bench", rep, f"engine-{rep}"), [(SUM_ID, schema)], n, threat,
        k=args.k, t=args.t, graph_seed=plan_rng.bytes(32), consistency_check=not args.semi_honest,
        identities=[identities[i].public for i in range(1, n + 1)],
    )
    spec = config.sum_spec(SUM_ID)
    n_drop = math.floor(round(args.dropout * n, 9))
    dropped = sorted(int(i) + 1 for i in plan_rng.choice(n, size=n_drop, replace=False))
    dropouts = {i: Dropout(PHASE_OF_DROPOUT[args.phase]) for i in dropped}

    t0 = time.perf_counter()
    inputs = make_inputs(schema, config, args.seed, rep)
    log(f"run {rep}: inputs encoded in {time.perf_counter() - t0:.1f}s "
        f"(k={config.params.k}, t={config.threshold}, bits={spec.bits}, dropped={n_drop})")

    # The client limit is sampled before and after the cohort, so that a machine whose load
    # drifts (a shared host) is sampled on both sides of the client timings.
    limit = MaskLimit(dim, ring_dtype(spec.bits), spec.bits)
    expected_client_masks = 1 + config.params.k  # nobody drops before ShareKeys here
    limit_client_before = limit.time(expected_client_masks, 0, args.limit_repeat)

    profiler = cProfile.Profile() if (args.profile and rep == 0) else None
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    # Uploads are counted here, from every message the server receives, rather than with the
    # driver's measure_bytes: that also walks every download, and each UnmaskRequest carries
    # the whole survivor list, which makes the accounting itself quadratic in N.
    upload_bytes: dict[int, int] = defaultdict(int)

    def observe(message) -> None:
        upload_bytes[message.sender] += payload_bytes(message)
        if on_message is not None:
            on_message(message)

    device_threat = dataclasses.replace(threat, malicious_server=not args.semi_honest)
    run = run_cohort(config, inputs, dropouts, observe=observe, identities=identities,
                     policy=DevicePolicy(threat=device_threat),
                     clock=time.process_time if args.cpu_clock else time.perf_counter)
    if profiler:
        profiler.disable()
        profiler.dump_stats(str(args.profile))
    cohort_wall = time.perf_counter() - t0
    if on_message is not None and hasattr(on_message, "flush"):
        on_message.flush()
    log(f"run {rep}: cohort done in {cohort_wall:.1f}s")

    # -- correctness: integer-exact in the ring, and the decoded reals vs float sums.
    result = run.results.get(SUM_ID)
    out: dict = {
        "k": config.params.k, "t": config.threshold, "bits": spec.bits,
        "consistency_check": config.consistency_check,
        "wire_bits": wire_bits(spec),
        "dropped": n_drop, "aborted": run.aborted, "cohort_wall_s": cohort_wall,
        "refused": len(run.refused), "rejected": len(run.rejected),
    }
    if result is None:
        out.update(correct=False, max_abs_error=float("nan"), contributors=0)
        return out
    contributors = list(result.contributors)
    expected = np.zeros(dim, dtype=np.uint64)
    float_sum = np.zeros(dim, dtype=np.float64)
    for i in contributors:
        np.add(expected, inputs[i][SUM_ID].astype(np.uint64), out=expected)
        values, _ = device_values(args.seed, rep, i, dim)
        float_sum += values
    expected &= np.uint64(ring_mask(spec.bits))
    ring_exact = bool(np.array_equal(result.total.astype(np.uint64), expected))
    decoded = schema.decode_sum(result.total, spec.bits)[SUM_ID]
    max_abs_error = float(np.max(np.abs(decoded - float_sum)))
    bound = schema.quantisation_bound(len(contributors))[SUM_ID]
    expected_contributors = (
        set(range(1, n + 1)) - set(dropped) if args.phase == "shares" else set(range(1, n + 1))
    )
    out.update(
        correct=ring_exact and max_abs_error <= bound and set(contributors) == expected_contributors,
        ring_exact=ring_exact,
        max_abs_error=max_abs_error,
        quantisation_bound=bound,
        contributors=len(contributors),
    )

    # -- what the engine spent.
    out["server_seconds"] = {p: float(s) for p, s in run.server_seconds.items()}
    out["client_median_s"] = {p: _median(v) for p, v in run.client_seconds.items()}
    out["client_mean_per_device_s"] = {p: float(sum(v)) / n for p, v in run.client_seconds.items()}
    out["client_mask_s"] = _median(run.client_seconds.get(Phase.MASKED_INPUT, []))
    out["server_unmask_s"] = float(run.server_seconds.get(Phase.UNMASK, float("nan")))
    # The server adds each masked input as it arrives: what it spends on the sum is its
    # MaskedInput phase (checks, additions, the Unmask requests) plus its Unmask phase.
    out["server_sum_s"] = out["server_unmask_s"] + float(run.server_seconds.get(Phase.MASKED_INPUT, 0.0))
    survivors = [i for i in range(1, n + 1) if i not in dropouts]
    out["upload_bytes_per_client"] = _median(upload_bytes[i] for i in survivors)

    # -- the work nobody can avoid, counted from the run itself.
    sharers = run.server.sharers
    contributor_set = set(contributors)
    client_masks = [
        1 + sum(1 for j in config.neighbours(i) if int(j) in sharers) for i in contributors
    ]
    out["client_masks"] = int(statistics.median_low(client_masks))
    edges = 0
    result_dropped_keys = []  # dropped devices with a surviving neighbour: their keys are rebuilt
    for j in result.dropped:
        e = sum(1 for i in config.neighbours(j) if int(i) in contributor_set)
        edges += e
        if e:
            result_dropped_keys.append(j)
    out["server_self_masks"] = len(contributors)
    out["server_pairwise_masks"] = edges
    out["server_adds"] = len(contributors)

    del run, inputs, result
    gc.collect()

    t0 = time.perf_counter()
    out["limit_client_samples"] = limit.time(out["client_masks"], 0, args.limit_repeat)
    if out["client_masks"] == expected_client_masks:
        out["limit_client_samples"] += limit_client_before
    out["limit_server_samples"] = limit.time(
        len(contributors) + edges, len(contributors), args.limit_repeat
    )
    out["kex_server_samples"] = time_key_agreement(
        len(result_dropped_keys), edges, len(contributors), max(1, min(3, args.limit_repeat))
    )
    out["limit_client_s"] = _median(out["limit_client_samples"])
    out["limit_server_kex_s"] = _median(out["kex_server_samples"])
    out["limit_server_s"] = _median(out["limit_server_samples"])
    out["client_ratio"] = out["client_mask_s"] / out["limit_client_s"]
    out["server_ratio"] = out["server_sum_s"] / out["limit_server_s"]
    out["server_ratio_with_kex"] = out["server_sum_s"] / (out["limit_server_s"] + out["limit_server_kex_s"])
    out["authentication"] = authentication_cost(
        n, config.params.k, len(config.sums), len(contributors), max(1, min(3, args.limit_repeat))
    )
    log(f"run {rep}: limits timed in {time.perf_counter() - t0:.1f}s")
    return out


# ---------------------------------------------------------------------------- report


def machine_info() -> dict:
    cpu_model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "platform": platform.platform(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cryptography": version("cryptography"),
        "rich": version("rich"),
    }


def summarise(args: argparse.Namespace, runs: list[dict], wall: float) -> dict:
    first = runs[0]
    dim = args.dim
    bits = first["bits"]
    ok = [r for r in runs if "server_seconds" in r]

    def med(key: str) -> float:
        return _median(r[key] for r in ok)

    summary: dict = {
        "clients": args.clients,
        "dim": dim,
        "dropout": args.dropout,
        "phase": args.phase,
        "dropout_at": PHASE_OF_DROPOUT[args.phase],
        "corrupt": args.corrupt,
        "repeat": args.repeat,
        "seed": args.seed,
        "clock": "process_time" if args.cpu_clock else "perf_counter",
        "k": first["k"],
        "t": first["t"],
        "bits": bits,
        "wire_bits": first["wire_bits"],
        "dropped": first["dropped"],
        "correct": all(r["correct"] for r in runs),
        "max_abs_error": max(r["max_abs_error"] for r in runs),
        "quantisation_bound": first.get("quantisation_bound"),
        "aborted": [r["aborted"] for r in runs if r["aborted"]],
    }
    if ok:
        summary.update(
            client_mask_s=med("client_mask_s"),
            limit_client_s=med("limit_client_s"),
            server_unmask_s=med("server_unmask_s"),
            server_sum_s=med("server_sum_s"),
            limit_server_s=med("limit_server_s"),
            client_masks=first["client_masks"],
            server_self_masks=ok[0]["server_self_masks"],
            server_pairwise_masks=ok[0]["server_pairwise_masks"],
            server_adds=ok[0]["server_adds"],
        )
        summary["client_ratio"] = summary["client_mask_s"] / summary["limit_client_s"]
        summary["server_ratio"] = summary["server_sum_s"] / summary["limit_server_s"]
        summary["server_unmask_ratio"] = summary["server_unmask_s"] / summary["limit_server_s"]
        summary["authentication"] = {
            key: _median(r["authentication"][key] for r in ok) for key in ok[0]["authentication"]
        }
        # Each run's engine and limit times share the machine's load of the moment; on a
        # shared host the median of per-run ratios is the steadier figure.
        summary["client_ratio_per_run"] = [r["client_ratio"] for r in ok]
        summary["server_ratio_per_run"] = [r["server_ratio"] for r in ok]
        summary["client_ratio_median_of_runs"] = _median(summary["client_ratio_per_run"])
        summary["server_ratio_median_of_runs"] = _median(summary["server_ratio_per_run"])
        # Informational: the floor including the X25519 work behind the pairwise masks.
        summary["limit_server_kex_s"] = med("limit_server_kex_s")
        summary["server_ratio_with_kex"] = summary["server_sum_s"] / (
            summary["limit_server_s"] + summary["limit_server_kex_s"]
        )
        summary["server_ratio_with_kex_per_run"] = [r["server_ratio_with_kex"] for r in ok]
        summary["target_client_ratio"] = TARGET_CLIENT_RATIO
        summary["target_server_ratio"] = TARGET_SERVER_RATIO
        summary["upload_bytes_per_client"] = med("upload_bytes_per_client")
        summary["masked_input_bytes"] = packed_size(dim, wire_width(bits))
        summary["plain_bytes_per_client"] = 4 * dim
        summary["upload_ratio"] = summary["upload_bytes_per_client"] / summary["plain_bytes_per_client"]
        phases = [p for p in TIMED if any(p in r["server_seconds"] for r in ok)]
        summary["server_phase_s"] = {
            p: _median(r["server_seconds"].get(p, 0.0) for r in ok) for p in phases
        }
        cphases = [p for p in TIMED if any(p in r["client_median_s"] for r in ok)]
        summary["client_phase_median_s"] = {
            p: _median(r["client_median_s"].get(p, 0.0) for r in ok) for p in cphases
        }
        summary["client_phase_mean_per_device_s"] = {
            p: _median(r["client_mean_per_device_s"].get(p, 0.0) for r in ok) for p in cphases
        }
        summary["cohort_wall_s"] = med("cohort_wall_s")
    summary["wall_s"] = wall
    summary["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    summary["machine"] = machine_info()
    summary["runs"] = runs
    return summary


def _fmt_s(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    if x >= 1:
        return f"{x:.3f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.2f} ms"
    return f"{x * 1e6:.1f} µs"


def print_report(console: Console, s: dict) -> None:
    title = (f"SecAgg engine: N={s['clients']} D={s['dim']} dropout={s['dropout']} "
             f"({s['dropout_at']}) k={s['k']} t={s['t']} bits={s['bits']} "
             f"(wire {s['wire_bits']})")
    table = Table(title=title)
    table.add_column("measure")
    table.add_column("engine", justify="right")
    table.add_column("limit", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("target", justify="right")
    if "client_mask_s" in s:
        for name, key, lim, ratio, target in (
            (f"client masking ({s['client_masks']} masks)", "client_mask_s", "limit_client_s",
             "client_ratio", TARGET_CLIENT_RATIO),
            (f"server sum ({s['server_self_masks']}+{s['server_pairwise_masks']} masks, "
             f"{s['server_adds']} adds)", "server_sum_s", "limit_server_s", "server_ratio",
             TARGET_SERVER_RATIO),
        ):
            met = s[ratio] <= target
            table.add_row(name, _fmt_s(s[key]), _fmt_s(s[lim]),
                          f"[{'green' if met else 'red'}]{s[ratio]:.2f}x[/]", f"<= {target}x")
        if len(s["client_ratio_per_run"]) > 1:
            table.add_row("  per-run ratios (client; server)", "", "",
                          "; ".join(", ".join(f"{r:.2f}" for r in s[k])
                                    for k in ("client_ratio_per_run", "server_ratio_per_run")),
                          "")
        table.add_row("  of which Unmask phase", _fmt_s(s["server_unmask_s"]), "",
                      f"{s['server_unmask_ratio']:.2f}x", "")
        table.add_row("  limit + X25519/HKDF for the masks", "",
                      _fmt_s(s["limit_server_kex_s"]), f"{s['server_ratio_with_kex']:.2f}x", "")
        table.add_row("upload per device", f"{s['upload_bytes_per_client']:,.0f} B",
                      f"{s['plain_bytes_per_client']:,} B (float32)",
                      f"{s['upload_ratio']:.3f}", "")
        table.add_row("masked input", f"{s['masked_input_bytes']:,} B", "", "", "")
        auth = s["authentication"]
        table.add_row("identity signatures + checks, per device", _fmt_s(auth["client_per_device_s"]),
                      "", "", "")
        table.add_row("identity signatures + checks, server", _fmt_s(auth["server_per_session_s"]),
                      "", "", "")
        for p, v in s["server_phase_s"].items():
            table.add_row(f"server {p}", _fmt_s(v), "", "", "")
        for p, v in s["client_phase_median_s"].items():
            table.add_row(f"client {p} (median msg)", _fmt_s(v), "", "", "")
    ok = "[green]yes[/]" if s["correct"] else "[red]NO[/]"
    table.add_row("correct (ring-exact)", ok, "", "", "")
    table.add_row("max |error| (reals)", f"{s['max_abs_error']:.3g}",
                  f"{s['quantisation_bound']:.3g}" if s.get("quantisation_bound") else "", "", "")
    table.add_row("wall", _fmt_s(s["wall_s"]), "", "", "")
    table.add_row("peak RSS", f"{s['peak_rss_mib']:,.0f} MiB", "", "", "")
    console.print(table)
    m = s["machine"]
    console.print(f"{m['cpu_model']}, {m['cpu_usable']}/{m['cpu_count']} CPUs, "
                  f"Python {m['python']}, numpy {m['numpy']}, cryptography {m['cryptography']}")
    if s["aborted"]:
        console.print(f"[red]aborted:[/] {s['aborted']}")


# ---------------------------------------------------------------------------- grid


def point_memory_bytes(n: int, dim: int, schema_bits: int) -> int:
    """What one cohort of the grid holds at its peak: every device's ring input, every upload
    in flight, and the correctness check's copies (the driver hands all inputs over at once)."""
    item = ring_dtype(schema_bits).itemsize
    return n * dim * (item + packed_size(1, wire_width(schema_bits))) + 8 * n * dim // 10 + (1 << 30)


def run_grid(args: argparse.Namespace) -> int:
    console = Console() if Console().is_terminal else Console(width=110)
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "engine_grid.log"
    points = [(n, d, phase) for phase in args.grid_phases for n in args.grid_clients
              for d in args.grid_dims]
    results, skipped = [], []
    start = time.perf_counter()
    with log_path.open("w") as log, Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console,
    ) as progress:
        task = progress.add_task("grid", total=len(points))
        for n, dim, phase in points:
            label = f"N={n} D={dim} {phase}"
            progress.update(task, description=label)
            bits = build_schema(1).required_bits(n)
            need = point_memory_bytes(n, dim, bits)
            if need > args.max_memory_gib * 2**30:
                reason = (f"needs ~{need / 2**30:.0f} GiB (inputs, uploads in flight, checks) "
                          f"> --max-memory-gib {args.max_memory_gib:g}")
                skipped.append({"clients": n, "dim": dim, "phase": phase, "reason": reason})
                progress.console.log(f"skip {label}: {reason}")
                progress.advance(task)
                continue
            point_json = out_dir / f".grid_point_{n}_{dim}_{phase}.json"
            command = [sys.executable, str(Path(__file__).resolve()), "--clients", str(n),
                       "--dim", str(dim), "--phase", phase, "--dropout", str(args.dropout),
                       "--repeat", str(args.repeat), "--limit-repeat", str(args.limit_repeat),
                       "--corrupt", str(args.corrupt), "--seed", str(args.seed),
                       "--json", str(point_json)]
            log.write(f"$ {' '.join(command[1:])}\n")
            log.flush()
            proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, text=True)
            if proc.returncode != 0 or not point_json.exists():
                skipped.append({"clients": n, "dim": dim, "phase": phase,
                                "reason": f"run failed (exit {proc.returncode}); see {log_path.name}"})
            else:
                summary = json.loads(point_json.read_text())
                summary["measured_on"] = time.strftime("%Y-%m-%d", time.gmtime())
                point_json.unlink()
                results.append(summary)
                progress.console.log(
                    f"{label}: server {summary['server_ratio']:.2f}x "
                    f"(+kex {summary['server_ratio_with_kex']:.2f}x), "
                    f"client {summary['client_ratio']:.2f}x, correct={summary['correct']}")
            progress.advance(task)
    grid = {
        "command": "python bench/secagg_engine.py --grid " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in (("grid_clients", args.grid_clients), ("grid_dims", args.grid_dims),
                         ("grid_phases", args.grid_phases), ("repeat", args.repeat),
                         ("dropout", args.dropout))),
        "target_server_ratio": TARGET_SERVER_RATIO,
        "target_client_ratio": TARGET_CLIENT_RATIO,
        "wall_s": time.perf_counter() - start,
        "machine": machine_info(),
        "points": results,
        "skipped": skipped,
    }
    json_path = out_dir / "engine_grid.json"
    if args.grid_merge and json_path.exists():
        grid = merge_grid(json.loads(json_path.read_text()), grid)
    json_path.write_text(json.dumps(grid, indent=2, default=str) + "\n")
    plot_grid(grid, out_dir / "engine_grid.png")
    console.print(grid_markdown(grid))
    console.print(f"wrote {json_path}, {out_dir / 'engine_grid.png'} and {log_path}")
    return 0 if all(p["correct"] for p in results) else 1


def merge_grid(earlier: dict, now: dict) -> dict:
    """``earlier`` with the points ``now`` ran (measured or skipped) replaced by ``now``'s: a
    grid of hours can be brought up to date one slow corner at a time."""
    def key(p: dict) -> tuple:
        return p["clients"], p["dim"], p["phase"]

    rerun = {key(p) for p in now["points"] + now["skipped"]}
    merged = dict(earlier)
    merged["points"] = [p for p in earlier["points"] if key(p) not in rerun] + now["points"]
    merged["skipped"] = [s for s in earlier["skipped"] if key(s) not in rerun] + now["skipped"]
    merged["merged"] = earlier.get("merged", []) + [
        {"command": now["command"], "points": sorted(rerun), "wall_s": now["wall_s"],
         "machine": now["machine"]}]
    return merged


def _ratio_range(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def grid_markdown(grid: dict) -> str:
    """The README's table: one row per point, medians and the per-run range of the server ratio;
    bold where the server target is met (against the limit with X25519/HKDF at small D)."""
    lines = [
        "| N | D | dropped 10 % | k, t | bits (wire) | server / limit | + X25519/HKDF | "
        "client / limit | upload / float32 | correct |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    phase_name = {"shares": "after ShareKeys", "masked": "after MaskedInput"}
    target = grid["target_server_ratio"]
    for p in sorted(grid["points"], key=lambda p: (p["phase"] != "shares", p["clients"], p["dim"])):
        judged = "server_ratio_with_kex" if p["dim"] <= KEX_LIMIT_MAX_DIM else "server_ratio"
        server, kex = f"{p['server_ratio']:.2f}×", f"{p['server_ratio_with_kex']:.2f}×"
        if p[judged] <= target:
            server, kex = (f"**{server}**", kex) if judged == "server_ratio" else (server, f"**{kex}**")
        lines.append(
            f"| {p['clients']:,} | {p['dim']:,} | {phase_name[p['phase']]} | {p['k']}, {p['t']} | "
            f"{p['bits']} ({p['wire_bits']}) | {server} ({_ratio_range(p['server_ratio_per_run'])}) | "
            f"{kex} | {p['client_ratio']:.2f}× | {p['upload_ratio']:.3f} | "
            f"{'yes' if p['correct'] else 'NO'} |"
        )
    for s in grid["skipped"]:
        lines.append(f"| {s['clients']:,} | {s['dim']:,} | {phase_name[s['phase']]} | "
                     f"skipped: {s['reason']} ||||||| ")
    return "\n".join(lines)


def plot_grid(grid: dict, path: Path) -> None:
    """Ratio per point: server (solid; dashed with X25519/HKDF in the limit) and client, per
    dropout phase, against N, one line per D, with the targets drawn in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = sorted({p["phase"] for p in grid["points"]})
    if not phases:
        return
    fig, axes = plt.subplots(2, len(phases), figsize=(6 * len(phases), 8), squeeze=False,
                             sharex=True)
    titles = {"shares": "10 % drop after ShareKeys", "masked": "10 % drop after MaskedInput"}
    for col, phase in enumerate(phases):
        mine = [p for p in grid["points"] if p["phase"] == phase]
        for dim in sorted({p["dim"] for p in mine}):
            line = sorted((p for p in mine if p["dim"] == dim), key=lambda p: p["clients"])
            ns = [p["clients"] for p in line]
            drawn = axes[0][col].plot(ns, [p["server_ratio"] for p in line], "o-", label=f"D={dim:,}")
            axes[0][col].plot(ns, [p["server_ratio_with_kex"] for p in line], "x--",
                              color=drawn[0].get_color())
            axes[1][col].plot(ns, [p["client_ratio"] for p in line], "o-", label=f"D={dim:,}")
        for row, (target, what) in enumerate(((grid["target_server_ratio"], "server sum"),
                                              (grid["target_client_ratio"], "client masking"))):
            ax = axes[row][col]
            ax.axhline(target, color="red", lw=1, ls=":", label=f"target {target}x")
            ax.set_xscale("log")
            ax.set_ylabel(f"{what} / limit")
            ax.set_title(f"{what}, {titles.get(phase, phase)}"
                         + (" (dashed: limit + X25519/HKDF)" if row == 0 else ""), fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        axes[1][col].set_xlabel("devices N")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main


class MessageTracker:
    """Advances a progress bar per message the server receives; logs how long each kind took.

    The log lines are what a run redirected to a file shows while it goes on.
    """

    def __init__(self, progress: Progress, task) -> None:
        self.progress = progress
        self.task = task
        self.reset()

    def reset(self) -> None:
        self.kind: str | None = None
        self.since = time.perf_counter()
        self.count = 0

    def log(self, text: str) -> None:
        self.progress.console.log(text)

    def flush(self) -> None:
        if self.kind is not None:
            self.log(f"  {self.count:,} {self.kind}: {time.perf_counter() - self.since:.1f}s")
        self.kind = None

    def __call__(self, message: object) -> None:
        kind = type(message).__name__
        if kind != self.kind:
            self.flush()
            self.kind, self.since, self.count = kind, time.perf_counter(), 0
            self.progress.update(self.task, description=kind)
        self.count += 1
        self.progress.advance(self.task)



def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.grid:
        return run_grid(args)
    console = Console()
    if not console.is_terminal:  # a log file: room for the table's columns
        console = Console(width=110)
    schema = build_schema(args.dim)
    start = time.perf_counter()
    runs: list[dict] = []
    # Messages the server receives per run: AdvertiseKeys, ShareKeys, MaskedInput, Unmask.
    expected_messages = 4 * args.clients
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console, transient=False,
    ) as progress:
        repeats = progress.add_task("cohort runs", total=args.repeat)
        messages = progress.add_task("messages", total=expected_messages)
        tracker = MessageTracker(progress, messages)

        for rep in range(args.repeat):
            progress.reset(messages, total=expected_messages, description="messages")
            tracker.reset()
            runs.append(run_once(args, schema, rep, tracker, tracker.log))
            progress.advance(repeats)
            if not runs[-1]["correct"]:
                tracker.log(f"[red]run {rep} is not correct[/]: aborted={runs[-1]['aborted']}")
    summary = summarise(args, runs, time.perf_counter() - start)
    print_report(console, summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        console.print(f"wrote {args.json}")
    return 0 if summary["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
