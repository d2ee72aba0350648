"""Saved session states: restore is bit-exact, and a corrupt, truncated or half-written file is never used."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ds4t import DecodeItem, eval_batch
from ds4t.serve.persistence import SUFFIX, CorruptStateError, KVStore, model_fingerprint, read_header
from ds4t.serve.pool import SlotPool

PROMPT = [5, 9, 77, 3, 120, 8]


def _states_equal(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def setup(model, tmp_path):
    pool = SlotPool(model, 1, 64)
    fp = model_fingerprint(model, pool.zero_state)
    yield pool, fp, tmp_path
    pool.close()


def _saved(setup):
    """A slot that ran PROMPT + 2 decode steps, saved to disk; a reference session that never left."""
    pool, fp, d = setup
    s = pool.slots[0].session
    ref = pool.model.new_session(64)
    assert torch.equal(s.prefill(PROMPT), ref.prefill(PROMPT))
    for tok in (11, 42):
        a = eval_batch([DecodeItem(s, tok)]).logits
        b = eval_batch([DecodeItem(ref, tok)]).logits
        assert torch.equal(a, b)
    store = KVStore(d, fp)
    assert store.save_async(s.tokens, s.pos, s.state_dict())
    assert not store.save_async(s.tokens, s.pos, s.state_dict())  # same history: saved once
    store.close()
    return s, ref, list(s.tokens)


def test_restore_after_eviction_is_bit_exact(setup):
    pool, fp, d = setup
    s, ref, history = _saved(setup)
    pool.reset(pool.slots[0])
    s.prefill([1, 2, 3, 4])  # another conversation takes the slot
    store = KVStore(d, fp)   # as after a restart: the index comes from the directory
    key, n = store.match(history + [99])
    assert n == len(history)
    tokens, pos, state = store.load(key)
    pool.reset(pool.slots[0])
    s.load_state_dict(state, pos, list(tokens))
    assert s.tokens == ref.tokens and s.pos == ref.pos
    assert _states_equal(s.state_dict(), ref.state_dict())
    for tok in (99, 7, 200):  # continuing gives the very logits of never having left
        a = eval_batch([DecodeItem(s, tok)]).logits
        b = eval_batch([DecodeItem(ref, tok)]).logits
        assert torch.equal(a, b)
    assert torch.equal(s.prefill([3, 1, 4]), ref.prefill([3, 1, 4]))
    assert _states_equal(s.state_dict(), ref.state_dict())
    store.close()
    ref.close()


def _only_file(d):
    files = [f for f in os.listdir(d) if f.endswith(SUFFIX)]
    assert len(files) == 1
    return os.path.join(d, files[0])


def test_bit_flip_is_detected_and_quarantined(setup):
    pool, fp, d = setup
    _, ref, history = _saved(setup)
    path = _only_file(d)
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0x01  # one bit in the last tensor's data: the header still parses
    open(path, "wb").write(bytes(data))
    events = []
    store = KVStore(d, fp, on_event=lambda k, m: events.append((k, m)))
    key, _ = store.match(history + [1])  # the header is fine: it is indexed
    with pytest.raises(CorruptStateError, match="checksum"):
        store.load(key)
    assert store.stats["corrupt"] == 1 and any(k == "corrupt" for k, _ in events)
    assert store.match(history + [1]) is None and not os.path.exists(path) and os.path.exists(path + ".corrupt")
    store.close()
    ref.close()


@pytest.mark.parametrize("cut", ["last byte", "half"])
def test_truncated_file_is_never_used(setup, cut):
    pool, fp, d = setup
    _, ref, history = _saved(setup)
    path = _only_file(d)
    data = open(path, "rb").read()
    keep = len(data) // 2 if cut == "half" else len(data) - 1
    open(path, "wb").write(data[:keep])
    for n in (keep, 7, 0):
        with pytest.raises(CorruptStateError):
            read_header(data[:n])
    store = KVStore(d, fp)
    assert store.stats["corrupt"] == 1 and store.match(history + [1]) is None
    store.close()
    ref.close()


def test_other_models_files_are_left_alone(setup):
    pool, fp, d = setup
    _, ref, history = _saved(setup)
    store = KVStore(d, "another-model")
    assert store.match(history + [1]) is None and store.stats["corrupt"] == 0
    assert os.path.exists(_only_file(d))
    store.close()
    ref.close()


_WRITER = textwrap.dedent("""
    import os, sys, torch
    import ds4t
    from ds4t.serve.persistence import KVStore
    store = KVStore(sys.argv[1], "fp")
    state = {"big": torch.randn(4, 1 << 20)}   # 16 MiB: the write pauses half-way (test hook)
    store.save_async(list(range(5)), 5, state)
    store.flush()
    print("finished", flush=True)
""")


def test_writer_killed_mid_write_leaves_nothing_usable(tmp_path):
    env = dict(os.environ, DS4T_SERVE_FAULT_SLOW_WRITE="60")
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], env=env, stdout=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not any(f.startswith(".tmp-") for f in os.listdir(tmp_path)):
            assert p.poll() is None and time.time() < deadline, "the writer never started"
            time.sleep(0.05)
        time.sleep(0.2)  # inside the pause: half the bytes are on disk
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert [f for f in os.listdir(tmp_path) if f.endswith(SUFFIX)] == []  # never renamed into place
    store = KVStore(tmp_path, "fp")
    assert store.stats["temp_removed"] == 1 and store.entries == {}
    assert store.match(list(range(6))) is None
    assert os.listdir(tmp_path) == [".lock"]  # the directory lock, released at close
    store.close()


# -- the directory is private, single-server, and never followed through links or FIFOs ----------------

def _store(d, fp="fp", **kw):
    return KVStore(str(d), fp, **kw)


def _state():
    return {"x": torch.arange(6, dtype=torch.float32)}


def test_files_and_directory_are_private(tmp_path):
    d = tmp_path / "kv"
    store = _store(d)
    store.save_async([1, 2, 3], 3, _state())
    store.flush()
    assert os.stat(d).st_mode & 0o777 == 0o700
    [name] = [f for f in os.listdir(d) if f.endswith(SUFFIX)]
    assert os.stat(d / name).st_mode & 0o777 == 0o600
    store.close()
    os.chmod(d, 0o755)  # widened by hand: narrowed again at start
    _store(d).close()
    assert os.stat(d).st_mode & 0o777 == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another user")
def test_another_users_directory_is_refused(tmp_path):
    from ds4t.serve.persistence import KVStoreError

    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)
    with pytest.raises(KVStoreError, match="belongs to uid 12345"):
        _store(d)


def test_a_file_as_the_directory_is_a_clear_error(tmp_path):
    from ds4t.serve.persistence import KVStoreError

    f = tmp_path / "not-a-dir"
    f.write_text("x")
    with pytest.raises(KVStoreError, match="not a directory"):
        _store(f)


def test_one_server_per_directory(tmp_path):
    from ds4t.serve.persistence import KVStoreError

    first = _store(tmp_path)
    with pytest.raises(KVStoreError, match=rf"another ds4t server \(pid {os.getpid()}\)"):
        _store(tmp_path)
    first.close()
    _store(tmp_path).close()  # released at close


def test_a_planted_symlink_is_never_written_through(tmp_path):
    d, outside = tmp_path / "kv", tmp_path / "victim.txt"
    outside.write_text("precious")
    store = _store(d)
    tokens = (1, 2, 3)
    # the temp name is predictable (key, pid, I/O thread): plant a link there before the save runs
    tmp = d / f".tmp-{store.key(tokens)}-{os.getpid()}-{store._thread.ident % 100000}"
    os.symlink(outside, tmp)
    store.save_async(list(tokens), 3, _state())
    store.flush()
    assert outside.read_text() == "precious"
    assert store.stats["save_errors"] == 1 and store.stats["saved"] == 0 and store.match([1, 2, 3, 4]) is None
    store.close()


def test_a_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    import errno

    store = _store(tmp_path)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    store.save_async([1, 2], 2, _state())
    store.flush()
    monkeypatch.undo()
    assert store.stats["save_errors"] == 1
    assert sorted(os.listdir(tmp_path)) == [".lock"]
    store.close()


def test_fifos_and_device_links_named_like_states_are_skipped_without_hanging(tmp_path):
    import threading

    os.mkfifo(tmp_path / ("a" * 40 + SUFFIX))
    os.symlink("/dev/zero", tmp_path / ("b" * 40 + SUFFIX))
    out = []
    t = threading.Thread(target=lambda: out.append(_store(tmp_path)), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "start-up blocked on a FIFO or device"
    store = out[0]
    assert store.stats["skipped"] == 2 and store.stats["corrupt"] == 0 and store.entries == {}
    assert os.path.exists(tmp_path / ("a" * 40 + SUFFIX))  # not ours to rename or delete
    store.close()


def test_a_missing_file_is_counted_apart_from_corrupt_ones(tmp_path):
    from ds4t.serve.persistence import MissingStateError

    store = _store(tmp_path)
    store.save_async([1, 2, 3], 3, _state())
    store.flush()
    key, _ = store.match([1, 2, 3, 4])
    os.remove(_only_file(tmp_path))
    with pytest.raises(MissingStateError):
        store.load(key)
    assert store.stats["missing"] == 1 and store.stats["corrupt"] == 0
    assert not any(f.endswith(".corrupt") for f in os.listdir(tmp_path)) and store.match([1, 2, 3, 4]) is None
    store.close()
