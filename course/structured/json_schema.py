"""A JSON Schema subset becomes a regular expression (regex.py's subset), hence a DFA.

    schema_to_regex({"type": "object", "properties": {"name": {"type": "string"},
                     "age": {"type": "integer"}}, "required": ["name"]})
    # \\{"name": "(...)*"(?:, "age": (0|-?[1-9][0-9]*))?\\}     (string body shortened here)

The subset, and what each becomes:
- object: `properties` in their declared order; names in `required` must appear, the others may be
  left out; no other property (as xgrammar's and OpenAI's strict mode: `additionalProperties` may be
  false or absent, nothing else). An object without `properties` is any JSON object (bounded depth).
- string: JSON's string (any character but `"`, `\\` and controls, or an escape: \\" \\\\ \\/ \\b \\f
  \\n \\r \\t \\uXXXX), with `minLength` / `maxLength` counted in those units.
- integer: 0 or -?[1-9][0-9]* (no -0, no leading zeros); number: JSON's number; boolean; null.
- enum and const of any JSON values; anyOf and a list of types: alternatives.
- array: `items` of one schema (any JSON value without it), `minItems` / `maxItems`.
- annotations (title, description, default, examples, $schema, $id, $comment, ...) are ignored.
- `$ref`: schema_to_regex refuses it; `resolve_refs(schema)` first inlines the local ones
  ("#/$defs/Name": pydantic's enum fields and nested models), refusing recursive and remote ones.
Anything else raises UnsupportedSchemaError, a ValueError that names the keyword and where it is
(`pattern`, `format`, `minimum`, `$ref`, `oneOf`, `additionalProperties: true`, ...).

Whitespace policy, fixed: `separators` as in json.dumps, default (", ", ": "): one space after
each comma and colon, none anywhere else (not after { or [, not before } or ]). json.dumps(value)
writes exactly this form. xgrammar's `compile_json_schema(..., any_whitespace=False,
separators=(", ", ": "))` describes the same language (but for strings with minLength/maxLength,
where xgrammar 0.2.8 allows raw control characters and no escapes: not JSON), and the tests check
that its masks equal ours at every step.

Any JSON (`{"type": "json_object"}`, untyped values) is recursive: a regular expression can hold it
only to a bounded depth (a DFA cannot count brackets). `json_object_regex(max_depth)` writes that
bounded grammar; deeper nesting needs a pushdown automaton (xgrammar's context-free grammars).
"""
from __future__ import annotations

import json

from course.structured.regex import MAX_REPEAT

STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"(?:0|-?[1-9][0-9]*)"
NUMBER = r"(?:-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)"
BOOLEAN = "(?:true|false)"
NULL = "null"

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly"}
KEYWORDS = {                                     # what each type understands, beside type/enum/const/anyOf
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
    "string": {"minLength", "maxLength"},
    "integer": set(), "number": set(), "boolean": set(), "null": set(),
}
DEFAULT_DEPTH = 2                                # nesting of untyped values (objects in arrays in ...)


class UnsupportedSchemaError(ValueError):
    """A schema outside the subset: `keyword` is the JSON Schema keyword, `path` where it is (#/...)."""

    def __init__(self, keyword: str, path: str, detail: str = ""):
        self.keyword, self.path = keyword, path
        super().__init__(f"unsupported JSON Schema keyword {keyword!r} at {path}"
                         + (f": {detail}" if detail else "") + " (supported: type, properties, required, "
                         "items, minItems, maxItems, minLength, maxLength, enum, const, anyOf)")


def escape(text: str) -> str:
    """`text` as a regex that matches exactly it."""
    return "".join("\\" + c if c in ".[]()*+?{}|\\^$" else f"\\x{ord(c):02x}" if ord(c) < 0x20 else c
                   for c in text)


def schema_to_regex(schema: dict, *, separators: tuple[str, str] = (", ", ": "),
                    max_depth: int = DEFAULT_DEPTH) -> str:
    """The regex of the JSON texts (in the whitespace policy above) that are valid under `schema`."""
    item_sep, key_sep = _check_separators(separators)
    return _Writer(item_sep, key_sep, max_depth).value(schema, "#")


def json_object_regex(max_depth: int = 3, *, separators: tuple[str, str] = (", ", ": ")) -> str:
    """Any JSON object nested at most `max_depth` deep (1: values are scalars), OpenAI's json_object."""
    if type(max_depth) is not int or not 1 <= max_depth <= 6:
        raise ValueError(f"max_depth must be an int in 1..6 (the regex grows 4x per level), got {max_depth!r}")
    item_sep, key_sep = _check_separators(separators)
    return _Writer(item_sep, key_sep, max_depth).any_object(max_depth - 1)



REF_PREFIXES = ("#/$defs/", "#/definitions/")    # where pydantic (and JSON Schema drafts) keep definitions
DATA_KEYWORDS = {"enum", "const", "default", "examples"}   # their values are JSON data, not schemas
NAMED_SCHEMAS = {"properties", "patternProperties", "dependentSchemas", "$defs", "definitions"}   # name -> schema


def resolve_refs(schema: dict) -> dict:
    """`schema` with each local `$ref` ("#/$defs/Name" or "#/definitions/Name") replaced by the
    definition it names, and the root's `$defs` / `definitions` dropped: a copy schema_to_regex reads.

    Why: pydantic writes an enum field or a nested model as {"$ref": "#/$defs/Color"} beside a root
    "$defs", and the openai SDK sends it so (`chat.completions.parse(response_format=Model)`). Keywords
    beside a $ref (a description) are kept. A recursive definition (a tree) has no regular expression
    (a DFA cannot count brackets) and a remote $ref (a URL) is never fetched: both raise
    UnsupportedSchemaError naming "$ref". A schema without $ref comes back equal to itself."""
    if not isinstance(schema, dict):
        raise UnsupportedSchemaError("schema", "#", f"a schema must be a JSON object, got {type(schema).__name__}")
    defs: dict = {}
    for key in ("$defs", "definitions"):
        table = schema.get(key, {})
        if not isinstance(table, dict):
            raise UnsupportedSchemaError(key, "#", f"{key} must be an object of named schemas")
        defs.update({f"#/{key}/{name}": sub for name, sub in table.items()})
    root = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    return _inline(root, "#", defs, ())


def _inline(node, path: str, defs: dict, seen: tuple[str, ...]):
    """`node` with its $refs replaced (recursively); `seen`: the refs being expanded around it."""
    if isinstance(node, list):
        return [_inline(x, f"{path}/{i}", defs, seen) for i, x in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in NAMED_SCHEMAS and isinstance(v, dict):      # {name: schema}: a property may be called "enum"
            out[k] = {name: _inline(sub, f"{path}/{k}/{name}", defs, seen) for name, sub in v.items()}
        elif k != "$ref":
            out[k] = v if k in DATA_KEYWORDS else _inline(v, f"{path}/{k}", defs, seen)
    if "$ref" not in node:
        return out
    ref = node["$ref"]
    if not isinstance(ref, str) or not ref.startswith(REF_PREFIXES):
        local = " or ".join(p + "<name>" for p in REF_PREFIXES)
        raise UnsupportedSchemaError("$ref", path, f"only local references {local} are resolved, got {str(ref)[:40]!r}")
    if ref not in defs:
        raise UnsupportedSchemaError("$ref", path, f"{ref!r} names no definition")
    if ref in seen:
        raise UnsupportedSchemaError("$ref", path, f"{ref!r} is recursive: no regular expression holds it")
    target = _inline(defs[ref], ref, defs, seen + (ref,))
    if not isinstance(target, dict):
        raise UnsupportedSchemaError("$ref", path, f"{ref!r} must name a schema object")
    return {**target, **out}                                    # the keywords beside the $ref win


def _check_separators(separators) -> tuple[str, str]:
    ok = isinstance(separators, tuple) and len(separators) == 2 and all(isinstance(s, str) for s in separators)
    if not ok or separators[0].strip(" ") != "," or separators[1].strip(" ") != ":":
        raise ValueError("separators must be (item, key) like json.dumps': (', ', ': ') or (',', ':'), "
                         f"got {separators!r}")
    return separators


def _dumps(value, path: str, keyword: str, separators: tuple[str, str]) -> str:
    """The one JSON text of a value (enum, const), written under the whitespace policy."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=separators)
    except (TypeError, ValueError) as e:
        raise UnsupportedSchemaError(keyword, path, f"{value!r} is not a JSON value ({e})") from None


class _Writer:
    def __init__(self, item_sep: str, key_sep: str, max_depth: int):
        if type(max_depth) is not int or not 0 <= max_depth <= 6:
            raise ValueError(f"max_depth must be an int in 0..6, got {max_depth!r}")
        self.raw = (item_sep, key_sep)                              # for json.dumps (enum, const)
        self.sep, self.colon, self.depth = escape(item_sep), escape(key_sep), max_depth

    def value(self, schema, path: str) -> str:
        if not isinstance(schema, dict):
            raise UnsupportedSchemaError("schema", path, f"a schema must be a JSON object, got {type(schema).__name__}")
        for key in ("enum", "const"):
            if key in schema:
                self.check_keys(schema, path, {key, "type"})
                values = [schema[key]] if key == "const" else schema[key]
                if key == "enum" and (not isinstance(values, list) or not values):
                    raise UnsupportedSchemaError("enum", path, "enum must be a non-empty list")
                texts = [_dumps(v, path, key, self.raw) for v in values]
                return "(?:" + "|".join(escape(t) for t in dict.fromkeys(texts)) + ")"
        if "anyOf" in schema:
            self.check_keys(schema, path, {"anyOf"})
            options = schema["anyOf"]
            if not isinstance(options, list) or not options:
                raise UnsupportedSchemaError("anyOf", path, "anyOf must be a non-empty list of schemas")
            return "(?:" + "|".join(self.value(s, f"{path}/anyOf/{i}") for i, s in enumerate(options)) + ")"
        types = schema.get("type")
        if types is None:                            # untyped: guess from the keywords, else any value
            types = "object" if "properties" in schema else "array" if "items" in schema else None
            if types is None:
                self.check_keys(schema, path, set())
                return self.any_value(self.depth)
        names = types if isinstance(types, list) else [types]
        for t in names:
            if t not in KEYWORDS:
                raise UnsupportedSchemaError("type", path, f"type {t!r} is not one of {sorted(KEYWORDS)}")
        self.check_keys(schema, path, {"type"}.union(*(KEYWORDS[t] for t in names)))
        options = [self.typed(t, schema, path) for t in dict.fromkeys(names)]
        return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"

    def check_keys(self, schema: dict, path: str, allowed: set[str]) -> None:
        for key in schema:
            if key not in allowed and key not in ANNOTATIONS:
                raise UnsupportedSchemaError(key, path)

    def typed(self, t: str, schema: dict, path: str) -> str:
        if t == "string":
            lo, hi = _bounds(schema, "minLength", "maxLength", path)
            return STRING if (lo, hi) == (0, None) else f'"{STRING_CHAR}{_count(lo, hi)}"'
        if t in ("integer", "number", "boolean", "null"):
            return {"integer": INTEGER, "number": NUMBER, "boolean": BOOLEAN, "null": NULL}[t]
        if t == "array":
            items = schema.get("items")
            if isinstance(items, list) or isinstance(items, bool):
                raise UnsupportedSchemaError("items", path, "items must be one schema (no tuples, no true/false)")
            item = self.any_value(self.depth - 1) if items is None else self.value(items, f"{path}/items")
            return self.array(item, *_bounds(schema, "minItems", "maxItems", path))
        return self.object(schema, path)

    def object(self, schema: dict, path: str) -> str:
        extra = schema.get("additionalProperties", False)
        if extra is not False:
            raise UnsupportedSchemaError("additionalProperties", path,
                                         "only false: outputs hold the declared properties only")
        props = schema.get("properties")
        required = schema.get("required", [])
        if props is None:
            if "additionalProperties" in schema:
                return r"\{\}"
            return self.any_object(self.depth - 1)
        if not isinstance(props, dict):
            raise UnsupportedSchemaError("properties", path, "properties must be an object of schemas")
        if not isinstance(required, list) or any(r not in props for r in required):
            missing = [r for r in required if r not in props] if isinstance(required, list) else required
            raise UnsupportedSchemaError("required", path,
                                         f"required names must be listed in properties: {missing!r}")
        # after[i]: properties i.. once one was written (each needs a comma first);
        # first[i]: properties i.. while none was written yet (the first one has no comma)
        n = len(props)
        after, first = [""] * (n + 1), [""] * (n + 1)
        for i, (name, sub) in reversed(list(enumerate(props.items()))):
            value = self.value(sub, f"{path}/properties/{name}")
            kv = escape(json.dumps(name, ensure_ascii=False)) + self.colon + value
            if name in required:
                after[i] = self.sep + kv + after[i + 1]
                first[i] = kv + after[i + 1]
            else:
                after[i] = f"(?:{self.sep}{kv})?" + after[i + 1]
                first[i] = f"(?:{kv}{after[i + 1]}|{first[i + 1]})"
        return r"\{" + first[0] + r"\}"

    def array(self, item: str, lo: int, hi: int | None) -> str:
        if hi == 0:
            return r"\[\]"
        rest = "*" if hi is None and lo <= 1 else _count(max(lo - 1, 0), None if hi is None else hi - 1)
        more = f"(?:{self.sep}{item}){rest}"
        body = f"{item}{more}"
        return r"\[" + (f"(?:{body})?" if lo == 0 else body) + r"\]"

    def any_value(self, depth: int) -> str:
        """Any JSON value with containers nested at most `depth` deep (0: scalars only)."""
        scalars = [STRING, NUMBER, BOOLEAN, NULL]
        if depth > 0:
            scalars += [self.any_object(depth - 1), self.array(self.any_value(depth - 1), 0, None)]
        return "(?:" + "|".join(scalars) + ")"

    def any_object(self, depth: int) -> str:
        """Any JSON object whose values nest at most `depth` deep."""
        member = STRING + self.colon + self.any_value(depth)
        return r"\{" + f"(?:{member}(?:{self.sep}{member})*)?" + r"\}"


def _count(lo: int, hi: int | None) -> str:
    """The quantifier {lo,hi} ({lo,} without a maximum)."""
    return f"{{{lo},{'' if hi is None else hi}}}"


def _bounds(schema: dict, lo_key: str, hi_key: str, path: str) -> tuple[int, int | None]:
    lo, hi = schema.get(lo_key, 0), schema.get(hi_key)
    for key, v in ((lo_key, lo), (hi_key, hi)):
        if v is not None and (type(v) is not int or v < 0):
            raise UnsupportedSchemaError(key, path, f"{key} must be an int >= 0, got {v!r}")
        if v is not None and v > MAX_REPEAT:
            raise UnsupportedSchemaError(key, path, f"counts above {MAX_REPEAT} are not supported, got {v}")
    if hi is not None and hi < lo:
        raise UnsupportedSchemaError(hi_key, path, f"{hi_key} {hi} < {lo_key} {lo}: nothing is valid")
    return lo, hi

