"""Stored responses in SQLite: what `previous_response_id` continues and `GET /v1/responses/{id}`
answers (docs/server.md#stored-responses).

One row per response, keyed by (tenant, id): the conversation (chat-shaped messages, input and output)
and the Response body the create call answered, both JSON, and the id of the chain's first response
(what a conversation's python interpreter is keyed by). Each tenant keeps its newest
`max_per_tenant` rows, and no row outlives `ttl` seconds; both bounds are applied on every write.

The file is `responses.sqlite3` in the data directory, in WAL mode, so any number of server
processes on one directory read and write it together (a writer waits up to `BUSY_TIMEOUT_MS` for
another). Every write is one transaction: a process killed mid-write leaves the row whole or absent.
The schema is versioned (`PRAGMA user_version`) and the file marked as this store's
(`PRAGMA application_id`); a file that is not this store, or is damaged, is a StoreError when the
store opens, not a failure on some later request.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

FILE_NAME = "responses.sqlite3"
SCHEMA_VERSION = 2  # 2 added `chain`; a version 1 file is upgraded in place when opened
APPLICATION_ID = int.from_bytes(b"gOSr", "big")  # marks the file as this store's (`file` shows it too)
MAX_PER_TENANT = 1024  # stored responses each tenant keeps (the newest)
TTL_SECONDS = 30 * 24 * 3600  # age at which a stored response is dropped: 30 days
BUSY_TIMEOUT_MS = 10_000  # how long a write waits for another process's write to finish

SCHEMA = """
CREATE TABLE responses (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at REAL NOT NULL,    -- Unix time, seconds
    conversation TEXT NOT NULL,  -- JSON: the chat-shaped messages previous_response_id continues
    body TEXT NOT NULL,          -- JSON: the Response object the create call answered
    chain TEXT,                  -- the id of the chain's first response (NULL: this one's own id)
    PRIMARY KEY (tenant, id)
);
CREATE INDEX responses_by_age ON responses (created_at);
CREATE INDEX responses_by_tenant_age ON responses (tenant, created_at);
"""


class StoreError(ValueError):
    """The store's file cannot be used: not this store's, a newer schema, or damaged."""


class ResponseStore:
    """Stored responses by (tenant, id) in one SQLite file; safe to call from any thread."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_per_tenant: int = MAX_PER_TENANT,
        ttl: float = TTL_SECONDS,
        clock: Callable[[], float] = time.time,
    ):
        if max_per_tenant < 1:
            raise ValueError(f"max_per_tenant={max_per_tenant}: must be >= 1")
        if not ttl > 0:
            raise ValueError(f"ttl={ttl}: must be > 0 seconds")
        self.path = Path(path)
        self.max_per_tenant, self.ttl, self.clock = max_per_tenant, ttl, clock
        self._lock = threading.Lock()  # one connection, used by one thread at a time
        try:
            # Conversations are private: a new file is 0600, and SQLite gives its -wal and -shm files the same mode.
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
            # isolation_level=None: no implicit transactions; each write opens its own (BEGIN IMMEDIATE).
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"{self.path}: cannot open the response store: {exc}") from None
        try:
            self._open()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise StoreError(
                f"{self.path}: not a usable response store ({exc}); move it away, or pass another --data-dir"
            ) from None
        except StoreError:
            self._db.close()
            raise

    def _open(self) -> None:
        db = self._db
        db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        self._enter_wal()  # reads "file is not a database" first if it is not one
        db.execute("BEGIN IMMEDIATE")  # of two processes creating the schema at once, the second waits
        try:
            app_id = db.execute("PRAGMA application_id").fetchone()[0]
            version = db.execute("PRAGMA user_version").fetchone()[0]
            tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
            if app_id == 0 and version == 0 and tables == 0:  # a new, empty file
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            elif app_id != APPLICATION_ID:
                raise StoreError(
                    f"{self.path}: an SQLite file that is not a gptoss-lite response store; move it away, or pass "
                    "another --data-dir"
                )
            elif version == 1:  # before `chain`: each old response begins its own chain
                db.execute("ALTER TABLE responses ADD COLUMN chain TEXT")
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            elif version != SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path}: response store schema version {version}; this server reads version "
                    f"{SCHEMA_VERSION} (a newer gptoss-lite wrote it); pass another --data-dir"
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        problem = db.execute("PRAGMA quick_check").fetchone()[0]
        if problem != "ok":
            raise StoreError(f"{self.path}: the response store is damaged ({problem}); move it away")

    def _enter_wal(self) -> None:
        """Switch the file to WAL. The switch needs the file to itself for a moment, and SQLite answers
        "database is locked" at once, without the busy handler, when another process holds it (two
        servers starting together on one --data-dir); so it is retried, up to BUSY_TIMEOUT_MS."""
        deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
        while True:
            try:
                self._db.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
            time.sleep(0.01)

    def put(
        self, tenant: str, response_id: str, conversation: list[dict], body: dict, chain: str | None = None
    ) -> None:
        """Store a response (replacing one of the same id), then drop what is past the bounds. chain:
        the id of the first response of its conversation (None: this one)."""
        conversation_json = json.dumps(conversation, ensure_ascii=False, separators=(",", ":"))
        body_json = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        now = self.clock()
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(
                    "INSERT OR REPLACE INTO responses (tenant, id, created_at, conversation, body, chain) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (tenant, response_id, now, conversation_json, body_json, chain),
                )
                db.execute("DELETE FROM responses WHERE created_at < ?", (now - self.ttl,))
                db.execute(
                    "DELETE FROM responses WHERE tenant = ? AND rowid NOT IN (SELECT rowid FROM responses "
                    "WHERE tenant = ? ORDER BY created_at DESC, rowid DESC LIMIT ?)",
                    (tenant, tenant, self.max_per_tenant),
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def conversation(self, tenant: str, response_id: str) -> list[dict] | None:
        """The stored conversation of `tenant`'s response `response_id` (None: no such response)."""
        found = self._get("conversation", tenant, response_id)
        return None if found is None else json.loads(found)

    def body(self, tenant: str, response_id: str) -> dict | None:
        """The stored Response object of `tenant`'s response `response_id` (None: no such response)."""
        found = self._get("body", tenant, response_id)
        return None if found is None else json.loads(found)

    def chain(self, tenant: str, response_id: str) -> str | None:
        """The id of the first response of the conversation `response_id` continues (its own id when
        it began one; None: no such response)."""
        return self._get("coalesce(chain, id)", tenant, response_id)

    def _get(self, column: str, tenant: str, response_id: str) -> str | None:
        assert column in ("conversation", "body", "coalesce(chain, id)"), column
        with self._lock:
            row = self._db.execute(
                f"SELECT {column} FROM responses WHERE tenant = ? AND id = ? AND created_at >= ?",
                (tenant, response_id, self.clock() - self.ttl),
            ).fetchone()
        return None if row is None else row[0]

    def delete(self, tenant: str, response_id: str) -> bool:
        """Delete `tenant`'s response `response_id`; False if there was none."""
        with self._lock:
            cursor = self._db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id))
        return cursor.rowcount > 0

    def count(self, tenant: str | None = None) -> int:
        """Stored rows: a tenant's, or all of them (expired rows not yet dropped included)."""
        where, args = ("WHERE tenant = ?", (tenant,)) if tenant is not None else ("", ())
        with self._lock:
            return self._db.execute(f"SELECT count(*) FROM responses {where}", args).fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


__all__ = ["ResponseStore", "StoreError", "FILE_NAME", "MAX_PER_TENANT", "TTL_SECONDS"]
