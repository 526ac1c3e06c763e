"""JSON schemas rewritten into the subset lm-format-enforcer enforces as written, or refused.

Runs in a worker process (its constraint compiler's child); pure functions of JSON, no imports of
the enforcer. lm-format-enforcer 0.11.3 reads only part of JSON Schema, and what it misreads it
does not refuse: it fails lazily, when generation reaches the value, and the job then ends with
text that is not JSON at all. So every schema goes through `enforceable` first, which rewrites
what means the same in the enforcer's terms and refuses (ValueError naming the place) what the
enforcer could only get wrong:

- a `$ref` to `#`, or to any pointer but `#/$defs/NAME` (the enforcer looks up the pointer's last
  part and fails): to a generated `#/$defs/refN`, which also lets a schema recurse;
- `{}`, `true`, a schema without `type` ("Unsupported type None"): any JSON value, or the type its
  keywords imply;
- `type: [a, b]` with other keywords (which the enforcer drops): `anyOf`, one schema per type;
- `oneOf` (a dead end unless every option is an object), keywords beside `anyOf` (dropped):
  `anyOf`, with those keywords merged into each option;
- `allOf` of several schemas (only object properties merged): one merged schema;
- a `required` key missing from `properties` (KeyError): a property of additionalProperties' schema;
- `additionalProperties: false` without `properties` (any keys allowed): no keys allowed.

Refused: `not`, `if`/`then`/`else`, `prefixItems`, `items` as a list, `patternProperties`,
`dependentSchemas`, `false` as a schema, `$ref`s outside the document, and enum values the
enforcer cannot match (objects, arrays, strings that need escapes).
"""

from __future__ import annotations

from typing import Any

_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated",
                          "readOnly", "writeOnly", "$schema", "$id", "$anchor", "discriminator"})  # fmt: skip
_DEFINITIONS = frozenset({"$defs", "definitions"})  # read through $ref only
_REFUSED = ("not", "if", "then", "else", "prefixItems", "patternProperties", "dependentSchemas")
_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
# Keywords that say which type a schema without `type` is about.
_IMPLIED = {
    "object": ("properties", "required", "additionalProperties", "minProperties", "maxProperties"),
    "array": ("items", "minItems", "maxItems", "uniqueItems", "contains"),
    "string": ("pattern", "minLength", "maxLength", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}
ANY_VALUE: dict[str, Any] = {"anyOf": [{"type": t} for t in _TYPES if t != "integer"]}
MAX_REFS = 256


def enforceable(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` in the enforcer's terms; ValueError (saying where) for what it cannot enforce."""
    return _Rewriter(schema).root()


class _Rewriter:
    def __init__(self, schema: dict[str, Any]) -> None:
        self.document = schema
        self.names: dict[str, str] = {}  # JSON pointer -> generated definition name
        self.defs: dict[str, Any] = {}

    def root(self) -> dict[str, Any]:
        rewritten = self.node(self.document, "schema")
        if self.defs:
            rewritten = {**rewritten, "$defs": self.defs}
        return rewritten

    def node(self, node: Any, where: str) -> dict[str, Any]:
        if node is True:
            return dict(ANY_VALUE)
        if not isinstance(node, dict):
            raise ValueError(f"{where} must be a schema object (or true)")
        return self.keywords({k: v for k, v in node.items() if k not in _ANNOTATIONS | _DEFINITIONS}, where)

    def keywords(self, node: dict[str, Any], where: str) -> dict[str, Any]:
        for keyword in _REFUSED:
            if keyword in node:
                raise ValueError(f"{where}.{keyword} cannot be enforced")
        if "$ref" in node:
            return self.ref(node, where)
        if "allOf" in node:
            return self.node(self.merged_all_of(node, where), where)
        for keyword in ("anyOf", "oneOf"):
            if keyword in node:
                return self.union(node, keyword, where)
        if "const" in node:
            node["enum"] = [node.pop("const")]
        if "enum" in node:
            values = node["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError(f"{where}.enum must be a non-empty list")
            if any(isinstance(v, (dict, list)) for v in values):
                raise ValueError(f"{where}.enum: objects and arrays as enum values cannot be enforced")
            if any(isinstance(v, str) and any(c in '"\\' or c < " " for c in v) for v in values):
                raise ValueError(f"{where}.enum: strings with quotes, backslashes or control characters "
                                 "cannot be enforced")  # fmt: skip
            return {"enum": values}  # the values decide; the structured_output fix writes each exactly
        kind = node.get("type")
        if kind is None:
            implied = [t for t, keys in _IMPLIED.items() if any(k in node for k in keys)]
            if not implied:
                return dict(ANY_VALUE)
            kind = implied[0] if len(implied) == 1 else implied
        if isinstance(kind, list):
            if not kind or not all(isinstance(t, str) for t in kind):
                raise ValueError(f"{where}.type must be a type name or a non-empty list of them")
            options = [{**node, "type": t} for t in dict.fromkeys(kind)]
            return self.node(options[0], where) if len(options) == 1 else {"anyOf": [
                self.node(option, f"{where}.type[{i}]") for i, option in enumerate(options)]}  # fmt: skip
        if kind not in _TYPES:
            raise ValueError(f"{where}.type {kind!r} is not a JSON Schema type")
        node["type"] = kind
        if kind == "object":
            return self.object(node, where)
        if kind == "array":
            return self.array(node, where)
        return node

    def object(self, node: dict[str, Any], where: str) -> dict[str, Any]:
        extra = node.get("additionalProperties", True)
        properties = node.get("properties")
        required = node.get("required", [])
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise ValueError(f"{where}.required must be a list of property names")
        if properties is None and extra is False:
            properties = {}
        if properties is not None:
            if not isinstance(properties, dict):
                raise ValueError(f"{where}.properties must be an object")
            properties = {k: self.node(v, f"{where}.properties.{k}") for k, v in properties.items()}
            for key in required:
                if key not in properties:
                    if extra is False:
                        raise ValueError(f"{where}.required names {key!r}, which no property allows")
                    properties[key] = self.node(extra, f"{where}.additionalProperties")
            node["properties"] = properties
        if isinstance(extra, dict):
            node["additionalProperties"] = self.node(extra, f"{where}.additionalProperties")
        elif extra is not False and extra is not True:
            raise ValueError(f"{where}.additionalProperties must be a schema or a boolean")
        return node

    def array(self, node: dict[str, Any], where: str) -> dict[str, Any]:
        items = node.get("items")
        if isinstance(items, list):
            raise ValueError(f"{where}.items as a list (a tuple) cannot be enforced")
        if items is False:
            raise ValueError(f"{where}.items false cannot be enforced")
        if items is not None:
            node["items"] = self.node(items, f"{where}.items")
        return node

    def union(self, node: dict[str, Any], keyword: str, where: str) -> dict[str, Any]:
        options = node.pop(keyword)
        if not isinstance(options, list) or not options:
            raise ValueError(f"{where}.{keyword} must be a non-empty list of schemas")
        if node:  # keywords beside the union apply to every option
            options = [_merge(node, self.target_if_ref(o, where), f"{where}.{keyword}") for o in options]
        return {"anyOf": [self.node(o, f"{where}.{keyword}[{i}]") for i, o in enumerate(options)]}

    def merged_all_of(self, node: dict[str, Any], where: str) -> dict[str, Any]:
        parts = node.pop("allOf")
        if not isinstance(parts, list) or not parts:
            raise ValueError(f"{where}.allOf must be a non-empty list of schemas")
        merged = node
        for part in parts:
            merged = _merge(merged, self.target_if_ref(part, where), f"{where}.allOf")
        return merged

    def target_if_ref(self, node: Any, where: str) -> Any:
        """A `$ref` replaced by what it points at (one level), for merging with other keywords."""
        if isinstance(node, dict) and "$ref" in node:
            rest = {k: v for k, v in node.items() if k != "$ref" and k not in _ANNOTATIONS}
            return _merge(self.pointed(node["$ref"], where), rest, where)
        return node

    def ref(self, node: dict[str, Any], where: str) -> dict[str, Any]:
        pointer = node.pop("$ref")
        if node:  # keywords beside a $ref apply too (JSON Schema 2019-09 and later)
            return self.node(_merge(self.pointed(pointer, where), node, where), where)
        if pointer not in self.names:
            if len(self.names) >= MAX_REFS:
                raise ValueError(f"{where}: more than {MAX_REFS} distinct $ref targets")
            name = self.names[pointer] = f"ref{len(self.names)}"
            self.defs[name] = {}  # taken before the target is rewritten, for recursive schemas
            self.defs[name] = self.node(self.pointed(pointer, where), pointer)
        return {"$ref": f"#/$defs/{self.names[pointer]}"}

    def pointed(self, pointer: Any, where: str) -> Any:
        if not isinstance(pointer, str) or not (pointer == "#" or pointer.startswith("#/")):
            raise ValueError(f"{where}.$ref {pointer!r}: only references inside the schema (#/...) work")
        target: Any = self.document
        for part in pointer[2:].split("/") if pointer != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise ValueError(f"{where}.$ref {pointer!r} points at nothing in the schema")
        return target


def _merge(base: Any, extra: Any, where: str) -> Any:
    """Both schemas at once: properties joined, required keys joined, other keywords must agree."""
    if base is True or extra is True:
        return extra if base is True else base
    if not isinstance(base, dict) or not isinstance(extra, dict):
        raise ValueError(f"{where} must hold schema objects")
    merged = {k: v for k, v in base.items() if k not in _ANNOTATIONS}
    for key, value in extra.items():
        if key in _ANNOTATIONS:
            continue
        if key == "properties" and isinstance(merged.get(key), dict) and isinstance(value, dict):
            properties = dict(merged[key])
            for name, schema in value.items():
                properties[name] = _merge(properties[name], schema, where) if name in properties else schema
            merged[key] = properties
        elif key == "required" and isinstance(merged.get(key), list) and isinstance(value, list):
            merged[key] = list(dict.fromkeys(merged[key] + value))
        elif key in merged and merged[key] != value:
            raise ValueError(f"{where}: the schemas it combines disagree on {key!r}; this cannot be enforced")
        else:
            merged[key] = value
    return merged


def schemas_within(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """Every schema an `enforceable` result holds (itself, its properties, items, options, $defs):
    the places where the enforcer builds a parser, to build each once before generation starts."""
    found: list[dict[str, Any]] = []
    pending: list[Any] = [schema]
    while pending:
        node = pending.pop()
        if not isinstance(node, dict):
            continue
        found.append(node)
        pending.extend((node.get("properties") or {}).values())
        pending.extend((node.get("$defs") or {}).values())
        pending.extend(node.get("anyOf") or [])
        pending.extend(
            v for v in (node.get("items"), node.get("additionalProperties")) if isinstance(v, dict)
        )
    return found
