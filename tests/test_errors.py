import pytest

from tidegate import errors
from tidegate.errors import (
    ERROR_TABLE,
    PROVIDER_ERROR_TABLE,
    BudgetExceeded,
    ProviderError,
    ProviderErrorKind,
    QueueFull,
    RateLimited,
    Rejected,
    TidegateError,
    http_error,
)


def _leaf_classes(base: type[TidegateError]) -> list[type[TidegateError]]:
    """The leaves of the tree drawn in tidegate.errors (not private helpers built on it)."""
    leaves = []
    for sub in base.__subclasses__():
        if sub.__module__ != errors.__name__:
            continue
        leaves.extend(_leaf_classes(sub) or [sub])
    return leaves


def _instance(cls: type[TidegateError]) -> TidegateError:
    if issubclass(cls, Rejected):
        return cls("refused", policy="test", retry_after=2.5)
    if issubclass(cls, ProviderError):
        return cls(ProviderErrorKind.SERVER, "boom")
    if issubclass(cls, errors.MethodNotAllowed):
        return cls("bad", allow="GET")
    return cls("bad")


# ConfigError stops the process at start-up; it is never an HTTP answer.
ANSWERS = [c for c in _leaf_classes(TidegateError) if c is not errors.ConfigError]


@pytest.mark.parametrize("cls", ANSWERS, ids=lambda c: c.__name__)
def test_every_error_class_maps_to_exactly_one_table_row(cls: type[TidegateError]) -> None:
    """Each leaf of the tree that can answer a request has its own code in the one table."""
    error = _instance(cls)
    if isinstance(error, ProviderError):
        assert error.kind in PROVIDER_ERROR_TABLE
    else:
        assert error.code in ERROR_TABLE
        assert error.code != "internal_error"


def test_codes_are_unique_across_classes() -> None:
    """No two error classes share a code, so a code names one failure."""
    codes = [_instance(c).code for c in ANSWERS if not issubclass(c, ProviderError)]
    assert len(codes) == len(set(codes))


def test_every_provider_kind_has_a_row() -> None:
    """The provider table covers every kind, and nothing else."""
    assert set(PROVIDER_ERROR_TABLE) == set(ProviderErrorKind)


def test_rejection_carries_policy_and_retry_after_into_http() -> None:
    """A rejection answers with its status, the JSON body shape, and Retry-After rounded up."""
    status, body, headers = http_error(
        RateLimited("slow down", policy="ratelimit", retry_after=0.2)
    )
    assert status == 429
    assert body == {
        "error": {
            "type": "rate_limit_error",
            "code": "rate_limited",
            "message": "slow down",
            "retryable": True,
        }
    }
    assert headers == {"Retry-After": "1"}


def test_rejections_share_one_base() -> None:
    """A caller can catch every policy refusal as Rejected."""
    for error in (QueueFull("q", policy="admission"), BudgetExceeded("b", policy="budget")):
        assert isinstance(error, Rejected)
        assert error.reason == error.code


def test_provider_error_retryable_defaults_from_kind_and_can_be_overridden() -> None:
    """retryable follows the table unless the provider knows better."""
    assert ProviderError("timeout", "slow").retryable is True
    assert ProviderError("content_filter", "no").retryable is False
    quota = ProviderError("rate_limited", "quota gone", retryable=False)
    status, body, _ = http_error(quota)
    assert status == 429
    assert body["error"]["retryable"] is False
    assert body["error"]["code"] == "provider_rate_limited"


def test_provider_retry_after_becomes_a_header() -> None:
    """A provider's Retry-After reaches the caller as whole seconds."""
    _, _, headers = http_error(ProviderError("overloaded", "busy", retry_after=2.0))
    assert headers == {"Retry-After": "2"}


def test_unknown_exceptions_are_internal_errors_without_details() -> None:
    """An exception tidegate did not raise on purpose is a 500 that leaks no message."""
    status, body, headers = http_error(KeyError("secret detail"))
    assert status == 500
    assert body["error"]["message"] == "internal error"
    assert headers == {}


def test_unknown_provider_kind_is_refused() -> None:
    """A kind outside the enum is a programming error, caught at construction."""
    with pytest.raises(ValueError):
        ProviderError("gremlins", "?")


def test_docs_list_every_code_with_its_status() -> None:
    """docs/errors.md has a row for every code in both tables, with the right status."""
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "errors.md").read_text(encoding="utf-8")
    for code, spec in ERROR_TABLE.items():
        assert f"| `{code}` | {spec.status} |" in doc
    for kind, spec in PROVIDER_ERROR_TABLE.items():
        assert f"| `provider_{kind.value}` | `{kind.value}` | {spec.status} |" in doc


def test_headers_a_policy_attaches_reach_the_answer() -> None:
    """A rejection's own headers (a rate limit's RateLimit fields) join Retry-After."""
    refusal = RateLimited("slow", policy="ratelimit", retry_after=2, headers={"RateLimit": "r=0"})
    _, _, headers = http_error(refusal)
    assert headers == {"Retry-After": "2", "RateLimit": "r=0"}
