"""The demo task set with tools: requests that offer functions reading the picture, and the reply each one gets.

A function takes one or two of what a task-set picture shows (``QUANTITIES``: its shape's colour, the shape,
how many shapes, the written number) under a property name of its own. A request offers one function that fits
the picture (all it takes, the picture shows), sometimes beside one that does not (a number reader for a shape),
and asks one of the five questions or a free phrasing ("Use the tool on this picture."). The reply is what
``tool_choice: "auto"`` should give: a call of the function that fits and takes what the question asks (a
describe question or a free phrasing: whatever it takes), its arguments read from the picture, written as
``tool_prompt.call_block`` writes it; where no offered function takes what the question asks, the question's
plain answer. The server puts the tools in the prompt with ``tool_prompt.with_tools``; training does the same.

Names come from a ``Names`` vocabulary: ``TRAINING``'s are what train-demo's tool phase shows, ``UNSEEN``'s
(function and property names, descriptions, free phrasings) never occur in training, for the held-out check.
Everything is a pure function of the seed, as ``demo_tasks.sample``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lm_engine.tool_prompt import call_block, with_tools
from tools import demo_tasks as tasks

QUANTITIES = ("color", "shape", "count", "number")
# what each kind of picture shows (a single shape is one shape: its count is 1)
SHOWS = {"single": ("color", "shape", "count"), "many": ("count",), "number": ("number",)}
# what one function takes
SIGNATURES: tuple[tuple[str, ...], ...] = (
    ("color",),
    ("shape",),
    ("color", "shape"),
    ("count",),
    ("number",),
)
# what each of the five questions asks for; describe (and a free phrasing): whatever the function takes
ASKS = {"color": "color", "shape": "shape", "count": "count", "number": "number", "describe": None}
# The README's tool: its pydantic ``Shape`` model's schema (``Shape.model_json_schema()``) as the openai client
# sends it.
README_TOOL = {
    "type": "function",
    "function": {
        "name": "describe_shape",
        "parameters": {
            "properties": {
                "color": {"enum": list(tasks.COLORS), "title": "Color", "type": "string"},
                "shape": {"enum": list(tasks.SHAPES), "title": "Shape", "type": "string"},
            },
            "required": ["color", "shape"],
            "title": "Shape",
            "type": "object",
        },
    },
}


@dataclass(frozen=True, slots=True)
class Names:
    """The words a request is made of: function names per signature, property names and descriptions per
    quantity ("" for none), functions' descriptions, schema titles and free phrasings of the request."""

    functions: dict[tuple[str, ...], tuple[str, ...]]
    properties: dict[str, tuple[str, ...]]
    descriptions: dict[str, tuple[str, ...]]
    function_descriptions: tuple[str, ...]
    titles: tuple[str, ...]
    free: tuple[str, ...]


TRAINING = Names(
    functions={
        ("color",): ("get_color", "record_color", "report_colour", "set_color"),
        ("shape",): ("get_shape", "classify_shape", "report_shape", "set_kind"),
        ("color", "shape"): ("describe_shape", "record_shape", "report_object", "log_item"),
        ("count",): ("count_shapes", "report_count", "set_total", "record_count"),
        ("number",): ("read_number", "record_number", "report_value", "transcribe"),
    },
    properties={
        "color": ("color", "colour", "fill", "shape_color"),
        "shape": ("shape", "kind", "form", "shape_type"),
        "count": ("count", "n", "how_many", "num_shapes"),
        "number": ("number", "value", "digits", "text"),
    },
    descriptions={
        "color": ("", "", "The shape's colour.", "Colour of the object"),
        "shape": ("", "", "Which shape it is.", "The kind of shape"),
        "count": ("", "", "How many shapes there are.", "Number of objects"),
        "number": ("", "", "The number written in the image.", "The digits shown"),
    },
    function_descriptions=("", "", "Record the shape.", "Report what the picture shows.", "Save the result."),
    titles=("Shape", "Reading", "Args", "Params"),
    free=(
        "Use the tool on this picture.",
        "Call the function for this image.",
        "Use the tool.",
        "Record what you see.",
        "Fill in the function's arguments from the image.",
    ),
)
UNSEEN = Names(
    functions={
        ("color",): ("paint_lookup", "tint_of"),
        ("shape",): ("outline_class", "geometry_of"),
        ("color", "shape"): ("catalogue_item", "note_object"),
        ("count",): ("tally", "object_total"),
        ("number",): ("scan_figure", "ocr_digits"),
    },
    properties={
        "color": ("tint", "paint"),
        "shape": ("outline", "geometry"),
        "count": ("total", "objects"),
        "number": ("figure", "reading"),
    },
    descriptions={
        "color": ("", "Hue of the figure drawn."),
        "shape": ("", "Its outline: round, four-sided or three-sided."),
        "count": ("", "Tally of the figures drawn."),
        "number": ("", "Figure printed on the card."),
    },
    function_descriptions=("", "Store a fact about the photo."),
    titles=("Item", "Fact"),
    free=("Please run the function on the photo.", "Apply the provided tool to what is drawn here."),
)


@dataclass(frozen=True, slots=True)
class Function:
    """One offered function: its OpenAI tool object, and the quantity each of its properties reads."""

    tool: dict
    reads: tuple[tuple[str, str], ...]  # (property, quantity), in the schema's order

    @property
    def name(self) -> str:
        return self.tool["function"]["name"]

    @property
    def takes(self) -> frozenset[str]:
        return frozenset(q for _, q in self.reads)

    def fits(self, kind: str) -> bool:
        return self.takes <= set(SHOWS[kind])

    def arguments(self, example: tasks.Example) -> dict:
        """The call's arguments read from the picture (a property of type string gets the number as text)."""
        props = self.tool["function"]["parameters"]["properties"]
        out = {}
        for prop, quantity in self.reads:
            value = example.qa[quantity]
            out[prop] = int(value) if props[prop].get("type") == "integer" else value
        return out


def _pydantic(schema: dict) -> dict:
    """Keys in the order pydantic writes them (sorted at every level, a ``properties`` map kept in order)."""
    out = {}
    for key in sorted(schema):
        value = schema[key]
        if key == "properties":
            value = {name: _pydantic(s) for name, s in value.items()}
        out[key] = value
    return out


def _value_schema(rng: random.Random, quantity: str) -> dict:
    if quantity in ("color", "shape"):
        values = list(tasks.COLORS) if quantity == "color" else list(tasks.SHAPES)
        if rng.random() < 0.25:
            rng.shuffle(values)
        return {"type": "string", "enum": values} if rng.random() < 0.8 else {"type": "string"}
    if quantity == "count":
        return {"type": "integer", "minimum": 1, "maximum": 6} if rng.random() < 0.5 else {"type": "integer"}
    return {"type": "integer"} if rng.random() < 0.6 else {"type": "string"}


def make_function(
    rng: random.Random, signature: tuple[str, ...], names: Names, taken: frozenset[str] = frozenset()
) -> Function:
    """A function taking ``signature``'s quantities (in a random order), named from ``names`` (not one of
    ``taken``), in one of three schema styles: plain, plain with ``additionalProperties: false``, pydantic's."""
    name = rng.choice([n for n in names.functions[signature] if n not in taken])
    quantities = list(signature)
    rng.shuffle(quantities)
    style = rng.choice(("plain", "closed", "pydantic"))
    props, reads = {}, []
    for quantity in quantities:
        prop = rng.choice(names.properties[quantity])
        schema = _value_schema(rng, quantity)
        if description := rng.choice(names.descriptions[quantity]):
            schema["description"] = description
        if style == "pydantic":
            schema["title"] = prop.replace("_", " ").title()
        props[prop] = schema
        reads.append((prop, quantity))
    params: dict = {"type": "object", "properties": props, "required": list(props)}
    if style == "closed":
        params["additionalProperties"] = False
    if style == "pydantic":
        params = _pydantic(params | {"title": rng.choice(names.titles)})
    function: dict = {"name": name}
    if description := rng.choice(names.function_descriptions):
        function["description"] = description
    function["parameters"] = params
    return Function({"type": "function", "function": function}, tuple(reads))


def question(task: str | None, rng: random.Random, names: Names) -> str:
    """One of the five questions, or (``task`` None) a free phrasing from ``names``."""
    return tasks.QUESTIONS[task] if task is not None else rng.choice(names.free)


def reply(example: tasks.Example, functions: list[Function], task: str | None) -> tuple[str, tuple | None]:
    """(the reply's text, the call (name, arguments) or None): a call of the first offered function that fits
    the picture and takes what ``task`` asks (any, for describe or a free phrasing: None), else the plain
    answer. A free phrasing with no such function has no reply (ValueError)."""
    wanted = ASKS[task] if task is not None else None
    for fn in functions:
        if fn.fits(example.kind) and (wanted is None or wanted in fn.takes):
            args = fn.arguments(example)
            return call_block(fn.name, args), (fn.name, args)
    if task is None:
        raise ValueError("a free phrasing needs a function that fits the picture")
    return example.qa[task], None


def system_text(tools: list[dict]) -> str:
    """The system message the server writes for these tools (``tool_prompt.with_tools``, no system message of
    the client's)."""
    return with_tools([], tools)[0]["content"]


def _offer(rng: random.Random, example: tasks.Example, names: Names, distractor: float) -> list[Function]:
    """A function that fits the picture, and with probability ``distractor`` one that does not, in either
    order."""
    fitting = [s for s in SIGNATURES if set(s) <= set(SHOWS[example.kind])]
    target = make_function(rng, rng.choice(fitting), names)
    functions = [target]
    if rng.random() < distractor:
        other = rng.choice([s for s in SIGNATURES if s not in fitting])
        functions.insert(rng.randrange(2), make_function(rng, other, names, frozenset({target.name})))
    return functions


def training_request(example: tasks.Example, rng: random.Random) -> tuple[list[dict], list[tuple[str, str]]]:
    """One picture's tool request for training: (the tools offered, 1-3 (question, reply) pairs asked with
    them). The questions are drawn from the picture's own and a free phrasing; about one reply in six is plain
    text (a single shape asked what the offered function does not take)."""
    functions = _offer(rng, example, TRAINING, distractor=0.4)
    asked: list[str | None] = [*example.qa, None]
    chosen = rng.sample(asked, k=rng.randint(1, 3))
    pairs = [(question(t, rng, TRAINING), reply(example, functions, t)[0]) for t in chosen]
    return [fn.tool for fn in functions], pairs


@dataclass(frozen=True, slots=True)
class ToolCase:
    """A held-out tool request: one picture, the tools, the question, and the call it should get."""

    example: tasks.Example
    tools: list[dict]
    question: str
    name: str
    arguments: dict
    reads: str  # what the called function takes: "color", "color+shape", "count", ...


def eval_cases(seed: int, n: int, names: Names | None = TRAINING) -> list[ToolCase]:
    """``n`` held-out requests whose right reply is a call (what ``tool_choice: "required"`` asks for), over
    the three kinds of picture in turn. ``names`` None: the README's tool (``README_TOOL``) on single shapes,
    asked "Describe the image."."""
    out = []
    for i in range(n):
        rng = random.Random(f"vlmserve-demo-tools-eval:{seed}:{i}")
        kind = "single" if names is None else tasks.KINDS[i % len(tasks.KINDS)]
        example = tasks.sample(seed, i, kind)
        if names is None:
            functions = [Function(README_TOOL, (("color", "color"), ("shape", "shape")))]
            task: str | None = "describe"
        else:
            functions = _offer(rng, example, names, distractor=0.3)
            fits = next(fn for fn in functions if fn.fits(kind))
            # the question asks something the fitting function takes, or anything (describe, free)
            options: list[str | None] = [t for t in example.qa if ASKS[t] in fits.takes]
            task = rng.choice([*options, "describe", None])
        text, call = reply(example, functions, task)
        assert call is not None, text
        takes = next(fn.takes for fn in functions if fn.name == call[0])
        ask = question(task, rng, names or TRAINING)
        out.append(ToolCase(example, [fn.tool for fn in functions], ask, *call, "+".join(sorted(takes))))
    return out
