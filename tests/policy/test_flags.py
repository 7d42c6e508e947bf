"""Tests for tidegate.policy.flags: typed flags, the audit history, snapshots and the kill switch."""

from __future__ import annotations

import json
import math
import re

import pytest

from tidegate.clock import ManualClock
from tidegate.errors import Unavailable, http_error
from tidegate.policy import flags as flags_module
from tidegate.policy.flags import (
    ANSWER_MODE,
    BUILTIN_SPECS,
    AuditEntry,
    FlagSet,
    FlagSpec,
    KillSwitchMode,
    check_answering,
)

START = 1_767_225_600.0  # ManualClock's default wall time at now() == 0

SPECS = (
    FlagSpec("prompt.version", str, "v1", "which prompt template answers"),
    FlagSpec("rollout.share", float, 0.0, "share of users on the new version"),
    FlagSpec("answer.max_tokens", int, 1024, "upper bound on max_tokens"),
    FlagSpec("cache.enabled", bool, True, "serve exact repeats from the response cache"),
)


def isort_key(name: str) -> tuple[int, str]:
    """Constants, then classes, then functions, each alphabetical (ruff's RUF022 order)."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def make(clock: ManualClock | None = None) -> FlagSet:
    return FlagSet(SPECS, clock or ManualClock())


def test_all_is_sorted_and_complete() -> None:
    """The module lists its public names in a sorted __all__, and each one exists."""
    assert list(flags_module.__all__) == sorted(flags_module.__all__, key=isort_key)
    for name in flags_module.__all__:
        assert hasattr(flags_module, name)


# --------------------------------------------------------------------------- values and audit


def test_unset_flags_read_their_defaults() -> None:
    """A flag nobody set has its spec's default, the kill switch included."""
    flags = make()
    assert [flags.get(s.name) for s in SPECS] == ["v1", 0.0, 1024, True]
    assert flags.get(ANSWER_MODE) == "full"


def test_set_changes_the_value_and_returns_the_audit_entry() -> None:
    """set stores the value and returns who changed what, from what, why and when."""
    clock = ManualClock()
    clock.advance(5.0)
    flags = make(clock)
    entry = flags.set("prompt.version", "v2", who="oncall", why="new prompt passed review")
    assert flags.get("prompt.version") == "v2"
    assert entry == AuditEntry(
        "prompt.version", "v1", "v2", "oncall", "new prompt passed review", START + 5.0
    )


def test_history_keeps_every_change_in_order_per_flag_and_overall() -> None:
    """history lists changes oldest first, all of them or one flag's."""
    clock = ManualClock()
    flags = make(clock)
    flags.set("rollout.share", 0.05, who="rollout-bot", why="gate proceeded")
    clock.advance(600.0)
    flags.set("prompt.version", "v2", who="dana", why="fix wording")
    clock.advance(600.0)
    flags.set("rollout.share", 0.0, who="rollout-bot", why="gate rolled back")
    share = flags.history("rollout.share")
    assert [(e.old, e.new, e.at) for e in share] == [
        (0.0, 0.05, START),
        (0.05, 0.0, START + 1200.0),
    ]
    assert [e.flag for e in flags.history()] == ["rollout.share", "prompt.version", "rollout.share"]
    assert flags.history("cache.enabled") == ()


def test_setting_the_same_value_is_still_recorded() -> None:
    """The history is of decisions: re-setting the current value leaves an entry."""
    flags = make()
    flags.set("cache.enabled", True, who="oncall", why="confirming after the incident")
    assert len(flags.history("cache.enabled")) == 1


def test_on_change_sees_every_entry() -> None:
    """The on_change callback receives each audit entry as it is made."""
    seen: list[AuditEntry] = []
    flags = FlagSet(SPECS, ManualClock(), on_change=seen.append)
    entry = flags.set("answer.max_tokens", 512, who="oncall", why="cost spike")
    assert seen == [entry]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("cache.enabled", 1),
        ("cache.enabled", "true"),
        ("answer.max_tokens", True),
        ("answer.max_tokens", 512.0),
        ("answer.max_tokens", "512"),
        ("rollout.share", False),
        ("rollout.share", "0.5"),
        ("prompt.version", 2),
    ],
)
def test_wrong_type_raises_value_error_naming_the_flag(name: str, value: object) -> None:
    """A value of the wrong type is refused, the message names the flag, nothing changes."""
    flags = make()
    with pytest.raises(ValueError, match=name):
        flags.set(name, value, who="oncall", why="typo")  # type: ignore[arg-type]
    assert flags.history() == ()
    assert flags.get(name) == next(s.default for s in SPECS if s.name == name)


def test_float_flag_takes_an_int_as_a_float() -> None:
    """An int given to a float flag is stored as a float."""
    flags = make()
    flags.set("rollout.share", 1, who="oncall", why="full rollout")
    value = flags.get("rollout.share")
    assert value == 1.0
    assert type(value) is float


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_float_flag_refuses_non_finite_values(value: float) -> None:
    """NaN and infinity are not valid flag values (and not valid JSON)."""
    with pytest.raises(ValueError, match=re.escape("rollout.share")):
        make().set("rollout.share", value, who="oncall", why="oops")


@pytest.mark.parametrize(("who", "why"), [("", "reason"), ("oncall", ""), ("  ", "reason")])
def test_who_and_why_are_required(who: str, why: str) -> None:
    """A change without a non-empty who and why is refused and not applied."""
    flags = make()
    field = "who" if not who.strip() else "why"
    with pytest.raises(ValueError, match=field):
        flags.set("prompt.version", "v2", who=who, why=why)
    assert flags.get("prompt.version") == "v1"


def test_unknown_flags_raise_key_error() -> None:
    """Reading, setting or asking the history of an undefined flag is a KeyError."""
    flags = make()
    with pytest.raises(KeyError, match="nope"):
        flags.get("nope")
    with pytest.raises(KeyError, match="nope"):
        flags.set("nope", True, who="a", why="b")
    with pytest.raises(KeyError, match="nope"):
        flags.history("nope")


def test_typed_getters_return_or_refuse() -> None:
    """get_bool/get_int/get_float/get_str return the value of their type and refuse others."""
    flags = make()
    assert flags.get_bool("cache.enabled") is True
    assert flags.get_int("answer.max_tokens") == 1024
    assert flags.get_float("rollout.share") == 0.0
    assert flags.get_str("prompt.version") == "v1"
    with pytest.raises(TypeError, match=re.escape("cache.enabled")):
        flags.get_int("cache.enabled")
    with pytest.raises(TypeError, match=re.escape("answer.max_tokens")):
        flags.get_float("answer.max_tokens")
    with pytest.raises(TypeError, match=re.escape("rollout.share")):
        flags.get_bool("rollout.share")
    with pytest.raises(TypeError, match=re.escape("prompt.version")):
        flags.get_bool("prompt.version")


# --------------------------------------------------------------------------- specs


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("", str, "x", "d"), {}, "name"),
        (("has space", str, "x", "d"), {}, "name"),
        (("a", list, [], "d"), {}, "type"),
        (("a", int, "1", "d"), {}, "'a'"),
        (("a", bool, 0, "d"), {}, "'a'"),
        (("a", str, "x", " "), {}, "description"),
        (("a", int, 1, "d"), {"choices": frozenset({"1"})}, "choices"),
        (("a", str, "x", "d"), {"choices": frozenset({"y"})}, "one of"),
        (("a", str, "x", "d"), {"choices": frozenset()}, "choices"),
    ],
)
def test_flag_spec_validates_itself(
    args: tuple[object, ...], kwargs: dict[str, object], match: str
) -> None:
    """A bad name, type, default, description or choices raises ValueError saying which."""
    with pytest.raises(ValueError, match=match):
        FlagSpec(*args, **kwargs)  # type: ignore[arg-type]


def test_choices_limit_a_string_flag() -> None:
    """A str flag with choices refuses any other string."""
    spec = FlagSpec("tier", str, "gold", "service tier", choices=frozenset({"gold", "silver"}))
    flags = FlagSet([spec], ManualClock())
    flags.set("tier", "silver", who="ops", why="downgrade")
    with pytest.raises(ValueError, match="tier"):
        flags.set("tier", "bronze", who="ops", why="downgrade")


def test_specs_must_have_distinct_names() -> None:
    """Two specs with one name, or one clashing with a built-in, are refused."""
    with pytest.raises(ValueError, match=re.escape("prompt.version")):
        FlagSet([*SPECS, FlagSpec("prompt.version", str, "v9", "again")], ManualClock())
    with pytest.raises(ValueError, match=ANSWER_MODE):
        FlagSet([FlagSpec(ANSWER_MODE, str, "full", "mine")], ManualClock())


def test_passing_the_builtin_specs_is_harmless() -> None:
    """Listing the built-in specs explicitly gives the same set as leaving them out."""
    flags = FlagSet([*BUILTIN_SPECS, *SPECS], ManualClock())
    assert set(flags.specs) == {ANSWER_MODE, *(s.name for s in SPECS)}


# --------------------------------------------------------------------------- snapshot / restore


def test_snapshot_round_trips_through_json() -> None:
    """A snapshot survives JSON and restores the same values and history in a fresh set."""
    clock = ManualClock()
    flags = make(clock)
    flags.set("rollout.share", 0.25, who="rollout-bot", why="gate proceeded")
    clock.advance(30.0)
    flags.set(ANSWER_MODE, KillSwitchMode.DEGRADED, who="oncall", why="provider outage")
    stored = json.loads(json.dumps(flags.snapshot()))

    replica = make()
    replica.restore(stored)
    assert replica.get("rollout.share") == 0.25
    assert replica.get(ANSWER_MODE) == "degraded"
    assert replica.history() == flags.history()
    assert replica.snapshot() == flags.snapshot()


def test_snapshot_holds_only_values_someone_set() -> None:
    """Defaults are not stored, so a later release's new default takes effect."""
    flags = make()
    flags.set("prompt.version", "v2", who="dana", why="fix wording")
    snapshot = flags.snapshot()
    assert snapshot["values"] == {"prompt.version": "v2"}
    newer = FlagSet(
        [
            FlagSpec("prompt.version", str, "v1", "which prompt template answers"),
            FlagSpec("answer.max_tokens", int, 2048, "upper bound on max_tokens"),
        ],
        ManualClock(),
    )
    newer.restore(snapshot)
    assert newer.get("answer.max_tokens") == 2048


def test_restore_keeps_flags_this_release_does_not_know() -> None:
    """Values of flags another release defined are carried through to the next snapshot."""
    flags = make()
    flags.restore({"version": 1, "values": {"future.flag": "on"}, "history": []})
    flags.set("prompt.version", "v3", who="dana", why="ship v3")
    assert flags.snapshot()["values"] == {"future.flag": "on", "prompt.version": "v3"}
    with pytest.raises(KeyError):
        flags.get("future.flag")


@pytest.mark.parametrize(
    ("snapshot", "match"),
    [
        ({"version": 2, "values": {}, "history": []}, "version"),
        ({"version": 1, "values": {"answer.max_tokens": "many"}, "history": []}, "max_tokens"),
        ({"version": 1, "values": {ANSWER_MODE: "off"}, "history": []}, ANSWER_MODE),
        ({"version": 1, "values": {}, "history": [{"flag": "x"}]}, "missing"),
        ({"version": 1, "values": [], "history": []}, "values"),
    ],
)
def test_restore_refuses_a_bad_snapshot_and_changes_nothing(
    snapshot: dict[str, object], match: str
) -> None:
    """A snapshot of another version or with a value that does not fit is refused whole."""
    flags = make()
    flags.set("prompt.version", "v2", who="dana", why="fix wording")
    before = flags.snapshot()
    with pytest.raises(ValueError, match=match):
        flags.restore(snapshot)
    assert flags.snapshot() == before


# --------------------------------------------------------------------------- kill switch


def test_builtin_kill_switch_spec() -> None:
    """answer.mode is built in: a str flag defaulting to full, limited to the three modes."""
    (spec,) = BUILTIN_SPECS
    assert spec.name == ANSWER_MODE == "answer.mode"
    assert spec.type is str
    assert spec.default == "full"
    assert spec.choices == frozenset({"full", "degraded", "unavailable"})


def test_check_answering_returns_full_and_degraded() -> None:
    """In full or degraded mode check_answering returns the mode for the caller to act on."""
    flags = make()
    assert check_answering(flags) is KillSwitchMode.FULL
    flags.set(ANSWER_MODE, "degraded", who="oncall", why="provider outage")
    assert check_answering(flags) is KillSwitchMode.DEGRADED


def test_kill_switch_refuses_with_an_honest_503() -> None:
    """In unavailable mode check_answering raises Unavailable from the flags policy."""
    flags = make()
    flags.set(ANSWER_MODE, KillSwitchMode.UNAVAILABLE, who="oncall", why="kill switch drill")
    stored = flags.get(ANSWER_MODE)
    assert stored == "unavailable"
    assert type(stored) is str
    with pytest.raises(Unavailable) as caught:
        check_answering(flags, retry_after=45.0)
    assert caught.value.policy == "flags"
    assert caught.value.retry_after == 45.0
    status, body, headers = http_error(caught.value)
    assert (status, headers) == (503, {"Retry-After": "45"})
    assert body["error"]["code"] == "unavailable"


def test_kill_switch_defaults_to_thirty_seconds_and_can_be_lifted() -> None:
    """The default Retry-After hint is 30 s, and setting full again answers normally."""
    flags = make()
    flags.set(ANSWER_MODE, "unavailable", who="oncall", why="drill")
    with pytest.raises(Unavailable) as caught:
        check_answering(flags)
    assert caught.value.retry_after == 30.0
    flags.set(ANSWER_MODE, "full", who="oncall", why="drill over")
    assert check_answering(flags) is KillSwitchMode.FULL
    assert [(e.old, e.new) for e in flags.history(ANSWER_MODE)] == [
        ("full", "unavailable"),
        ("unavailable", "full"),
    ]


def test_kill_switch_refuses_a_bad_retry_after() -> None:
    """A negative or non-finite retry_after is a ValueError."""
    with pytest.raises(ValueError, match="retry_after"):
        check_answering(make(), retry_after=-1.0)
    with pytest.raises(ValueError, match="retry_after"):
        check_answering(make(), retry_after=math.inf)


def test_check_answering_follows_every_change_of_the_mode() -> None:
    """The mode check_answering reads is the flag's value after every set, restore and failed
    restore, and is already the new one when on_change hears of a change."""
    heard: list[KillSwitchMode | str] = []
    flags = FlagSet(SPECS, ManualClock(), on_change=lambda _: heard.append(mode_of(flags)))

    def mode_of(flags: FlagSet) -> KillSwitchMode | str:
        try:
            mode = check_answering(flags)
        except Unavailable:
            return "refused"
        assert mode.value == flags.get_str(ANSWER_MODE)
        return mode

    assert mode_of(flags) is KillSwitchMode.FULL
    flags.set("prompt.version", "v2", who="dana", why="fix wording")
    flags.set(ANSWER_MODE, "degraded", who="oncall", why="outage")
    assert heard == [KillSwitchMode.FULL, KillSwitchMode.DEGRADED]
    flags.restore({"version": 1, "values": {ANSWER_MODE: "unavailable"}, "history": []})
    assert mode_of(flags) == "refused"
    with pytest.raises(ValueError, match=ANSWER_MODE):
        flags.restore({"version": 1, "values": {ANSWER_MODE: "off"}, "history": []})
    assert mode_of(flags) == "refused"
    flags.restore({"version": 1, "values": {}, "history": []})
    assert mode_of(flags) is KillSwitchMode.FULL


@pytest.mark.parametrize("retry_after", [30, 30.0, 0.0, 45.5])
def test_check_answering_takes_any_finite_retry_after(retry_after: float) -> None:
    """Any finite hint >= 0 is taken, the default's value passed explicitly too."""
    flags = make()
    assert check_answering(flags, retry_after) is KillSwitchMode.FULL
    flags.set(ANSWER_MODE, "unavailable", who="oncall", why="drill")
    with pytest.raises(Unavailable) as caught:
        check_answering(flags, retry_after=retry_after)
    assert caught.value.retry_after == retry_after


@pytest.mark.parametrize("retry_after", [math.nan, -0.5, "30", None])
def test_check_answering_refuses_what_is_not_a_finite_number(retry_after: object) -> None:
    """A hint that is not a finite number >= 0 is refused whatever the mode, naming the value."""
    with pytest.raises(ValueError, match=re.escape(f"got {retry_after!r}")):
        check_answering(make(), retry_after)  # type: ignore[arg-type]
