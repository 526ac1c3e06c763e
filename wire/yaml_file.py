"""Reading a YAML config file (the registry, the API keys file) into plain data, within bounds.

Imported by the gateway process (serve, reloads, `gateway check-config`) and by a remote worker at
start-up (model_worker.remote_spec, model_worker.etcd_target), so both read one file within the same
bounds. The one module of the wire package that needs PyYAML. Owns what PyYAML's
safe loader lets through: a file too large to be a config (or a device that never ends), text that
is not UTF-8, nesting deep enough to exhaust Python's recursion, aliases that expand to more values
than any config holds ("billion laughs") or that contain themselves, keys given twice (PyYAML keeps
the last one silently), and NUL characters (no path, name or environment value can hold one). Every
error is a `YamlFileError` whose text names the file and the line, or the place in the file as the
caller describes it (the registry says which model and field).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

# A registry is a few KiB; the largest real ones (many models, inline templates) stay far below these.
MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 64
MAX_VALUES = 100_000
MERGE_TAG = "tag:yaml.org,2002:merge"

# Where a value is in the data, as keys and list indices; the caller turns it into words.
Location = tuple[str | int, ...]
Describe = Callable[[Any, Location], str]


class YamlFileError(Exception):
    """A config file that cannot be read into data; str() is the whole message, file name first."""


class _Refused(Exception):
    """A problem found in the node graph, with the line it is on."""

    def __init__(self, message: str, node: Node) -> None:
        super().__init__(message)
        self.line = node.start_mark.line + 1


class _DepthLimitedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing nesting deeper than MAX_DEPTH while it composes (the composer
    recurses once per level, so a deeper file would end in a RecursionError)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                event = self.peek_event()
                raise yaml.MarkedYAMLError(
                    problem=f"nested deeper than {MAX_DEPTH} levels", problem_mark=event.start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _NodeCheck:
    """One walk over the composed nodes, where an alias is the node it names: the size and depth
    the data will have once aliases are expanded, cycles, keys given twice and NUL characters.
    Each node is measured once (memoized), so an alias bomb costs no more than its text."""

    def __init__(self) -> None:
        self.measured: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth below it)
        self.open: set[int] = set()  # nodes being measured: one reached again is a cycle
        self.first_problem: tuple[Location, str] | None = None  # kept for after construction

    def measure(self, node: Node, depth: int, where: Location) -> tuple[int, int]:
        if depth > MAX_DEPTH:  # before descending: a chain of aliases is not bounded by the text
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels once aliases are expanded", node)
        known = self.measured.get(id(node))
        if known is None:
            if id(node) in self.open:
                raise _Refused("an alias refers to a value that contains it (a cycle)", node)
            self.open.add(id(node))
            known = self._measure_children(node, depth, where)
            self.open.discard(id(node))
            self.measured[id(node)] = known
        values, below = known
        if depth + below > MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels once aliases are expanded", node)
        return values, below

    def _measure_children(self, node: Node, depth: int, where: Location) -> tuple[int, int]:
        if isinstance(node, ScalarNode):
            if "\x00" in node.value:
                self._note(where, "a NUL character (\\0) cannot be part of any value")
            return 1, 0
        children: list[tuple[Node, Location]] = []
        if isinstance(node, SequenceNode):
            children = [(item, (*where, index)) for index, item in enumerate(node.value)]
        elif isinstance(node, MappingNode):
            children = self._mapping_children(node, where)
        values, below = 1, 0
        for child, child_where in children:
            child_values, child_below = self.measure(child, depth + 1, child_where)
            values += child_values
            below = max(below, child_below + 1)
            if values > MAX_VALUES:
                raise _Refused(f"more than {MAX_VALUES} values (an alias counts as all it names)", node)
        return values, below

    def _mapping_children(self, node: MappingNode, where: Location) -> list[tuple[Node, Location]]:
        children: list[tuple[Node, Location]] = []
        lines: dict[tuple[str, str], int] = {}  # (tag, text) of each key -> its line
        for key, value in node.value:
            name = key.value if isinstance(key, ScalarNode) else "?"
            if isinstance(key, ScalarNode) and key.tag != MERGE_TAG:
                line = key.start_mark.line + 1
                first = lines.get((key.tag, key.value))
                if first is None:
                    lines[(key.tag, key.value)] = line
                else:
                    self._note(
                        (*where, name),
                        f"{name!r} is given twice (lines {first} and {line}); YAML would keep only the last",
                    )
            children += [(key, (*where, name)), (value, (*where, name))]
        return children

    def _note(self, where: Location, message: str) -> None:
        if self.first_problem is None:
            self.first_problem = (where, message)


def _read_text(path: Path, kind: str) -> str:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)  # bounded: the path may name a device or a fifo
    except OSError as exc:
        raise YamlFileError(f"{path}: cannot read{kind and ' '}{kind}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise YamlFileError(f"{path}: larger than {MAX_FILE_BYTES // 1024 // 1024} MiB; is it a config file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise YamlFileError(
            f"{path}: not UTF-8 text: byte 0x{data[exc.start]:02x} at line {line} (save the file as UTF-8)"
        ) from None


def _yaml_message(path: Path, text: str, exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow, by its offset
        line = text[: exc.position].count("\n") + 1
        return f"{path}: not valid YAML at line {line}: character #x{exc.character:04x}: {exc.reason}"
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}" if mark is not None else ""
    return f"{path}: not valid YAML{where}: {getattr(exc, 'problem', None) or exc}"


def field_path(data: Any, where: Location) -> str:
    """The plain description of a place in a file: `field 'server.cluster.etcd'`."""
    return f"field {'.'.join(str(part) for part in where)!r}"


def read_yaml_file(path: Path, describe: Describe = field_path, kind: str = "") -> Any:
    """The file's data (None for an empty file); YamlFileError naming the file and where the problem
    is: a line, or `describe(data, location)` for a value or key that the data itself holds. `kind`
    names the file in the message when it cannot be read ("keys file")."""
    text = _read_text(path, kind)
    check = _NodeCheck()
    try:
        loader = _DepthLimitedLoader(text)  # reads the whole text: refuses characters YAML does not allow
    except yaml.YAMLError as exc:
        raise YamlFileError(_yaml_message(path, text, exc)) from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check.measure(node, 0, ())
        data = loader.construct_document(node)
    except _Refused as exc:
        raise YamlFileError(f"{path}: line {exc.line}: {exc}") from None
    except yaml.YAMLError as exc:
        raise YamlFileError(_yaml_message(path, text, exc)) from None
    finally:
        loader.dispose()
    if check.first_problem is not None:
        where, message = check.first_problem
        raise YamlFileError(f"{path}: {describe(data, where)}: {message}")
    return data
