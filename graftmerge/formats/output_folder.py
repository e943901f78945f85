"""OUT replaced whole or not at all: the one way graftmerge publishes an output folder.

Every command that writes a folder builds it with :class:`OutputFolder` (merges of graft
configs, ``sweep``, ``fisher estimate``/``compress``, ``delta extract``, ``import-gguf``,
``pull -o``):

0. **No input.** OUT may not be, lie inside, or contain any input the command reads
   (``inputs``: model, donor, delta, adapter and Fisher folders, a GGUF or rollouts file,
   the Hugging Face cache folder of a pulled repo), compared by real path and by
   (device, inode) of every ancestor (:func:`check_not_inputs`), before anything is made.
   A parent folder anyone may write, without the sticky bit, is refused.
1. **Lock.** An exclusive ``flock`` on ``.NAME.lock`` beside OUT, taken before any work
   and held until OUT is published. A second process asking for the same OUT fails at
   once: ``another graftmerge process (pid N) is writing OUT``. The lock file is removed
   on release; one left by a killed process is simply locked again. It is opened without
   following a link or blocking, must be a regular file of one link owned by this user,
   and is never truncated (the pid is written over its first bytes).
2. **Tidy.** What killed runs on the same OUT left beside it, named after their process
   (``.NAME.partial-PID-*`` staging folders, ``.NAME.old-PID-*`` old copies), is removed,
   but only once that process is gone, and only if it is this user's. If OUT is missing
   and an old copy is there, the killed run died between its two renames (step 5): the
   old copy becomes OUT again, but only if its marker ``.NAME.old-PID-*.marker`` (written
   before the rename: uid, pid, a digest of the folder's identity and listing) verifies.
   Anything else is left alone, with one warning line.
3. **Check.** What is at OUT may be replaced (the command's policy: :data:`NEW`,
   :data:`EMPTY`, :data:`OVERWRITE` or :data:`MERGE`). A symbolic link at OUT is refused,
   never followed.
4. **Stage.** The caller writes ``.NAME.partial-PID-XXXXXXXX/NAME/`` (:attr:`staging`:
   same basename as OUT, which mergekit names the model card after), on OUT's file system.
5. **Publish.** OUT's marker is written, OUT renamed to ``.NAME.old-PID-XXXXXXXX``, the
   staging folder to OUT, and the old copy and its marker deleted. If the second rename
   fails, the old copy is renamed back.

So a kill at any moment leaves OUT as the complete old folder or the complete new one.
The one exception is the instant between the two renames of step 5: then OUT is missing
and the old copy intact beside it, and the next graftmerge run on OUT puts it back before
anything else. (This is about processes killed or failing, not power loss: files are not
fsynced.)

``$GRAFTMERGE_TEST_STOP_AT`` is a test hook: ``STAGE`` or ``STAGE:N`` makes the process
stop itself (SIGSTOP) on its first or N-th arrival at a named stage (:func:`stage_reached`),
so a test can kill it there, or let it go on, deterministically.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from graftmerge.errors import GraftError

NEW = "new"  # OUT must not exist
EMPTY = "empty"  # OUT may exist as an empty folder
OVERWRITE = "overwrite"  # any folder at OUT is replaced (the command's --overwrite)
MERGE = "merge"  # OUT may be empty or hold only files a merge writes
POLICIES = (NEW, EMPTY, OVERWRITE, MERGE)

# What mergekit (and graft) write into a model folder: shards, configs, index, tokenizer,
# model card, chat template, the merge config. Anything else in OUT stops a merge.
MERGE_SUFFIXES = frozenset(
    {".safetensors", ".bin", ".json", ".txt", ".model", ".jinja", ".md", ".yml", ".yaml", ".tiktoken"}
)

STOP_ENV = "GRAFTMERGE_TEST_STOP_AT"
STAGES = ("scoring", "merging", "staged", "publish-aside", "publish-done")
# Per process, not per merge: the test hook stops the process, armed by the process's own
# environment, so it counts this process's arrivals at each stage; it holds no merge data.
_ARRIVALS: dict[str, int] = {}


def stage_reached(stage: str) -> None:
    """Test hook: stop this process (SIGSTOP) here when ``$GRAFTMERGE_TEST_STOP_AT`` names ``stage``.

    Stages: ``scoring`` (each tensor of the threshold pass), ``merging`` (each tensor
    grafted), ``staged`` (everything written, nothing published), ``publish-aside`` (OUT
    renamed to its old copy, the new one not yet in place), ``publish-done`` (the new OUT
    in place, the old copy not yet deleted). ``STAGE:N`` stops at the N-th arrival.
    """
    wanted = os.environ.get(STOP_ENV)
    if not wanted:
        return
    name, _, count = wanted.partition(":")
    if name != stage:
        return
    _ARRIVALS[stage] = _ARRIVALS.get(stage, 0) + 1
    if _ARRIVALS[stage] == int(count or 1):
        os.kill(os.getpid(), signal.SIGSTOP)


def output_path(out: str | os.PathLike) -> Path:
    """OUT as an absolute path, its parent resolved, its last part not (a link at OUT is never followed)."""
    absolute = Path(os.path.abspath(os.fspath(out)))
    if absolute.name in ("", ".", ".."):
        raise GraftError(f"{out} cannot be an output folder; name a folder inside it")
    return absolute.parent.resolve() / absolute.name


Inputs = Iterable[tuple[str, "str | os.PathLike | None"]]
_HUB_REPO = re.compile(r"^(.*/(?:models|datasets|spaces)--[^/]+)/snapshots/[^/]+(?:/.*)?$")


def input_root(path: str | os.PathLike) -> Path:
    """An input's real path; for a snapshot in the Hugging Face cache, its repo folder ``models--org--name``.

    A snapshot's files are links into the repo's ``blobs/``, so the whole repo folder is the input.
    """
    real = os.path.realpath(os.fspath(path))
    match = _HUB_REPO.match(real)
    return Path(match.group(1) if match else real)


def _identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """(st_dev, st_ino) of ``path`` (followed), None when nothing is there."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


def _chain(path: Path) -> set[tuple[int, int]]:
    """The identities of ``path`` and of each of its ancestors that exists."""
    found = {_identity(folder) for folder in (path, *path.parents)}
    return found - {None}


def check_not_inputs(out: str | os.PathLike, inputs: Inputs, what: str = "output folder") -> None:
    """GraftError when OUT is one of ``inputs`` ((label, path) pairs), is inside one, or contains one.

    The one check for every path a command writes: an output folder, or a file (``what``
    names it as the user gave it, e.g. ``--json``; :mod:`graftmerge.formats.output_file`).
    Compared by real path and by (device, inode) of OUT, the inputs and all their ancestors,
    so a symbolic link, ``a/../a``, ``.`` or a bind mount is seen through. OUT need not
    exist. Reads only: call it before anything is locked, recovered or created.
    """
    spelled = Path(os.path.abspath(os.fspath(out)))
    real = Path(os.path.realpath(spelled))
    out_id = _identity(real)
    out_chain = _chain(real) | _chain(spelled)
    for label, path in inputs:
        if path is None:
            continue
        folder = input_root(path)
        folder_id = _identity(folder)  # None for an input not there yet (compared by path alone)
        if folder == real or (folder_id is not None and folder_id == out_id):
            how = "is"
        elif folder in real.parents or (folder_id is not None and folder_id in out_chain):
            how = "is inside"
        elif real in folder.parents or (out_id is not None and out_id in _chain(folder.parent)):
            how = "contains"
        else:
            continue
        if what == "output folder":
            raise GraftError(f"output folder {out} {how} the {label} {path}: writing OUT would replace or delete "
                             "that input; choose an output folder outside every input")
        raise GraftError(f"{what} {out} {how} the {label} {path}, which this command reads or replaces: writing "
                         f"{what} there would overwrite or lose it; give a path outside every input and output")


def lock_path(out: Path) -> Path:
    """The lock file of OUT: ``.NAME.lock`` beside it."""
    return out.parent / f".{out.name}.lock"


def check_replaceable(out: Path, replace: str, hint: str = "choose a new folder") -> None:
    """GraftError unless what is at ``out`` may be replaced under the policy ``replace``."""
    if os.path.islink(out):
        raise GraftError(f"{out} is a symbolic link; graftmerge replaces OUT whole and never through "
                         "a link: give the link's target, or remove the link")
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise GraftError(f"{out} exists and is not a folder; remove it or choose another output folder")
    if replace == OVERWRITE:
        return
    if replace == NEW:
        raise GraftError(f"{out} already exists; {hint}")
    try:
        entries = sorted(os.listdir(out))
    except OSError as error:
        raise GraftError(f"cannot read {out} ({error.strerror}); choose another output folder") from error
    if entries and replace == EMPTY:
        raise GraftError(f"{out} already exists and is not an empty folder; choose a new one")
    foreign = [name for name in entries if not _merge_written(out / name)]
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise GraftError(f"{out} holds {foreign[0]!r}{more}, which no merge writes; the merge replaces "
                         "OUT whole, so move them out of it or choose another output folder")


def _merge_written(path: Path) -> bool:
    """A plain, visible file of a kind a merge writes (so a re-run may delete it)."""
    return (not path.name.startswith(".") and path.suffix in MERGE_SUFFIXES
            and path.is_file() and not path.is_symlink())


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not; another user's does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def leftovers(out: Path) -> dict[str, list[Path]]:
    """Staging folders (``partial``) and old copies (``old``) of OUT whose process is gone.

    Leftovers of this very process count as gone too: they are only ever looked for while
    this process holds OUT's lock, so none of them is being written.
    """
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(partial|old)-(\d+)-[A-Za-z0-9_]+")
    found: dict[str, list[Path]] = {"partial": [], "old": []}
    for entry in os.scandir(out.parent):
        match = pattern.fullmatch(entry.name)
        if not match or not entry.is_dir(follow_symlinks=False):
            continue
        pid = int(match.group(2))
        if pid == os.getpid() or not _alive(pid):
            found[match.group(1)].append(Path(entry.path))
    return found


def recover(out: Path) -> None:
    """Put back an old OUT a killed run left between its two renames; remove other leftovers.

    Only what this user's graftmerge wrote is touched: an old copy is restored (or removed)
    only when it and its marker (:func:`write_old_marker`) are this user's and the marker
    verifies; a staging folder is removed only when it is this user's. Anything else is
    left alone, with one warning line on stderr.
    """
    found = leftovers(out)
    verified = [path for path in found["old"] if verify_old_marker(path)]
    mine = [path for path in found["partial"] if _owned(path)]
    foreign = sorted(set(found["old"]) - set(verified) | set(found["partial"]) - set(mine))
    old = sorted(verified, key=lambda path: path.lstat().st_ctime)
    if old and not os.path.lexists(out):
        restored = old.pop()
        os.rename(restored, out)  # killed between the two renames: the old OUT comes back
        _unlink(marker_path(restored))
    for path in old + mine:
        shutil.rmtree(path, ignore_errors=True)
        _unlink(marker_path(path))
    _remove_stale_markers(out)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        print(f"warning: left {foreign[0]}{more} alone: not a leftover this user's graftmerge wrote "
              "(no verified marker, or another owner)", file=sys.stderr)


def marker_path(old: Path) -> Path:
    """The marker of an old copy ``.NAME.old-PID-X``: the file ``.NAME.old-PID-X.marker`` beside it."""
    return old.parent / f"{old.name}.marker"


def listing_digest(folder: Path) -> str:
    """SHA-256 of ``folder``'s identity (device, inode) and its tree: each entry's path, kind, size, mtime."""
    top = os.lstat(folder)
    digest = hashlib.sha256(f"{top.st_dev}:{top.st_ino}\n".encode())
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(dirs + files):
            path = os.path.join(root, name)
            info = os.lstat(path)
            relative = os.path.relpath(path, folder)
            digest.update(f"{relative}\0{stat.S_IFMT(info.st_mode)}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def write_old_marker(folder: Path, old: Path) -> Path:
    """Vouch that ``folder`` (OUT, about to be renamed to ``old``) is this user's graftmerge's old copy.

    Written before the rename, beside OUT (never inside it, so never published): owner uid,
    the pid in ``old``'s name, and the listing digest of ``folder``, which the rename keeps.
    """
    pid = int(old.name.rpartition(".old-")[2].split("-")[0])
    record = {"uid": os.getuid(), "pid": pid, "listing": listing_digest(folder)}
    path = marker_path(old)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(record, sort_keys=True))
    return path


def verify_old_marker(old: Path) -> bool:
    """Whether ``old`` and its marker are this user's and the marker matches ``old`` as it is now."""
    if not _owned(old):
        return False
    try:
        fd = os.open(marker_path(old), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size > 4096:
            return False
        try:
            record = json.loads(handle.read(4096))
            pid = int(old.name.rpartition(".old-")[2].split("-")[0])
            return (isinstance(record, dict) and record.get("uid") == os.getuid() and record.get("pid") == pid
                    and record.get("listing") == listing_digest(old))
        except (ValueError, OSError, RecursionError):
            return False


def _owned(path: Path) -> bool:
    """Whether ``path`` (not followed) belongs to the current user."""
    try:
        return os.lstat(path).st_uid == os.getuid()
    except OSError:
        return False


def _unlink(path: Path) -> None:
    """Remove the file at ``path`` if there is one."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _remove_stale_markers(out: Path) -> None:
    """Remove this user's markers of OUT's old copies that no longer exist, whose process is gone."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.old-(\d+)-[A-Za-z0-9_]+\.marker")
    for entry in os.scandir(out.parent):
        match = pattern.fullmatch(entry.name)
        if (match and entry.is_file(follow_symlinks=False) and _owned(Path(entry.path))
                and not os.path.lexists(entry.path[: -len(".marker")])
                and (int(match.group(1)) == os.getpid() or not _alive(int(match.group(1))))):
            _unlink(Path(entry.path))


def usual_modes(staging: Path) -> None:
    """The staged folder and the files directly in it given a normal file's modes: 0666 / 0777 less the umask.

    safetensors writes its files readable by the owner only (and transformers' ``save_pretrained``
    with it), unlike the other files of the folder and unlike a Hub download; a folder meant
    for sharing (an imported model, a delta) gets what a plain ``open()`` would have given.
    A file with several links (shared with a file outside this folder) is left as it is.
    """
    umask = os.umask(0)
    os.umask(umask)
    for file in staging.iterdir():
        info = file.lstat()
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
            os.chmod(file, 0o666 & ~umask)
    os.chmod(staging, 0o777 & ~umask)


def check_parent(out: Path) -> None:
    """GraftError when OUT's parent is writable by anyone and has no sticky bit (others could plant leftovers)."""
    try:
        mode = os.stat(out.parent).st_mode
    except OSError:
        return
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise GraftError(f"{out.parent} (the folder holding {out.name}) is writable by every user and has no "
                         "sticky bit, so others could plant or swap files beside OUT; choose a folder only you "
                         "can write, or set its sticky bit (chmod +t)")


class OutputFolder:
    """OUT written into a staging folder beside it and published whole, under a lock.

    >>> with OutputFolder("merged/model", replace=MERGE) as output:  # doctest: +SKIP
    ...     write_the_model(output.staging)
    >>> # merged/model is now exactly what was written, and nothing else

    Leaving the block normally publishes; an exception discards the staging folder and
    leaves OUT as it was. :meth:`open`, :meth:`publish` and :meth:`close` do the same
    steps one by one (the Fisher cache writer uses them). See the module doc.
    """

    def __init__(self, out: str | os.PathLike, *, replace: str = NEW, hint: str = "choose a new folder",
                 inputs: Inputs = ()):
        if replace not in POLICIES:
            raise ValueError(f"replace must be one of {POLICIES}, not {replace!r}")
        self.out = output_path(out)
        self.replace = replace
        self.hint = hint
        self.given = out
        self.inputs = list(inputs)  # (label, path) of what the command reads: OUT may be none of them
        self.root: Path | None = None  # the hidden staging root; holds staging and scratch
        self.published = False
        self._lock = None

    @property
    def staging(self) -> Path:
        """The folder to write OUT's contents into (it becomes OUT on publish)."""
        if self.root is None:
            raise GraftError(f"{self.out}: output folder is not open")
        return self.root / self.out.name

    @property
    def scratch(self) -> Path:
        """A private folder beside the staging folder, deleted with it (never published)."""
        return self.staging.parent / ("scratch" if self.out.name != "scratch" else "scratch-files")

    def __enter__(self) -> OutputFolder:
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self.published and self.root is not None:
            self.publish()
        else:
            self.close()

    def open(self) -> OutputFolder:
        """Check OUT is no input, lock it, tidy up after killed runs, check it may be replaced, stage."""
        if self._lock is not None:
            return self
        check_not_inputs(self.given, self.inputs)  # before anything is created, locked or recovered
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise GraftError(f"cannot create {self.out.parent} ({error.strerror})") from error
        check_parent(self.out)
        self._lock = _acquire_lock(self.out)
        try:
            recover(self.out)
            check_replaceable(self.out, self.replace, self.hint)
            self.root = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-{os.getpid()}-",
                                              dir=self.out.parent))
            self.staging.mkdir()
        except OSError as error:
            self.close()
            raise GraftError(f"cannot write beside {self.out} ({error.strerror})") from error
        except BaseException:
            self.close()
            raise
        return self

    def publish(self) -> Path:
        """Replace OUT with the staging folder (two renames), then release the lock; returns OUT."""
        try:
            stage_reached("staged")
            check_replaceable(self.out, self.replace, self.hint)  # again: a user may have made OUT meanwhile
            prefix = f".{self.out.name}.partial-"  # the old copy is named like this run's staging root
            _swap(self.out, self.staging, f".{self.out.name}.old-{self.root.name[len(prefix):]}")
            self.published = True
            return self.out
        finally:
            self.close()

    def close(self) -> None:
        """Delete the staging root (whatever was not published) and release the lock."""
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
        if self._lock is not None:
            _release_lock(self.out, self._lock)
            self._lock = None


@contextlib.contextmanager
def locked(out: str | os.PathLike) -> Iterator[Path]:
    """OUT's lock (step 1) without staging, for a folder a command fills in place and resumes (``sweep --eval``).

    Creates OUT's parent, refuses a parent anyone may write (no sticky bit), holds ``.NAME.lock``
    beside OUT while the block runs (another process asking for OUT fails at once) and removes it
    after. Yields OUT as an absolute path; creates nothing else.
    """
    path = output_path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise GraftError(f"cannot create {path.parent} ({error.strerror})") from error
    check_parent(path)
    handle = _acquire_lock(path)
    try:
        yield path
    finally:
        _release_lock(path, handle)


def _swap(out: Path, staging: Path, old_name: str) -> None:
    """OUT → its old copy, staging → OUT, old copy deleted; the old copy put back if the second rename fails."""
    old = out.parent / old_name if os.path.lexists(out) else None
    if old is not None:
        marker = None
        try:
            marker = write_old_marker(out, old)  # so a run killed between the renames can tell it is ours
            os.rename(out, old)
        except OSError as error:
            if marker is not None:
                _unlink(marker)
            raise GraftError(f"cannot replace {out}: moving it aside failed ({error.strerror}); "
                             "it is unchanged") from error
        stage_reached("publish-aside")
    try:
        os.rename(staging, out)
    except OSError as error:
        if old is not None:
            os.rename(old, out)
            _unlink(marker_path(old))
        raise GraftError(f"cannot move the finished output into {out} ({error.strerror}); "
                         "it is unchanged") from error
    stage_reached("publish-done")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
        _unlink(marker_path(old))


def _acquire_lock(out: Path):
    """OUT's lock file, exclusively locked (kept open while held); GraftError if another process has it."""
    path = lock_path(out)
    for _ in range(100):
        handle = _open_lock_file(out, path)
        if handle is None:
            continue  # removed by its holder between two looks
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = handle.read(32).decode(errors="replace").strip()
            handle.close()
            pid = f" (pid {holder})" if holder.isdigit() else ""
            raise GraftError(f"another graftmerge process{pid} is writing {out}; "
                             "wait for it to finish, or choose another output folder") from None
        except OSError as error:
            handle.close()
            raise GraftError(f"cannot lock {out} ({path}: {error.strerror})") from error
        if _is_file_at(handle, path):
            os.pwrite(handle.fileno(), f"{os.getpid():>{_PID_WIDTH}}\n".encode(), 0)  # never truncated
            return handle
        handle.close()  # its holder removed it while finishing: lock the file now at ``path``
    raise GraftError(f"cannot lock {out}: {path} keeps changing")


_PID_WIDTH = 10  # the pid is written right-aligned in this many characters, over what was there


def _open_lock_file(out: Path, path: Path):
    """The lock file, created fresh or, if there, opened without following a link or blocking on a FIFO.

    What is there must be a regular file with one link, owned by this user; else one-line GraftError.
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise GraftError(f"cannot lock {out} ({path}: {error.strerror}); remove {path} if no graftmerge "
                         "runs on it") from error
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_uid != os.getuid():
        os.close(fd)
        raise GraftError(f"cannot lock {out}: {path} is not a lock file of yours (a special file, a hard link, "
                         "or another user's); remove it if no graftmerge runs on OUT, or choose another folder")
    return os.fdopen(fd, "r+b", buffering=0)  # closed (and so unlocked) even if forgotten


def _is_file_at(handle, path: Path) -> bool:
    """Whether the open ``handle`` is the file now at ``path`` (not one unlinked meanwhile)."""
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False


def _release_lock(out: Path, handle) -> None:
    """Remove the lock file (still ours: whoever locks it checks it is the one at its path), then unlock."""
    try:
        if _is_file_at(handle, lock_path(out)):
            os.unlink(lock_path(out))
    finally:
        handle.close()
