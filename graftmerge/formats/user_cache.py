"""The user's graftmerge cache folder, and the keyed records kept in it across runs.

Results that are expensive to recompute and cheap to key live here: global thresholds
(:mod:`graftmerge.pipeline.threshold_pass`) and the eigenbases that passed the full
orthonormality check (:mod:`graftmerge.formats.fisher_cache`). Nothing in it is ever
needed: a missing, unwritable, foreign or damaged folder or entry only means recomputing.

Nothing here is trusted for having been found in the folder:

- Every record's name is an HMAC-SHA256, under a per-user secret (``cache_dir()/secret``,
  32 random bytes, mode 0600, owned by the user), of what the record vouches for. Without
  the secret nobody can name a record for given content, so nobody can plant one.
- Folders must be real folders (never links) owned by the user; entries are opened with
  ``O_NOFOLLOW | O_NONBLOCK`` relative to their folder's descriptor and read only when
  ``fstat`` shows a regular file, owned by the user, of bounded size.
- Writes go to a fresh temporary file (``O_CREAT | O_EXCL | O_NOFOLLOW``) in the same
  folder, then ``os.replace`` over the name: a link planted at the name is replaced, never
  followed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import secrets
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

SECRET_NAME = "secret"
SECRET_BYTES = 32
MAX_RECORD_BYTES = 1 << 20  # thresholds are a few KiB; anything larger is not ours
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_warned: set[str] = set()  # per process: each warning once (a run of several merges need not repeat it)


def cache_dir() -> Path:
    """``$GRAFTMERGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/graftmerge``, else ``~/.cache/graftmerge``."""
    if os.environ.get("GRAFTMERGE_CACHE_DIR"):
        return Path(os.environ["GRAFTMERGE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "graftmerge"


def _warn(message: str) -> None:
    """One line on stderr, once per process per message: the cache is skipped, the run goes on."""
    if message not in _warned:
        _warned.add(message)
        print(f"warning: {message}", file=sys.stderr)


def warn_once(message: str) -> None:
    """``warning: message`` on stderr, once per process: for checks that are skipped, not failed."""
    _warn(message)


def _own_folder(fd: int) -> bool:
    """Whether an opened folder belongs to this user (a folder someone else owns is never used)."""
    return os.fstat(fd).st_uid == os.geteuid()


@contextlib.contextmanager
def _folder(sub: str | None, create: bool) -> Iterator[int | None]:
    """A descriptor of ``cache_dir()`` (or its ``sub`` folder): real folders owned by the user, else None.

    With ``create``, missing folders are made (mode 0700). A link, a non-folder or a
    folder owned by someone else gives None and one warning: the cache is skipped.
    """
    top = cache_dir()
    fds: list[int] = []
    usable = False
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                os.makedirs(top, mode=0o700)
        fds.append(os.open(top, _DIR_FLAGS))
        if sub is not None:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(sub, mode=0o700, dir_fd=fds[0])
            fds.append(os.open(sub, _DIR_FLAGS, dir_fd=fds[0]))
        usable = all(_own_folder(fd) for fd in fds)
        if not usable:
            _warn(f"graftmerge cache {top} (or its {sub} folder) is not owned by you: not used")
    except OSError as error:
        if create or error.errno != errno.ENOENT:  # a missing folder on a read is simply an empty cache
            _warn(f"graftmerge cache {top} is not usable ({error.strerror}): results are recomputed")
    try:
        yield fds[-1] if usable else None
    finally:
        for fd in fds:
            os.close(fd)


def _read_regular(name: str, folder: int, limit: int) -> bytes | None:
    """An entry's bytes if it is a regular file owned by the user of at most ``limit`` bytes; else None.

    ``O_NOFOLLOW`` (a link is not an entry), ``O_NONBLOCK`` (a FIFO does not hang the
    open), then ``fstat`` of what was opened: never a FIFO, device or oversized file.
    """
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=folder)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_size > limit:
            return None
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks) if size <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _write_new(name: str, folder: int, data: bytes) -> None:
    """Write ``data`` under ``name`` in ``folder``: a fresh temporary file, then renamed over the name."""
    tmp = f".tmp-{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                 0o600, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise


def _sound_secret(folder: int) -> bytes | None:
    """The secret file's 32 bytes when it is sound: a regular file (not a link), ours, mode 0600, one link;
    else None."""
    try:
        fd = os.open(SECRET_NAME, _READ_FLAGS, dir_fd=folder)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o600
                and info.st_size == SECRET_BYTES and info.st_nlink == 1):
            key = os.read(fd, SECRET_BYTES + 1)
            return key if len(key) == SECRET_BYTES else None
        return None
    except OSError:
        return None
    finally:
        os.close(fd)


def _secret(folder: int) -> bytes | None:
    """The per-user secret in the cache folder, made anew (old records become unreachable) when missing or unsound."""
    key = _sound_secret(folder)
    if key is not None:
        return key
    key = secrets.token_bytes(SECRET_BYTES)
    try:
        _write_new(SECRET_NAME, folder, key)
    except OSError:
        return None
    return key


def record_name(check: str, subject: str) -> str | None:
    """The name of the record that ``subject`` passed ``check``: HMAC-SHA256 under the user's secret, hex.

    None when the cache folder is not usable (then nothing is read or written).
    """
    with _folder(None, create=True) as folder:
        if folder is None:
            return None
        key = _secret(folder)
    if key is None:
        return None
    return hmac.new(key, f"graftmerge record v1\n{check}\n{subject}".encode(), hashlib.sha256).hexdigest()


def read_record(check: str, name: str, limit: int = MAX_RECORD_BYTES) -> bytes | None:
    """The bytes of record ``name`` in ``cache_dir()/<check>/`` (see ``_read_regular``), None when absent or unsound."""
    with _folder(check, create=False) as folder:
        return None if folder is None else _read_regular(name, folder, limit)


def write_record(check: str, name: str, data: bytes) -> None:
    """Store record ``name`` in ``cache_dir()/<check>/``, never following a link; skipped when the cache is not
    usable."""
    with _folder(check, create=True) as folder:
        if folder is not None:
            try:
                _write_new(name, folder, data)
            except OSError as error:
                _warn(f"graftmerge cache {cache_dir()} is not writable ({error.strerror}): results are recomputed")


def remove_record(check: str, name: str) -> None:
    """Delete record ``name`` from ``cache_dir()/<check>/`` if it is there."""
    with _folder(check, create=False) as folder:
        if folder is not None:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=folder)


def record_path(check: str, name: str) -> Path:
    """Where record ``name`` lies (for messages)."""
    return cache_dir() / check / name


class PassedChecks:
    """Subjects (content digests, file identities) that passed one check: an empty record each in
    ``cache_dir()/<check>/``.

    Only ever written after the check passed on the exact bytes the subject names; the
    record's name is keyed by the user's secret (``record_name``), so a record cannot be
    planted by anyone who cannot read that secret.

    An instance holds only its check's name (``ORTHONORMAL_PASSED`` is one, module-wide):
    what passed is on disk, shared by every run of this user on purpose (a record vouches
    for bytes, never for a merge), so it keeps nothing of any merge in the process.
    """

    def __init__(self, check: str):
        self.check = check

    def __contains__(self, subject: str) -> bool:
        name = record_name(self.check, subject)
        return name is not None and read_record(self.check, name, limit=0) is not None

    def add(self, subject: str) -> None:
        """Record that ``subject`` passed; silently skipped when the cache folder is not usable."""
        name = record_name(self.check, subject)
        if name is not None:
            write_record(self.check, name, b"")
