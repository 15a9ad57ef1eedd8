"""A synthetic instruction corpus in the Gemma 4 chat format, for the bundled demo model.

Nine tasks, each rendered with `render_gemma4` (prompt) plus the exact reply text the model must write:

    arith        "What is 17 + 25?"                      -> "17 + 25 = 42<turn|>"
    retrieval    30-48 "- KEY: WORD" lines (longer than the sliding window), "What is the code word for KEY?"
                 -> "The code word for KEY is WORD.<turn|>"
    long         "Count from 37 to 55."                  -> "37, 38, ..., 55<turn|>" (2-4 canvas blocks)
    tool_call    a request that needs one of the declared tools -> '<|tool_call>call:NAME{...}<tool_call|><|tool_response>'
    tool_answer  the same after the tool result          -> a sentence built from the result + "<turn|>"
    tool_answer_json  the same, the result sent as OpenAI clients send it: a JSON string answering a call id
    think        thinking on: "Which number is larger, 37 or 52?" -> "<|channel>thought\\n...\\n<channel|>52 is larger.<turn|>"
    yesno        parity / comparison / category questions -> "Yes<turn|>" or "No<turn|>"
    schema       a question schema (`chat.questions`) about an order's state -> "kind:\nB\nlate:\nno\n<turn|>"

Everything is deterministic for a seed. The held-out split is decided by a hash of each example's identity
(the operands for arithmetic, the rendered prompt otherwise): an example whose hash falls in the held-out
bucket is never produced for training, so evaluation prompts are unseen.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from diffgemma.chat import questions
from diffgemma.chat.template import render_gemma4
from diffgemma.chat.toolcall import format_call

TASKS = (
    "arith",
    "retrieval",
    "long",
    "tool_call",
    "tool_answer",
    "tool_answer_json",
    "think",
    "yesno",
    "schema",
)
# Share of each task in a training batch. The two hard targets (arithmetic, retrieval) get most of it: runs
# with arith 0.28 / tool_call 0.16 reached 100% on tool calls and answers but 50% on arithmetic. Arithmetic
# prompts are also the cheapest (~26 tokens against ~250 for retrieval and tool prompts).
TASK_WEIGHTS = {
    "arith": 0.38,
    "retrieval": 0.23,
    # Training only: retrieval from 2-16 lines (mostly inside the window), where few candidates give the lookup a
    # stronger gradient. With 30-48 lines only, 3k steps left retrieval at 6% (a frequent code word answered).
    "retrieval_short": 0.12,
    "long": 0.04,
    "tool_call": 0.07,
    "tool_answer": 0.03,
    "tool_answer_json": 0.03,
    "think": 0.05,
    "yesno": 0.07,
    "schema": 0.12,
}
HELDOUT_BUCKETS = 10  # 1 in 10 identities is held out
TURN_END = "<turn|>"
TOOL_RESPONSE = "<|tool_response>"

ANIMALS = [
    "cat",
    "dog",
    "fox",
    "wolf",
    "bear",
    "lion",
    "tiger",
    "horse",
    "cow",
    "sheep",
    "goat",
    "pig",
    "duck",
    "goose",
    "owl",
    "eagle",
    "hawk",
    "crow",
    "frog",
    "toad",
    "snake",
    "lizard",
    "shark",
    "whale",
    "seal",
    "otter",
    "mouse",
    "rat",
    "rabbit",
    "deer",
    "moose",
    "camel",
    "zebra",
    "panda",
    "koala",
    "monkey",
    "bee",
    "ant",
    "spider",
    "crab",
]
FRUITS = [
    "apple",
    "banana",
    "cherry",
    "grape",
    "lemon",
    "lime",
    "mango",
    "melon",
    "orange",
    "peach",
    "pear",
    "plum",
    "kiwi",
    "papaya",
    "guava",
    "fig",
    "date",
    "apricot",
    "coconut",
    "berry",
]
OBJECTS = [
    "chair",
    "table",
    "lamp",
    "book",
    "pen",
    "cup",
    "spoon",
    "fork",
    "knife",
    "plate",
    "clock",
    "phone",
    "radio",
    "door",
    "window",
    "bottle",
    "basket",
    "hammer",
    "brush",
    "mirror",
    "pillow",
    "blanket",
    "candle",
    "ladder",
    "rope",
    "wheel",
    "bucket",
    "kettle",
]
CITIES = [
    "Paris",
    "London",
    "Berlin",
    "Madrid",
    "Rome",
    "Vienna",
    "Prague",
    "Lisbon",
    "Dublin",
    "Oslo",
    "Stockholm",
    "Helsinki",
    "Warsaw",
    "Athens",
    "Cairo",
    "Tokyo",
    "Seoul",
    "Beijing",
    "Delhi",
    "Mumbai",
    "Sydney",
    "Toronto",
    "Chicago",
    "Boston",
    "Denver",
    "Seattle",
    "Miami",
    "Lima",
    "Bogota",
    "Nairobi",
]
CODE_WORDS = FRUITS + CITIES  # retrieval values: disjoint from the keys (animals and objects)
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")
CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "SEK")
TIMER_LABELS = ("tea", "pasta", "eggs", "laundry", "break", "workout", "bread", "rice", "meeting", "nap")
TOPICS = ANIMALS[:20] + FRUITS[:10]
SYSTEM_PROMPTS = ("You are a helpful assistant.", "Answer briefly.", "You are a precise assistant.")

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city name"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert_currency",
            "description": "Convert an amount of money",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "integer", "description": "The amount"},
                    "from_currency": {"type": "string", "description": "Source currency code"},
                    "to_currency": {"type": "string", "description": "Target currency code"},
                },
                "required": ["amount", "from_currency", "to_currency"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_timer",
            "description": "Start a timer",
            "parameters": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "description": "What the timer is for"},
                    "minutes": {"type": "integer", "description": "Duration in minutes"},
                },
                "required": ["minutes", "label"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "The search query"}},
                "required": ["query"],
            },
        },
    },
]


@dataclass
class Example:
    task: str
    prompt: str  # rendered chat prompt (starts with <bos>)
    target: str  # the reply, ending on its stop token (<turn|> or <|tool_response>)
    identity: str  # what the held-out split hashes
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def stop(self) -> str:
        return TOOL_RESPONSE if self.target.endswith(TOOL_RESPONSE) else TURN_END

    @property
    def answer(self) -> str:
        """The reply as the engine returns it: the target without its stop token."""
        return self.target[: -len(self.stop)]


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def is_heldout(identity: str) -> bool:
    return _hash(identity) % HELDOUT_BUCKETS == 0


def _messages(rng: random.Random, user: str) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.25:
        msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    msgs.append({"role": "user", "content": user})
    return msgs


def _arith(rng: random.Random) -> Example:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice("+-")
    if op == "-" and b > a:
        a, b = b, a
    c = a + b if op == "+" else a - b
    q = rng.choice(
        ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?", "What's {a} {op} {b}?")
    )
    prompt = render_gemma4(_messages(rng, q.format(a=a, op=op, b=b)))
    return Example("arith", prompt, f"{a} {op} {b} = {c}{TURN_END}", f"arith:{a}{op}{b}", {"result": c})


# Filler between a list and its question (`_retrieval(filler=True)`, used by the retrieval probe): 11 sentences,
# 139-144 demo-tokenizer tokens, more than the demo preset's 128-token sliding window, so only the
# full-attention layers can reach the list. (As training data it did not help: docs/train/README.md.)
FILLER_SENTENCES = 11


def _filler(rng: random.Random) -> str:
    """Sentences with no key and no code word (a first filler of fruit and cities held 40 code words)."""
    return " ".join(
        f"It is {rng.choice(CONDITIONS)} and {rng.choice(TIMER_LABELS)} costs {rng.randint(1, 99)} "
        f"{rng.choice(CURRENCIES)}."
        for _ in range(FILLER_SENTENCES)
    )


def _retrieval(rng: random.Random, lines: tuple[int, int], filler: bool = False) -> Example:
    # Each key and value is one word with its leading space, so the list, the question and the answer spell
    # them with the same tokens: the model must find the line, not also learn that "dog" and " dog" are one
    # word. (A first design, "dog: 744" lines answered "744", stayed at 0% after 15 minutes of training.)
    n = rng.randint(*lines)
    keys = rng.sample(ANIMALS + OBJECTS, n)
    vals = [rng.choice(CODE_WORDS) for _ in keys]
    lines_text = "\n".join(f"- {k}: {v}" for k, v in zip(keys, vals, strict=True))
    i = rng.randrange(n)
    q = rng.choice(
        (
            "What is the code word for {k}?",
            "Which code word belongs to {k}?",
            "Tell me the code word for {k}.",
        )
    )
    head, question = f"Here is a list of code words.\n{lines_text}\n", q.format(k=keys[i])
    msgs = _messages(rng, head + question)
    identity = render_gemma4(msgs)  # with or without filler, so a held-out list never trains
    if filler:
        msgs[-1]["content"] = f"{head}{_filler(rng)}\n{question}"
    prompt = render_gemma4(msgs)
    target = f"The code word for {keys[i]} is {vals[i]}.{TURN_END}"
    meta = {"key": keys[i], "value": vals[i], "index": i, "n": n}
    return Example("retrieval", prompt, target, identity, meta)


def _long(rng: random.Random) -> Example:
    a = rng.randint(1, 80)
    b = a + rng.randint(10, 24)
    q = rng.choice(
        ("Count from {a} to {b}.", "List the numbers from {a} to {b}.", "Count from {a} up to {b}.")
    )
    prompt = render_gemma4(_messages(rng, q.format(a=a, b=b)))
    target = ", ".join(str(x) for x in range(a, b + 1)) + TURN_END
    return Example("long", prompt, target, f"long:{a}-{b}:{q}", {})


def _tool_request(rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    kind = rng.choice(("get_weather", "convert_currency", "set_timer", "search_web"))
    if kind == "get_weather":
        city = rng.choice(CITIES)
        user = rng.choice(
            ("What's the weather like in {c}?", "Is it raining in {c}?", "Weather in {c} please.")
        )
        return user.format(c=city), kind, {"city": city}
    if kind == "convert_currency":
        amount = rng.randint(1, 999)
        src, dst = rng.sample(CURRENCIES, 2)
        user = rng.choice(("Convert {n} {s} to {d}.", "How much is {n} {s} in {d}?"))
        return (
            user.format(n=amount, s=src, d=dst),
            kind,
            {
                "amount": amount,
                "from_currency": src,
                "to_currency": dst,
            },
        )
    if kind == "set_timer":
        minutes = rng.randint(1, 90)
        label = rng.choice(TIMER_LABELS)
        user = rng.choice(("Set a timer for {m} minutes for the {l}.", "Start a {m} minute timer for {l}."))
        return user.format(m=minutes, l=label), kind, {"label": label, "minutes": minutes}
    query = " ".join(rng.sample(TOPICS, 2))
    user = rng.choice(("Search the web for {q}.", "Look up {q} online."))
    return user.format(q=query), kind, {"query": query}


def _tools(rng: random.Random, needed: str) -> list[dict[str, Any]]:
    others = [t for t in TOOLS if t["function"]["name"] != needed]
    chosen = [next(t for t in TOOLS if t["function"]["name"] == needed)] + rng.sample(
        others, rng.randint(0, len(others))
    )
    rng.shuffle(chosen)
    return chosen


def _tool_call(rng: random.Random) -> Example:
    user, name, args = _tool_request(rng)
    tools = _tools(rng, name)
    prompt = render_gemma4(_messages(rng, user), tools=tools)
    target = f"<|tool_call>{format_call(name, args)}<tool_call|>{TOOL_RESPONSE}"
    return Example("tool_call", prompt, target, prompt, {"name": name, "arguments": args})


def _tool_answer(rng: random.Random, as_json: bool = False) -> Example:
    """A reply to a tool's result: as a mapping (Gemma's native form), or `as_json` as OpenAI clients send it,
    `content` a JSON string in a tool message that answers the call's id (rendered as a string value)."""
    while True:
        user, name, args = _tool_request(rng)
        if name != "search_web":
            break
    if name == "get_weather":
        cond, temp = rng.choice(CONDITIONS), rng.randint(-5, 35)
        result: Any = {"conditions": cond, "temperature": temp}
        answer = f"It is {cond} and {temp} degrees in {args['city']}."
    elif name == "convert_currency":
        value = rng.randint(1, 1999)
        result = {"amount": value, "currency": args["to_currency"]}
        answer = f"{args['amount']} {args['from_currency']} is {value} {args['to_currency']}."
    else:
        result = {"status": "started"}
        answer = f"Your {args['minutes']} minute timer for {args['label']} is running."
    tools = _tools(rng, name)
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    reply: dict[str, Any] = {"role": "tool", "name": name, "content": result}
    if as_json:
        call["id"] = f"call_{rng.getrandbits(48):012x}"
        reply = {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)}
    msgs = _messages(rng, user) + [{"role": "assistant", "tool_calls": [call]}, reply]
    prompt = render_gemma4(msgs, tools=tools)
    task = "tool_answer_json" if as_json else "tool_answer"
    return Example(task, prompt, answer + TURN_END, prompt, {"name": name})


def _think(rng: random.Random) -> Example:
    a, b = rng.sample(range(0, 100), 2)
    m = max(a, b)
    q = rng.choice(("Which number is larger, {a} or {b}?", "Which is bigger: {a} or {b}?"))
    prompt = render_gemma4(_messages(rng, q.format(a=a, b=b)), enable_thinking=True)
    target = f"<|channel>thought\nCompare {a} and {b}: {m} is larger.\n<channel|>{m} is larger.{TURN_END}"
    return Example("think", prompt, target, f"think:{a},{b}:{q}", {"result": m})


def _yesno(rng: random.Random) -> Example:
    kind = rng.randrange(3)
    if kind == 0:
        n = rng.randint(0, 999)
        q, yes = f"Is {n} an even number? Answer yes or no.", n % 2 == 0
    elif kind == 1:
        a, b = rng.sample(range(0, 100), 2)
        q, yes = f"Is {a} greater than {b}? Answer yes or no.", a > b
    else:
        cat = rng.choice(("an animal", "a fruit", "a city"))
        pool = {"an animal": ANIMALS, "a fruit": FRUITS, "a city": CITIES}
        if rng.random() < 0.5:
            word, yes = rng.choice(pool[cat]), True
        else:
            other = [w for c, p in pool.items() if c != cat for w in p] + OBJECTS
            word, yes = rng.choice(other), False
        q = f"Is {word} {cat}? Answer yes or no."
    prompt = render_gemma4(_messages(rng, q))
    return Example("yesno", prompt, ("Yes" if yes else "No") + TURN_END, f"yesno:{q}", {"yes": yes})


KINDS = {"animal": ANIMALS, "fruit": FRUITS, "object": OBJECTS}
WAIT_LEVELS = ("1 to 3 days", "4 to 6 days", "7 days or more")
# The schema task's words, one token each in the demo tokenizer: the state's items and cities as its JSON strings
# show them (no space before), and the kinds as the options show them (after a space).
SCHEMA_WORDS = tuple(ANIMALS + FRUITS + OBJECTS + CITIES) + tuple(" " + k for k in KINDS)


def _schema_questions(rng: random.Random, state: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """Every question the schema task can ask about `state`, each with its answer's label."""
    kinds = list(KINDS)
    rng.shuffle(kinds)
    cities = rng.sample([c for c in CITIES if c != state["city"]], rng.randint(1, 3)) + [state["city"]]
    rng.shuffle(cities)
    limit = rng.randint(2, 8)
    kind = next(k for k, pool in KINDS.items() if state["item"] in pool)
    wait = 0 if state["days"] <= 3 else 1 if state["days"] <= 6 else 2
    letter = "ABCD"
    return [
        ({"id": "kind", "type": "choice", "instructions": "What kind of thing is the item?",
          "options": [{"name": k} for k in kinds]}, letter[kinds.index(kind)]),
        ({"id": "city", "type": "choice", "instructions": "Which city is the order from?",
          "options": [{"name": c} for c in cities]}, letter[cities.index(state["city"])]),
        ({"id": "late", "type": "noul", "instructions": f"Has the order waited more than {limit} days?"},
         "yes" if state["days"] > limit else "no"),
        ({"id": "even", "type": "noul", "instructions": "Is the count an even number?"},
         "yes" if state["count"] % 2 == 0 else "no"),
        ({"id": "fruit", "type": "noul", "instructions": "Is the item a fruit?"},
         "yes" if kind == "fruit" else "no"),
        ({"id": "wait", "type": "score", "instructions": "How long has the order waited?",
          "levels": list(WAIT_LEVELS)}, str(wait + 1)),
    ]  # fmt: skip


def _schema(rng: random.Random) -> Example:
    """A question schema (one to three questions) about an order: the system message `chat.questions` builds from
    it, the state as JSON, and the answer template with each label filled in."""
    pool = KINDS[rng.choice(list(KINDS))]
    state = {"item": rng.choice(pool), "city": rng.choice(CITIES), "days": rng.randint(1, 12)}
    state["count"] = rng.randint(0, 99)
    asked = rng.sample(_schema_questions(rng, state), rng.randint(1, 3))
    obj = {"questions": [q for q, _ in asked]}
    schema = questions.parse(obj)
    prompt = render_gemma4(questions.messages(schema, state))
    target = "".join(f"{q['id']}:\n{label}\n" for q, label in asked) + TURN_END
    answers = {q["id"]: label for q, label in asked}
    return Example(
        "schema", prompt, target, f"schema:{prompt}", {"schema": obj, "state": state, "labels": answers}
    )


# List lengths of the two retrieval tasks; a training curriculum may cap them (`make_example(max_lines=...)`).
RETRIEVAL_LINES = {"retrieval": (30, 48), "retrieval_short": (2, 16)}
MAKERS = {
    "arith": _arith,
    "retrieval": partial(_retrieval, lines=RETRIEVAL_LINES["retrieval"]),
    "retrieval_short": partial(_retrieval, lines=RETRIEVAL_LINES["retrieval_short"]),
    "long": _long,
    "tool_call": _tool_call,
    "tool_answer": _tool_answer,
    "tool_answer_json": partial(_tool_answer, as_json=True),
    "think": _think,
    "yesno": _yesno,
    "schema": _schema,
}


def make_example(
    task: str, rng: random.Random, split: str = "train", max_lines: int | None = None
) -> Example:
    """One example of `task` from the given split ("train" or "heldout"); `max_lines` caps retrieval lists."""
    want_heldout = split == "heldout"
    maker = MAKERS[task]
    if max_lines is not None and task in RETRIEVAL_LINES:
        # Under the curriculum both tasks draw 2..cap lines, as in the sweep where the lookup formed.
        maker = partial(_retrieval, lines=(2, max(2, min(RETRIEVAL_LINES[task][1], max_lines))))
    for _ in range(10_000):
        ex = maker(rng)
        if is_heldout(ex.identity) == want_heldout:
            return ex
    raise RuntimeError(f"could not draw a {split} example of {task}")


def generate(
    n: int,
    seed: int,
    split: str = "train",
    tasks: dict[str, float] | None = None,
    max_lines: int | None = None,
) -> list[Example]:
    """n examples, tasks drawn by weight; deterministic for (n, seed, split, max_lines)."""
    weights = tasks or TASK_WEIGHTS
    rng = random.Random(f"{seed}:{split}")
    names = list(weights)
    w = [weights[t] for t in names]
    return [make_example(rng.choices(names, w)[0], rng, split, max_lines) for _ in range(n)]


def heldout_set(n_per_task: int, seed: int = 1234, tasks: tuple[str, ...] = TASKS) -> list[Example]:
    """The evaluation prompts: n_per_task held-out examples of each task."""
    out = []
    for task in tasks:
        rng = random.Random(f"{seed}:heldout:{task}")
        out += [make_example(task, rng, "heldout") for _ in range(n_per_task)]
    return out


def tokenizer_corpus(n: int = 4000, seed: int = 7) -> list[str]:
    """Texts the demo tokenizer's merges are learned from: rendered examples plus the word lists."""
    texts = [ex.prompt + ex.target for ex in generate(n, seed)]
    texts.append(" ".join(ANIMALS + FRUITS + OBJECTS + CITIES + list(CONDITIONS) + list(CURRENCIES)))
    texts.append(json.dumps(TOOLS))
    return texts
