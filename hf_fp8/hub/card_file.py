"""Read and replace a folder's ``README.md`` without following it anywhere (DESIGN §8).

Every card hf_fp8 reads from a folder (``push_folder``, ``save_pretrained``, ``push_to_hub``,
``write_model_card``, the card of the folder a model was loaded from) goes through
:func:`read_card`, and every card it writes into an existing folder through :func:`write_card`:

* the path is ``contained(folder, "README.md")``: a symlink raises ``UnsafePathError``
  (a Hub cache snapshot's link into its own ``blobs/`` excepted, as for the weights);
* the file is opened with ``O_NOFOLLOW | O_NONBLOCK`` (a link swapped in after the check is
  refused, a FIFO never blocks) and must be a regular file: a FIFO, a device or a folder named
  ``README.md`` is refused;
* at most :data:`MAX_CARD_BYTES` are read; a larger file is refused unread;
* a new card replaces the old one by a rename, never by writing through it, and is never
  larger than :data:`MAX_CARD_BYTES` (a card hf_fp8 could not read back is not written).

A hard link is a regular file (it has no target to follow) and is read like the weights are.

The layout of a card's text is read here too (:func:`split_card`): a byte order mark, its line
ending, the YAML metadata block, and hf_fp8's marked part of the text after it
(:func:`find_marked_part`, written by :func:`marked_part`); :func:`merge_metadata` adds
hf_fp8's metadata keys to a block by editing only their lines.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from hf_fp8.serialization.checkpoint import CARD_NAME
from hf_fp8.utils.folders import UnsafePathError, contained, hub_cache_root

# The largest model card hf_fp8 reads: long Hub cards are tens of KiB, a few reach ~1 MiB.
MAX_CARD_BYTES = 8 * 2**20
_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def card_path(folder: str | os.PathLike) -> Path:
    """``folder/README.md``, checked (not followed) as :func:`read_card` reads it."""
    return contained(folder, CARD_NAME, links_within=hub_cache_root(folder))


def read_card(folder: str | os.PathLike) -> str | None:
    """Text of ``folder/README.md``; ``None`` when there is none (or no folder). Raises
    ``UnsafePathError`` when it is a symlink, not a regular file, larger than
    :data:`MAX_CARD_BYTES` or not UTF-8 text."""
    path = card_path(folder)
    try:
        fd = os.open(path, _FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # ELOOP: a link put there after the check
        if os.path.islink(path):
            raise UnsafePathError(
                f"{path} is a symlink: hf_fp8 does not follow links in a checkpoint folder; "
                "replace it with the file itself"
            ) from exc
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePathError(
                f"{path} is not a regular file (a folder, FIFO or device): hf_fp8 reads the "
                "model card only from a plain README.md; remove it or put the card's text there"
            )
        data = _read(fd, MAX_CARD_BYTES + 1) if info.st_size <= MAX_CARD_BYTES else b""
    finally:
        os.close(fd)
    if info.st_size > MAX_CARD_BYTES or len(data) > MAX_CARD_BYTES:
        raise UnsafePathError(
            f"{path} is {max(info.st_size, len(data))} bytes, more than a model card may have "
            f"({MAX_CARD_BYTES}); hf_fp8 does not read it: shorten it or move it out of the folder"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnsafePathError(
            f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}): hf_fp8 reads and "
            "rewrites only a text model card; fix or remove it"
        ) from exc


def _read(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``fd`` (a regular file: no short read before its end)."""
    chunks, size = [], 0
    while size < limit and (chunk := os.read(fd, min(limit - size, 1 << 20))):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def write_card(folder: str | os.PathLike, text: str) -> Path:
    """Put ``text`` into ``folder/README.md`` by writing a temporary file next to it and
    renaming it into place: an existing link or file is replaced, never written through.
    A new card gets ``0o666 & ~umask`` (as ``open()`` gives the weights and config.json); one
    that replaces a regular card keeps that card's mode. Raises ``UnsafePathError`` when the
    path goes through a symlink, or when ``text`` is larger than :data:`MAX_CARD_BYTES`
    (nothing is written: the next read would refuse it)."""
    path = contained(folder, CARD_NAME)
    size = len(text.encode("utf-8"))
    if size > MAX_CARD_BYTES:
        raise UnsafePathError(
            f"the model card for {path} would be {size} bytes, more than a model card may "
            f"have ({MAX_CARD_BYTES}); hf_fp8 leaves README.md as it is: shorten it"
        )
    old_mode = _old_mode(path)
    fd, tmp = _create_temp(path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if old_mode is not None:
                os.fchmod(f.fileno(), old_mode)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


def _create_temp(parent: Path) -> tuple[int, Path]:
    """A new, empty ``.README.md.<random>.tmp`` in ``parent``, opened for writing, created with
    mode ``0o666`` so the kernel applies the umask (``mkstemp`` would give ``0o600``)."""
    for _ in range(100):
        tmp = parent / f".{CARD_NAME}.{secrets.token_hex(8)}.tmp"
        try:
            return os.open(tmp, _CREATE | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary card file in {parent}")


def _old_mode(path: Path) -> int | None:
    """The old card's permission bits (its own, not a link target's); ``None`` when there is
    no regular file to replace."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return stat.S_IMODE(info.st_mode) if stat.S_ISREG(info.st_mode) else None


# --- the layout of a card's text ---------------------------------------------------------

# hf_fp8's part of a card lies between these two lines (hf_fp8.hub.card's docstring)
BEGIN_MARKER = "<!-- hf_fp8:begin"
END_MARKER = "<!-- hf_fp8:end"
_BEGIN_LINE = (
    f"{BEGIN_MARKER}: written by hf-fp8 and rewritten on every save; put your own text above "
    "or below these two marker lines -->"
)
_END_LINE = re.compile(r"<!-- hf_fp8:end(?: sha256:([0-9a-f]{16}))? -->")
FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)^---[ \t]*(?:\r?\n|\Z)", re.S | re.M)
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})(.*)")
# the metadata keys hf_fp8 writes; every other key is the user's and is never touched
_OWN_KEYS = ("library_name", "base_model", "base_model_relation")


def warn_card(message: str) -> None:
    """One warning about a card (hf_fp8 kept something as it is: the message names the fix)."""
    warnings.warn(f"hf_fp8: {message}", UserWarning, stacklevel=4)


class CardText(NamedTuple):
    """A card's text in its parts: ``bom + head + body`` is the text (``head`` ``None``: "")."""

    bom: str  # "\ufeff" or ""
    newline: str  # the card's line ending: "\r\n" or "\n"
    head: str | None  # the YAML metadata block with its --- lines; None: the card has none
    yaml: str  # the text between the --- lines
    body: str  # everything after the metadata block


def split_card(text: str) -> CardText:
    """``text`` in its parts; its line ending is CRLF when most of its lines end so."""
    bom = "\ufeff" if text.startswith("\ufeff") else ""
    text = text[len(bom) :]
    crlf = text.count("\r\n")
    newline = "\r\n" if crlf and 2 * crlf >= text.count("\n") else "\n"
    match = FRONT_MATTER.match(text)
    if match is None:
        return CardText(bom, newline, None, "", text)
    return CardText(bom, newline, text[: match.end()], match.group(1), text[match.end() :])


class MarkedPart(NamedTuple):
    """hf_fp8's marked part of a card's body (offsets in the body)."""

    start: int  # offset of the begin marker line in the body
    end: int  # offset just past the end marker line
    content: str  # the text between the two lines
    digest: str | None  # what the end marker records


def find_marked_part(body: str) -> MarkedPart | str | None:
    """hf_fp8's marked part of ``body``; a sentence saying what is wrong when the markers are
    not as hf_fp8 writes them (a marker mentioned anywhere else counts); ``None`` when the
    card has no marker at all."""
    if "hf_fp8:begin" not in body and "hf_fp8:end" not in body:
        return None
    begins, ends, fence, offset = [], [], None, 0
    for line in body.splitlines(keepends=True):
        text = line.strip()
        inside = fence is not None
        if fence_match := _FENCE.match(line.rstrip("\r\n")):
            mark, rest = fence_match.groups()
            if fence is None and not (mark[0] == "`" and "`" in rest):
                fence = mark
            elif fence is not None and mark[0] == fence[0] and len(mark) >= len(fence):
                fence = None if not rest.strip() else fence
        if "hf_fp8:begin" in line:
            ok = text.startswith(BEGIN_MARKER) and text.endswith("-->") and text.count("-->") == 1
            begins.append((offset, offset + len(line), ok and not inside))
        if "hf_fp8:end" in line:
            ok = _END_LINE.fullmatch(text) is not None
            ends.append((offset, offset + len(line), ok and not inside, text))
        offset += len(line)
    if len(begins) != 1 or len(ends) != 1:
        return f"{len(begins)} begin and {len(ends)} end markers, where one of each belongs"
    (b_start, b_end, b_ok), (e_start, e_end, e_ok, e_text) = begins[0], ends[0]
    if not (b_ok and e_ok):
        return "a marker line changed, joined to other text or inside a code block"
    if e_start < b_end:
        return "the end marker comes before the begin marker"
    recorded = _END_LINE.fullmatch(e_text).group(1)
    return MarkedPart(b_start, e_end, body[b_end:e_start], recorded)


def normal_text(text: str) -> str:
    """``text`` with its line endings, trailing spaces and outer blank lines left out."""
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


def digest(text: str) -> str:
    """What the end marker records of the text hf_fp8 wrote (:func:`normal_text`: an editor
    that changes line endings or trailing spaces changes nothing the user wrote)."""
    return hashlib.sha256(normal_text(text).encode("utf-8")).hexdigest()[:16]


def marked_part(generated: str, newline: str = "\n") -> str:
    """``generated`` (its outer blank lines left out) between hf_fp8's marker lines, the end
    one recording its digest."""
    lines = generated.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    lines = lines[next((i for i, line in enumerate(lines) if line.strip()), len(lines)) :]
    end = f"{END_MARKER} sha256:{digest(generated)} -->"
    return newline.join([_BEGIN_LINE, *lines, end]) + newline


def merge_metadata(parts: CardText, fresh: dict[str, Any], wrote: dict[str, Any] | None) -> str:
    """The card's metadata block with hf_fp8's keys merged in: its tags added to the user's,
    a missing key of its own added, and a value of its own updated where the card still holds
    what hf_fp8 wrote there (``wrote``: its metadata of the card's facts; ``None``: unknown,
    only missing keys are added); a value the user set stays. Untouched (byte for byte)
    when nothing changes; a block that is not YAML is kept as it is (one warning)."""
    nl = parts.newline
    if _has_aliases(parts.yaml):  # R23 F1: comparing expanded aliases can take forever
        warn_card(
            "README.md's metadata (between its --- lines) uses YAML anchors and aliases "
            "(&name / *name), so it is kept as it is and hf-fp8 adds none of its keys "
            "(library_name, tags); write the values out if you want them added"
        )
        return parts.head or ""
    try:
        data = yaml.safe_load(parts.yaml) if parts.yaml.strip() else {}
    except yaml.YAMLError:
        data = None
    if not isinstance(data, dict):
        warn_card(
            "README.md's metadata (between its --- lines) is not a YAML mapping, so it is kept "
            "as it is and hf-fp8 adds none of its keys (library_name, tags); fix its YAML"
        )
        return parts.head or ""
    wrote = wrote or {}
    updates: dict[str, Any] = {}
    tags = data.get("tags")
    tags = [tags] if isinstance(tags, str) else tags or []
    if isinstance(tags, list) and (missing := [t for t in fresh["tags"] if t not in tags]):
        updates["tags"] = tags + missing
    for key in _OWN_KEYS:
        ours = data.get(key) is None or (key in wrote and data[key] == wrote[key])
        if ours and data.get(key) != fresh.get(key):
            updates[key] = fresh.get(key)
    if not updates:
        return parts.head or ""
    target = {k: v for k, v in {**data, **updates}.items() if v is not None}
    text = _edit_yaml(parts.yaml, updates)
    try:
        same = text is not None and yaml.safe_load(text) == target
    except yaml.YAMLError:
        same = False
    if not same:  # a layout the line edit cannot follow: the whole block written anew ...
        if "#" in parts.yaml:  # ... which would drop the user's comments: left as it is
            warn_card(
                "README.md's metadata has comments and a layout hf-fp8 cannot edit line by "
                "line, so it is kept as it is and hf-fp8 adds none of its keys "
                f"({', '.join(updates)}); add them yourself if you want them"
            )
            return parts.head or ""
        text = _dump(target)
    text = text.replace("\r\n", "\n").replace("\n", nl)
    if parts.head is None:
        return f"---{nl}{text}---{nl}"
    opening = parts.head[: parts.head.index("\n") + 1]
    closing = parts.head[len(opening) + len(parts.yaml) :]
    return f"{opening}{text}{closing}"


def _has_aliases(text: str) -> bool:
    """Whether the YAML ``text`` uses an alias (``*name``): read as events, never expanded."""
    try:
        return any(
            isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, yaml.SafeLoader)
        )
    except yaml.YAMLError:
        return False  # not YAML: the caller's own check keeps it as it is


def _edit_yaml(text: str, updates: dict[str, Any]) -> str | None:
    """``text`` (a YAML mapping) with each key of ``updates`` set to its value (``None``:
    removed), by replacing only that key's lines; new keys go at the end. ``None`` when the
    lines of a key to replace hold a ``#`` (a comment of the user's would go)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    done: set[str] = set()
    i = 0
    while i < len(lines):
        match = re.match(r"([A-Za-z_][\w.-]*)[ \t]*:(?:[ \t]|\r?\n|$)", lines[i])
        key = match.group(1) if match else None
        if key not in updates or key in done:
            out.append(lines[i])
            i += 1
            continue
        j = i + 1
        while j < len(lines) and (lines[j][:1] in (" ", "\t", "-") or not lines[j].strip()):
            j += 1
        while j > i + 1 and not lines[j - 1].strip():  # blank lines after it stay
            j -= 1
        if any("#" in line for line in lines[i:j]):
            return None
        done.add(key)
        if updates[key] is not None:
            out.append(_dump({key: updates[key]}))
        i = j
    if out and not out[-1].endswith("\n"):
        out[-1] += "\n"
    out += [_dump({k: v}) for k, v in updates.items() if k not in done and v is not None]
    return "".join(out)


def _dump(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
