"""Safe output: never write over an input, write beside the destination and rename, create outputs exclusively.

Every command that writes goes through this module:
  - `refuse_input_overlap`: an output path must not be, contain or lie inside any input (symlinks resolved);
  - `check_output_file`: the same for a single output file (--json, --plot), plus "not a folder, parent writable",
    checked before any long run; `check_output_files`: one command's files, each also against the others, and
    for a command that writes exclusively an existing file refused unless `force`;
  - `write_output_file`: such a command's file, published exclusively (`atomic_output_file`);
  - `atomic_write_bytes` / `atomic_write_text`: readers see the old file or the whole new one; with
    `replace=False` (a --json report without --force) an existing file, or one that appears meanwhile, is refused;
  - `atomic_output_dir`: a temporary folder beside OUT, renamed onto OUT only if OUT still does not exist
    (renameat2 RENAME_NOREPLACE on Linux) unless `force`; removed on any error, Ctrl-C or SIGTERM;
  - `record_written` / `written_outputs`: the outputs a command has put in place, so that a later error or an
    interrupt says truly what is on disk (the CLI names them; "nothing was written" only when nothing was);
Files and folders are created with the usual modes (0666 / 0777 minus the umask), as other tools do.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator, Union

from dspark_cli.errors import DsparkError

PathLike = Union[str, "os.PathLike[str]"]
NamedInput = tuple[str, PathLike]  # (what it is, e.g. "input checkpoint", its path)

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


# --- modes --------------------------------------------------------------------------------------------------------


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux), else by setting it back."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    return 0o666 & ~current_umask()


def default_dir_mode() -> int:
    return 0o777 & ~current_umask()


# --- overlap with inputs -----------------------------------------------------------------------------------------


def real_path(path: PathLike) -> Path:
    """Absolute path with every existing symlink resolved (the path itself need not exist)."""
    return Path(os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(path)))))


def refuse_input_overlap(output: PathLike, inputs: Iterable[NamedInput], what: str = "output") -> None:
    """Raise DsparkError (exit 2) when `output` is, contains or lies inside one of `inputs` (symlinks resolved).

    `inputs` are (description, path) pairs; a None path is skipped. `what` names the output in the message.
    """
    out = real_path(output)
    for description, path in inputs:
        if path is None:
            continue
        source = real_path(path)
        if out == source:
            raise DsparkError(f"{what} {output} is the {description} {path}; choose another path.")
        if source in out.parents:
            raise DsparkError(f"{what} {output} is inside the {description} {path}; choose a path outside it.")
        if out in source.parents:
            raise DsparkError(f"{what} {output} contains the {description} {path}; choose a path that holds no "
                              "input.")


def local_inputs(description: str, sources: Iterable[PathLike | None]) -> list[NamedInput]:
    """(description, path) for each source that exists on disk (hub ids and None are left out)."""
    return [(description, source) for source in sources
            if source is not None and os.path.lexists(os.path.expanduser(os.fspath(source)))]


def check_output_file(path: PathLike | None, inputs: Iterable[NamedInput], what: str) -> None:
    """Refuse, before any work, an output file that would overwrite an input or cannot be written.

    None and "-" (stdout) pass. Refused: a path that is or lies inside an input, an existing folder or other
    non-regular file, a path whose nearest existing parent is not a writable folder.
    """
    if path is None or os.fspath(path) == "-":
        return
    path = Path(os.path.expanduser(os.fspath(path)))
    try:
        refuse_input_overlap(path, inputs, what)
        if path.is_dir():
            raise DsparkError(f"{what} {path} is a folder; give a file name.")
        if path.exists() and not path.is_file():
            raise DsparkError(f"{what} {path} exists and is not a regular file; give another file name.")
        check_writable_parent(path, what)
    except OSError as error:  # a path no file can have: a name too long, a loop of links, ...
        raise DsparkError(f"{what} {path} cannot be created ({error.strerror or error}); choose another "
                          "path.") from None


def check_output_files(outputs: Iterable[tuple[str, PathLike | None]], inputs: Iterable[NamedInput],
                       force: bool | None = None) -> None:
    """check_output_file for each (what, path) of one command's outputs, each also against the outputs before it:
    two outputs naming one file (or one inside the other) would destroy each other, existing or not.

    `force` is given by a command that writes its files exclusively (`write_output_file`): then a file that exists
    is refused unless `force` is True, before any work.
    """
    inputs, earlier = list(inputs), []
    for what, path in outputs:
        check_output_file(path, inputs + earlier, what)
        if path is None or os.fspath(path) == "-":
            continue
        if force is False and os.path.lexists(os.path.expanduser(os.fspath(path))):
            raise DsparkError(exists_sentence(path, what))
        earlier.append((what, path))


def check_writable_parent(path: PathLike, what: str) -> None:
    """Refuse `path` when its nearest existing parent is not a folder this process may create entries in."""
    parent = Path(os.path.abspath(os.path.expanduser(os.fspath(path)))).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise DsparkError(f"{what} {path}: {parent} is not a folder; choose another path.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DsparkError(f"{what} {path}: the folder {parent} is not writable; choose another path.")


# --- reading inputs ------------------------------------------------------------------------------------------------


# --- what a command has written, for true messages when it stops ----------------------------------------------------

_written: list[Path] = []  # outputs put in place since the last forget_written(), in order
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG}


def record_written(path: PathLike) -> None:
    """Note that `path` now holds a finished output (an atomic file renamed into place, a published folder)."""
    path = Path(path)
    if path not in _written:
        _written.append(path)


def written_outputs() -> list[Path]:
    """The outputs put in place since forget_written() that are still there: what an error or an interrupt leaves
    behind (a file written into a temporary file or folder that was renamed or removed since is not)."""
    return [path for path in _written if os.path.lexists(path)]


def forget_written() -> None:
    """Start a new command: nothing written yet."""
    _written.clear()


def kept_sentence(own: str | None = None) -> str:
    """What is on disk after a failed or interrupted command, as a clause: 'nothing was written' only when true.

    `own` is a command's own sentence about its main output (train's checkpoints, eval's run file, regen's records),
    which names what it kept there; every other output still on disk (train's log, a --json file) is added.
    """
    others = unnamed_outputs(own or "")
    if own is not None:
        return own if not others else f"{own}; also written and kept: " + ", ".join(map(str, others))
    if not others:
        return "nothing was written"
    return "already written and kept: " + ", ".join(map(str, others))


def unnamed_outputs(message: str) -> list[Path]:
    """The outputs still on disk that `message` does not name already."""
    return [path for path in written_outputs() if str(path) not in message]


def is_disk_error(error: BaseException) -> bool:
    """A write that failed because of the disk or its permissions (full, quota, read-only, denied, I/O)."""
    return isinstance(error, OSError) and error.errno in DISK_ERRNOS


def is_full_or_read_only(error: BaseException) -> bool:
    """A disk error that only a write can meet: no space, a quota, a read-only file system, a file too large."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


# --- atomic files --------------------------------------------------------------------------------------------------


def atomic_write_bytes(path: Path, data: bytes, replace: bool = True) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one.

    A replaced file keeps its mode; a new one gets 0666 minus the umask. With `replace` False the file is created
    exclusively (a command's report without its force option): one that exists, or appears while `data` is being
    written, is never replaced (DsparkError, the temporary file removed).
    """
    path = Path(path)
    if not replace and os.path.lexists(path):
        raise DsparkError(exists_sentence(path))
    existed = path.is_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        mode = path.stat().st_mode & 0o7777 if existed else default_file_mode()
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise DsparkError(f"cannot write {path}: {error.strerror or error}; choose another path.") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, mode)
        if replace:
            os.replace(tmp, path)
        else:
            _publish(tmp, path)
    except BaseException as error:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(error, OSError):
            state = "keeps its earlier content" if existed else "was not created"
            raise DsparkError(f"cannot write {path}: {error.strerror or error}; the temporary file was removed and "
                              f"{path} {state}.") from None
        raise
    record_written(path)


def atomic_write_text(path: Path, text: str, replace: bool = True) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), replace)


def exists_sentence(path: PathLike, what: str | None = None) -> str:
    """The one sentence refusing an output file that exists (the CLI prints the force option as --force)."""
    named = f"{what} {path}" if what else f"{path}"
    return f"{named} already exists; choose another file or pass the force option to replace it."


# --- atomic, exclusive output folders --------------------------------------------------------------------------------


def _load_renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_renameat2 = _load_renameat2()


def rename_noreplace(source: Path, destination: Path) -> None:
    """Rename `source` to `destination`; FileExistsError when `destination` exists (never replaced).

    Linux: renameat2(RENAME_NOREPLACE), atomic. Elsewhere (or on file systems without it): a check then rename,
    where rename itself still refuses a non-empty destination folder.
    """
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(destination), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(code, os.strerror(code), str(destination))  # EEXIST becomes FileExistsError
    if os.path.lexists(destination):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(destination))
    try:
        os.rename(source, destination)
    except OSError as error:
        if error.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(destination)) from None
        raise


def _exists_message(out: Path) -> str:
    return f"{out} already exists; choose another output folder or pass the force option to replace it."


@contextlib.contextmanager
def atomic_output_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; on success it becomes `out`, on any error it is removed.

    Without `force`, `out` is created exclusively: if it exists at the start, or appears while the folder is
    being written (another run), DsparkError and nothing is replaced. With `force` the old `out` is moved aside
    under a unique name and deleted only once the new one is in place. Ctrl-C / SIGTERM leave nothing behind.
    """
    out = Path(out)
    if os.path.lexists(out) and not force:
        raise DsparkError(_exists_message(out))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as error:
        raise DsparkError(f"cannot create {out}: {error.strerror or error}; choose another output folder.") from None
    existed = os.path.lexists(out)
    try:
        os.chmod(tmp, default_dir_mode())
        yield tmp
        if force:
            replace_path(tmp, out)
        else:
            _publish(tmp, out)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_error(error):
            state = "was left as it was" if existed else "was not created"
            raise DsparkError(f"cannot write {out}: {error.strerror or error}"
                              + (f" ({error.filename})" if error.filename else "")
                              + f"; the temporary folder was removed and {out} {state}.") from None
        raise
    record_written(out)


@contextlib.contextmanager
def atomic_output_file(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary file path beside `out`; on success it becomes `out`, on any error it is removed.

    Exclusive like `atomic_output_dir`: without `force` an `out` that exists, or appears meanwhile, is never
    replaced; with `force` the old file is moved aside and deleted once the new one is in place.
    """
    out = Path(out)
    if os.path.lexists(out) and not force:
        raise DsparkError(f"{out} already exists; choose another output file or pass the force option to replace it.")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        os.close(fd)
    except OSError as error:
        raise DsparkError(f"cannot create {out}: {error.strerror or error}; choose another output file.") from None
    tmp = Path(name)
    try:
        os.chmod(tmp, default_file_mode())
        yield tmp
        (replace_path if force else _publish)(tmp, out)
    except BaseException as error:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if is_disk_error(error):
            raise DsparkError(f"cannot write {out}: {error.strerror or error}; the temporary file was removed and "
                              f"{out} was not written.") from None
        raise
    record_written(out)


def write_output_file(path: PathLike | None, write: Callable[[Path], None], force: bool) -> None:
    """`write(file)` into a temporary file beside `path`, then published exclusively (`atomic_output_file`): an
    existing file is replaced only with `force`. None writes nothing; `-` is stdout (`write("-")`)."""
    if path is None:
        return
    if os.fspath(path) == "-":
        write(Path("-"))
        return
    with atomic_output_file(Path(os.path.expanduser(os.fspath(path))), force) as tmp:
        write(tmp)


def _publish(tmp: Path, out: Path) -> None:
    try:
        rename_noreplace(tmp, out)
    except FileExistsError:
        raise DsparkError(f"{out} appeared while this output was being written (another run?); it was left as "
                          "it is and nothing was written. Choose another output folder or pass the force option.") from None


def replace_path(tmp: Path, out: Path) -> None:
    """Put `tmp` (a file or folder) at `out`, moving an existing `out` aside under a unique name first and
    deleting it last; if the move fails, the old `out` is put back."""
    if not os.path.lexists(out):
        _publish(tmp, out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    old = aside / "previous"
    os.replace(out, old)
    try:
        _publish(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):  # put the old output back; if that fails it stays in `aside`
            rename_noreplace(old, out)
            aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)
