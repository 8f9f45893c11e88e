"""The algorithm contract (DESIGN.md section 5).

A round is an ordered list of steps; each step is: the server broadcasts, devices compute, one secure
sum, the server updates. The server half only ever receives the *total* of a step's payload over the
round's devices: that is the one rule made structural. The client half keeps whatever must stay on the
device in ``local_state``. The simulator (``tally.sim.rounds``) and the services (coordinator, client
SDK) run any pair of halves that follows this contract, so everything they rely on is declared here:
the step flags on ``StepSpec``, the server half's methods, the per-silo broadcast of personal
steps (``PersonalBroadcast``), the personal model of a personalised client half
(``PersonalisedClient``) and the one parser of an algorithm's options (``Options``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import numpy as np

from tally.codec import PayloadSchema

Arrays = dict[str, np.ndarray]


@dataclass(frozen=True)
class StepSpec:
    """One step of a round: its name, the schema of what each device contributes, and how a runner
    (the simulator or the coordinator) must carry it out.

    Both flags default to the plain case, one broadcast for everyone and one secure sum, so an
    algorithm that keeps the one rule never sets them. They exist for AAggFF-S's online Newton step,
    the documented exception (DESIGN.md section 1), and every runner reads them from here:

    * ``personal``: each device gets its own broadcast, ``broadcast_to(state, name, d)`` with ``d``
      its stable id in ``[0, num_clients)`` (the server half must implement
      ``PersonalBroadcast``), because what it is sent (its own coefficient) must not reach the
      others. The contributions are still summed securely.
    * ``reveal``: the names of the values this step reveals in the clear, each one the job opted in
      to. A runner does *not* run a secure sum: it checks that the job's ``reveal:`` list names every
      one of them, encodes each answering device's payload through ``schema`` alone (the same fixed
      point, no masks) and calls
      ``apply(state, name, {"device_ids": int64[n], field: values[n, *shape] for every field})``
      with rows in ascending id order; the contributors are the devices that answered. The schema's
      ``count`` field is 1, or 0 for a device with nothing to reveal. The runner logs every reveal
      and counts the values (devices × revealed names): the coordinator in
      ``tally_coordinator_revealed_values_total``, the simulator in
      ``tally.sim.rounds.REVEALED_VALUES``. Differential privacy refuses such a step.
    """

    name: str
    schema: PayloadSchema
    reveal: tuple[str, ...] = ()
    personal: bool = False


class ModelMismatch(ValueError):
    """The parameters a trainer was given do not fit its model (names or shapes).

    A device whose model is not the job's must refuse the task with this reason, which it
    reports to the coordinator, rather than fail inside training with a framework error."""


def check_fits(given: Mapping[str, np.ndarray], model: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ``ModelMismatch`` naming every parameter of ``model`` that ``given`` lacks or
    shapes differently."""
    problems = []
    for name, shape in model.items():
        if name not in given:
            problems.append(f"{name} missing")
        elif tuple(np.shape(given[name])) != tuple(shape):
            problems.append(f"{name} is {tuple(np.shape(given[name]))}, the device's model {tuple(shape)}")
    if problems:
        raise ModelMismatch("the job's model does not fit this device's model: " + "; ".join(problems))


class LocalTrainer(Protocol):
    """What a device offers an algorithm: training and evaluation on its own data.

    The client SDK and the simulator implement it with torch (``cuda`` when present);
    algorithms never touch the data directly, so one algorithm file serves both.
    """

    @property
    def num_examples(self) -> int: ...

    def train(self, params: Mapping[str, np.ndarray], epochs: int, lr: float, batch_size: int) -> tuple[Arrays, float]:
        """Train from ``params``; return the new parameters and the mean training loss."""
        ...

    def evaluate(self, params: Mapping[str, np.ndarray]) -> tuple[float, float]:
        """(mean loss, accuracy) of ``params`` on this device's data."""
        ...


class ServerAlgorithm(Protocol):
    """The server half: pure functions of a state it owns, fed with sums only.

    The runner keeps the state (the coordinator stores it between rounds and resumes from it after a
    restart), so what a server half learns from sums belongs in the state, not in the object: the
    same state through the same totals gives the same model, in the simulator and the services alike.
    """

    name: str

    def init(self, params: Arrays) -> Any:
        """The state before round 0 from the job's initial model.

        Only the model, because the options were fixed when the half was built
        (``Options.from_dict``) and the model is the job's (its ``model:`` section, or the
        simulator's task): one server half then serves any model, and a restarted coordinator
        rebuilds the same half from the job spec alone."""
        ...

    def steps(self, state: Any) -> list[StepSpec]:
        """This round's steps, in order, with the schema of each sum.

        A function of the state because a round's shape may change as rounds pass (LG-FedAvg's
        warm-up sums the whole model, later rounds the global layers only) and a schema's sizes
        follow the model. The runner asks at the start of each round and opens one secure sum per
        step with exactly these schemas, so devices and aggregators agree on every payload."""
        ...

    def broadcast(self, state: Any, step: str) -> Arrays:
        """What every device of the round receives before computing ``step``'s contribution.

        Called after the earlier steps' totals were applied, so a later step can depend on an
        earlier sum (the mean loss AAggFF-D's devices turn into responses). It must be the same
        for every device; a step whose devices need different values is ``personal``."""
        ...

    def apply(self, state: Any, step: str, total: Mapping[str, np.ndarray]) -> Any:
        """The state after ``step``'s total, the sum of the payload over the devices that counted.

        The only way device data reaches the server half, and it is a sum: nothing here can single
        out one device (a reveal step, opted in, hands rows by device id instead). A total whose
        weight or count is zero means no device counted; raise ``ValueError`` rather than divide."""
        ...

    def model(self, state: Any) -> Arrays:
        """The global model in ``state``: what is evaluated, exported and served to new devices.

        Separate from the state because the state also holds what only the server needs
        (optimizer moments, domain weights, a decision over silos)."""
        ...


@runtime_checkable
class PersonalBroadcast(Protocol):
    """A server half with ``personal`` steps: it can address one device.

    Only AAggFF-S's online Newton step needs it: each silo is sent its own mixing coefficient,
    which the others must not learn (the runner calls this instead of ``broadcast``)."""

    def broadcast_to(self, state: Any, step: str, device_id: int) -> Arrays:
        """What device ``device_id`` (a stable id in ``[0, num_clients)``) receives before ``step``."""
        ...


class ClientAlgorithm(Protocol):
    """The device half: turns a broadcast and the device's own data into one step's payload."""

    def contribute(
        self, step: str, broadcast: Mapping[str, np.ndarray], device: LocalTrainer, local_state: Any
    ) -> tuple[Arrays, Any]:
        """This device's payload for ``step`` (a value for every field of the step's schema, within
        its clip) and its new local state.

        The payload is summed with every other device's before anyone reads it, so it may depend on
        anything the device holds; what must never leave the device goes in the returned state.
        The runner keeps that state only if the payload counted (a device that dropped out of the
        sum keeps its old one), so a step must not assume its previous contribution was used."""
        ...


@runtime_checkable
class PersonalisedClient(ClientAlgorithm, Protocol):
    """A client half whose devices end up with a model of their own (LG-FedAvg, SuPerFed).

    Reports judge each device on the model it would use rather than the global one; a client half
    without this method personalises nothing and every device uses the global model."""

    def personal_model(
        self, model: Mapping[str, np.ndarray], local_state: Any, validation: LocalTrainer | None = None
    ) -> Arrays:
        """The model this device would use, from the global ``model`` and its ``local_state``
        (``None`` for a device that never took part: what a new device would use).

        Anything tuned (SuPerFed's mixing weight) is tuned on ``validation``, the device's
        validation split, never on the data it is reported on."""
        ...


C = TypeVar("C", bound="Options")


class Options:
    """Base of every algorithm's options dataclass: ``from_dict`` is the one parser of a job's
    ``options:`` mapping (and of ``tally simulate --option``).

    One parser so every algorithm refuses the same mistakes the same way: an unknown key is named
    with the algorithm's options, and a tuple-typed option takes a YAML list or one string (a lone
    pattern or name). Each option's meaning and range are in ``tally.algorithms.options``; checks
    between options are the dataclass's ``__post_init__``."""

    options_of: ClassVar[str]  # the algorithm these options configure, as error messages name it

    @classmethod
    def from_dict(cls: type[C], raw: Mapping[str, Any] | None) -> C:
        """The options in ``raw`` (missing ones take their defaults); ``ValueError`` naming each
        unknown key or a value that is not the list a tuple option needs."""
        raw = dict(raw or {})
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - fields
        if unknown:
            raise ValueError(f"unknown {cls.options_of} options {sorted(unknown)}")
        hints = typing.get_type_hints(cls)
        return cls(**{name: _as_declared(cls.options_of, name, hints[name], value) for name, value in raw.items()})


def _as_declared(options_of: str, name: str, hint: Any, value: Any) -> Any:
    """``value`` as a tuple where the option is declared one (YAML and JSON have lists only)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if value is None:
            return None
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) is not tuple:
        return value
    if isinstance(value, str):
        value = (value,)
    elif not isinstance(value, Iterable):
        raise ValueError(f"{options_of} option {name} takes a list, got {value!r}")
    element = typing.get_args(hint)[0]
    return tuple(float(v) for v in value) if element is float else tuple(value)


def flatten(params: Mapping[str, np.ndarray]) -> np.ndarray:
    """Parameters as one float64 vector, in the mapping's order."""
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in params.values()])


def unflatten(vector: np.ndarray, like: Mapping[str, np.ndarray]) -> Arrays:
    out, offset = {}, 0
    for name, value in like.items():
        size = int(np.prod(value.shape, dtype=np.int64))
        out[name] = vector[offset : offset + size].reshape(value.shape).astype(value.dtype)
        offset += size
    if offset != vector.size:
        raise ValueError(f"vector has {vector.size} values, the model {offset}")
    return out
