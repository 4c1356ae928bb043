"""YAML and JSON reading that keeps line numbers and refuses anything that is not plain data.

Both recipes and raw DeepSpeed JSON come through here so that every finding can point at
`file:line:col`. The loader composes the YAML node graph itself (ruamel.yaml's composer) instead
of constructing Python objects, which gives us, in one pass:

- positions for every key and value (1-based line and column),
- duplicate keys as errors (DeepSpeed rejects them in JSON; HF silently keeps the last),
- no object-constructing tags (`!!python/object`, custom `!tags`),
- bounds on size, nesting depth and alias expansion ("billion laughs"), so bad input never hangs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError

Path_ = tuple  # a key path inside a document: ("deepspeed", "stage") or ("lora", "target_modules", 0)

MAX_BYTES = 2 * 1024 * 1024  # a recipe is a few KB; a 2 MB "recipe" is a mistake
MAX_DEPTH = 64
MAX_NODES = 200_000  # counts alias expansions too

_STD = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_STD + t for t in ("str", "int", "float", "bool", "null", "timestamp", "binary")}


class DocumentError(FinetuneError):
    """A document could not be read at all. Carries a position for the report."""

    def __init__(self, message: str, line: int = 1, col: int = 1, key: str | None = None):
        super().__init__(message)
        self.message = message
        self.line = line
        self.col = col
        self.key = key


@dataclass
class Document:
    """Plain data (dicts, lists, str, int, float, bool, None) plus where each piece came from."""

    path: str
    data: Any
    positions: dict[Path_, tuple[int, int]] = field(default_factory=dict)
    duplicates: list[tuple[Path_, int, int]] = field(default_factory=list)

    def pos(self, key_path: Path_) -> tuple[int, int]:
        """Best position for `key_path`: the key itself, else its nearest parent, else 1:1."""
        key_path = tuple(key_path)
        while key_path:
            if key_path in self.positions:
                return self.positions[key_path]
            key_path = key_path[:-1]
        return self.positions.get((), (1, 1))


def read_text(path: Path) -> str:
    """A recipe or DeepSpeed JSON file as text: a regular file of at most MAX_BYTES (finetune.fsutil.read_capped:
    a FIFO or a link to /dev/zero is refused, never waited on or read to the end)."""
    from finetune.fsutil import read_capped

    try:
        raw = read_capped(path, MAX_BYTES)
    except OSError as exc:
        if exc.strerror is None:  # read_capped's own refusal: it names the path, which the report names already
            raise DocumentError(str(exc).replace(f"{path} ", "file ", 1)) from None
        raise DocumentError(f"cannot read file: {exc.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentError(f"file is not UTF-8 text (byte {exc.start})") from None


def load_yaml(text: str, path: str = "<string>", allow_duplicates: bool = False) -> Document:
    """Parse one YAML document into plain data with positions. Raises DocumentError."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import MarkedYAMLError, YAMLError

    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise DocumentError(f"document is larger than {MAX_BYTES:,} bytes")
    # libyaml's C parser (ruamel.yaml.clib) composes ~5x faster than the pure-Python one; same nodes,
    # same marks. Without the C extension, ruamel falls back to pure Python by itself.
    yaml = YAML(typ="safe", pure=False)
    _refuse_deep_nesting(text)
    try:
        nodes = list(yaml.compose_all(text))
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = exc.problem or exc.context or "invalid YAML"
        context = exc.context_mark
        if exc.context and context is not None and exc.problem and (context.line, context.column) != (line - 1, col - 1):
            # e.g. an unclosed `[`: the error is at the end of the file, the cause where the `[` opened
            problem += f" ({exc.context} started at line {context.line + 1}, column {context.column + 1})"
        if problem.startswith("mapping values are not allowed"):  # `key: a: b`: the value holds ": "
            problem += "; a value that contains `: ` must be quoted, e.g. `name_or_path: \"builtin:tiny-llama\"`"
        elif problem.startswith("found unexpected ':'"):  # `{name_or_path: builtin:tiny-llama}`: flow style
            problem += "; inside `{...}` a value that contains `:` must be quoted, e.g. `{name_or_path: \"builtin:tiny-llama\"}`"
        raise DocumentError(f"invalid YAML: {problem}", line, col) from None
    except (YAMLError, RecursionError, ValueError) as exc:
        raise DocumentError(f"invalid YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if len(nodes) > 1:
        mark = nodes[1].start_mark
        raise DocumentError("file holds more than one YAML document (`---`); put one recipe per file", mark.line + 1, mark.column + 1)
    doc = Document(path=path, data=None)
    if not nodes or nodes[0] is None:
        return doc
    _refuse_alias_bombs(nodes[0])
    builder = _Builder(doc, yaml, allow_duplicates)
    doc.data = builder.build(nodes[0], (), 0)
    return doc


def _refuse_alias_bombs(root: Any) -> None:
    """Raise DocumentError when the document, its aliases expanded, holds more than MAX_NODES values.

    Aliases share their anchor's node, so each node's expanded size is counted once (bottom up): ten levels
    of ten aliases each ("billion laughs") are refused after a few hundred nodes, where the builder would
    construct MAX_NODES values first (2 s on a busy 2-core box; issue 40: lint ran past 10 s)."""
    from ruamel.yaml.nodes import MappingNode, SequenceNode

    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # entered, children not yet counted: an alias to one of them is a cycle
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = [v for pair in node.value for v in pair] if isinstance(node, MappingNode) else \
            node.value if isinstance(node, SequenceNode) else []
        if children_done:
            open_nodes.discard(id(node))
            sizes[id(node)] = size = 1 + sum(sizes.get(id(child), 0) for child in children)
            if size > MAX_NODES:
                raise DocumentError(f"document expands to more than {MAX_NODES:,} values (alias bomb?)", *_mark(node))
            continue
        if id(node) in open_nodes:  # `a: &x [*x]`: a collection that holds itself never ends
            raise DocumentError("an alias refers to a collection that contains it (a recursive value)", *_mark(node))
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)


def _refuse_deep_nesting(text: str) -> None:
    """Raise DocumentError at the first collection nested deeper than MAX_DEPTH.

    The composer recurses once per level (in C with ruamel.yaml.clib): 20,000 levels take seconds
    and 100,000 overflow the C stack (signal 11), long before the builder could count them. The
    parser underneath emits events from an explicit stack, so walking events stops at level 65
    after a few dozen of them, whatever follows. Syntax errors are left to the composer to report.
    """
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError
    from ruamel.yaml.events import CollectionEndEvent, CollectionStartEvent

    depth = 0
    try:
        for event in YAML(typ="safe", pure=False).parse(text):
            if isinstance(event, CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH + 1:  # the top-level collection is depth 0 in the builder
                    raise DocumentError(f"document is nested deeper than {MAX_DEPTH} levels", *_mark(event))
            elif isinstance(event, CollectionEndEvent):
                depth -= 1
    except (YAMLError, RecursionError, ValueError):
        return


class _Builder:
    def __init__(self, doc: Document, yaml: Any, allow_duplicates: bool):
        self.doc = doc
        self.yaml = yaml
        self.allow_duplicates = allow_duplicates
        self.count = 0

    def build(self, node: Any, key_path: Path_, depth: int) -> Any:
        from ruamel.yaml.nodes import MappingNode, ScalarNode, SequenceNode

        self.count += 1
        if self.count > MAX_NODES:
            raise DocumentError(f"document expands to more than {MAX_NODES:,} values (alias bomb?)", *_mark(node))
        if depth > MAX_DEPTH:
            raise DocumentError(f"document is nested deeper than {MAX_DEPTH} levels", *_mark(node))
        if key_path not in self.doc.positions:
            self.doc.positions[key_path] = _mark(node)
        if isinstance(node, ScalarNode):
            return self.scalar(node)
        if isinstance(node, SequenceNode):
            self.check_tag(node, _STD + "seq")
            return [self.build(item, key_path + (i,), depth + 1) for i, item in enumerate(node.value)]
        if isinstance(node, MappingNode):
            self.check_tag(node, _STD + "map")
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                if isinstance(key_node, ScalarNode) and key_node.tag == _STD + "merge":
                    raise DocumentError("YAML merge keys (`<<:`) are not supported; use `extends:` instead", *_mark(key_node))
                if not isinstance(key_node, ScalarNode):
                    raise DocumentError("mapping keys must be plain strings", *_mark(key_node))
                key = self.scalar(key_node)
                if not isinstance(key, (str, int, float, bool)) or key is None:
                    raise DocumentError("mapping keys must be plain strings", *_mark(key_node))
                key = key if isinstance(key, str) else str(key)
                child = key_path + (key,)
                if key in out:
                    line, col = _mark(key_node)
                    if not self.allow_duplicates:
                        raise DocumentError(f"duplicate key `{key}` (first at line {self.doc.positions[child][0]})", line, col, key=".".join(map(str, child)))
                    self.doc.duplicates.append((child, line, col))
                self.doc.positions[child] = _mark(key_node)
                out[key] = self.build(value_node, child, depth + 1)
            return out
        raise DocumentError("unsupported YAML node", *_mark(node))

    def check_tag(self, node: Any, expected: str) -> None:
        if node.tag != expected:
            raise DocumentError(f"YAML tag `{node.tag}` is not allowed: recipes hold plain data only", *_mark(node))

    def scalar(self, node: Any) -> Any:
        tag = node.tag
        if tag not in _SCALAR_TAGS:
            raise DocumentError(f"YAML tag `{tag}` is not allowed: recipes hold plain data only", *_mark(node))
        if tag in (_STD + "timestamp", _STD + "binary"):
            return str(node.value)
        try:
            return self.yaml.constructor.construct_object(node, deep=True)
        except Exception as exc:  # ruamel raises several types for odd scalars; report, don't crash
            raise DocumentError(f"cannot read value {shorten(repr(node.value))}: {shorten(str(exc))}",
                                *_mark(node)) from None


ECHO_LIMIT = 120  # characters of a user's value repeated in a message (a 100k-digit --set is not echoed whole)


def shorten(text: str, limit: int = ECHO_LIMIT) -> str:
    """`text` as a message repeats it: at most `limit` characters, saying how long the rest was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _mark(node: Any) -> tuple[int, int]:
    mark = getattr(node, "start_mark", None)
    return (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)


def load_json(text: str, path: str = "<string>") -> Document:
    """Parse JSON the way DeepSpeed and HF do (Python's json), with positions from the YAML composer.

    Duplicate keys are recorded (not raised): DeepSpeed rejects them, HF keeps the last, and lint
    reports the disagreement.
    """
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise DocumentError(f"document is larger than {MAX_BYTES:,} bytes")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = ""
        stripped = text.lstrip()
        if "//" in text or "/*" in text or stripped.startswith("#"):
            hint = " (comments are not allowed in DeepSpeed JSON: HF and accelerate read it with json.load)"
        elif exc.msg.startswith("Expecting property name") or exc.msg.startswith("Expecting value"):
            hint = " (trailing comma?)"
        raise DocumentError(f"invalid JSON: {exc.msg}{hint}", exc.lineno, exc.colno) from None
    except RecursionError:
        raise DocumentError(f"document is nested deeper than {MAX_DEPTH} levels") from None
    _refuse_deep_nesting(text)  # with the position, when YAML can read the text
    if _nesting(data) > MAX_DEPTH:
        raise DocumentError(f"document is nested deeper than {MAX_DEPTH} levels")
    doc = Document(path=path, data=data)
    try:
        positioned = load_yaml(text, path, allow_duplicates=True)
        doc.positions = positioned.positions
        doc.duplicates = positioned.duplicates
    except DocumentError:
        pass  # valid JSON that YAML can't read (tabs, odd escapes): keep the data, lose positions
    return doc


def _nesting(data: Any) -> int:
    """Depth of the deepest value (the top level is 0), without recursion."""
    deepest, stack = 0, [(data, 0)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest
