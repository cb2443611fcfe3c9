"""Durable attestation store: SQLite in WAL mode with ``synchronous=FULL``, so a
``put`` has reached the disk (fsync of the WAL) when it returns."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading

COLUMNS = ("id", "created", "output_digest", "blob")


class AttestationStore:
    """Signed attestation files keyed by their id (hex SHA-256 of the file bytes).

    Thread-safe; ``path`` is created with its folder. Raises ``sqlite3.Error``
    on I/O failure, also for a store it could only read; a store that cannot be
    created (a full disk) leaves no file behind, nor the folders it made.
    """

    def __init__(self, folder: str):
        # the folders makedirs will create, deepest first; realpath, as the system resolves
        # the name ("link/../data" is beside the link's target)
        made, up = [], os.path.realpath(folder)
        while not os.path.exists(up) and os.path.dirname(up) != up:
            made.append(up)
            up = os.path.dirname(up)
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, "attestations.sqlite3")
        fresh = not os.path.exists(self.path)
        self._lock = threading.Lock()
        db = None
        try:
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("CREATE TABLE IF NOT EXISTS attestations (id TEXT PRIMARY KEY, "
                       "created TEXT NOT NULL, output_digest TEXT NOT NULL, blob BLOB NOT NULL)")
            # SQLite opens a file it may not write (another owner's, a read-only mount)
            # read-only without a word: a write that changes nothing fails here, not at
            # the first put, after that request's work is done
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM attestations WHERE 0")
            finally:
                db.execute("ROLLBACK")
            cols = [r[1] for r in db.execute("PRAGMA table_info(attestations)")]
        except sqlite3.Error:
            if db is not None:
                db.close()
            if fresh:
                for p in (self.path, self.path + "-wal", self.path + "-shm"):
                    try:
                        os.unlink(p)
                    except FileNotFoundError:
                        pass
                for d in made:
                    os.rmdir(d)
            raise
        self._db = db
        if cols != list(COLUMNS):
            self._db.close()
            raise sqlite3.DatabaseError(f"{self.path} holds a table 'attestations' with columns {cols}, "
                                        f"not a bitexact store")

    def put(self, att_id: str, created: str, output_digest: str, blob: bytes) -> None:
        """Insert and commit (durable on return). Re-inserting the same id is a no-op.
        On any error the transaction is rolled back (the store stays usable) and
        the ``sqlite3.Error`` propagates."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR IGNORE INTO attestations VALUES (?, ?, ?, ?)",
                                 (att_id, created, output_digest, blob))
                self._db.execute("COMMIT")
            except BaseException:
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.Error:   # e.g. the failed COMMIT already ended the transaction
                    pass
                raise

    def get(self, att_id: str) -> bytes | None:
        """The attestation file stored under ``att_id``, or None. Raises
        ``sqlite3.DatabaseError`` for a row whose blob is not bytes (SQLite keeps any
        type in any column) or not the file its id names (its SHA-256), and
        ``sqlite3.Error`` on I/O failure."""
        with self._lock:
            row = self._db.execute("SELECT blob FROM attestations WHERE id = ?", (att_id,)).fetchone()
        if row is None:
            return None
        blob = row[0]
        if not isinstance(blob, bytes):
            raise sqlite3.DatabaseError(f"the row of attestation {att_id} holds {type(blob).__name__}, not a blob")
        if hashlib.sha256(blob).hexdigest() != att_id:
            raise sqlite3.DatabaseError(f"the row of attestation {att_id} holds a blob whose SHA-256 is not its id")
        return blob

    def blobs(self):
        """The blobs of the stored rows, earliest first (by insertion; attestation files
        in a sound store, though SQLite keeps any type in any column), read one row at
        a time. Raises ``sqlite3.Error`` on I/O failure."""
        last = None
        while True:
            with self._lock:
                row = self._db.execute("SELECT rowid, blob FROM attestations WHERE ? IS NULL OR rowid > ? "
                                       "ORDER BY rowid LIMIT 1", (last, last)).fetchone()
            if row is None:
                return
            last = row[0]
            yield row[1]

    def count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM attestations").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
