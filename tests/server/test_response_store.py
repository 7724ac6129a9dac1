"""The SQLite response store (server/response_store.py): per tenant, bounded, shared, and refusing foreign files."""

from __future__ import annotations

import sqlite3
import stat
import threading
import time

import pytest

from gptoss_lite.server.response_store import FILE_NAME, ResponseStore, StoreError

CONVERSATION = [{"role": "user", "content": "Weather in Paris? ☀"}, {"role": "assistant", "content": "Sunny."}]


def body(rid: str) -> dict:
    return {"id": rid, "object": "response", "output_text": "Sunny.", "output": []}


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_put_get_delete(tmp_path):
    """A stored response reads back (conversation and body, exactly); deleting it removes it once."""
    store = ResponseStore(tmp_path / FILE_NAME)
    store.put("alice", "resp_1", CONVERSATION, body("resp_1"))
    assert store.conversation("alice", "resp_1") == CONVERSATION
    assert store.body("alice", "resp_1") == body("resp_1")
    assert store.delete("alice", "resp_1") is True
    assert store.conversation("alice", "resp_1") is None and store.body("alice", "resp_1") is None
    assert store.delete("alice", "resp_1") is False
    assert store.body("alice", "never") is None


def test_tenants_are_isolated(tmp_path):
    """One tenant's id is not found, and cannot be deleted, by another."""
    store = ResponseStore(tmp_path / FILE_NAME)
    store.put("alice", "resp_1", CONVERSATION, body("resp_1"))
    assert store.body("bob", "resp_1") is None and store.conversation("bob", "resp_1") is None
    assert store.delete("bob", "resp_1") is False
    assert store.body("alice", "resp_1") == body("resp_1")


def test_each_tenant_keeps_its_newest(tmp_path):
    """Past max_per_tenant, a tenant's oldest rows go; other tenants' rows are not touched."""
    clock = Clock()
    store = ResponseStore(tmp_path / FILE_NAME, max_per_tenant=3, clock=clock)
    store.put("bob", "b0", CONVERSATION, body("b0"))
    for i in range(5):
        clock.now += 1
        store.put("alice", f"a{i}", CONVERSATION, body(f"a{i}"))
    assert [store.body("alice", f"a{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.count("alice") == 3 and store.body("bob", "b0") is not None


def test_same_second_writes_keep_the_newest_by_insertion(tmp_path):
    """Rows written at the same clock reading are ordered by insertion: the last ones stay."""
    store = ResponseStore(tmp_path / FILE_NAME, max_per_tenant=2, clock=Clock())
    for i in range(4):
        store.put("alice", f"a{i}", CONVERSATION, body(f"a{i}"))
    assert [store.body("alice", f"a{i}") is not None for i in range(4)] == [False, False, True, True]


def test_rows_expire_after_the_ttl(tmp_path):
    """A row older than ttl is not found, and the next write (any tenant's) drops it."""
    clock = Clock()
    store = ResponseStore(tmp_path / FILE_NAME, ttl=100, clock=clock)
    store.put("alice", "old", CONVERSATION, body("old"))
    clock.now += 100
    assert store.body("alice", "old") is not None  # exactly ttl old: still kept
    clock.now += 1
    assert store.body("alice", "old") is None and store.conversation("alice", "old") is None
    assert store.count() == 1
    store.put("bob", "new", CONVERSATION, body("new"))
    assert store.count() == 1 and store.body("bob", "new") is not None


def test_two_stores_on_one_file_see_each_other(tmp_path):
    """Two stores on one file (as two server processes) read each other's writes and deletes at once."""
    a, b = ResponseStore(tmp_path / FILE_NAME), ResponseStore(tmp_path / FILE_NAME)
    a.put("alice", "resp_a", CONVERSATION, body("resp_a"))
    b.put("alice", "resp_b", CONVERSATION, body("resp_b"))
    assert b.body("alice", "resp_a") == body("resp_a") and a.body("alice", "resp_b") == body("resp_b")
    assert b.delete("alice", "resp_a") and a.body("alice", "resp_a") is None
    a.close()
    assert ResponseStore(tmp_path / FILE_NAME).body("alice", "resp_b") == body("resp_b")  # reopened: still there


def test_concurrent_writers_lose_nothing(tmp_path):
    """Threads writing through two stores on one file at once: every row arrives, none is torn."""
    stores = [ResponseStore(tmp_path / FILE_NAME), ResponseStore(tmp_path / FILE_NAME)]

    def write(k: int) -> None:
        for i in range(25):
            stores[k % 2].put("alice", f"r{k}-{i}", CONVERSATION, body(f"r{k}-{i}"))

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stores[0].count("alice") == 100
    assert all(stores[1].body("alice", f"r{k}-{i}") == body(f"r{k}-{i}") for k in range(4) for i in range(25))


def _open_together(path, n: int) -> tuple[list[ResponseStore], list[str]]:
    """n stores opened on `path` at once, one thread each (its own connection): (opened, errors)."""
    barrier, opened, errors = threading.Barrier(n), [], []

    def open_store() -> None:
        barrier.wait()
        try:
            opened.append(ResponseStore(path))
        except StoreError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=open_store) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return opened, errors


def test_stores_opening_a_new_file_together_all_open(tmp_path):
    """Several servers started together on one new --data-dir (here: threads, each with its own
    connection) all open the store: switching a new file to WAL answers "locked" at once to all
    but one of them, and the store waits for its turn instead of refusing the file."""
    for round_ in range(20):
        path = tmp_path / str(round_) / FILE_NAME
        path.parent.mkdir()
        opened, errors = _open_together(path, 4)
        assert errors == [] and len(opened) == 4
        opened[0].put("alice", "resp_a", CONVERSATION, body("resp_a"))
        assert opened[3].body("alice", "resp_a") == body("resp_a")
        for store in opened:
            store.close()


def test_the_file_is_wal_versioned_and_private(tmp_path):
    """A new store is in WAL mode, with this store's application_id and schema version 2, and its
    files (the -wal and -shm ones too) are readable by their owner only."""
    store = ResponseStore(tmp_path / FILE_NAME)
    store.put("alice", "resp_1", CONVERSATION, body("resp_1"))
    db = sqlite3.connect(tmp_path / FILE_NAME)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == 2
    assert db.execute("PRAGMA application_id").fetchone()[0] == int.from_bytes(b"gOSr", "big")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {FILE_NAME: 0o600, FILE_NAME + "-wal": 0o600, FILE_NAME + "-shm": 0o600}


def test_a_file_that_is_not_a_database_is_refused_at_open(tmp_path):
    """Garbage bytes are a StoreError when the store opens, naming the file and the way out."""
    path = tmp_path / FILE_NAME
    path.write_bytes(b"this is not an SQLite file at all" * 100)
    with pytest.raises(StoreError, match=f"{FILE_NAME}: not a usable response store .*another --data-dir"):
        ResponseStore(path)


def test_a_damaged_database_is_refused_at_open(tmp_path):
    """A store whose pages were overwritten is a StoreError at open, not a failure on a later request."""
    path = tmp_path / FILE_NAME
    store = ResponseStore(path)
    for i in range(200):
        store.put("alice", f"r{i}", CONVERSATION * 20, body(f"r{i}"))
    store.close()
    sqlite3.connect(path).execute("PRAGMA wal_checkpoint(TRUNCATE)").close()
    data = bytearray(path.read_bytes())
    assert len(data) > 8192
    data[4096:8192] = b"\xa5" * 4096  # the second page on: b-tree pages
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="response store"):
        ResponseStore(path)


def test_another_programs_database_is_refused(tmp_path):
    """An SQLite file of another program (tables, no application_id) is refused, and left as it was."""
    path = tmp_path / FILE_NAME
    other = sqlite3.connect(path)
    other.execute("CREATE TABLE notes (text TEXT)")
    other.commit()
    other.close()
    with pytest.raises(StoreError, match="not a gptoss-lite response store"):
        ResponseStore(path)
    assert [r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master")] == ["notes"]


def test_a_newer_schema_is_refused(tmp_path):
    """A store written with a schema version this code does not know is refused by name."""
    path = tmp_path / FILE_NAME
    ResponseStore(path).close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 3")
    db.close()
    with pytest.raises(StoreError, match="schema version 3; this server reads version 2"):
        ResponseStore(path)


def test_a_version_1_store_is_upgraded_and_keeps_its_rows(tmp_path):
    """A store written before `chain` existed opens as version 2: its rows are kept, and each is the
    first response of its own chain."""
    path = tmp_path / FILE_NAME
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE responses (tenant TEXT NOT NULL, id TEXT NOT NULL, created_at REAL NOT NULL, "
        "conversation TEXT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (tenant, id));"
    )
    db.execute("INSERT INTO responses VALUES ('alice', 'resp_old', ?, '[]', '{}')", (time.time(),))
    db.execute(f"PRAGMA application_id = {int.from_bytes(b'gOSr', 'big')}")
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    store = ResponseStore(path)
    assert store.chain("alice", "resp_old") == "resp_old"
    store.put("alice", "resp_new", CONVERSATION, body("resp_new"), chain="resp_old")
    assert (store.chain("alice", "resp_new"), store.chain("bob", "resp_new")) == ("resp_old", None)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 2


def test_bad_bounds_are_refused(tmp_path):
    """max_per_tenant < 1 and a ttl that is not positive are ValueErrors."""
    with pytest.raises(ValueError, match="max_per_tenant=0"):
        ResponseStore(tmp_path / FILE_NAME, max_per_tenant=0)
    with pytest.raises(ValueError, match="ttl=0"):
        ResponseStore(tmp_path / FILE_NAME, ttl=0)
