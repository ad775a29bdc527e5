"""Hypothesis strategies for the JSON Schema subset FastAPI's OpenAPI uses (objects,
``$ref`` into components, ``anyOf``, enums and consts, strings with patterns and lengths,
bounded numbers, arrays). hypothesis-jsonschema would do this, but no release of it works
with the hypothesis this project uses."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

Schema = dict[str, Any]
# Any code point, lone surrogates often (JSON can carry them as escapes).
TEXT = st.characters() | st.characters(categories=["Cs"])


def from_schema(schema: Schema, root: Schema | None = None) -> st.SearchStrategy[Any]:
    root = root or schema
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(root["components"]["schemas"][name], root))
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([from_schema(s, root) for s in schema.get("anyOf", schema.get("oneOf"))])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, root) for k in kind])
    if kind == "object" or "properties" in schema:
        return _object(schema, root)
    if kind == "array":
        items = from_schema(schema.get("items", {}), root)
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=max(low, schema.get("maxItems", 4)))
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"].strip("^$"), fullmatch=True).filter(
                lambda s: len(s) <= schema.get("maxLength", 10**9)
            )
        low = schema.get("minLength", 0)
        high = max(low, min(schema.get("maxLength", 24), 24))
        return st.text(TEXT, min_size=low, max_size=high)
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -(2**40) - 1) + 1)
        high = schema.get("maximum", schema.get("exclusiveMaximum", 2**40 + 1) - 1)
        return st.integers(low, high)
    if kind == "number":
        return st.floats(
            schema.get("minimum", schema.get("exclusiveMinimum")),
            schema.get("maximum", schema.get("exclusiveMaximum")),
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
            allow_nan=False,
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8)


def _object(schema: Schema, root: Schema) -> st.SearchStrategy[dict[str, Any]]:
    props: dict[str, Schema] = schema.get("properties", {})
    required = set(schema.get("required", ()))
    fixed = {k: from_schema(v, root) for k, v in props.items() if k in required}
    optional = {k: from_schema(v, root) for k, v in props.items() if k not in required}
    return st.fixed_dictionaries(fixed, optional=optional)
