"""Environment rules: each environment's settings, loaded with the real loader and checked.

One folder holds one subfolder per environment (``dev``, ``staging``, ``production``), each with:

- ``tidegate.yaml``: the gateway config, loaded with :func:`tidegate.gateway.config.load_config`
  (no ``TIDEGATE_*`` overrides: the files are what is checked);
- the secret files that config names (``auth.keys_file``, ``providers.*.api_key_file``);
- ``deploy.yaml``: how the environment is run, the facts the config alone cannot tell::

      replicas: 2        # gateway processes sharing this environment's state (required, >= 1)
      allow_fake: false  # outside dev, the fake provider only when this says so (production never)

The production profile's own start-up rules (auth, rate limits, budgets, durable state, no fake,
pinned models) are set aside while loading so that each one is reported under its own rule id.
:data:`RULES` lists every rule; :func:`check_envs` applies them all and :func:`drift` lists the
settings that differ between two environments, secrets masked.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tidegate.errors import ConfigError
from tidegate.gateway.auth import KeyRing
from tidegate.gateway.config import Config, Profile, load_config, profile_problems, resolve
from tidegate.ops.findings import Finding, Rule, Severity, rule_table

__all__ = [
    "CONFIG_FILE",
    "DEPLOY_FILE",
    "RULES",
    "DeploySettings",
    "Difference",
    "Environment",
    "check_environment",
    "check_envs",
    "discover",
    "drift",
    "flatten",
    "is_pinned",
    "load_environment",
    "looks_like_secret",
]

CONFIG_FILE: Final = "tidegate.yaml"
DEPLOY_FILE: Final = "deploy.yaml"

E = Severity.ERROR

RULES: Final[Mapping[str, Rule]] = rule_table(
    Rule("ENV001", E, "the settings load with the real config loader"),
    Rule("ENV002", E, "secrets come from files, never from values in the YAML"),
    Rule(
        "ENV003",
        E,
        "no value in the YAML looks like a secret (sk-..., a private key, a long token)",
    ),
    Rule("ENV004", E, "each secret file sits inside its own environment's folder"),
    Rule("ENV005", E, "no secret file is taken from another environment's folder"),
    Rule("ENV006", E, "outside dev, the fake provider runs only when deploy.yaml allows it"),
    Rule("ENV007", E, "no route falls back between a real provider and the fake"),
    Rule("ENV008", E, "production never runs the fake provider"),
    Rule("ENV009", E, "production names pinned model ids (a snapshot date or version)"),
    Rule("ENV010", E, "production has no test or demo callers"),
    Rule("ENV011", E, "production has authentication (auth.keys_file)"),
    Rule("ENV012", E, "production has rate limits"),
    Rule("ENV013", E, "production has budgets with at least one limit"),
    Rule("ENV014", E, "more than one replica shares a durable store (postgresql://)"),
    Rule("ENV015", E, "deploy.yaml exists and is valid"),
    Rule("ENV016", E, "a folder named after a profile runs that profile"),
    Rule("ENV017", E, "production keeps its state in a durable store"),
    Rule("ENV018", E, "the folder holds at least one environment"),
    Rule("ENV019", E, "no two environments share the same secret"),
)

#: Key names that hold a secret themselves (a ``*_file`` key holds a path, which is fine); a
#: key ending in one of the words of ``_SECRET_PARTS`` (``client_secret``, ``access_token``) too.
_SECRET_LEAVES: Final = frozenset(
    {"api_key", "apikey", "key", "keys", "access_key", "secret_key", "private_key"}
)
_SECRET_PARTS: Final = frozenset(
    {"password", "passwd", "secret", "token", "credential", "credentials"}
)

_SECRET_PATTERNS: Final[tuple[tuple[re.Pattern[str], str], ...]] = (
    (re.compile(r"(?<![A-Za-z0-9])sk-[A-Za-z0-9_\-]{16,}"), "an API key (sk-...)"),
    (
        re.compile(r"(?<![A-Za-z0-9])(?:ghp|gho|ghs|ghu|github_pat)_[A-Za-z0-9_]{20,}"),
        "a GitHub token",
    ),
    (re.compile(r"(?<![A-Za-z0-9])AKIA[0-9A-Z]{16}(?![A-Za-z0-9])"), "an AWS access key id"),
    (re.compile(r"(?<![A-Za-z0-9])xox[abprs]-[A-Za-z0-9-]{10,}"), "a Slack token"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "a private key"),
    (re.compile(r"(?<![A-Za-z0-9])eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\."), "a JSON web token"),
)
_LONG_TOKEN = re.compile(r"[A-Za-z0-9+/_\-]{32,}={0,2}")
_LONG_HEX = re.compile(r"[0-9a-fA-F]{40,}")

#: A pinned model id ends in a snapshot date or an explicit version.
_PINNED = re.compile(r"[-_@:/](?:\d{4}-\d{2}(?:-\d{2})?|\d{3,8}|v\d+(?:\.\d+)*)$")
_CALLER_WORDS: Final = ("test", "demo")
_PROFILE_NAMES: Final = frozenset(p.value for p in Profile)


class DeploySettings(BaseModel):
    """``deploy.yaml``: how an environment is run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Gateway processes (pods, containers) that share this environment's state.
    replicas: Annotated[int, Field(ge=1, strict=True)]
    #: Outside dev, the fake provider is allowed only when this is true (never in production).
    allow_fake: bool = False


@dataclass(frozen=True, slots=True)
class Environment:
    """One environment as loaded: ``config`` and ``deploy`` are ``None`` when they do not load."""

    name: str
    folder: Path
    config: Config | None
    deploy: DeploySettings | None
    raw: Mapping[str, Any]
    raw_deploy: Mapping[str, Any]

    @property
    def production(self) -> bool:
        """Production by its folder name or by its profile: either one makes the rules apply."""
        profile = self.config.profile if self.config is not None else None
        return self.name == Profile.PRODUCTION.value or profile is Profile.PRODUCTION


@dataclass(frozen=True, slots=True)
class Difference:
    """One setting that differs between two environments; values as displayed, secrets masked."""

    key: str
    a: str
    b: str


# --------------------------------------------------------------------------- loading


def _where(env: Environment | str, file: str, key: str = "") -> str:
    name = env if isinstance(env, str) else env.name
    return f"{name}/{file}" + (f" [{key}]" if key else "")


def _read_yaml(path: Path) -> tuple[Mapping[str, Any], str | None]:
    """The mapping in ``path``, or an empty one and the reason it could not be read."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        return {}, f"cannot read {path.name} ({exc.strerror})"
    except yaml.YAMLError as exc:
        return {}, f"{path.name} is not valid YAML: {exc}"
    if data is None:
        return {}, None
    if not isinstance(data, dict):
        return {}, f"{path.name}: the top level must be a mapping of keys"
    return data, None


def _load_config(path: Path, raw: Mapping[str, Any]) -> tuple[Config | None, str | None]:
    """The config through the real loader, with the profile's start-up rules set aside.

    The loader is tried as is first; when it refuses, it is tried again as a dev profile. If that
    loads, the only refusal was the profile's rules, which the ENV rules report one by one.
    """
    try:
        return load_config(path, env={}), None
    except ConfigError as first:
        profile = raw.get("profile", Profile.DEV.value)
        if profile not in _PROFILE_NAMES:
            return None, first.message
        try:
            config = load_config(path, env={"TIDEGATE_PROFILE": Profile.DEV.value})
        except ConfigError:
            return None, first.message
        return config.model_copy(update={"profile": Profile(profile)}), None


def load_environment(folder: Path) -> tuple[Environment, list[Finding]]:
    """Load one environment folder; what does not load is reported (ENV001, ENV015)."""
    name = folder.name
    findings: list[Finding] = []
    config_path = folder / CONFIG_FILE
    raw, problem = _read_yaml(config_path)
    config: Config | None = None
    if problem is not None:
        findings.append(RULES["ENV001"].finding(problem, _where(name, CONFIG_FILE)))
    else:
        config, problem = _load_config(config_path, raw)
        if problem is not None:
            findings.append(RULES["ENV001"].finding(problem, _where(name, CONFIG_FILE)))
    deploy: DeploySettings | None = None
    deploy_path = folder / DEPLOY_FILE
    raw_deploy: Mapping[str, Any] = {}
    if not deploy_path.is_file():
        findings.append(
            RULES["ENV015"].finding(
                f"{DEPLOY_FILE} is missing: it must say how many replicas run (replicas: N)",
                _where(name, DEPLOY_FILE),
            )
        )
    else:
        raw_deploy, problem = _read_yaml(deploy_path)
        if problem is not None:
            findings.append(RULES["ENV015"].finding(problem, _where(name, DEPLOY_FILE)))
        else:
            try:
                deploy = DeploySettings.model_validate(raw_deploy)
            except ValidationError as exc:
                for error in exc.errors():
                    key = ".".join(str(part) for part in error["loc"])
                    text = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
                    findings.append(
                        RULES["ENV015"].finding(f"{key}: {text}", _where(name, DEPLOY_FILE, key))
                    )
    env = Environment(name, folder, config, deploy, raw, raw_deploy)
    return env, findings


def discover(root: Path) -> list[Path]:
    """The environment folders under ``root``: subfolders holding a ``tidegate.yaml``, by name."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / CONFIG_FILE).is_file())


# --------------------------------------------------------------------------- secrets in values


def looks_like_secret(value: str) -> str | None:
    """What kind of secret ``value`` seems to contain (``"an API key (sk-...)"``), or ``None``."""
    for pattern, kind in _SECRET_PATTERNS:
        if pattern.search(value):
            return kind
    for word in value.split():
        if _LONG_HEX.fullmatch(word):
            return "a long hexadecimal token"
        if (
            _LONG_TOKEN.fullmatch(word)
            and re.search(r"\d", word)
            and re.search(r"[a-z]", word)
            and re.search(r"[A-Z]", word)
        ):
            return "a long base64 token"
    return None


def _walk(data: Any, prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """``(dotted key, leaf name, value)`` for every value in nested mappings and lists."""
    if isinstance(data, Mapping):
        for key, value in data.items():
            dotted = f"{prefix}.{key}" if prefix else str(key)
            yield dotted, str(key), value
            yield from _walk(value, dotted)
    elif isinstance(data, list):
        for index, value in enumerate(data):
            dotted = f"{prefix}.{index}"
            yield dotted, "", value
            yield from _walk(value, dotted)


def _secret_leaf(leaf: str) -> bool:
    low = leaf.lower()
    if low.endswith("_file"):
        return False
    return low in _SECRET_LEAVES or low.rsplit("_", 1)[-1] in _SECRET_PARTS


def _url_password(value: str) -> bool:
    if "://" not in value:
        return False
    try:
        return urlsplit(value).password is not None
    except ValueError:
        return False


def _scan_values(env: Environment, file: str, data: Mapping[str, Any]) -> list[Finding]:
    findings: list[Finding] = []
    for key, leaf, value in _walk(data):
        where = _where(env, file, key)
        if leaf and _secret_leaf(leaf) and value is not None and not isinstance(value, Mapping):
            findings.append(
                RULES["ENV002"].finding(
                    f"{key} holds a secret as a value: secrets are read from files only "
                    f"(use {leaf}_file)",
                    where,
                )
            )
            continue
        if not isinstance(value, str):
            continue
        if _url_password(value):
            findings.append(
                RULES["ENV002"].finding(
                    f"{key} is a URL with a password in it: read the password from a file "
                    "(for Postgres, libpq's passfile= parameter or PGPASSFILE)",
                    where,
                )
            )
        elif (kind := looks_like_secret(value)) is not None:
            findings.append(
                RULES["ENV003"].finding(
                    f"{key} holds what looks like {kind}: move it into a secret file", where
                )
            )
    return findings


# --------------------------------------------------------------------------- the rules


def _secret_files(env: Environment) -> list[tuple[str, Path]]:
    config = env.config
    if config is None:
        return []
    config_path = env.folder / CONFIG_FILE
    files: list[tuple[str, Path]] = []
    if config.auth.keys_file is not None:
        files.append(("auth.keys_file", resolve(config_path, config.auth.keys_file)))
    for name, provider in config.providers.items():
        if provider.api_key_file is not None:
            files.append(
                (f"providers.{name}.api_key_file", resolve(config_path, provider.api_key_file))
            )
    return files


def _check_secret_places(env: Environment, others: Sequence[Path]) -> list[Finding]:
    findings: list[Finding] = []
    home = env.folder.resolve()
    for key, path in _secret_files(env):
        real = path.resolve()
        if real.is_relative_to(home):
            continue
        where = _where(env, CONFIG_FILE, key)
        foreign = next((o for o in others if real.is_relative_to(o.resolve())), None)
        if foreign is not None:
            findings.append(
                RULES["ENV005"].finding(
                    f"{key} reads {real.name} from the {foreign.name} environment's folder: "
                    "one leaked file would open two environments",
                    where,
                )
            )
        else:
            findings.append(
                RULES["ENV004"].finding(
                    f"{key} points outside the {env.name} folder ({path}): keep each "
                    "environment's secret files in its own folder",
                    where,
                )
            )
    return findings


def _check_fake(env: Environment, config: Config) -> list[Finding]:
    findings: list[Finding] = []
    fakes = {name for name, p in config.providers.items() if p.type == "fake"}
    for name in sorted(fakes):
        where = _where(env, CONFIG_FILE, f"providers.{name}")
        if env.production:
            findings.append(
                RULES["ENV008"].finding(
                    f"production must not run the fake provider (providers.{name})", where
                )
            )
        elif config.profile is not Profile.DEV and not (env.deploy and env.deploy.allow_fake):
            findings.append(
                RULES["ENV006"].finding(
                    f"providers.{name} is the fake provider in a {config.profile.value} "
                    f"environment: the fake is for dev, or set allow_fake: true in {DEPLOY_FILE} "
                    "if this environment really means it",
                    where,
                )
            )
    for alias, route in config.models.items():
        kinds = {name in fakes for name in route.providers}
        if len(kinds) == 2:
            findings.append(
                RULES["ENV007"].finding(
                    f"models.{alias} mixes real and fake providers ({', '.join(route.providers)}):"
                    " a failover would serve fake answers, or real ones, without anyone choosing",
                    _where(env, CONFIG_FILE, f"models.{alias}.providers"),
                )
            )
    return findings


def _callers(env: Environment, config: Config) -> list[Finding]:
    if config.auth.keys_file is None:
        return []
    path = resolve(env.folder / CONFIG_FILE, config.auth.keys_file)
    where = _where(env, CONFIG_FILE, "auth.keys_file")
    try:
        KeyRing.from_file(path, classes=config.admission.classes)
    except ConfigError as exc:
        return [RULES["ENV001"].finding(f"the keys file does not load: {exc.message}", where)]
    data, _ = _read_yaml(path)
    findings: list[Finding] = []
    for entry in data.get("keys") or ():
        if not isinstance(entry, Mapping):
            continue
        for field in ("id", "user", "tenant"):
            value = str(entry.get(field, ""))
            word = next((w for w in _CALLER_WORDS if w in value.lower()), None)
            if word is not None:
                findings.append(
                    RULES["ENV010"].finding(
                        f"production has a {word} caller: key {entry.get('id')!r} has "
                        f"{field} {value!r}",
                        where,
                    )
                )
                break
    return findings


def is_pinned(model: str) -> bool:
    """Whether ``model`` names one fixed snapshot: not ``latest``, and ends in a date or version.

    ``gpt-4o-2024-08-06``, ``claude-3-5-sonnet-20241022``, ``gemini-1.5-pro-002`` and
    ``my-model-v3`` are pinned; ``gpt-4o``, ``claude-3-5-sonnet-latest`` and ``llama3`` are not.
    """
    if re.search(r"(^|[-:/_@])latest$", model):
        return False
    return _PINNED.search(model) is not None


def _check_production(env: Environment, config: Config) -> list[Finding]:
    findings: list[Finding] = []
    file = CONFIG_FILE
    for name, provider in config.providers.items():
        if not is_pinned(provider.model):
            findings.append(
                RULES["ENV009"].finding(
                    f"providers.{name}.model is {provider.model!r}: production needs a pinned "
                    "model id (a snapshot date or version), because an alias can change under you",
                    _where(env, file, f"providers.{name}.model"),
                )
            )
    if config.auth.keys_file is None:
        findings.append(
            RULES["ENV011"].finding(
                "production needs authentication: set auth.keys_file", _where(env, file, "auth")
            )
        )
    findings += _callers(env, config)
    limits = config.rate_limits
    if limits.per_user is None and limits.per_tenant is None:
        findings.append(
            RULES["ENV012"].finding(
                "production needs rate limits: set rate_limits.per_user or per_tenant",
                _where(env, file, "rate_limits"),
            )
        )
    budgets = config.budgets
    if budgets is None:
        findings.append(
            RULES["ENV013"].finding(
                "production needs budgets: set budgets", _where(env, file, "budgets")
            )
        )
    elif budgets.calls is None and budgets.tokens is None and budgets.cost_usd is None:
        findings.append(
            RULES["ENV013"].finding(
                "budgets sets no limit: set budgets.calls, tokens or cost_usd",
                _where(env, file, "budgets"),
            )
        )
    if not config.state.url.startswith(("sqlite:///", "postgresql://", "postgres://")):
        findings.append(
            RULES["ENV017"].finding(
                f"production keeps its state in {config.state.url.split(':', 1)[0]}, which is "
                "not durable: use postgresql:// (or sqlite:/// for a single replica)",
                _where(env, file, "state.url"),
            )
        )
    return findings


def check_environment(env: Environment, others: Sequence[Path] = ()) -> list[Finding]:
    """Every rule that concerns one environment; ``others`` are the other environments' folders."""
    findings = _scan_values(env, CONFIG_FILE, env.raw) + _scan_values(
        env, DEPLOY_FILE, env.raw_deploy
    )
    config = env.config
    if config is None:
        return findings
    if env.name in _PROFILE_NAMES and config.profile.value != env.name:
        findings.append(
            RULES["ENV016"].finding(
                f"the {env.name} folder runs profile {config.profile.value}: set "
                f"profile: {env.name} so that the loader applies that profile's rules",
                _where(env, CONFIG_FILE, "profile"),
            )
        )
    findings += _check_secret_places(env, others)
    findings += _check_fake(env, config)
    if env.production:
        production = _check_production(env, config)
        findings += production
        loader = profile_problems(config.model_copy(update={"profile": Profile.PRODUCTION}))
        if loader and not production and not any(f.rule_id == "ENV008" for f in findings):
            findings.append(
                RULES["ENV001"].finding(
                    "the production profile refuses to start: " + "; ".join(loader),
                    _where(env, CONFIG_FILE),
                )
            )
    shared = config.state.url.startswith(("postgresql://", "postgres://"))
    if env.deploy is not None and env.deploy.replicas > 1 and not shared:
        findings.append(
            RULES["ENV014"].finding(
                f"{env.deploy.replicas} replicas with state in "
                f"{config.state.url.split(':', 1)[0]}: it is not shared between machines, so "
                "each replica would count limits, budgets and idempotency keys on its own; "
                "use postgresql://",
                _where(env, CONFIG_FILE, "state.url"),
            )
        )
    return findings


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes().strip()).hexdigest()
    except OSError:
        return None


def _shared_secrets(envs: Sequence[Environment]) -> list[Finding]:
    """Secret files with the same contents in two environments (a shared path is ENV005)."""
    owners: dict[str, list[tuple[Environment, str, Path]]] = {}
    for env in envs:
        for key, path in _secret_files(env):
            digest = _digest(path)
            if digest is not None:
                owners.setdefault(digest, []).append((env, key, path.resolve()))
    findings: list[Finding] = []
    for holders in owners.values():
        for env, key, real in holders:
            copies = sorted(
                {
                    other.name
                    for other, _, path in holders
                    if other.name != env.name and path != real
                }
            )
            if copies:
                findings.append(
                    RULES["ENV019"].finding(
                        f"{key} holds the same secret as the {', '.join(copies)} environment: "
                        "give each environment its own",
                        _where(env, CONFIG_FILE, key),
                    )
                )
    return findings


def check_envs(root: Path) -> list[Finding]:
    """Load every environment under ``root`` and apply every rule; ``[]`` means all pass."""
    folders = discover(root)
    if not folders:
        return [
            RULES["ENV018"].finding(
                f"no environment found: expected subfolders (dev, staging, production) each "
                f"with a {CONFIG_FILE}",
                str(root),
            )
        ]
    findings: list[Finding] = []
    envs: list[Environment] = []
    for folder in folders:
        env, loading = load_environment(folder)
        envs.append(env)
        others = [f for f in folders if f != folder]
        findings += loading + check_environment(env, others)
    findings += _shared_secrets(envs)
    return findings


# --------------------------------------------------------------------------- drift


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{"a.b.c": value}``; lists and scalars are leaves."""
    if isinstance(data, Mapping) and (data or not prefix):
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: data}


MASK: Final = "<secret>"
UNSET: Final = "(unset)"


def _display(key: str, value: Any) -> str:
    leaf = key.rsplit(".", 1)[-1]
    if _secret_leaf(leaf) and value is not None:
        return MASK
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    if isinstance(value, str) and _url_password(value):
        parts = urlsplit(value)
        netloc = parts.netloc.replace(f":{parts.password}@", f":{MASK}@", 1)
        return parts._replace(netloc=netloc).geturl()
    if looks_like_secret(text) is not None:
        return MASK
    return text


def _settings(env: Environment) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if env.config is not None:
        settings.update(flatten(env.config.model_dump(mode="json")))
    deploy = env.deploy.model_dump(mode="json") if env.deploy is not None else env.raw_deploy
    settings.update(flatten({"deploy": dict(deploy)}))
    return settings


def drift(a: Path, b: Path) -> tuple[list[Difference], list[Finding]]:
    """The settings that differ between environment folders ``a`` and ``b``, by dotted key.

    Both are loaded as :func:`check_envs` loads them, defaults included, so a value written in
    one file and left to its default in the other is not a difference. ``deploy.*`` keys come
    from ``deploy.yaml``. Secret-looking values are shown as ``<secret>``. The findings say what
    did not load; a side that did not load is compared on what did.
    """
    env_a, findings_a = load_environment(a)
    env_b, findings_b = load_environment(b)
    left, right = _settings(env_a), _settings(env_b)
    differences = [
        Difference(
            key,
            _display(key, left[key]) if key in left else UNSET,
            _display(key, right[key]) if key in right else UNSET,
        )
        for key in sorted(left.keys() | right.keys())
        if left.get(key, UNSET) != right.get(key, UNSET) or (key in left) != (key in right)
    ]
    return differences, findings_a + findings_b
