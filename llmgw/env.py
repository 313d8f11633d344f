"""Typed readers for LLMGW_* environment variables.

Each helper fails loudly with ImproperlyConfigured, naming the variable and what was
expected, so a malformed value stops start-up instead of surfacing as a traceback later.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

__all__ = [
    "DatabaseConfig",
    "env_bool",
    "env_float",
    "env_int",
    "env_list",
    "env_listen",
    "env_secret",
    "env_str",
    "parse_database_url",
    "parse_listen",
    "secret_key",
]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip()


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={value!r}: expected a boolean (1/0, true/false, yes/no, on/off)")


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        number = int(value.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r}: expected a whole number") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number}: expected at least {minimum}")
    if maximum is not None and number > maximum:
        raise ImproperlyConfigured(f"{name}={number}: expected at most {maximum}")
    return number


def env_float(name: str, default: float, *, minimum: float | None = None, maximum: float | None = None) -> float:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        number = float(value.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r}: expected a number") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ImproperlyConfigured(f"{name}={value!r}: expected a finite number")
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number:g}: expected at least {minimum:g}")
    if maximum is not None and number > maximum:
        raise ImproperlyConfigured(f"{name}={number:g}: expected at most {maximum:g}")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def env_secret(name: str) -> str | None:
    """Read NAME, or the file named by NAME_FILE (so secrets need not sit in the environment)."""
    value = os.environ.get(name)
    if value:
        return value
    path = os.environ.get(f"{name}_FILE")
    if not path:
        return None
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ImproperlyConfigured(f"{name}_FILE={path!r}: cannot read the file ({exc.strerror})") from None


def parse_listen(name: str, value: str) -> tuple[str, int]:
    host, sep, port_text = value.strip().rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ImproperlyConfigured(f"{name}={value!r}: expected host:port, for example 127.0.0.1:8000")
    return host.strip("[]"), int(port_text)


def env_listen(name: str, default: str) -> tuple[str, int]:
    return parse_listen(name, os.environ.get(name) or default)


@dataclass(frozen=True)
class DatabaseConfig:
    engine: str  # "sqlite" or "postgresql"
    name: str
    user: str = ""
    password: str = ""
    host: str = ""
    port: str = ""
    options: tuple[tuple[str, str], ...] = ()

    def django(self, *, pool_size: int | None = 10, pool_timeout: float = 30.0) -> dict[str, object]:
        """Django's DATABASES entry; with PostgreSQL, a pool of `pool_size` connections per process,
        or none (`pool_size` None): a connection per thread, opened when a query needs it and closed
        when the thread's work ends (CONN_MAX_AGE 0, the same as a pooled one goes back)."""
        if self.engine == "sqlite":
            return {
                "ENGINE": "django.db.backends.sqlite3",
                "NAME": self.name,
                "OPTIONS": {
                    # web, worker and agent write at once: WAL lets readers go on while one
                    # writes, IMMEDIATE takes the write lock up front (no upgrade deadlocks)
                    # and the timeout makes a writer wait for its turn instead of failing.
                    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
                    "transaction_mode": "IMMEDIATE",
                    "timeout": 20,
                },
                # A file, not the shared in-memory database: that one locks whole tables and
                # ignores the busy timeout, which is not how llmgw runs.
                "TEST": {"NAME": f"{self.name}.test"},
                # Kept open like PostgreSQL's: opening one (and its PRAGMAs) per request or usage
                # batch cost more than the write itself.
                "CONN_MAX_AGE": 60,
                "CONN_HEALTH_CHECKS": True,
            }
        # A bounded pool per process (psycopg_pool, through Django): a connection goes back to the
        # pool when a request, task or thread's work ends, so a process never holds more than
        # `pool_size` however many threads it runs; a request that finds none free waits up to
        # `pool_timeout` seconds. Kept-open connections per thread (CONN_MAX_AGE) grew with every
        # sync thread of the ASGI server until PostgreSQL refused everyone. The Celery worker and
        # beat have none (llmgw.settings: PROCESS): Celery closes a prefork process's pool after
        # every task, under the feet of the batch runner's thread in the same process.
        options: dict[str, object] = dict(self.options)
        if pool_size is not None:
            options["pool"] = {"min_size": 0, "max_size": pool_size, "timeout": pool_timeout, "max_idle": 60.0}
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": self.name,
            "USER": self.user,
            "PASSWORD": self.password,
            "HOST": self.host,
            "PORT": self.port,
            "CONN_MAX_AGE": 0,
            "CONN_HEALTH_CHECKS": True,
            "OPTIONS": options,
        }


def parse_database_url(name: str, url: str) -> DatabaseConfig:
    """Understand sqlite:////absolute/path and postgres[ql]://user:pass@host:port/db?sslmode=..."""
    parts = urlsplit(url.strip())
    if parts.scheme == "sqlite":
        # sqlite:////abs/path is absolute, sqlite:///rel/path relative to the working directory.
        path = unquote(parts.path)[1:]
        if path and not path.startswith("/"):
            path = str(Path(path).resolve())
        if not path or path == "/":
            raise ImproperlyConfigured(f"{name}={url!r}: expected sqlite:////absolute/path/to/file.sqlite3")
        return DatabaseConfig(engine="sqlite", name=path)
    if parts.scheme in {"postgres", "postgresql", "pgsql"}:
        database = unquote(parts.path.lstrip("/"))
        if not database:
            raise ImproperlyConfigured(f"{name}={url!r}: expected a database name, e.g. postgres://user@host/llmgw")
        try:
            port = str(parts.port or "")
        except ValueError:
            raise ImproperlyConfigured(f"{name}={url!r}: the port is not a number") from None
        query = parse_qs(parts.query)
        return DatabaseConfig(
            engine="postgresql",
            name=database,
            user=unquote(parts.username or ""),
            password=unquote(parts.password or ""),
            host=parts.hostname or "",
            port=port,
            options=tuple((key, values[-1]) for key, values in sorted(query.items())),
        )
    raise ImproperlyConfigured(f"{name}={url!r}: expected a URL starting with postgres://, postgresql:// or sqlite:///")


def secret_key(data_dir: Path) -> str:
    """LLMGW_SECRET_KEY, else a key generated once into the data directory with mode 0600."""
    configured = env_secret("LLMGW_SECRET_KEY")
    if configured:
        return configured
    path = data_dir / "secret_key"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    key = secrets.token_urlsafe(50)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        # another process won the race; use its key
        return path.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(key)
    return key
