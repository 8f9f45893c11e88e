"""What the coordinator and an aggregator exchange about a sum, outside any session stream: the
payload schema of each sum (``OpenSessionRequest``) and the cohort's packed total or abort reason
(``AwaitResult``).

Apart from the protocol messages because these belong to the aggregator's control API
(``aggregator_pb2``), which devices never speak; a schema or total that does not decode is a
``WireError`` like any other.
"""

from __future__ import annotations

import numpy as np

from tally.codec import Field, Kind, PayloadSchema, pack, ring_mask, unpack, wire_width
from tally.secagg.messages import SessionAborted, SumResult, SumSpec
from tally.wire.fields import WireError, device_index, device_indices, id_text
from tally.wire.protocol import from_proto
from tally.wire.v1 import aggregator_pb2, secagg_pb2

# ---- payload schemas ---------------------------------------------------------------------------

_KINDS = {Kind.REAL: aggregator_pb2.FIELD_KIND_REAL, Kind.COUNT: aggregator_pb2.FIELD_KIND_COUNT}
_KINDS_BACK = {v: k for k, v in _KINDS.items()}


def schema_to_proto(sum_id: str, schema: PayloadSchema) -> aggregator_pb2.PayloadSchemaSpec:
    """The schema of sum ``sum_id``; pairs as in ``SessionConfig.plan(schemas=...)``."""
    out = aggregator_pb2.PayloadSchemaSpec(sum_id=sum_id)
    for f in schema.fields:
        out.fields.add(name=f.name, shape=f.shape, kind=_KINDS[f.kind], clip=f.clip,
                       frac_bits=f.frac_bits)
    return out


def schema_from_proto(proto: aggregator_pb2.PayloadSchemaSpec) -> tuple[str, PayloadSchema]:
    """(sum_id, schema); a field with no kind, or any schema the codec refuses, is a WireError."""
    if not isinstance(proto, aggregator_pb2.PayloadSchemaSpec):
        raise WireError(f"expected a PayloadSchemaSpec, got {type(proto).__name__}")
    sum_id = id_text(proto, "sum_id")
    fields = []
    for f in proto.fields:
        kind = _KINDS_BACK.get(f.kind)
        if kind is None:
            raise WireError(f"schema of sum {sum_id!r}: field {f.name!r} has no kind")
        try:
            fields.append(Field(f.name, tuple(f.shape), kind, f.clip, f.frac_bits))
        except ValueError as exc:
            raise WireError(f"schema of sum {sum_id!r}: {exc}") from exc
    try:
        return sum_id, PayloadSchema(tuple(fields))
    except ValueError as exc:
        raise WireError(f"schema of sum {sum_id!r}: {exc}") from exc


# ---- cohort sums -------------------------------------------------------------------------------


def cohort_sum_to_proto(
    session_id: str, spec: SumSpec, result: SumResult | SessionAborted
) -> aggregator_pb2.CohortSum:
    """What AwaitResult returns: the packed total, or the abort reason."""
    out = aggregator_pb2.CohortSum(
        session_id=session_id, sum_id=spec.sum_id, bits=spec.bits, dim=spec.dim
    )
    if isinstance(result, SessionAborted):
        out.aborted_reason = result.reason or "aborted"
        return out
    if result.sum_id != spec.sum_id:
        raise ValueError(f"result of sum {result.sum_id!r} does not belong to {spec.sum_id!r}")
    out.total = pack(np.asarray(result.total), spec.wire_bits)
    out.contributors.extend(result.contributors)
    out.dropped.extend(result.dropped)
    for index, reason in result.excluded:
        out.excluded.add(index=index, reason=reason, proven=index in result.convicted)
    return out


def cohort_sum_from_proto(proto: aggregator_pb2.CohortSum) -> SumResult | SessionAborted:
    """The cohort's SumResult (total mod 2**bits, as the codec decodes it), or SessionAborted."""
    if not isinstance(proto, aggregator_pb2.CohortSum):
        raise WireError(f"expected a CohortSum, got {type(proto).__name__}")
    if proto.aborted_reason:
        return SessionAborted(proto.aborted_reason)
    sum_id = id_text(proto, "sum_id")
    spec = from_proto(secagg_pb2.SumSpec(sum_id=sum_id, dim=proto.dim, bits=proto.bits))
    try:
        total = unpack(proto.total, wire_width(spec.bits), spec.dim)
    except ValueError as exc:
        raise WireError(f"CohortSum {sum_id!r}: {exc}") from exc
    if total.size and int(total.max()) > ring_mask(spec.bits):
        raise WireError(f"CohortSum {sum_id!r}: total has values >= 2^{spec.bits}")
    excluded = tuple((device_index(e, "index"), e.reason) for e in proto.excluded)
    convicted = tuple(device_index(e, "index") for e in proto.excluded if e.proven)
    return SumResult(sum_id, total, device_indices(proto, "contributors"), device_indices(proto, "dropped"), excluded,
                     convicted)
