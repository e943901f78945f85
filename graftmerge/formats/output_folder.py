"""OUT replaced whole or not at all: the one way graftmerge publishes an output folder.

Every command that writes a folder builds it with :class:`OutputFolder` (merges of graft
configs, ``sweep``, ``fisher estimate``/``compress``, ``delta extract``, ``import-gguf``,
``pull -o``):

1. **Lock.** An exclusive ``flock`` on ``.NAME.lock`` beside OUT, taken before any work
   and held until OUT is published. A second process asking for the same OUT fails at
   once: ``another graftmerge process (pid N) is writing OUT``. The lock file is removed
   on release; one left by a killed process is simply locked again.
2. **Tidy.** What killed runs on the same OUT left beside it, named after their process
   (``.NAME.partial-PID-*`` staging folders, ``.NAME.old-PID-*`` old copies), is removed,
   but only once that process is gone. If OUT is missing and an old copy is there, the
   killed run died between its two renames (step 5): the old copy becomes OUT again.
3. **Check.** What is at OUT may be replaced (the command's policy: :data:`NEW`,
   :data:`EMPTY`, :data:`OVERWRITE` or :data:`MERGE`). A symbolic link at OUT is refused,
   never followed.
4. **Stage.** The caller writes ``.NAME.partial-PID-XXXXXXXX/NAME/`` (:attr:`staging`:
   same basename as OUT, which mergekit names the model card after), on OUT's file system.
5. **Publish.** OUT is renamed to ``.NAME.old-PID-XXXXXXXX``, the staging folder to OUT,
   and the old copy deleted. If the second rename fails, the old copy is renamed back.

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

import fcntl
import os
import re
import shutil
import signal
import tempfile
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
    """Put back an old OUT a killed run left between its two renames; remove other leftovers."""
    found = leftovers(out)
    old = sorted(found["old"], key=lambda path: path.lstat().st_ctime)
    if old and not os.path.lexists(out):
        os.rename(old.pop(), out)  # killed between the two renames: the old OUT comes back
    for path in old + found["partial"]:
        shutil.rmtree(path, ignore_errors=True)


class OutputFolder:
    """OUT written into a staging folder beside it and published whole, under a lock.

    >>> with OutputFolder("merged/model", replace=MERGE) as output:  # doctest: +SKIP
    ...     write_the_model(output.staging)
    >>> # merged/model is now exactly what was written, and nothing else

    Leaving the block normally publishes; an exception discards the staging folder and
    leaves OUT as it was. :meth:`open`, :meth:`publish` and :meth:`close` do the same
    steps one by one (the Fisher cache writer uses them). See the module doc.
    """

    def __init__(self, out: str | os.PathLike, *, replace: str = NEW, hint: str = "choose a new folder"):
        if replace not in POLICIES:
            raise ValueError(f"replace must be one of {POLICIES}, not {replace!r}")
        self.out = output_path(out)
        self.replace = replace
        self.hint = hint
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
        """Lock OUT, tidy up after killed runs, check OUT may be replaced, make the staging folder."""
        if self._lock is not None:
            return self
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise GraftError(f"cannot create {self.out.parent} ({error.strerror})") from error
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


def _swap(out: Path, staging: Path, old_name: str) -> None:
    """OUT → its old copy, staging → OUT, old copy deleted; the old copy put back if the second rename fails."""
    old = out.parent / old_name if os.path.lexists(out) else None
    if old is not None:
        try:
            os.rename(out, old)
        except OSError as error:
            raise GraftError(f"cannot replace {out}: moving it aside failed ({error.strerror}); "
                             "it is unchanged") from error
        stage_reached("publish-aside")
    try:
        os.rename(staging, out)
    except OSError as error:
        if old is not None:
            os.rename(old, out)
        raise GraftError(f"cannot move the finished output into {out} ({error.strerror}); "
                         "it is unchanged") from error
    stage_reached("publish-done")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _acquire_lock(out: Path):
    """OUT's lock file, exclusively locked (kept open while held); GraftError if another process has it."""
    path = lock_path(out)
    for _ in range(100):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise GraftError(f"cannot lock {out} ({path}: {error.strerror})") from error
        handle = os.fdopen(fd, "r+b", buffering=0)  # closed (and so unlocked) even if forgotten
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
            handle.truncate(0)
            handle.write(f"{os.getpid()}\n".encode())
            return handle
        handle.close()  # its holder removed it while finishing: lock the file now at ``path``
    raise GraftError(f"cannot lock {out}: {path} keeps changing")


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
