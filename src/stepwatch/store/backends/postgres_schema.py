"""The PostgreSQL run store's schema, its version and migrations, and how connections are
opened (with the password kept out of every message).

psycopg 3 is imported here, and only when a ``postgresql://`` location is opened: importing
stepwatch, or reading an SQLite store, never loads it (``pip install 'stepwatch[postgres]'``).

Tables: ``meta`` (the schema version), ``runs`` (one row per run: its host and user, the
writer's heartbeat as the server's clock saw it in ``seen``, and ``origin``, which makes
creating a run and pushing a local run idempotent), ``keys``, ``points`` (one value per
``(run, key, step)``: a batch sent twice is stored once), ``events`` (``seq`` numbers a run's
events, so they too are stored once), ``rollups`` (the min/max blocks of
:mod:`~stepwatch.store.backends.rollup`) and ``series`` (per run and key: the count,
extremes and last point, so that listing 1,000 runs never reads their points).
"""

from __future__ import annotations

import time
from typing import Any

from ..base import StoreUnreachable, hide_password, secrets_of

__all__: list[str] = []

SCHEMA_VERSION = 1
CONNECT_TIMEOUT = 5  # seconds per connection attempt

# Applied in order to a store of an older version: {version it upgrades from: SQL}. Version 1
# is the first; a later version adds its step here and raises SCHEMA_VERSION.
MIGRATIONS: dict[int, str] = {}

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key text PRIMARY KEY, value text NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id bigserial PRIMARY KEY,
    name text NOT NULL,
    status text NOT NULL,
    started double precision NOT NULL,
    ended double precision,
    host text NOT NULL,
    "user" text NOT NULL DEFAULT '',
    pid integer NOT NULL,
    config text NOT NULL DEFAULT '{}',
    heartbeat double precision NOT NULL,
    seen timestamptz NOT NULL DEFAULT clock_timestamp(),
    dropped bigint NOT NULL DEFAULT 0,
    steps bigint NOT NULL DEFAULT 0,
    pushed boolean NOT NULL DEFAULT false,
    origin text NOT NULL UNIQUE
);
CREATE INDEX IF NOT EXISTS runs_by_name ON runs (name);
CREATE TABLE IF NOT EXISTS keys (id serial PRIMARY KEY, name text NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS points (
    run bigint NOT NULL,
    key integer NOT NULL,
    step bigint NOT NULL,
    epoch integer,
    time double precision NOT NULL,
    value double precision,
    PRIMARY KEY (run, key, step)
);
CREATE TABLE IF NOT EXISTS events (
    run bigint NOT NULL,
    seq bigint NOT NULL,
    step bigint,
    epoch integer,
    time double precision NOT NULL,
    kind text NOT NULL,
    level text NOT NULL,
    message text NOT NULL,
    data text NOT NULL DEFAULT '{}',
    PRIMARY KEY (run, seq)
);
CREATE TABLE IF NOT EXISTS rollups (
    run bigint NOT NULL,
    key integer NOT NULL,
    width integer NOT NULL,
    bucket bigint NOT NULL,
    n bigint NOT NULL,
    min_step bigint,
    min_value double precision,
    max_step bigint,
    max_value double precision,
    nan_step bigint,
    PRIMARY KEY (run, key, width, bucket)
);
CREATE TABLE IF NOT EXISTS series (
    run bigint NOT NULL,
    key integer NOT NULL,
    n bigint NOT NULL,
    vmin double precision,
    vmax double precision,
    lmin double precision,
    last_step bigint NOT NULL,
    last_value double precision,
    min_epoch integer,
    max_epoch integer,
    per_epoch boolean NOT NULL,
    PRIMARY KEY (run, key)
);
"""

# Held while the tables are created or migrated: writers starting together take turns.
_LOCK = 0x57E9_3A7C

# libpq's words for a server that refused us for good (wrong password, unknown database or
# role, no pg_hba.conf entry): a clear error before training, never a retry.
_REFUSED = (
    "authentication failed",
    "does not exist",
    "pg_hba.conf",
    "permission denied",
    "no password supplied",
    "password is required",
    "invalid",
    "unsupported",
    "certificate",
)


def psycopg() -> Any:
    """The psycopg module; an ImportError saying how to install it when it is missing."""
    try:
        import psycopg as module
    except ImportError:
        raise ImportError(
            "a postgresql:// store needs psycopg 3: pip install 'stepwatch[postgres]'"
        ) from None
    return module


def scrub(text: str, url: str) -> str:
    """``text`` without the password of ``url`` (nor the URL itself, but its shown form)."""
    text = text.replace(url, hide_password(url))
    for secret in sorted(secrets_of(url), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def connect(url: str, argname: str = "db") -> Any:
    """An autocommit connection to the store at ``url``.

    Raises:
        StoreUnreachable: the server cannot be reached now (down, restarting, no network).
        ValueError: the server refused us for good (password, database, role), or a URL
            libpq cannot read; the password is never in the message.
    """
    pg = psycopg()
    shown = hide_password(url)
    try:
        return pg.connect(
            url, autocommit=True, connect_timeout=CONNECT_TIMEOUT, application_name="stepwatch"
        )
    except pg.ProgrammingError as exc:  # a URL libpq cannot parse
        raise ValueError(
            f"'{argname}' {shown!r} is not a PostgreSQL URL libpq can use: "
            f"{scrub(_one_line(exc), url)}; pass postgresql://user[:password]@host:port/database"
        ) from None
    except pg.OperationalError as exc:
        message = scrub(_one_line(exc), url)
        if any(word in message for word in _REFUSED):
            raise ValueError(f"'{argname}' {shown!r}: the server refused: {message}") from None
        raise StoreUnreachable(message) from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text.removeprefix("connection failed: ")


def stored_version(conn: Any) -> int | None:
    """The store's schema version; None for a database without stepwatch's tables."""
    row = conn.execute("SELECT to_regclass('meta') IS NOT NULL").fetchone()
    if not row[0]:
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return None if row is None else int(row[0])


def check_version(version: int | None, shown: str) -> None:
    if version is not None and version > SCHEMA_VERSION:
        raise ValueError(
            f"{shown!r} was written by a newer stepwatch (store schema {version}; this version "
            f"reads schema {SCHEMA_VERSION} and older): upgrade stepwatch to use it."
        )


def ensure_schema(conn: Any, shown: str) -> None:
    """Create the tables (or migrate an older store) under an advisory lock; a ValueError for
    a store of a newer version."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK,))
        version = stored_version(conn)
        check_version(version, shown)
        if version == SCHEMA_VERSION:
            return
        if version is not None:
            for old in range(version, SCHEMA_VERSION):
                conn.execute(MIGRATIONS[old])
        else:
            conn.execute(SCHEMA)
        conn.execute(
            "INSERT INTO meta (key, value) VALUES ('schema_version', %s) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (str(SCHEMA_VERSION),),
        )


def check_writable_url(url: str, argname: str = "db") -> None:
    """Before training: psycopg is installed, the server takes our credentials and the store
    is not of a newer version. A server that cannot be reached now is no error here, and no
    message: if it is still away when the run starts, the writer records the run locally and
    says so, once (:class:`~stepwatch.store.RunWriter`)."""
    shown = hide_password(url)
    try:
        conn = connect(url, argname)
    except StoreUnreachable:
        return
    try:
        check_version(stored_version(conn), shown)
    finally:
        conn.close()


class Backoff:
    """When to try a server again: 0.25 s after the first failure, doubling up to 2 s."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.next_try = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self.next_try

    def failed(self) -> None:
        self.delay = min(2.0, self.delay * 2 or 0.25)
        self.next_try = time.monotonic() + self.delay

    def succeeded(self) -> None:
        self.delay = 0.0
        self.next_try = 0.0
