"""The writer-lock protocol (lmdbstore.store.locks): one exclusive writer, verify's shared lock, the probe."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import StoreInfo

from lmdbstore import LmdbStoreError, StoreLockedError, open_writer
from lmdbstore.store.locks import (
    WRITER_LOCK_FILE,
    acquire_writer_lock,
    hold_off_writers,
    lock_table_writable,
    release_lock,
    resolve_lock,
    writer_active,
)


def test_an_open_writer_is_seen_and_excludes_everyone_else(small_store: StoreInfo) -> None:
    p = small_store.path
    assert not writer_active(p)
    assert resolve_lock(p, None) is False  # nobody writes: read lock-free
    with open_writer(p):
        assert writer_active(p)
        assert resolve_lock(p, None) is True  # a registered snapshot while a writer is active
        assert resolve_lock(p, False) is False  # as asked
        with pytest.raises(StoreLockedError, match="a writer is appending to the store"):
            hold_off_writers(p)
        with pytest.raises(StoreLockedError, match="another writer is using this store"):
            acquire_writer_lock(p)
    assert not writer_active(p)


def test_verifys_shared_lock_keeps_writers_out_but_is_no_writer(small_store: StoreInfo) -> None:
    p = small_store.path
    fd = hold_off_writers(p)
    try:
        assert fd >= 0
        assert not writer_active(p)  # a shared lock is not a writer: readers stay lock-free
        release_lock(hold_off_writers(p))  # shared locks coexist
        with pytest.raises(StoreLockedError, match="`lmdbstore verify` is checking its file structure"):
            open_writer(p)
    finally:
        release_lock(fd)
    with open_writer(p) as w:  # free again
        assert w.count == 2000


def test_a_directory_without_a_lock_file_has_nothing_to_hold(tmp_path: Path) -> None:
    assert hold_off_writers(tmp_path) == -1
    release_lock(-1)  # a no-op
    assert not writer_active(tmp_path)
    fd = acquire_writer_lock(tmp_path)  # creates the file
    try:
        assert (tmp_path / WRITER_LOCK_FILE).is_file()
        assert writer_active(tmp_path)
    finally:
        release_lock(fd)
    assert not writer_active(tmp_path)


def test_a_lock_file_a_writer_cannot_open_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / WRITER_LOCK_FILE).mkdir()
    with pytest.raises(LmdbStoreError) as err:
        acquire_writer_lock(tmp_path)
    assert err.value.message.startswith(f"cannot open the writer lock {WRITER_LOCK_FILE} (")
    assert err.value.hint == "a writer needs to create and write this file in the store directory"
    assert not isinstance(err.value, StoreLockedError)


def test_the_reader_table_of_a_writable_store_is_writable(small_store: StoreInfo, tmp_path: Path) -> None:
    assert lock_table_writable(small_store.path)
    assert lock_table_writable(tmp_path)  # no lock.mdb yet: the directory decides
