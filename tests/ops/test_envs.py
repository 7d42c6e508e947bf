"""Environment rules: each rule fails on a broken copy of the passing fixture, and drift."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.ops.conftest import FIXTURES, Copier, edit_yaml
from tidegate.ops.envs import (
    RULES,
    check_envs,
    discover,
    drift,
    flatten,
    is_pinned,
    load_environment,
    looks_like_secret,
)
from tidegate.ops.findings import Severity

GOOD = FIXTURES / "envs" / "good"
BAD = FIXTURES / "envs" / "bad"


def _config(root: Path, env: str, change: Callable[[dict[str, Any]], object]) -> None:
    edit_yaml(root / env / "tidegate.yaml", change)


def _deploy(root: Path, env: str, change: Callable[[dict[str, Any]], object]) -> None:
    edit_yaml(root / env / "deploy.yaml", change)


def _fake(name: str = "offline") -> dict[str, Any]:
    return {"type": "fake", "model": f"{name}-2026-01"}


def _unknown_key(root: Path) -> None:
    _config(
        root,
        "production",
        lambda d: d["server"].update(prot=1) if "server" in d else d.update(server={"prot": 1}),
    )


def _inline_key(root: Path) -> None:
    _config(root, "staging", lambda d: d["providers"]["openai"].update(api_key="abc"))


def _secret_value(root: Path) -> None:
    secret = "sk-" + "a1B2" * 8
    _config(root, "staging", lambda d: d["models"]["chat-default"].update(description=secret))


def _outside_folder(root: Path) -> None:
    (root / "shared-key.txt").write_text("a key kept beside every environment\n")
    _config(
        root,
        "staging",
        lambda d: d["providers"]["openai"].update(api_key_file="../shared-key.txt"),
    )


def _other_env(root: Path) -> None:
    _config(
        root,
        "staging",
        lambda d: d["providers"]["openai"].update(api_key_file="../production/openai-key.txt"),
    )


def _fake_in_staging(root: Path) -> None:
    _config(root, "staging", lambda d: d["providers"].update(offline=_fake()))


def _mixed_route(root: Path) -> None:
    def change(d: dict[str, Any]) -> None:
        d["providers"]["local"] = {
            "type": "openai",
            "model": "llama-3.1-8b-v1",
            "base_url": "http://127.0.0.1:9100/v1",
        }
        d["models"]["chat-default"]["providers"] = ["local", "fake-chat"]

    _config(root, "dev", change)


def _fake_in_production(root: Path) -> None:
    def change(d: dict[str, Any]) -> None:
        d["providers"]["offline"] = _fake()
        d["models"]["offline"] = {"providers": ["offline"]}

    _config(root, "production", change)


def _floating_model(root: Path) -> None:
    _config(root, "production", lambda d: d["providers"]["openai"].update(model="gpt-4o"))


def _test_caller(root: Path) -> None:
    def change(d: dict[str, Any]) -> None:
        d["keys"][1]["user"] = "load-test-runner"

    edit_yaml(root / "production" / "keys.yaml", change)


def _no_auth(root: Path) -> None:
    _config(root, "production", lambda d: d.pop("auth"))


def _no_rate_limits(root: Path) -> None:
    _config(root, "production", lambda d: d.pop("rate_limits"))


def _no_budgets(root: Path) -> None:
    _config(root, "production", lambda d: d.pop("budgets"))


def _sqlite_fleet(root: Path) -> None:
    _config(root, "staging", lambda d: d["state"].update(url="sqlite:///.tidegate/staging.db"))


def _no_deploy_file(root: Path) -> None:
    (root / "staging" / "deploy.yaml").unlink()


def _wrong_profile(root: Path) -> None:
    _config(root, "staging", lambda d: d.update(profile="dev"))


def _memory_state(root: Path) -> None:
    def change(d: dict[str, Any]) -> None:
        d["state"]["url"] = "memory://"

    _config(root, "production", change)
    _deploy(root, "production", lambda d: d.update(replicas=1))


def _no_environments(root: Path) -> None:
    for folder in discover(root):
        shutil.rmtree(folder)


def _copied_secret(root: Path) -> None:
    shutil.copyfile(root / "production" / "openai-key.txt", root / "staging" / "openai-key.txt")


#: One way to break each rule, starting from the passing fixture.
BREAKS: dict[str, Callable[[Path], None]] = {
    "ENV001": _unknown_key,
    "ENV002": _inline_key,
    "ENV003": _secret_value,
    "ENV004": _outside_folder,
    "ENV005": _other_env,
    "ENV006": _fake_in_staging,
    "ENV007": _mixed_route,
    "ENV008": _fake_in_production,
    "ENV009": _floating_model,
    "ENV010": _test_caller,
    "ENV011": _no_auth,
    "ENV012": _no_rate_limits,
    "ENV013": _no_budgets,
    "ENV014": _sqlite_fleet,
    "ENV015": _no_deploy_file,
    "ENV016": _wrong_profile,
    "ENV017": _memory_state,
    "ENV018": _no_environments,
    "ENV019": _copied_secret,
}


def test_every_rule_has_a_way_to_break_it() -> None:
    """The table of breaks covers exactly the rules the module declares."""
    assert set(BREAKS) == set(RULES)


def test_the_passing_fixture_passes_every_rule() -> None:
    """dev, staging and production as shipped in the fixture give no finding at all."""
    assert [p.name for p in discover(GOOD)] == ["dev", "production", "staging"]
    assert check_envs(GOOD) == []


@pytest.mark.parametrize("rule_id", sorted(BREAKS))
def test_each_rule_fails_on_its_broken_fixture(copy_fixture: Copier, rule_id: str) -> None:
    """Breaking the passing fixture one way gives an error under that rule's id."""
    root = copy_fixture("envs/good")
    assert check_envs(root) == []
    BREAKS[rule_id](root)
    findings = check_envs(root)
    hits = [f for f in findings if f.rule_id == rule_id]
    assert hits, findings
    assert all(f.severity is Severity.ERROR for f in hits)


def test_production_built_from_dev_fails_the_production_rules() -> None:
    """The on-disk failing fixture (production copied from dev) breaks every production rule."""
    ids = {f.rule_id for f in check_envs(BAD)}
    assert {"ENV003", "ENV005", "ENV008", "ENV009", "ENV010", "ENV012", "ENV013"} <= ids
    assert {"ENV014", "ENV016"} <= ids


def test_inline_key_names_the_file_key_to_use(copy_fixture: Copier) -> None:
    """An inline api_key is refused by the loader and told to use api_key_file."""
    root = copy_fixture("envs/good")
    _inline_key(root)
    messages = [f.message for f in check_envs(root) if f.rule_id == "ENV002"]
    assert messages == [
        "providers.openai.api_key holds a secret as a value: secrets are read from files only "
        "(use api_key_file)"
    ]


def test_a_password_in_the_state_url_is_an_inline_secret(copy_fixture: Copier) -> None:
    """postgresql://user:password@host is a secret in a value, even though the loader takes it."""
    root = copy_fixture("envs/good")
    url = "postgresql://tidegate:hunter2@db.prod.internal/tidegate"
    _config(root, "production", lambda d: d["state"].update(url=url))
    findings = check_envs(root)
    assert [f.rule_id for f in findings] == ["ENV002"]
    assert "hunter2" not in findings[0].message


def test_a_secret_value_is_not_echoed(copy_fixture: Copier) -> None:
    """The ENV003 message says what the value looks like, never the value itself."""
    root = copy_fixture("envs/good")
    _secret_value(root)
    (finding,) = [f for f in check_envs(root) if f.rule_id == "ENV003"]
    assert "a1B2" not in finding.message
    assert finding.where == "staging/tidegate.yaml [models.chat-default.description]"


def test_staging_may_run_the_fake_when_deploy_allows_it(copy_fixture: Copier) -> None:
    """allow_fake: true in staging's deploy.yaml makes the fake an explicit choice there."""
    root = copy_fixture("envs/good")
    _fake_in_staging(root)
    _deploy(root, "staging", lambda d: d.update(allow_fake=True))
    assert check_envs(root) == []


def test_production_may_not_allow_the_fake(copy_fixture: Copier) -> None:
    """allow_fake does not apply to production: the fake is still refused there."""
    root = copy_fixture("envs/good")
    _fake_in_production(root)
    _deploy(root, "production", lambda d: d.update(allow_fake=True))
    assert {f.rule_id for f in check_envs(root)} == {"ENV008"}


def test_one_replica_may_keep_state_in_sqlite(copy_fixture: Copier) -> None:
    """A single replica on SQLite is fine; the shared-store rule starts at two."""
    root = copy_fixture("envs/good")
    _sqlite_fleet(root)
    _deploy(root, "staging", lambda d: d.update(replicas=1))
    assert check_envs(root) == []


def test_a_latest_model_in_production_is_reported_once_under_its_rule(copy_fixture: Copier) -> None:
    """The loader refuses -latest too; the check reports it as ENV009, not a failure to load."""
    root = copy_fixture("envs/good")
    _config(root, "production", lambda d: d["providers"]["openai"].update(model="gpt-4o-latest"))
    assert [f.rule_id for f in check_envs(root)] == ["ENV009"]


def test_a_budget_without_any_limit_is_no_budget(copy_fixture: Copier) -> None:
    """budgets: {degrade_at: 0.9} sets no calls, tokens or cost limit, so ENV013 still fires."""
    root = copy_fixture("envs/good")
    _config(root, "production", lambda d: d.update(budgets={"degrade_at": 0.9}))
    assert [f.rule_id for f in check_envs(root)] == ["ENV013"]


def test_a_folder_named_production_gets_production_rules_whatever_its_profile(
    copy_fixture: Copier,
) -> None:
    """A production folder that claims the dev profile is still held to production's rules."""
    root = copy_fixture("envs/good")
    _config(root, "production", lambda d: (d.update(profile="dev"), d.pop("rate_limits")))
    assert {f.rule_id for f in check_envs(root)} == {"ENV016", "ENV012"}


def test_deploy_file_rejects_unknown_keys_and_bad_replicas(copy_fixture: Copier) -> None:
    """deploy.yaml forbids unknown keys and needs an integer replica count of at least one."""
    root = copy_fixture("envs/good")
    (root / "staging" / "deploy.yaml").write_text("replicas: 0\nreplica: 2\n")
    findings = [f for f in check_envs(root) if f.rule_id == "ENV015"]
    assert sorted(f.where for f in findings) == [
        "staging/deploy.yaml [replica]",
        "staging/deploy.yaml [replicas]",
    ]


def test_a_shared_secret_file_path_is_reported_as_foreign_not_as_a_copy(
    copy_fixture: Copier,
) -> None:
    """Pointing at another environment's file is ENV005; ENV019 is for copies at two paths."""
    root = copy_fixture("envs/good")
    _other_env(root)
    assert [f.rule_id for f in check_envs(root)] == ["ENV005"]


@pytest.mark.parametrize(
    "value",
    [
        "sk-" + "Zx9" * 8,
        "sk-ant-api03-" + "q" * 20,
        "AKIA" + "ABCDEFGHIJKLMNOP",
        "-----BEGIN RSA PRIVATE KEY-----",
        "token " + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z",
        "f" * 40,
    ],
)
def test_secret_shapes_are_recognised(value: str) -> None:
    """API keys, cloud keys, private keys, long base64 and long hex values look like secrets."""
    assert looks_like_secret(value) is not None


@pytest.mark.parametrize(
    "value",
    [
        "gpt-4o-2024-08-06",
        "https://api.openai.com/v1",
        "secrets/production/openai-key.txt",
        "postgresql://tidegate@db.prod.internal:5432/tidegate",
        "Hello from the dev fake.",
        "claude-3-5-sonnet-20241022",
    ],
)
def test_ordinary_values_do_not_look_like_secrets(value: str) -> None:
    """Model ids, URLs, paths and prose are not mistaken for secrets."""
    assert looks_like_secret(value) is None


@pytest.mark.parametrize(
    ("model", "pinned"),
    [
        ("gpt-4o-2024-08-06", True),
        ("claude-3-5-sonnet-20241022", True),
        ("gemini-1.5-pro-002", True),
        ("my-model-v3", True),
        ("fake-a-2026-01", True),
        ("gpt-4o", False),
        ("gpt-4", False),
        ("claude-3-5-sonnet-latest", False),
        ("llama3", False),
        ("latest", False),
    ],
)
def test_pinned_model_ids_end_in_a_snapshot(model: str, pinned: bool) -> None:
    """A pinned id ends in a snapshot date or version; an alias or latest does not."""
    assert is_pinned(model) is pinned


def test_drift_lists_differences_by_dotted_key_with_defaults_applied() -> None:
    """staging vs production: replicas, models, limits differ; equal defaults do not appear."""
    differences, findings = drift(GOOD / "staging", GOOD / "production")
    assert findings == []
    by_key = {d.key: (d.a, d.b) for d in differences}
    assert by_key["deploy.replicas"] == ("2", "3")
    assert by_key["providers.openai.model"] == ("gpt-4o-mini-2024-07-18", "gpt-4o-2024-08-06")
    assert by_key["profile"] == ("staging", "production")
    assert by_key["rate_limits.per_tenant"] == ("null", "(unset)")
    assert by_key["rate_limits.per_tenant.burst"] == ("(unset)", "100.0")
    assert by_key["providers.openai.stream.first_token_timeout_s"] == ("10.0", "8.0")
    assert by_key["providers.anthropic.type"] == ("(unset)", "anthropic")
    assert "server.port" not in by_key
    assert [d.key for d in differences] == sorted(by_key)


def test_drift_masks_secrets() -> None:
    """A password in a URL and a secret-looking value are shown masked on both sides."""
    differences, _ = drift(GOOD / "staging", BAD / "production")
    shown = " ".join(f"{d.a} {d.b}" for d in differences)
    assert "sk-live" not in shown
    by_key = {d.key: (d.a, d.b) for d in differences}
    assert by_key["models.chat-default.description"] == ("", "<secret>")


def test_drift_masks_a_url_password(copy_fixture: Copier) -> None:
    """Only the password of a state URL is masked; the rest of the URL is shown."""
    root = copy_fixture("envs/good")
    url = "postgresql://tidegate:hunter2@db.prod.internal:5432/tidegate"
    _config(root, "production", lambda d: d["state"].update(url=url))
    differences, _ = drift(root / "staging", root / "production")
    by_key = {d.key: d.b for d in differences}
    assert by_key["state.url"] == "postgresql://tidegate:<secret>@db.prod.internal:5432/tidegate"


def test_identical_environments_have_no_drift() -> None:
    """An environment compared with itself differs in nothing."""
    differences, findings = drift(GOOD / "production", GOOD / "production")
    assert (differences, findings) == ([], [])


def test_flatten_makes_dotted_keys_and_keeps_lists_whole() -> None:
    """Nested mappings flatten to dotted keys; lists and empty mappings are leaves."""
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": {}}) == {"a.b": 1, "a.c": [1, 2], "d": {}}


def test_load_environment_reports_an_unreadable_config(tmp_path: Path) -> None:
    """A tidegate.yaml that is not YAML is an ENV001 finding, not an exception."""
    folder = tmp_path / "dev"
    folder.mkdir()
    (folder / "tidegate.yaml").write_text("providers: [unclosed\n")
    (folder / "deploy.yaml").write_text("replicas: 1\n")
    env, findings = load_environment(folder)
    assert env.config is None
    assert [f.rule_id for f in findings] == ["ENV001"]


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("api_key", True),
        ("client_secret", True),
        ("access_token", True),
        ("password", True),
        ("keys", True),
        ("api_key_file", False),
        ("first_token_timeout_s", False),
        ("max_tokens", False),
        ("tokens", False),
        ("keys_file", False),
    ],
)
def test_secret_key_names_are_told_from_settings_about_tokens(
    copy_fixture: Copier, key: str, secret: bool
) -> None:
    """A key named like a secret is ENV002; a setting that merely mentions tokens is not."""
    root = copy_fixture("envs/good")
    _deploy(root, "dev", lambda d: d.update({key: "value"}))
    ids = {f.rule_id for f in check_envs(root)}
    assert ("ENV002" in ids) is secret


def test_a_production_refusal_no_rule_covers_is_still_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If the loader's production profile refuses something no ENV rule knows, ENV001 says so."""
    import tidegate.ops.envs as envs

    monkeypatch.setattr(envs, "profile_problems", lambda config: ["production needs a new thing"])
    (finding,) = check_envs(GOOD)
    assert finding.rule_id == "ENV001"
    assert finding.where == "production/tidegate.yaml"
    assert (
        finding.message == "the production profile refuses to start: production needs a new thing"
    )
