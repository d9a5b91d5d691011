"""Embeddings kept on disk across processes and runs, keyed by a content hash of model and text.

Why: an embedding is a pure function of (model, text), yet every replay used to embed every prompt
again -- `sagesched` spent ~11 s of a 12 s run on 1,500 prompts loading MiniLM and encoding them,
where FCFS takes ~1 s. With this cache a second replay of the same workload (another policy, run or
process) reads the vectors back and never loads the model.

Format: one sqlite file, `embeddings-v1.sqlite3`, rows of (16-byte key, float32 little-endian bytes,
8-byte checksum of those bytes, last use). Nothing is unpickled: a row is read with `np.frombuffer`
after its length and checksum are checked, so a damaged row is a miss (recomputed and rewritten),
never a wrong vector. The key is blake2b of the model's identity and the UTF-8 text, so another
model (or another version of its package) never reuses a vector.

Concurrency: several replays or pool workers may share the file. sqlite's WAL journal lets readers
run beside one writer; writes are one `BEGIN IMMEDIATE` transaction per batch, waiting up to
`busy_timeout_s` for another writer. A connection is never carried across a fork (the child opens
its own). A file that is not a readable database is deleted and rebuilt under a file lock, with a
warning; any other failure (a locked database past the timeout, a read-only or full disk) skips the
disk for that call, with a warning once -- the cache is an optimisation and never fails a run.

Bound: at most `max_entries` rows (150,000 by default, ~1.7 KB each for 384-d vectors: ~250 MB);
a write that goes past it evicts the least recently used rows down to 90% of it. "Used" is updated
on a read only when it is older than `touch_after_s` (an hour), so repeated replays do not turn
every read into a write; the order is least-recently-used to within that hour.

Location (`default_directory`): `ADAPT_EMBEDDING_CACHE` names a directory, or `off` disables the
disk layer; by default the cache lives beside an embedded MLflow store (`mlruns/embedding-cache`,
next to the registry's `mlruns/model-cache`, so deleting the store deletes it) and in the temp dir
for a remote tracking server. `ADAPT_EMBEDDING_CACHE_MAX_ENTRIES` overrides the bound.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from adapt import tracking

log = logging.getLogger(__name__)

ENV_DIRECTORY = "ADAPT_EMBEDDING_CACHE"
ENV_MAX_ENTRIES = "ADAPT_EMBEDDING_CACHE_MAX_ENTRIES"
DISABLED = frozenset({"off", "0", "false", "no", "none", "disabled"})
DEFAULT_MAX_ENTRIES = 150_000
PAGE_SIZE = 8192
SCHEMA_VERSION = "1"
FILENAME = f"embeddings-v{SCHEMA_VERSION}.sqlite3"  # another layout gets another file, never this one
EVICT_TO = 0.9  # evict down to this share of the bound, so a full cache does not evict on every write
MAX_FAILURES = 5  # e.g. a read-only directory: stop retrying it on every call
CHUNK = 500  # keys per `IN (...)` query: far below sqlite's variable limit on every version
_PERSON = b"adapt-embed-v1"  # blake2b personalisation: these keys never collide with other hashes


def content_key(model_id: str, text: str) -> bytes:
    """16-byte key of `text` embedded by `model_id`. The model's identity is length-prefixed, so
    no (model, text) pair can produce another pair's byte stream."""
    digest = hashlib.blake2b(digest_size=16, person=_PERSON)
    model = model_id.encode("utf-8")
    digest.update(len(model).to_bytes(8, "little"))
    digest.update(model)
    digest.update(text.encode("utf-8", "surrogatepass"))  # a lone surrogate is still a key
    return digest.digest()


@contextlib.contextmanager
def _immediate_transaction(connection: sqlite3.Connection) -> Iterator[None]:
    """A write transaction that takes the write lock at once (waiting up to the busy timeout), so
    two writers never deadlock upgrading from read to write; rolled back on any error."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield
        connection.execute("COMMIT")
    except BaseException:
        if connection.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                connection.execute("ROLLBACK")
        raise


def _checksum(blob: bytes) -> bytes:
    return hashlib.blake2b(blob, digest_size=8).digest()


def default_directory() -> Path | None:
    """Where the shared cache lives (see the module docstring); None when it is turned off."""
    setting = os.environ.get(ENV_DIRECTORY, "").strip()
    if setting.lower() in DISABLED:
        return None
    if setting:
        return Path(setting).expanduser()
    uri = tracking.tracking_uri()
    if tracking.is_embedded(uri):
        return tracking.artifact_root(uri).parent / "embedding-cache"
    return Path(tempfile.gettempdir()) / "adapt-embedding-cache"


def default_max_entries() -> int:
    """`ADAPT_EMBEDDING_CACHE_MAX_ENTRIES` when it is a positive integer, else the default (a bad
    value is reported and ignored: a cache setting should not stop a run)."""
    setting = os.environ.get(ENV_MAX_ENTRIES, "").strip()
    if not setting:
        return DEFAULT_MAX_ENTRIES
    try:
        value = int(setting)
    except ValueError:
        value = 0
    if value < 1:
        log.warning(
            "%s=%r is not a positive integer; using %d", ENV_MAX_ENTRIES, setting, DEFAULT_MAX_ENTRIES
        )
        return DEFAULT_MAX_ENTRIES
    return value


class _Corrupt(Exception):
    """The file is not a usable database: rebuild it."""


# Connections a forked child inherited: never used or closed there (closing one could release the
# parent's locks), only kept from the garbage collector, whose finaliser would close them.
_ABANDONED: list[sqlite3.Connection] = []


class DiskEmbeddingCache:
    """Vectors by `content_key`, in `directory/embeddings-v1.sqlite3`. See the module docstring."""

    def __init__(
        self,
        directory: str | Path,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        busy_timeout_s: float = 5.0,
        touch_after_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries: expected >= 1, got {max_entries!r}")
        self.directory = Path(directory)
        self.path = self.directory / FILENAME
        self.max_entries = int(max_entries)
        self.busy_timeout_s = busy_timeout_s
        self.touch_after_s = touch_after_s
        self.clock = clock
        self.disabled = False
        self.rejected_rows = 0  # rows whose length or checksum failed: read as misses
        self._connection: sqlite3.Connection | None = None
        self._inode: tuple[int, int] | None = None  # (device, inode) of the file last opened
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._failures = 0  # operations failed in a row: past MAX_FAILURES the disk is left alone

    # ------------------------------------------------------------ public
    def get_many(self, keys: Sequence[bytes], dimension: int) -> dict[bytes, np.ndarray]:
        """The stored vectors among `keys`, each a (dimension,) float32 array that passed its
        checks; missing or damaged rows are simply absent. One query per `CHUNK` keys."""
        if not keys:
            return {}
        return self._guarded("read", lambda: self._get_many(list(dict.fromkeys(keys)), dimension), {})

    def put_many(self, vectors: Mapping[bytes, np.ndarray]) -> None:
        """Store `vectors` (key -> 1-d float vector) in one transaction, evicting past the bound."""
        if vectors:
            self._guarded("write", lambda: self._put_many(vectors), None)

    def __len__(self) -> int:
        return self._guarded("count", self._count, 0)

    def close(self) -> None:
        with self._lock:
            if self._connection is not None and self._pid == os.getpid():
                self._connection.close()
            self._connection = None

    # ------------------------------------------------------------ internals
    def _guarded(self, what: str, operation: Callable, fallback):
        """Run `operation` on the database; the fallback (a miss, no write) on any failure."""
        if self.disabled:
            return fallback
        with self._lock:
            for attempt in (1, 2):
                try:
                    result = operation()
                    self._failures = 0
                    return result
                except _Corrupt as exc:
                    if attempt == 2 or not self._rebuild(str(exc)):
                        self._disable(f"{self.path}: still unusable after a rebuild ({exc})")
                        return fallback
                except sqlite3.DatabaseError as exc:  # a locked, read-only or full database
                    corrupt = not isinstance(exc, sqlite3.OperationalError)  # e.g. "disk image is malformed"
                    if corrupt and attempt == 1 and self._rebuild(str(exc)):
                        continue
                    self._warn_once(what, f"{self.path}: embedding cache {what} skipped ({exc})")
                    self._reset_connection()
                    self._failures += 1
                    if self._failures >= MAX_FAILURES:
                        self._disable(f"{self.path}: embedding cache off for this process ({exc})")
                    return fallback
                except OSError as exc:  # the directory cannot be made or opened
                    self._disable(f"{self.path}: embedding cache off for this process ({exc})")
                    return fallback
        return fallback

    def _conn(self) -> sqlite3.Connection:
        if self._pid != os.getpid():  # forked: the parent's connection is not ours to use
            if self._connection is not None:
                _ABANDONED.append(self._connection)
            self._connection = None
            self._pid = os.getpid()
        if self._connection is None:
            self._connection = self._open()
        return self._connection

    def _open(self) -> sqlite3.Connection:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._inode = self._current_inode()
        connection = sqlite3.connect(
            self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        try:
            # 8 KB pages hold five 1.5 KB rows with little waste (4 KB ones two); a no-op once the
            # file exists.
            connection.execute(f"PRAGMA page_size={PAGE_SIZE}")
            try:
                # WAL: readers beside a writer. It needs shared memory, so a network filesystem may
                # refuse it; the default rollback journal is still correct, only slower to share.
                connection.execute("PRAGMA journal_mode=WAL")
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc):
                    raise
            connection.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, never torn
            self._initialise(connection)
            self._inode = self._current_inode()  # the file this connection has, created if it was not
        except BaseException as exc:
            connection.close()
            if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
                raise _Corrupt(str(exc)) from exc  # "file is not a database", a malformed schema
            raise
        return connection

    def _initialise(self, connection: sqlite3.Connection) -> None:
        """Create the schema once, and recount the rows (this process's writes then keep the count,
        under the same transactions, so the bound never needs a full scan)."""
        with _immediate_transaction(connection):
            # A rowid table: a 1.5 KB row fits in a page there, where a WITHOUT ROWID table spills
            # each into overflow pages (measured: 4.7 KB a row on disk and 10x slower writes).
            connection.execute(
                "CREATE TABLE IF NOT EXISTS vectors (id INTEGER PRIMARY KEY, key BLOB NOT NULL UNIQUE, "
                "vector BLOB NOT NULL, checksum BLOB NOT NULL, used REAL NOT NULL)"
            )
            connection.execute("CREATE INDEX IF NOT EXISTS vectors_used ON vectors (used)")
            connection.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
            row = connection.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
            if row is None:
                connection.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
            elif row[0] != SCHEMA_VERSION:
                raise _Corrupt(f"schema {row[0]!r}, expected {SCHEMA_VERSION!r}")
            (count,) = connection.execute("SELECT count(*) FROM vectors").fetchone()
            connection.execute("INSERT OR REPLACE INTO meta VALUES ('count', ?)", (str(count),))

    def _get_many(self, keys: list[bytes], dimension: int) -> dict[bytes, np.ndarray]:
        connection = self._conn()
        found: dict[bytes, np.ndarray] = {}
        stale: list[bytes] = []
        damaged: list[bytes] = []
        horizon = self.clock() - self.touch_after_s
        for start in range(0, len(keys), CHUNK):
            chunk = keys[start : start + CHUNK]
            marks = ",".join("?" * len(chunk))
            rows = connection.execute(
                f"SELECT key, vector, checksum, used FROM vectors WHERE key IN ({marks})", chunk
            ).fetchall()
            for key, blob, checksum, used in rows:
                vector = self._decode(blob, checksum, dimension)
                if vector is None:
                    damaged.append(key)
                    continue
                found[key] = vector
                if used < horizon:
                    stale.append(key)
        if damaged:
            self.rejected_rows += len(damaged)
            self._warn_once(
                "damaged", f"{self.path}: {len(damaged)} damaged vector(s) ignored and recomputed"
            )
        if stale or damaged:
            self._write(connection, touch=stale, delete=damaged)
        return found

    @staticmethod
    def _decode(blob: object, checksum: object, dimension: int) -> np.ndarray | None:
        """The row's vector, or None when its type, length, checksum or values are wrong."""
        if not isinstance(blob, bytes) or len(blob) != 4 * dimension or checksum != _checksum(blob):
            return None
        vector = np.frombuffer(blob, dtype="<f4").astype(np.float32)  # a writable native copy
        return vector if np.isfinite(vector).all() else None

    def _put_many(self, vectors: Mapping[bytes, np.ndarray]) -> None:
        now = self.clock()
        rows = []
        for key, vector in vectors.items():
            array = np.asarray(vector)
            if array.ndim != 1 or not np.isfinite(array).all():
                continue  # never store what a read would reject; the caller still has its vector
            blob = np.ascontiguousarray(array, dtype="<f4").tobytes()
            rows.append((bytes(key), blob, _checksum(blob), now))
        self._write(self._conn(), insert=rows)

    def _write(
        self,
        connection: sqlite3.Connection,
        insert: Iterable[tuple] = (),
        touch: Sequence[bytes] = (),
        delete: Sequence[bytes] = (),
    ) -> None:
        """One transaction: delete damaged rows, refresh last use, insert, then evict past the bound."""
        with _immediate_transaction(connection):
            change = 0
            if delete:
                cursor = connection.executemany("DELETE FROM vectors WHERE key = ?", [(k,) for k in delete])
                change -= cursor.rowcount
            if touch:
                connection.executemany(
                    "UPDATE vectors SET used = ? WHERE key = ?", [(self.clock(), k) for k in touch]
                )
            rows = list(insert)
            if rows:
                # IGNORE: a row another process wrote meanwhile holds the same vector (same key).
                cursor = connection.executemany(
                    "INSERT OR IGNORE INTO vectors (key, vector, checksum, used) VALUES (?, ?, ?, ?)", rows
                )
                change += cursor.rowcount
            count = self._stored_count(connection) + change
            if count > self.max_entries:
                excess = count - int(self.max_entries * EVICT_TO)
                cursor = connection.execute(
                    "DELETE FROM vectors WHERE id IN (SELECT id FROM vectors ORDER BY used LIMIT ?)",
                    (excess,),
                )
                count -= cursor.rowcount
            connection.execute("UPDATE meta SET value = ? WHERE name = 'count'", (str(max(count, 0)),))

    @staticmethod
    def _stored_count(connection: sqlite3.Connection) -> int:
        row = connection.execute("SELECT value FROM meta WHERE name = 'count'").fetchone()
        try:
            return int(row[0])
        except (TypeError, ValueError):  # a missing or mangled counter: count once
            return int(connection.execute("SELECT count(*) FROM vectors").fetchone()[0])

    def _count(self) -> int:
        return int(self._conn().execute("SELECT count(*) FROM vectors").fetchone()[0])

    def _rebuild(self, reason: str) -> bool:
        """Delete an unusable file and start an empty one, under a lock so that two processes that
        both find it broken rebuild it once: the second sees a new file and simply reopens it."""
        failed = self._inode
        self._reset_connection()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.directory / (FILENAME + ".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    current = self._current_inode()
                    if current is not None and current != failed:
                        self._connection = self._open()  # another process rebuilt it meanwhile
                        return True
                    log.warning("%s: embedding cache unreadable (%s); deleted and rebuilt", self.path, reason)
                    for suffix in ("", "-wal", "-shm", "-journal"):
                        Path(str(self.path) + suffix).unlink(missing_ok=True)
                    self._connection = self._open()
                    return True
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
        except (OSError, _Corrupt, sqlite3.DatabaseError) as exc:
            self._reset_connection()
            log.warning("%s: could not rebuild the embedding cache (%s)", self.path, exc)
            return False

    def _current_inode(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return None
        return stat.st_dev, stat.st_ino

    def _reset_connection(self) -> None:
        if self._connection is not None:
            if self._pid == os.getpid():
                with contextlib.suppress(sqlite3.Error):
                    self._connection.close()
            else:
                _ABANDONED.append(self._connection)
        self._connection = None

    def _disable(self, message: str) -> None:
        self.disabled = True
        self._reset_connection()
        log.warning("%s", message)

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("%s", message)


def open_default() -> DiskEmbeddingCache | None:
    """The disk layer at `default_directory()` with the configured bound, or None when it is off."""
    directory = default_directory()
    if directory is None:
        return None
    return DiskEmbeddingCache(directory, max_entries=default_max_entries())
