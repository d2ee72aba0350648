"""On-disk session states (``--kv-cache-dir``): an idle slot's state is saved before the slot is
reused and restored when its conversation returns (matched by token prefix).

One file per state, ``<key>.kv.safetensors``: tensors ``tokens`` (int64 [pos]) and ``state.<name>``
(the session's ``state_dict()``), metadata: format, model fingerprint, pos and a SHA-256 over every
tensor (name, dtype, shape, bytes) and pos. Writes are atomic: a temp file, fsync, rename, fsync of
the directory. A truncated, corrupt or foreign file is detected (header checks + checksum), reported,
quarantined (renamed ``*.corrupt``) and never loaded: the conversation is prefilled again instead.

The directory holds stored prompts, so it is private to the user running the server: created 0700
(a wider mode is narrowed at start), refused when another user owns it, files written 0600 through
``O_EXCL | O_NOFOLLOW`` temp files (a planted symlink or file is never written through), and only
regular files are ever read (a FIFO or device named like a state file is skipped, never opened
blocking). One server per directory: an exclusive ``flock`` on ``.lock`` (another server's LRU would
delete this one's files); a second server gets :class:`KVStoreError` naming the holder's pid.

Saves and loads run on one background I/O thread so the decode worker never waits on the disk; a
state still waiting to be written is served from memory.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import stat
import struct
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from safetensors.torch import save as st_save

log = logging.getLogger("ds4t.serve.kv")

FORMAT = "ds4t-kv-1"
SUFFIX = ".kv.safetensors"
TMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"
FAULT_ENV = "DS4T_SERVE_FAULT_SLOW_WRITE"
"""Test hook: seconds to pause half-way through each state file write (to kill a server mid-write)."""

State = Dict[str, torch.Tensor]


class CorruptStateError(Exception):
    """A state file that failed verification (truncated, bit-flipped, foreign, unreadable)."""


class MissingStateError(CorruptStateError):
    """An indexed state file that is gone (deleted by hand, or the disk was cleaned): not corrupt."""


class KVStoreError(Exception):
    """The directory cannot be used: not a directory, another user's, or held by another server."""


def read_regular(path: str) -> bytes:
    """The bytes of ``path`` if it is a regular file. A symlink, FIFO, device or socket raises
    OSError without blocking (O_NOFOLLOW | O_NONBLOCK, then fstat on the open descriptor)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def state_checksum(tensors: Dict[str, torch.Tensor], pos: int, fingerprint: str) -> str:
    h = hashlib.sha256(f"{FORMAT}|{fingerprint}|{pos}".encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def model_fingerprint(model, zero_state: State) -> str:
    """Identifies the weights and state layout a saved state belongs to: family, vocab, dtype,
    the state names/dtypes/fixed dims, and a sample (first and last row) of every weight tensor."""
    h = hashlib.sha256(f"{model.family}|{model.vocab_size}|{model.dtype}".encode())
    tp = getattr(model, "tp", None)
    if tp is not None:   # a state of K ranks is K shards: it fits that K only
        h.update(f"|tp={tp.size}".encode())
    for name in sorted(zero_state):
        t = zero_state[name]
        h.update(f"|{name}|{t.dtype}|{tuple(t.shape[1:]) if t.dim() else ()}".encode())
    for name, t in sorted(model.parameters().items()):
        h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        for row in (0, -1):
            x = t
            while x.dim() > 1:
                x = x[row]
            if x.numel():
                h.update(_tensor_bytes(x[:64]))
    return h.hexdigest()[:32]


def read_header(data: bytes) -> dict:
    """The safetensors JSON header of a file's bytes, checked against the file's length."""
    if len(data) < 8:
        raise CorruptStateError(f"{len(data)} bytes: shorter than a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8 or n > 100 << 20:
        raise CorruptStateError(f"header of {n} bytes does not fit a file of {len(data)} bytes (truncated?)")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise CorruptStateError(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise CorruptStateError("header is not a JSON object")
    end = 0
    for k, v in header.items():
        if k != "__metadata__":
            try:
                end = max(end, int(v["data_offsets"][1]))
            except (TypeError, KeyError, IndexError, ValueError):
                raise CorruptStateError(f"tensor {k!r}: bad header entry") from None
    if 8 + n + end != len(data):
        raise CorruptStateError(f"file is {len(data)} bytes, its header says {8 + n + end} (truncated or padded)")
    return header


def _open_private_dir(path: str) -> int:
    """Create or check the state directory (ours, 0700) and take its lock; returns the lock's fd."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise KVStoreError(f"{path} exists and is not a directory") from None
    except OSError as e:
        raise KVStoreError(f"cannot create {path}: {e.strerror}") from None
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise KVStoreError(f"{path} exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise KVStoreError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                           f"saved prompts must stay private")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
        log.warning("kv-cache: %s was mode %o; narrowed to 0700 (it stores prompts)", path, st.st_mode & 0o777)
    lock = os.path.join(path, LOCK_NAME)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise KVStoreError(f"cannot open the lock file {lock}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise KVStoreError(f"{path} is in use by another ds4t server (pid {holder}); give each server its own "
                           f"--kv-cache-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@dataclasses.dataclass
class Entry:
    key: str
    tokens: Tuple[int, ...]
    path: str
    last_used: float


class KVStore:
    def __init__(self, directory: str, fingerprint: str, max_entries: int = 256,
                 on_event: Optional[Callable[[str, str], None]] = None):
        self.dir = os.path.abspath(directory)
        self._lock_fd = _open_private_dir(self.dir)
        self.fingerprint = fingerprint
        self.max_entries = max(1, int(max_entries))
        self.on_event = on_event
        self._lock = threading.Lock()
        self.entries: Dict[str, Entry] = {}
        self.pending: Dict[str, Tuple[Tuple[int, ...], int, State]] = {}
        self.stats = {"saved": 0, "restored": 0, "corrupt": 0, "missing": 0, "skipped": 0, "temp_removed": 0,
                      "save_errors": 0, "bytes_written": 0}
        self._jobs: "queue.Queue" = queue.Queue()
        self._clean_temps()
        self._scan()
        self._thread = threading.Thread(target=self._run, name="ds4t-kv-io", daemon=True)
        self._thread.start()

    # -- events ------------------------------------------------------------------------------
    def _event(self, kind: str, msg: str) -> None:
        if kind in ("corrupt", "missing", "skipped"):
            self.stats[kind] += 1
        (log.warning if kind in ("corrupt", "error", "missing", "skipped") else log.info)("kv-cache: %s", msg)
        if self.on_event is not None:
            self.on_event(kind, msg)

    # -- start-up ----------------------------------------------------------------------------
    def _clean_temps(self) -> None:
        """Remove temp files: with the directory's lock held, each is a killed writer's."""
        for name in os.listdir(self.dir):
            if not name.startswith(TMP_PREFIX):
                continue
            try:
                os.remove(os.path.join(self.dir, name))
                self.stats["temp_removed"] += 1
                self._event("info", f"removed incomplete write {name} (a writer was killed); never used")
            except OSError:
                pass

    def _scan(self) -> None:
        for name in sorted(os.listdir(self.dir)):
            if not name.endswith(SUFFIX):
                continue
            path = os.path.join(self.dir, name)
            key = name[: -len(SUFFIX)]
            try:
                data = read_regular(path)
            except OSError as e:
                self._event("skipped", f"{name}: not a readable regular file ({e.strerror}); skipped")
                continue
            try:
                header = read_header(data)
                meta = header.get("__metadata__") or {}
                if meta.get("format") != FORMAT:
                    raise CorruptStateError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
                if meta.get("fingerprint") != self.fingerprint:
                    continue  # another model's state: not ours to use or to touch
                tokens = self._tokens_from(data, header)
            except CorruptStateError as e:
                self._quarantine(path, str(e))
                continue
            self.entries[key] = Entry(key, tokens, path, os.path.getmtime(path))
        if self.entries:
            self._event("info", f"{len(self.entries)} saved state(s) in {self.dir}")

    @staticmethod
    def _tokens_from(data: bytes, header: dict) -> Tuple[int, ...]:
        h = header.get("tokens")
        if not isinstance(h, dict) or h.get("dtype") != "I64":
            raise CorruptStateError("no int64 'tokens' tensor")
        n = struct.unpack("<Q", data[:8])[0]
        a, b = (int(x) for x in h["data_offsets"])
        raw = data[8 + n + a: 8 + n + b]
        return tuple(struct.unpack(f"<{len(raw) // 8}q", raw))

    def _quarantine(self, path: str, why: str) -> None:
        self._event("corrupt", f"{os.path.basename(path)} is corrupt ({why}); quarantined, not used")
        try:
            os.replace(path, path + ".corrupt")
        except OSError:
            pass

    # -- lookup ------------------------------------------------------------------------------
    def key(self, tokens: Sequence[int]) -> str:
        h = hashlib.sha256(self.fingerprint.encode())
        h.update(struct.pack(f"<{len(tokens)}q", *tokens))
        return h.hexdigest()[:40]

    def contains(self, tokens: Sequence[int]) -> bool:
        k = self.key(tokens)
        with self._lock:
            return k in self.entries or k in self.pending

    def match(self, prompt: Sequence[int]) -> Optional[Tuple[str, int]]:
        """(key, length) of the longest saved history that is a proper prefix of ``prompt``."""
        best = None
        with self._lock:
            cands = [(k, e.tokens) for k, e in self.entries.items()]
            cands += [(k, p[0]) for k, p in self.pending.items()]
        n = len(prompt)
        for k, toks in cands:
            m = len(toks)
            if 0 < m < n and (best is None or m > best[1]) and tuple(prompt[:m]) == toks:
                best = (k, m)
        return best

    # -- save --------------------------------------------------------------------------------
    def save_async(self, tokens: Sequence[int], pos: int, state: State) -> bool:
        """Queue a write of ``state`` (already a snapshot: the caller may reuse the slot at once).
        Returns False when this exact history is already saved."""
        tokens = tuple(int(t) for t in tokens)
        k = self.key(tokens)
        with self._lock:
            if k in self.entries or k in self.pending:
                if k in self.entries:
                    self.entries[k].last_used = time.time()
                return False
            self.pending[k] = (tokens, pos, state)
        self._jobs.put(("save", k, None))
        return True

    def _write(self, key: str) -> None:
        with self._lock:
            tokens, pos, state = self.pending[key]
        tensors = {"tokens": torch.tensor(tokens, dtype=torch.int64)}
        for name, t in state.items():
            tensors["state." + name] = t.detach().to("cpu").contiguous()
        meta = {"format": FORMAT, "fingerprint": self.fingerprint, "pos": str(pos),
                "sha256": state_checksum(tensors, pos, self.fingerprint)}
        data = st_save(tensors, metadata=meta)
        final = os.path.join(self.dir, key + SUFFIX)
        tmp = os.path.join(self.dir, f"{TMP_PREFIX}{key}-{os.getpid()}-{threading.get_ident() % 100000}")
        pause = float(os.environ.get(FAULT_ENV, "0") or 0)
        # O_EXCL | O_NOFOLLOW: never write through a file or symlink someone planted under this name.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            try:
                view = memoryview(data)
                half = len(view) // 2 if pause > 0 else len(view)
                for part in (view[:half], view[half:]):
                    while part:
                        n = os.write(fd, part)
                        part = part[n:]
                    if pause > 0 and half < len(view):
                        os.fsync(fd)
                        time.sleep(pause)
                        pause = 0
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.stats["saved"] += 1
        self.stats["bytes_written"] += len(data)
        with self._lock:
            self.entries[key] = Entry(key, tokens, final, time.time())
            del self.pending[key]
            drop = []
            if len(self.entries) > self.max_entries:
                drop = sorted(self.entries.values(), key=lambda e: e.last_used)[: len(self.entries) - self.max_entries]
                for e in drop:
                    del self.entries[e.key]
        for e in drop:
            try:
                os.remove(e.path)
            except OSError:
                pass

    # -- load --------------------------------------------------------------------------------
    def load(self, key: str) -> Tuple[Tuple[int, ...], int, State]:
        """(tokens, pos, state) of a saved history, verified; CorruptStateError when it is not
        usable (the file is then quarantined and forgotten)."""
        with self._lock:
            if key in self.pending:
                tokens, pos, state = self.pending[key]
                self.stats["restored"] += 1
                return tokens, pos, state
            entry = self.entries.get(key)
        if entry is None:
            raise CorruptStateError(f"{key}: no such saved state (removed?)")
        try:
            out = self._read_verified(entry)
        except FileNotFoundError:
            with self._lock:
                self.entries.pop(key, None)
            self._event("missing", f"{os.path.basename(entry.path)} is gone; forgotten, the prompt is prefilled")
            raise MissingStateError(f"{os.path.basename(entry.path)}: no longer on disk") from None
        except (OSError, CorruptStateError) as e:
            with self._lock:
                self.entries.pop(key, None)
            self._quarantine(entry.path, str(e))
            raise CorruptStateError(f"{os.path.basename(entry.path)}: {e}") from None
        entry.last_used = time.time()
        try:
            os.utime(entry.path)
        except OSError:
            pass
        self.stats["restored"] += 1
        return out

    def _read_verified(self, entry: Entry):
        from safetensors.torch import load as st_load

        data = read_regular(entry.path)
        header = read_header(data)
        meta = header.get("__metadata__") or {}
        if meta.get("format") != FORMAT or meta.get("fingerprint") != self.fingerprint:
            raise CorruptStateError("format or model fingerprint changed")
        try:
            pos = int(meta["pos"])
            tensors = st_load(data)
        except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
            raise CorruptStateError(f"unreadable: {e}") from None
        if state_checksum(tensors, pos, self.fingerprint) != meta.get("sha256"):
            raise CorruptStateError("checksum mismatch")
        tokens = tuple(tensors.pop("tokens").tolist())
        if len(tokens) != pos or tokens != entry.tokens:
            raise CorruptStateError("token history does not match the index")
        state = {k[len("state."):]: v for k, v in tensors.items() if k.startswith("state.")}
        return tokens, pos, state

    def load_async(self, key: str, done: Callable[[object], None]) -> None:
        """Run :meth:`load` on the I/O thread; ``done`` gets (tokens, pos, state) or the exception."""
        self._jobs.put(("load", key, done))

    # -- thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            kind, key, done = self._jobs.get()
            try:
                if kind == "stop":
                    return
                if kind == "save":
                    try:
                        self._write(key)
                    except Exception as e:  # noqa: BLE001  (a full disk must not kill the server)
                        self.stats["save_errors"] += 1
                        with self._lock:
                            self.pending.pop(key, None)
                        self._event("error", f"could not save state {key}: {e}")
                elif kind == "load":
                    try:
                        res = self.load(key)
                    except Exception as e:  # noqa: BLE001
                        res = e
                    done(res)
            finally:
                self._jobs.task_done()

    def flush(self) -> None:
        """Wait until every queued save and load has finished."""
        self._jobs.join()

    def close(self) -> None:
        self.flush()
        self._jobs.put(("stop", None, None))
        self._thread.join(timeout=10)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock: another server may use the directory
            self._lock_fd = None

    def list_entries(self) -> List[Entry]:
        with self._lock:
            return list(self.entries.values())
