"""Settings of the internal HTTP client, from options or the environment."""

from dataclasses import dataclass

DEFAULTS = {
    "timeout": 30.0,
    "retries": 3,
    "verify_tls": True,
    "user_agent": "tidal-client/1.0",
    "proxy": None,
}


@dataclass(frozen=True)
class Settings:
    timeout: float
    retries: int
    verify_tls: bool
    user_agent: str
    proxy: str | None


def build_settings(options=None):
    """Settings from `options` over DEFAULTS: an option that is missing or None takes
    its default, any other value is used as given. Unknown names raise ValueError."""
    options = options or {}
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown option(s): {', '.join(unknown)}")
    return Settings(
        timeout=float(options.get("timeout") or DEFAULTS["timeout"]),
        retries=int(options.get("retries") or DEFAULTS["retries"]),
        verify_tls=bool(options.get("verify_tls") or DEFAULTS["verify_tls"]),
        user_agent=str(options.get("user_agent") or DEFAULTS["user_agent"]),
        proxy=options.get("proxy") or DEFAULTS["proxy"],
    )


def _flag(text):
    return text.strip().lower() in ("1", "true", "yes", "on")


def from_env(environ):
    """Settings from HTTPCLIENT_TIMEOUT, HTTPCLIENT_RETRIES, HTTPCLIENT_VERIFY_TLS
    (1/0, true/false, yes/no, on/off), HTTPCLIENT_USER_AGENT and HTTPCLIENT_PROXY."""
    options = {}
    if "HTTPCLIENT_TIMEOUT" in environ:
        options["timeout"] = float(environ["HTTPCLIENT_TIMEOUT"])
    if "HTTPCLIENT_RETRIES" in environ:
        options["retries"] = int(environ["HTTPCLIENT_RETRIES"])
    if "HTTPCLIENT_VERIFY_TLS" in environ:
        options["verify_tls"] = _flag(environ["HTTPCLIENT_VERIFY_TLS"])
    if "HTTPCLIENT_USER_AGENT" in environ:
        options["user_agent"] = environ["HTTPCLIENT_USER_AGENT"]
    if environ.get("HTTPCLIENT_PROXY"):
        options["proxy"] = environ["HTTPCLIENT_PROXY"]
    return build_settings(options)
