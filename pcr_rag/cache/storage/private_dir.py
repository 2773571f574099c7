"""A private directory for the SSD tier: owned by this process's user, closed to everyone else, no links followed.

Cached KV is close to the documents' text, and a chunk file someone else can write is KV the engine would serve.
So the directory of ``LocalDirBackend`` is held to these invariants:

- Created ``0700`` (the directory, each missing parent and every subdirectory); files ``0600``. The modes are set
  with ``fchmod``, whatever the umask.
- At start (``open_private_root`` then ``secure_tree``), the directory and everything in it must belong to this
  user and be writable by nobody else, or ``UnsafeCacheDirError`` is raised with the command that fixes it:
  anything others could write may already be poisoned, so it is not repaired silently. What is only *readable*
  by others (``0755``/``0644``, as older versions created it) is tightened to ``0700``/``0600``, with a warning.
  Ancestors are not changed; one that another user could rename entries in gets a warning (the engine keeps the
  directory open, so a later swap of the path does not redirect it).
- Every access goes through file descriptors: the root is opened once (``O_DIRECTORY | O_NOFOLLOW``) and each
  component below it is opened with ``O_NOFOLLOW`` relative to its parent (``walk_to``). A symbolic link planted
  in place of a chunk file, a subdirectory or the lock file fails with ``OSError`` (ELOOP/ENOTDIR) instead of
  being followed; the storage tier treats that as a miss or a failed write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import stat
from collections.abc import Iterator
from pathlib import Path

from pcr_rag.cache.errors import UnsafeCacheDirError

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "OPEN_DIR",
    "check_entry",
    "open_private_root",
    "refuse_unsafe",
    "secure_tree",
    "walk_to",
]

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_OTHERS_ANY = 0o077


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def check_entry(st: os.stat_result, path: Path, root: Path) -> int | None:
    """The mode ``path`` (a directory or regular file under the cache ``root``, ``st`` its lstat) must be
    tightened to, or None when it is private already. Raises ``UnsafeCacheDirError`` when another user owns it or
    others can write to it."""
    me = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != me:
        raise UnsafeCacheDirError(
            f"cache directory entry {path} is owned by {_user(st.st_uid)}, not by this process's user "
            f"{_user(me)}: its owner could read every tenant's KV and plant chunks that would be served. Run "
            f"`chown -R {me} {root}` as root if the files are yours, or give the engine a cache_dir of its own"
        )
    if mode & _OTHERS_WRITE:
        fix = f"chmod 700 {root}" if path == root else f"chmod -R go-rwx {root}"
        raise UnsafeCacheDirError(
            f"cache directory entry {path} is writable by group or others (mode {mode:04o}): another user could "
            f"plant or replace chunk files, which would be served as KV. If nobody else wrote there, run `{fix}`; "
            f"otherwise delete {root} (the cache is rebuilt)"
        )
    target = DIR_MODE if stat.S_ISDIR(st.st_mode) else FILE_MODE
    return target if mode & _OTHERS_ANY else None


def _warn_tightened(path: Path, old: int, new: int) -> None:
    log.warning("cache %s was readable by other users (mode %04o): tightened to %04o", path, old, new)


def _create_private(path: Path) -> None:
    """Create ``path`` and its missing parents, each ``0700`` whatever the umask; existing ones are left as they
    are."""
    missing: list[Path] = []
    probe = path
    while not probe.exists() and not probe.is_symlink():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:
            continue  # created concurrently: checked like any existing directory
        fd = os.open(p, OPEN_DIR)
        try:
            os.fchmod(fd, DIR_MODE)
        finally:
            os.close(fd)


def _warn_open_ancestors(path: Path) -> None:
    """Warn about an ancestor of ``path`` in which another user could rename entries (path swaps before start)."""
    me = os.geteuid()
    for parent in path.parents:
        try:
            st = os.stat(parent)
        except OSError:
            return
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if st.st_uid not in (0, me) or (st.st_mode & _OTHERS_WRITE and not sticky):
            log.warning(
                "%s, a parent of the cache directory %s, can be changed by another user (owner %s, mode %04o): "
                "they could swap the cache directory before the engine opens it; prefer a cache_dir under a "
                "directory only you and root can write",
                parent, path, _user(st.st_uid), stat.S_IMODE(st.st_mode),
            )
            return


def refuse_unsafe(path: str | os.PathLike[str]) -> None:
    """Raise ``UnsafeCacheDirError`` now when the directory ``path`` exists and another user owns it or others can
    write to it; nothing is created or changed. An engine calls it before loading its model, so an unsafe
    ``cache_dir`` fails before any compute; the full check (and the tightening) runs when the SSD tier opens it."""
    resolved = Path(path).expanduser().resolve()
    try:
        st = os.stat(resolved)
    except OSError:
        return  # missing (created private) or unusable (the SSD tier reports it and stays off)
    if stat.S_ISDIR(st.st_mode):
        check_entry(st, resolved, resolved)


def open_private_root(path: Path) -> int:
    """Create ``path`` (``0700``) when missing, open it without following a link, check it and tighten it (see the
    module docstring). Returns the directory's file descriptor; the caller closes it. Raises
    ``UnsafeCacheDirError`` for an unsafe directory, ``OSError`` when it cannot be created or opened."""
    _create_private(path)
    fd = os.open(path, OPEN_DIR)
    try:
        st = os.fstat(fd)
        tighten = check_entry(st, path, path)
        if tighten is not None:
            os.fchmod(fd, tighten)
            _warn_tightened(path, stat.S_IMODE(st.st_mode), tighten)
    except BaseException:
        os.close(fd)
        raise
    _warn_open_ancestors(path)
    return fd


def secure_tree(root_fd: int, root: Path) -> None:
    """Check everything under the open cache directory ``root_fd`` (``root`` names it in messages): raise
    ``UnsafeCacheDirError`` for an entry of another user or one others can write, tighten what others can only
    read (one warning for all of them). Links are not followed (one warning; reading through them fails later);
    other kinds of file (sockets, FIFOs) are left alone and never opened."""
    tightened: list[tuple[Path, int]] = []
    links: list[Path] = []
    for dirpath, dirnames, filenames, dir_fd in os.fwalk(".", dir_fd=root_fd):
        linked: set[str] = set()
        for name in [*dirnames, *filenames]:
            path = Path(os.path.normpath(root / dirpath / name))
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                links.append(path)
                linked.add(name)
                continue
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                continue
            tighten = check_entry(st, path, root)
            if tighten is not None:
                # not a link (lstat above) in a directory only this user can write, so chmod reaches the entry
                os.chmod(name, tighten, dir_fd=dir_fd)
                tightened.append((path, stat.S_IMODE(st.st_mode)))
        dirnames[:] = [d for d in dirnames if d not in linked]  # fwalk would open a linked directory's target
    if tightened:
        path, mode = tightened[0]
        log.warning(
            "%d entries under the cache directory %s were readable by other users (e.g. %s, mode %04o): "
            "tightened to %04o (directories) and %04o (files)",
            len(tightened), root, path, mode, DIR_MODE, FILE_MODE,
        )
    if links:
        log.warning(
            "%d symbolic links in the cache directory %s (e.g. %s) are never followed: what they name is not read "
            "or written, and chunk names among them are dropped as unreadable",
            len(links), root, links[0],
        )


@contextlib.contextmanager
def walk_to(root_fd: int, dirs: list[str], *, create: bool, fsync: bool) -> Iterator[int]:
    """The file descriptor of the subdirectory ``dirs`` (components, no ``..``) of ``root_fd``, each component
    opened with ``O_NOFOLLOW`` relative to its parent (a link fails with ``OSError``). With ``create``, missing
    components are made ``0700``, and with ``fsync`` the parent is fsynced so the new entry is durable before
    files are renamed into it. Closed on exit (``root_fd`` itself is not)."""
    fd = root_fd
    try:
        for name in dirs:
            try:
                child = os.open(name, OPEN_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, DIR_MODE, dir_fd=fd)
                except FileExistsError:
                    pass
                child = os.open(name, OPEN_DIR, dir_fd=fd)
                os.fchmod(child, DIR_MODE)
                if fsync:
                    os.fsync(fd)
            if fd != root_fd:
                os.close(fd)
            fd = child
        yield fd
    finally:
        if fd != root_fd:
            os.close(fd)
