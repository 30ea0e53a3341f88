"""An endpoint as the user names it (URL, model, name, key source, timeouts) and the API key it may
carry: never over clear text to another machine, never written anywhere."""

from __future__ import annotations

import ipaddress
import os
import re
import urllib.parse
from dataclasses import dataclass

from specplay.core.errors import ConfigError, SpecPlayError

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_DEADLINE_S = 3600.0  # an hour: a long answer from a slow CPU server, with room to spare
MAX_WAIT_S = 86400.0  # the longest timeout or deadline accepted: a day


class RemoteError(SpecPlayError):
    """An endpoint could not be reached or answered with an error (the message says which)."""


def _seconds(option: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"endpoint {option} must be a number of seconds, got {text!r}") from None


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: ``url`` is its API base (``http://host:port/v1``)."""

    url: str
    model: str = ""  # sent as "model"; empty: the first model the server lists
    name: str = ""  # label in tables and records (default: host:port and model)
    key_env: str = ""  # the environment variable holding this server's API key; empty: none
    timeout_s: float = DEFAULT_TIMEOUT_S  # per read: a server silent this long ends the run
    deadline_s: float = DEFAULT_DEADLINE_S  # per run, from its first request: however the server paces its bytes

    def __post_init__(self) -> None:
        # Checked on every construction, not only when parsed, so that no caller can build one
        # that fails later with a traceback.
        self.check()

    @staticmethod
    def parse(text: str) -> "Endpoint":
        """``URL[,model=NAME][,name=LABEL][,key-env=VAR][,timeout=SECONDS][,deadline=SECONDS]`` (the
        command line's form)."""
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise ConfigError("an endpoint needs a URL, e.g. http://127.0.0.1:8000/v1")
        url, fields_ = parts[0], {}
        for p in parts[1:]:
            key, sep, value = p.partition("=")
            if not sep or key not in ("model", "name", "key-env", "timeout", "deadline"):
                raise ConfigError(f"endpoint option '{p}' is not model=, name=, key-env=, timeout= or deadline=")
            fields_[key.replace("-", "_")] = value
        for option in ("timeout", "deadline"):
            seconds = fields_.pop(option, "")
            if seconds:
                fields_[f"{option}_s"] = _seconds(option, seconds)
        return Endpoint(url=url, **fields_)

    def check(self) -> None:
        """Refuse, in one line, what the connection would otherwise fail on with a traceback, or
        what would put a secret in records (the messages never repeat one)."""
        try:
            u = urllib.parse.urlsplit(self.url)
        except ValueError:  # an unclosed or invalid [IPv6] host
            raise ConfigError("endpoint URL has a malformed [IPv6] host") from None
        # The URL goes into records, logs and the history: a secret in it would too.
        if "@" in u.netloc or u.query or u.fragment:
            raise ConfigError(f"endpoint URL must not carry credentials, a query string or a fragment "
                              f"({_redacted(u)}): name the key's variable with key-env= or store it in the keyring")
        # http.client sends the URL as ASCII and rejects spaces and control characters mid-request.
        if not self.url.isascii() or any(c.isspace() or not c.isprintable() for c in self.url):
            raise ConfigError(f"endpoint URL must be ASCII without spaces (an international host name in its "
                              f"xn-- form), got {self.url!r}")
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError(f"endpoint URL must be http(s)://host[:port]/..., got {self.url!r}")
        try:
            port = u.port
        except ValueError:
            port = 0
        if port == 0:
            raise ConfigError(f"endpoint port must be a number from 1 to 65535, got {self.url!r}")
        for option, seconds in (("timeout", self.timeout_s), ("deadline", self.deadline_s)):
            # NaN fails the comparison; beyond a day, socket timeouts overflow on some platforms.
            if not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_WAIT_S:
                raise ConfigError(f"endpoint {option} must be more than 0 and at most {MAX_WAIT_S:g} seconds, "
                                  f"got {seconds!r}")
        if self.key_env and not _ENV_NAME.fullmatch(self.key_env):
            raise ConfigError(f"key-env= must name an environment variable, got {self.key_env!r}")
        if self.key_env and not _may_carry_key(u):
            raise ConfigError(_clear_text_key(u))

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        u = urllib.parse.urlsplit(self.url)
        return f"{u.hostname}:{u.port or (443 if u.scheme == 'https' else 80)}" + (f"/{self.model}" if self.model else "")

    def describe(self) -> dict:
        """What a record keeps of the endpoint: never the key."""
        return {"url": self.url, "model": self.model, "name": self.label}


def api_key(endpoint: Endpoint) -> str | None:
    """The endpoint's own key: from the variable its ``key-env=`` names, else from the OS keyring
    entry for its URL, else None. A key set for one server (``$OPENAI_API_KEY``) never goes to
    another, and none crosses a network in clear text (plain http:// off this machine)."""
    key = (os.environ.get(endpoint.key_env) if endpoint.key_env else None) or _keyring_key(endpoint.url)
    u = urllib.parse.urlsplit(endpoint.url)
    if key and not _may_carry_key(u):
        raise RemoteError(_clear_text_key(u))
    return key


def _keyring_key(url: str) -> str | None:
    try:
        import keyring  # optional
    except ImportError:
        return None
    try:
        return keyring.get_password("specplay", url)
    except Exception:  # no usable keyring backend
        return None


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _may_carry_key(u: urllib.parse.SplitResult) -> bool:
    """Whether a key may go to this URL: encrypted, or to this machine (localhost or a loopback
    address; other names are not resolved, as a resolver could point them anywhere)."""
    if u.scheme == "https" or u.hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(u.hostname).is_loopback
    except ValueError:
        return False


def _clear_text_key(u: urllib.parse.SplitResult) -> str:
    return (f"refusing to send an API key over plain http:// to {u.hostname}, which is not this machine: "
            "use https:// or drop key-env= and the keyring entry")


def _redacted(u: urllib.parse.SplitResult) -> str:
    """The URL without user info, query or fragment, for messages about them."""
    return f"{u.scheme}://{u.netloc.rpartition('@')[2]}{u.path}"
