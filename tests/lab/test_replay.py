"""Tests for replaying a recorded log through a candidate config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import tidegate.lab.replay as replay_module
from tidegate.errors import ConfigError
from tidegate.gateway.build import admission_options_from, breaker_options_from, retry_policy_from
from tidegate.gateway.config import AdmissionConfig, RouteConfig, ServerConfig, load_config
from tidegate.lab.replay import ReplayConfig, load_replay_config, replay_log, sample_log
from tidegate.lab.workload import Trace, TraceRecord, load_trace
from tidegate.policy.admission import AdmissionController, AdmissionOptions
from tidegate.policy.breaker import BreakerOptions, CircuitBreaker
from tidegate.policy.retry import RetryOptions
from tidegate.policy.routing import FailoverOptions


def steady(n: int, *, outcome: str = "ok", gap: float = 1.0) -> list[TraceRecord]:
    return [
        TraceRecord(at=i * gap, klass="standard", latency=0.5, outcome=outcome) for i in range(n)
    ]


def config(**fields: object) -> ReplayConfig:
    values: dict[str, object] = {
        "admission": AdmissionOptions(classes=("critical", "standard"), slots=4, queue_cap=8),
        "deadline": 10.0,
        "per_try": 5.0,
    }
    values.update(fields)
    return ReplayConfig(**values)  # type: ignore[arg-type]


def _isort_order(name: str) -> tuple[int, str]:
    """Constants first, then classes, then functions, as ruff's isort-style sort orders them."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_all_is_sorted_and_exported() -> None:
    """The public API is an ``__all__`` sorted as ruff sorts it, whose every name exists."""
    assert replay_module.__all__ == sorted(replay_module.__all__, key=_isort_order)
    for name in replay_module.__all__:
        assert hasattr(replay_module, name)


def test_a_healthy_log_replays_unchanged() -> None:
    """Requests that fit the candidate's slots are answered as they were, with one call each."""
    result = replay_log(Trace(records=tuple(steady(50))), config())
    assert result.recorded == {"ok": 50}
    assert result.replayed == {"ok": 50}
    assert result.changed == {}
    assert result.calls == 50
    assert result.retries == 0
    assert result.replayed_p95 == pytest.approx(0.5)


def test_a_burst_beyond_the_candidate_is_shed() -> None:
    """Twenty requests at once against four slots and eight places: eight are refused."""
    burst = tuple(TraceRecord(at=0.0, latency=1.0, klass="standard") for _ in range(20))
    result = replay_log(
        Trace(records=burst),
        config(
            admission=AdmissionOptions(
                classes=("standard",), slots=4, queue_cap=8, mode="queue_cap"
            )
        ),
    )
    assert result.replayed == {"ok": 12, "shed": 8}
    assert result.changed == {("ok", "shed"): 8}


def test_a_breaker_turns_an_outage_into_fast_refusals() -> None:
    """A long run of provider failures opens the candidate's breaker: later calls never start."""
    records = steady(10) + [
        TraceRecord(at=10.0 + i, latency=0.2, outcome="provider_server") for i in range(30)
    ]
    result = replay_log(
        Trace(records=tuple(records)),
        config(
            breaker=BreakerOptions(consecutive_failures=3, recovery=100.0),
            retry=RetryOptions(attempts=1),
        ),
    )
    assert result.replayed["circuit_open"] > 20
    assert result.replayed["provider_error"] == 3
    assert result.calls < len(records) - 20


def test_retries_recover_a_blip_the_log_recorded_as_a_failure() -> None:
    """A lone failure between successes is retried into an answer."""
    records = [
        *steady(5),
        TraceRecord(at=5.0, latency=0.1, outcome="provider_server"),
        *[TraceRecord(at=5.5 + i, latency=0.5) for i in range(5)],
    ]
    result = replay_log(
        Trace(records=tuple(records)),
        config(retry=RetryOptions(attempts=3, base=0.5, cap=1.0)),
    )
    assert result.changed == {("provider_error", "ok"): 1}
    assert result.retries >= 1
    assert result.calls == len(records) + result.retries


def test_unknown_classes_fall_to_the_lowest_class() -> None:
    """A logged class the candidate does not know is replayed as its lowest class."""
    records = (TraceRecord(at=0.0, klass="gold", latency=0.1),)
    result = replay_log(Trace(records=records), config())
    assert result.by_class == {"standard": {"ok": 1}}


def test_the_replay_uses_the_policy_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission and the breaker are tidegate.policy's own classes, called for every request."""
    seen: list[str] = []
    for cls, method in ((AdmissionController, "offer"), (CircuitBreaker, "acquire")):
        original = getattr(cls, method)

        def spy(
            self: object, *a: object, _o: object = original, _n: str = method, **k: object
        ) -> object:
            seen.append(_n)
            return _o(self, *a, **k)  # type: ignore[operator]

        monkeypatch.setattr(cls, method, spy)
    replay_log(Trace(records=tuple(steady(3))), config())
    assert seen.count("offer") == 3
    assert seen.count("acquire") == 3


#: What every gateway config needs (a provider and a route naming it).
ROUTED = """
providers: {a: {type: fake, model: m-1}}
models:
  chat: {providers: [a], per_try_timeout_s: 4}
  fast: {providers: [a], per_try_timeout_s: 2}
"""


def write(tmp_path: Path, text: str, name: str = "tidegate.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_the_candidate_config_reads_the_gateway_keys(tmp_path: Path) -> None:
    """admission, retry, breaker and the timeouts come from a tidegate YAML read by the gateway's
    loader; a secret file it names need not exist on the machine running the lab."""
    path = write(
        tmp_path,
        ROUTED
        + """
auth: {keys_file: /nowhere/keys}
server: {request_timeout_s: 12}
admission: {classes: [critical, standard], slots: 3, queue_cap: 5, dequeue: fifo}
retry: {attempts: 2, base_s: 0.25, cap_s: 1, jitter: equal, budget_ratio: 0.2,
        retry_timeouts_on_same_provider: true}
breaker: {consecutive_failures: 2, recovery_s: 9, window_s: 20}
""",
    )
    loaded = load_replay_config(path)
    assert loaded.admission.classes == ("critical", "standard")
    assert (loaded.admission.slots, loaded.admission.queue_cap) == (3, 5)
    assert loaded.retry == RetryOptions(attempts=2, base=0.25, cap=1.0, jitter="equal")  # type: ignore[arg-type]
    assert loaded.budget_ratio == 0.2
    assert loaded.failover.retry_timeouts is True
    assert loaded.breaker.consecutive_failures == 2
    assert loaded.breaker.recovery == 9.0
    assert (loaded.deadline, loaded.per_try) == (12.0, 2.0)


def test_the_three_admission_keys_the_old_reader_refused_are_read(tmp_path: Path) -> None:
    """conditional_priority, drop_expired_at_dequeue and initial_service_time_s are gateway keys:
    they reach the replay's admission options."""
    path = write(
        tmp_path,
        ROUTED
        + """
admission: {dequeue: strict, conditional_priority: 0.5, drop_expired_at_dequeue: false,
            initial_service_time_s: 2.5}
""",
    )
    admission = load_replay_config(path).admission
    assert admission.conditional_priority == 0.5
    assert admission.drop_expired_at_dequeue is False
    assert admission.initial_service_time == 2.5


def test_the_defaults_are_the_gateways(tmp_path: Path) -> None:
    """A config that sets none of the policies replays with the gateway's own defaults: the
    per-try timeout is the gateway's (15 s), the request timeout, the queue cap."""
    path = write(
        tmp_path, "providers: {a: {type: fake, model: m-1}}\nmodels: {chat: {providers: [a]}}\n"
    )
    loaded = load_replay_config(path)
    assert loaded.per_try == RouteConfig.model_fields["per_try_timeout_s"].default == 15.0
    assert loaded.deadline == ServerConfig.model_fields["request_timeout_s"].default
    assert loaded.admission.queue_cap == AdmissionConfig.model_fields["queue_cap"].default
    assert loaded.failover.retry_timeouts is False


def test_the_options_are_the_ones_the_gateway_builds(tmp_path: Path) -> None:
    """The replay's options are what gateway/build.py makes of the same file."""
    path = write(
        tmp_path,
        ROUTED + "admission: {slots: 7, mode: queue_cap}\nbreaker: {failure_rate: 0.3}\n",
    )
    gateway = load_config(path, env={})
    loaded = load_replay_config(path)
    assert loaded.admission == admission_options_from(gateway)
    assert loaded.retry == retry_policy_from(gateway)
    assert loaded.breaker == breaker_options_from(gateway)
    assert (loaded.budget_ratio, loaded.budget_floor_per_s) == (
        gateway.retry.budget_ratio,
        gateway.retry.budget_floor_per_s,
    )


def test_queue_cap_zero_is_refused_with_the_gateways_message(tmp_path: Path) -> None:
    """The gateway refuses ``queue_cap: 0``: so does the replay, in the same words."""
    path = write(tmp_path, ROUTED + "admission: {queue_cap: 0}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path, env={})
    with pytest.raises(ValueError) as replayed:
        load_replay_config(path)
    assert "admission.queue_cap" in str(replayed.value)
    assert str(replayed.value) == refused.value.message


def test_the_environment_does_not_override_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TIDEGATE_* variables of the machine running the lab change nothing: the file is read."""
    monkeypatch.setenv("TIDEGATE_ADMISSION__SLOTS", "99")
    path = write(tmp_path, ROUTED + "admission: {slots: 3}\n")
    assert load_replay_config(path).admission.slots == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (ROUTED + "admission: {slotz: 3}", "unknown key 'admission.slotz'"),
        (ROUTED + "retry: {tries: 3}", "unknown key 'retry.tries'"),
        (ROUTED + "colour: blue", "unknown key 'colour'"),
        (ROUTED + "breaker: [1]", "breaker"),
        (ROUTED + "admission: {slots: 0}", "admission.slots"),
        (
            ROUTED + "admission: {dequeue: fifo, conditional_priority: 0.5}",
            "admission: conditional_priority needs dequeue",
        ),
        (ROUTED + "profile: production", "profile production refuses to start"),
        (ROUTED + "profile: production\nauth: {keys_file: /nowhere/keys}", "rate limits"),
        ("admission: {slots: 3}", "providers: Field required"),
        ("[1, 2]", "top level"),
        ("a: [", "not valid YAML"),
    ],
)
def test_bad_candidate_configs_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    """Unknown keys, bad values, the profile's rules and broken YAML are refused as the gateway
    refuses them, with the key in the message."""
    with pytest.raises(ValueError, match=re.escape(message)):
        load_replay_config(write(tmp_path, text, "bad.yaml"))


def test_the_sample_log_has_a_burst_and_an_outage(tmp_path: Path) -> None:
    """The built-in sample shows steady traffic, a burst and provider errors, and round-trips."""
    trace = sample_log(seed=0)
    outcomes = {r.outcome for r in trace.records}
    assert outcomes == {"ok", "provider_server"}
    in_burst = sum(1 for r in trace.records if 240 <= r.at < 300)
    assert in_burst > 2 * sum(1 for r in trace.records if 120 <= r.at < 180)
    path = tmp_path / "log.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"at": r.at, "class": r.klass, "latency": r.latency, "outcome": r.outcome})
            for r in trace.records
        )
    )
    assert [r.at for r in load_trace(path).records] == [
        r.at - trace.records[0].at for r in trace.records
    ]
    first = replay_log(trace, config(admission=AdmissionOptions(slots=12, queue_cap=24)))
    assert first == replay_log(trace, config(admission=AdmissionOptions(slots=12, queue_cap=24)))
    assert sum(first.replayed.values()) == first.requests == len(trace.records)


def test_late_admitted_work_running_out_of_deadline_leaves_critical_traffic_served() -> None:
    """Overload under strict priority against a healthy provider: batch work that starts late
    runs out of its deadline mid-call. Those cut-short calls are not evidence about the provider,
    so its breaker never opens and every critical request is still served."""
    critical = [TraceRecord(at=i * 1.0, klass="critical", latency=0.4) for i in range(60)]
    batch = [TraceRecord(at=0.05 + i * 0.1, klass="batch", latency=0.4) for i in range(600)]
    candidate = config(
        admission=AdmissionOptions(
            classes=("critical", "batch"), slots=2, queue_cap=64, mode="queue_cap"
        ),
        deadline=1.0,
        per_try=5.0,
        retry=RetryOptions(attempts=1),
        breaker=BreakerOptions(consecutive_failures=5, minimum_calls=10, recovery=30.0),
    )
    result = replay_log(Trace(records=tuple(critical + batch)), candidate)
    assert result.by_class["critical"] == {"ok": 60}
    assert "circuit_open" not in result.replayed
    cut_short = result.calls - result.replayed["ok"]
    assert cut_short > 50  # the overload engaged: many calls ended at the caller's deadline


@pytest.mark.parametrize(
    ("retry_timeouts", "changed"), [(False, {}), (True, {("provider_error", "ok"): 1})]
)
def test_a_timeout_is_retried_on_the_same_provider_only_as_the_gateway_would(
    retry_timeouts: bool, changed: dict[tuple[str, str], int]
) -> None:
    """The failover table's rule holds in the replay as in the gateway: a timeout is not retried
    on the same provider unless ``retry_timeouts_on_same_provider`` is set."""
    records = [
        *steady(5),
        TraceRecord(at=5.0, latency=0.1, outcome="provider_timeout"),
        *[TraceRecord(at=5.5 + i, latency=0.5) for i in range(5)],
    ]
    candidate = config(
        retry=RetryOptions(attempts=3, base=0.5, cap=1.0),
        failover=FailoverOptions(retry_timeouts=retry_timeouts),
    )
    result = replay_log(Trace(records=tuple(records)), candidate)
    assert result.changed == changed
    assert (result.retries > 0) is retry_timeouts


def test_a_logged_deadline_shortens_the_candidates_never_lengthens_it() -> None:
    """A request whose log line gave a 1 s deadline is cut short on a 2 s call (the attempt's
    timeout, as in the gateway); one whose logged deadline is longer than the candidate's
    request timeout gets the candidate's."""
    records = (
        TraceRecord(at=0.0, latency=2.0, deadline=1.0),
        TraceRecord(at=0.0, latency=2.0),
        TraceRecord(at=0.0, latency=12.0, deadline=60.0),
    )
    result = replay_log(Trace(records=records, skipped=4), config(per_try=30.0))
    assert result.by_class == {"standard": {"ok": 1, "provider_error": 2}}
    assert result.changed == {("ok", "provider_error"): 2}
    assert result.skipped == result.as_dict()["skipped"] == 4
