"""Flags: typed runtime switches with an audit history, and the kill switch built on them.

A :class:`FlagSet` knows each flag's :class:`FlagSpec` (type, default, description, optional
choices). Every change names who made it and why and is kept as an :class:`AuditEntry` stamped
with the clock's wall time. :meth:`FlagSet.snapshot` and :meth:`FlagSet.restore` turn the whole
state into plain JSON values for a shared store, so every replica agrees and the history
survives restarts.

The kill switch is the built-in flag ``answer.mode`` (a :class:`KillSwitchMode`): ``full`` answers
normally, ``degraded`` answers without models (stale cache, retrieval excerpts), ``unavailable``
refuses with an honest 503 and a ``Retry-After``, without a deploy. Use flags to roll back a
prompt or a setting; a model, a dependency or the application itself needs a redeploy.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from enum import StrEnum
from typing import Final, TypeAlias

from tidegate.clock import Clock
from tidegate.errors import Unavailable

__all__ = [
    "ANSWER_MODE",
    "BUILTIN_SPECS",
    "SNAPSHOT_VERSION",
    "AuditEntry",
    "FlagSet",
    "FlagSpec",
    "FlagValue",
    "KillSwitchMode",
    "check_answering",
]

FlagValue: TypeAlias = bool | int | float | str
FlagType: TypeAlias = type[bool] | type[int] | type[float] | type[str]

#: The version of the :meth:`FlagSet.snapshot` layout; :meth:`FlagSet.restore` refuses others.
SNAPSHOT_VERSION: Final = 1

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_TYPES: Final[tuple[FlagType, ...]] = (bool, int, float, str)


def _coerce(name: str, type_: FlagType, value: object) -> FlagValue:
    """``value`` as a plain ``type_`` value, or ValueError naming the flag.

    ``bool`` is not accepted for ``int`` or ``float`` flags (it is an ``int`` to Python, never to
    an operator); an ``int`` is accepted for a ``float`` flag. Floats must be finite.
    """
    wrong = ValueError(
        f"flag {name!r} takes a {type_.__name__}, got {type(value).__name__} {value!r}"
    )
    if type_ is bool:
        if not isinstance(value, bool):
            raise wrong
        return bool(value)
    if isinstance(value, bool):
        raise wrong
    if type_ is int:
        if not isinstance(value, int):
            raise wrong
        return int(value)
    if type_ is float:
        if not isinstance(value, int | float):
            raise wrong
        if not math.isfinite(value):
            raise ValueError(f"flag {name!r} takes a finite float, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise wrong
    return str(value)


class KillSwitchMode(StrEnum):
    """How the gateway answers, set through the ``answer.mode`` flag."""

    FULL = "full"
    DEGRADED = "degraded"
    UNAVAILABLE = "unavailable"


_MODES: Final = {mode.value: mode for mode in KillSwitchMode}
_REAL: Final = (int, float)
#: :func:`check_answering`'s default ``retry_after``; passed as this very object, it needs no check.
_RETRY_AFTER: Final = 30.0


@dataclass(frozen=True, slots=True)
class FlagSpec:
    """What a flag is: its name, type, default and meaning, and for ``str`` flags the choices.

    ``type`` is one of ``bool``, ``int``, ``float``, ``str``. ``choices`` (keyword only) limits a
    ``str`` flag to a fixed set of values.
    """

    name: str
    type: FlagType
    default: FlagValue
    description: str
    _: KW_ONLY
    choices: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or _NAME.fullmatch(self.name) is None:
            raise ValueError(
                f"name must be letters, digits and . _ - (starting with a letter or digit), "
                f"got {self.name!r}"
            )
        if self.type not in _TYPES:
            raise ValueError(
                f"type of flag {self.name!r} must be bool, int, float or str, got {self.type!r}"
            )
        if not isinstance(self.description, str) or not self.description.strip():
            raise ValueError(f"description of flag {self.name!r} must be a non-empty string")
        if self.choices is not None:
            if self.type is not str:
                raise ValueError(f"choices of flag {self.name!r} need type str")
            if not isinstance(self.choices, frozenset) or not self.choices:
                raise ValueError(f"choices of flag {self.name!r} must be a non-empty frozenset")
        # Normalise the default (an int default of a float flag becomes a float).
        object.__setattr__(self, "default", self.check(self.default))

    def check(self, value: object) -> FlagValue:
        """``value`` as this flag's plain type; ValueError naming the flag when it does not fit."""
        checked = _coerce(self.name, self.type, value)
        if self.choices is not None and checked not in self.choices:
            raise ValueError(
                f"flag {self.name!r} takes one of {sorted(self.choices)}, got {value!r}"
            )
        return checked


#: The kill switch's flag name.
ANSWER_MODE: Final = "answer.mode"

#: Flags every :class:`FlagSet` has.
BUILTIN_SPECS: Final[tuple[FlagSpec, ...]] = (
    FlagSpec(
        ANSWER_MODE,
        str,
        KillSwitchMode.FULL.value,
        "kill switch: full answers normally, degraded answers without models, "
        "unavailable refuses with 503 and Retry-After",
        choices=frozenset(m.value for m in KillSwitchMode),
    ),
)


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One change of one flag: from what to what, by whom, why, and when (Unix seconds)."""

    flag: str
    old: FlagValue
    new: FlagValue
    who: str
    why: str
    at: float

    def to_json(self) -> dict[str, FlagValue]:
        """The entry as a plain JSON object."""
        return {
            "flag": self.flag,
            "old": self.old,
            "new": self.new,
            "who": self.who,
            "why": self.why,
            "at": self.at,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> AuditEntry:
        """The entry written by :meth:`to_json`; ValueError when a field is missing or wrong."""
        try:
            flag, who, why = data["flag"], data["who"], data["why"]
            old, new, at = data["old"], data["new"], data["at"]
        except KeyError as exc:
            raise ValueError(f"audit entry is missing {exc.args[0]!r}: {dict(data)!r}") from None
        if not (isinstance(flag, str) and isinstance(who, str) and isinstance(why, str)):
            raise ValueError(f"audit entry flag, who and why must be strings: {dict(data)!r}")
        if not isinstance(at, int | float) or isinstance(at, bool):
            raise ValueError(f"audit entry 'at' must be a number: {dict(data)!r}")
        if not isinstance(old, bool | int | float | str) or not isinstance(
            new, bool | int | float | str
        ):
            raise ValueError(f"audit entry values must be JSON scalars: {dict(data)!r}")
        return cls(flag, old, new, who, why, float(at))


class FlagSet:
    """The current values of a set of flags, and who changed what.

    Only values someone set are stored: a flag never set follows its spec's default, even when a
    later release changes that default. Values in a restored snapshot for flags this set does
    not define are kept and written back by :meth:`snapshot`, so replicas running two releases do
    not erase each other's flags. ``on_change`` is called with each new :class:`AuditEntry`.
    """

    __slots__ = (
        "_answer_mode",
        "_clock",
        "_foreign",
        "_history",
        "_on_change",
        "_specs",
        "_values",
    )

    def __init__(
        self,
        specs: Iterable[FlagSpec],
        clock: Clock,
        *,
        on_change: Callable[[AuditEntry], None] | None = None,
    ) -> None:
        self._specs: dict[str, FlagSpec] = {s.name: s for s in BUILTIN_SPECS}
        builtin = set(self._specs)
        for spec in specs:
            if spec.name in builtin and spec == self._specs[spec.name]:
                continue  # passing the built-in spec itself is harmless
            if spec.name in self._specs:
                raise ValueError(
                    f"flag {spec.name!r} is defined twice (or clashes with a built-in)"
                )
            self._specs[spec.name] = spec
        self._clock = clock
        self._on_change = on_change
        self._values: dict[str, FlagValue] = {}
        self._foreign: dict[str, FlagValue] = {}
        self._history: list[AuditEntry] = []
        #: The kill switch's mode, kept in step with ``_values`` (every request reads it).
        self._answer_mode = self._read_answer_mode()

    @property
    def specs(self) -> Mapping[str, FlagSpec]:
        """Every flag this set knows, built-ins included, by name."""
        return dict(self._specs)

    def _read_answer_mode(self) -> KillSwitchMode:
        """The kill switch's value as a mode (the enum's call raises for a value it lacks)."""
        value = self.get_str(ANSWER_MODE)
        return _MODES.get(value) or KillSwitchMode(value)

    def _spec(self, name: str) -> FlagSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise KeyError(f"unknown flag {name!r}") from None

    def get(self, name: str) -> FlagValue:
        """The flag's current value (its default when never set); KeyError for an unknown flag."""
        spec = self._spec(name)
        return self._values.get(name, spec.default)

    def get_bool(self, name: str) -> bool:
        """The value of a ``bool`` flag; TypeError when the flag has another type."""
        value = self.get(name)
        if not isinstance(value, bool):
            raise TypeError(f"flag {name!r} is a {self._specs[name].type.__name__}, not a bool")
        return value

    def get_int(self, name: str) -> int:
        """The value of an ``int`` flag; TypeError when the flag has another type."""
        value = self.get(name)
        if self._specs[name].type is not int or not isinstance(value, int):
            raise TypeError(f"flag {name!r} is a {self._specs[name].type.__name__}, not an int")
        return value

    def get_float(self, name: str) -> float:
        """The value of a ``float`` flag; TypeError when the flag has another type."""
        value = self.get(name)
        if not isinstance(value, float):
            raise TypeError(f"flag {name!r} is a {self._specs[name].type.__name__}, not a float")
        return value

    def get_str(self, name: str) -> str:
        """The value of a ``str`` flag; TypeError when the flag has another type."""
        value = self.get(name)
        if not isinstance(value, str):
            raise TypeError(f"flag {name!r} is a {self._specs[name].type.__name__}, not a str")
        return value

    def set(self, name: str, value: FlagValue, *, who: str, why: str) -> AuditEntry:
        """Change a flag, record who and why, and return the audit entry.

        ValueError naming the flag when the value has the wrong type or is not one of the
        choices, or when ``who`` or ``why`` is empty. Setting the current value is recorded too:
        the history is of decisions, not only of differences.
        """
        spec = self._spec(name)
        new = spec.check(value)
        for field, text in (("who", who), ("why", why)):
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"setting flag {name!r} needs a non-empty {field}")
        entry = AuditEntry(name, self.get(name), new, who, why, self._clock.wall())
        self._values[name] = new
        if name == ANSWER_MODE:
            self._answer_mode = self._read_answer_mode()
        self._history.append(entry)
        if self._on_change is not None:
            self._on_change(entry)
        return entry

    def history(self, name: str | None = None) -> tuple[AuditEntry, ...]:
        """Every change, oldest first; only the given flag's when ``name`` is given."""
        if name is None:
            return tuple(self._history)
        self._spec(name)
        return tuple(e for e in self._history if e.flag == name)

    def snapshot(self) -> dict[str, object]:
        """The whole state as plain JSON values: ``{"version", "values", "history"}``."""
        values: dict[str, FlagValue] = {**self._foreign, **self._values}
        return {
            "version": SNAPSHOT_VERSION,
            "values": dict(sorted(values.items())),
            "history": [e.to_json() for e in self._history],
        }

    def restore(self, snapshot: Mapping[str, object]) -> None:
        """Replace the whole state with one made by :meth:`snapshot`.

        ValueError, leaving the state unchanged, when the snapshot has another version or a
        value does not fit its flag's spec.
        """
        version = snapshot.get("version")
        if version != SNAPSHOT_VERSION:
            raise ValueError(f"flag snapshot version {version!r} is not {SNAPSHOT_VERSION}")
        raw_values = snapshot.get("values", {})
        raw_history = snapshot.get("history", [])
        if not isinstance(raw_values, Mapping) or not isinstance(raw_history, list):
            raise ValueError("flag snapshot needs a 'values' object and a 'history' list")
        values: dict[str, FlagValue] = {}
        foreign: dict[str, FlagValue] = {}
        for name, value in raw_values.items():
            if not isinstance(name, str):
                raise ValueError(f"flag snapshot has a non-string flag name {name!r}")
            if name in self._specs:
                values[name] = self._specs[name].check(value)
            elif isinstance(value, bool | int | float | str):
                foreign[name] = value
            else:
                raise ValueError(f"flag {name!r} in the snapshot is not a JSON scalar: {value!r}")
        history = []
        for item in raw_history:
            if not isinstance(item, Mapping):
                raise ValueError(f"flag snapshot history holds a non-object: {item!r}")
            history.append(AuditEntry.from_json(item))
        self._values, self._foreign, self._history = values, foreign, history
        self._answer_mode = self._read_answer_mode()

    def __repr__(self) -> str:
        return f"FlagSet({sorted(self._specs)!r})"


def check_answering(flags: FlagSet, retry_after: float = _RETRY_AFTER) -> KillSwitchMode:
    """The current answer mode; raises :class:`~tidegate.errors.Unavailable` when it is off.

    ``retry_after`` (seconds) is the hint the 503 carries: how soon it is worth asking again.
    """
    if retry_after is not _RETRY_AFTER and (  # the default (every request's) is a valid one
        not isinstance(retry_after, _REAL) or not math.isfinite(retry_after) or retry_after < 0
    ):
        raise ValueError(f"retry_after must be a finite number >= 0, got {retry_after!r}")
    # Asked on every request: the mode the flag set keeps with its values, which is what
    # flags.get_str(ANSWER_MODE) holds, as a KillSwitchMode.
    mode = flags._answer_mode
    if mode is KillSwitchMode.UNAVAILABLE:
        raise Unavailable(
            f"answering is switched off ({ANSWER_MODE}={mode.value})",
            policy="flags",
            retry_after=retry_after,
        )
    return mode
