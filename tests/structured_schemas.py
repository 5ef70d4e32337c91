"""JSON schemas that structured output must honour, for the API tests and benchmarks/structured.py.

Every string, array and number is bounded (a fractional number by multipleOf too: digits after the point
are otherwise unbounded), so a small random model completes each within a few dozen tokens:
a schema the model could fill forever would test max_tokens, not the grammar.
"""

from __future__ import annotations

COLORS = ["red", "green", "blue", "yellow", "orange", "purple", "black", "white"]
SHAPES = ["circle", "square", "triangle"]


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


_SHORT = {"type": "string", "maxLength": 8}

SCHEMAS: dict[str, dict] = {
    "enum-color-shape": _obj({"color": {"enum": COLORS}, "shape": {"enum": SHAPES}}),
    "string-bounded": _obj({"name": {"type": "string", "minLength": 1, "maxLength": 6}}),
    "integer-range": _obj({"count": {"type": "integer", "minimum": 1, "maximum": 6}}),
    "number-bounds": _obj({"score": {"type": "number", "minimum": -1.5, "maximum": 2.5, "multipleOf": 0.25}}),
    "exclusive-bounds": _obj({"p": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}}),
    "boolean": _obj({"visible": {"type": "boolean"}, "label": {"enum": ["yes", "no"]}}),
    "null-or-int": _obj({"value": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    "const": _obj({"kind": {"const": "shape"}, "n": {"type": "integer", "minimum": 0, "maximum": 3}}),
    "pattern-code": _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    "pattern-date": _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]$"}}),
    "array-enum": _obj(
        {"colors": {"type": "array", "items": {"enum": COLORS}, "minItems": 1, "maxItems": 3}}
    ),
    "array-int": _obj(
        {
            "digits": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 4,
            }
        }
    ),
    "nested-object": _obj(
        {
            "shape": _obj({"kind": {"enum": SHAPES}, "color": {"enum": COLORS}}),
            "count": {"type": "integer", "minimum": 1, "maximum": 6},
        }
    ),
    "deep-nesting": _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "boolean"}})})})}),
    "array-of-objects": _obj(
        {
            "items": {
                "type": "array",
                "items": _obj(
                    {"shape": {"enum": SHAPES}, "size": {"type": "integer", "minimum": 1, "maximum": 99}}
                ),
                "minItems": 1,
                "maxItems": 2,
            }
        }
    ),
    "anyof-primitive": _obj(
        {"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none", "many"]}]}}
    ),
    "anyof-objects": _obj(
        {
            "thing": {
                "anyOf": [
                    _obj({"circle": {"type": "integer", "minimum": 1, "maximum": 9}}),
                    _obj({"square": {"enum": COLORS}}),
                ]
            }
        }
    ),
    "optional-fields": _obj(
        {"color": {"enum": COLORS}, "note": _SHORT, "n": {"type": "integer", "minimum": 0, "maximum": 5}},
        required=["color"],
    ),
    "defs-ref": {
        "$defs": {"item": _obj({"color": {"enum": COLORS}, "shape": {"enum": SHAPES}})},
        **_obj({"first": {"$ref": "#/$defs/item"}, "second": {"$ref": "#/$defs/item"}}),
    },
    "tuple-prefix-items": _obj(
        {
            "pair": {
                "type": "array",
                "prefixItems": [{"enum": SHAPES}, {"type": "integer", "minimum": 0, "maximum": 9}],
                "items": False,
                "minItems": 2,
            }
        }
    ),
    "string-format-enumish": _obj(
        {
            "unit": {"enum": ["px", "cm", "in"]},
            "value": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5},
        }
    ),
    "top-level-array": {"type": "array", "items": {"enum": SHAPES}, "minItems": 1, "maxItems": 3},
    "top-level-enum": {"enum": COLORS},
    "mixed-record": _obj(
        {
            "id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
            "ok": {"type": "boolean"},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01},
        }
    ),
}
