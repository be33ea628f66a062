"""codeworld problems: procedurally generated Python function tasks for a tiny code model.

Each template is a small family of functions (count, filter, map, reduce, look-up) over one of
four kinds of input: lists of ints, strings, ints, and dicts with str keys. A template draws its
parameters (a threshold, a divisor, the letters to replace, a shift) and writes them into the
statement and, as literals, into a short reference solution, so one template yields many
instances that differ in what they ask and the model has to read the statement rather than
recall a function by its name.

Hidden tests are small random inputs plus fixed edge cases (empty input, zero, negatives), with
expected values computed by running the reference solution, so they are right by construction.
Statements say what to return in the corner cases the tests reach, so that a solution that does
what the statement says always passes. Everything is JSON: tests go to JSONL unchanged.

The vocabulary is built for a ~1M-parameter model: a handful of argument names (``xs``, ``nums``,
``s``, ``text``, ``d``, ``n``), one or two sentence statements, one to six line bodies, list and
dict values in -20..20, and words and keys from short closed lists. :func:`generate` is a pure function of the
random generator's state, so a problem is stored as its template name and a seed.

One piece, though long: it is a catalogue of ~50 short templates, and the order they register in
(:data:`TEMPLATES`) is the order problems are drawn in, so every split's tasks depend on it; one
file keeps that order where a reader sees it.
"""

from __future__ import annotations

import copy
import json
import random
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CATEGORIES = ("list", "string", "arithmetic", "dict")
N_TESTS = 8
LETTERS = "abcdefghijklmnopqrstuvwxyz"
WORDS = ("a", "an", "the", "cat", "dog", "sun", "red", "big", "is", "run", "sky", "egg")
KEYS = ("a", "b", "c", "x", "y", "z", "ab", "cd", "cat", "dog", "sun", "red", "box", "pen")


@dataclass(frozen=True)
class Problem:
    """One function-writing task: write ``signature`` so that it does what ``statement`` says."""

    template: str
    category: str
    entry_point: str
    signature: str
    statement: str
    solution: str
    tests: list[dict]  # {"args": [...], "expected": ...}
    params: dict


@dataclass(frozen=True)
class _Draft:
    """What a template draws: the parts of a problem before its tests are computed."""

    entry_point: str
    args: str  # "xs: list[int], k: int"
    returns: str
    statement: str
    body: str  # unindented
    params: dict
    inputs: list[list]


@dataclass(frozen=True)
class Template:
    """A family of problems; ``draft`` draws the parameters and test inputs of one instance."""

    name: str
    category: str
    draft: Callable[[random.Random], _Draft]

    def make(self, rng: random.Random) -> Problem:
        d = self.draft(rng)
        signature = f"def {d.entry_point}({d.args}) -> {d.returns}:"
        solution = signature + "\n" + textwrap.indent(d.body, "    ")
        expected = expected_values(solution, d.entry_point, d.inputs)
        return Problem(
            template=self.name, category=self.category, entry_point=d.entry_point,
            signature=signature, statement=d.statement, solution=solution,
            tests=[{"args": a, "expected": e} for a, e in zip(d.inputs, expected)],
            params=d.params)


TEMPLATES: list[Template] = []


def _template(category: str) -> Callable[[Callable[[random.Random], _Draft]], Callable]:
    """Register a draft function as a template named after it (``_list_sum_even`` ->
    ``list_sum_even``)."""

    def register(draft: Callable[[random.Random], _Draft]) -> Callable:
        TEMPLATES.append(Template(draft.__name__.lstrip("_"), category, draft))
        return draft

    return register


def generate(rng: random.Random, template: Template) -> Problem:
    """One instance of ``template``; the same generator state gives the same problem."""
    return template.make(rng)


def expected_values(solution: str, entry_point: str, args_list: list[list]) -> list:
    """Run the (trusted) reference ``solution`` on each argument list, in a fresh namespace and
    on copies of the arguments so that a mutating solution cannot change the stored tests."""
    namespace: dict[str, Any] = {}
    exec(compile(solution, f"<{entry_point}>", "exec"), namespace)  # noqa: S102 - trusted code
    fn = namespace[entry_point]
    return [fn(*copy.deepcopy(args)) for args in args_list]


# ----------------------------------------------------------------------------------------------
# Inputs


def _cases(rng: random.Random, edges: list[list], draw: Callable[[], list]) -> list[list]:
    """The edge cases, then distinct random argument lists up to :data:`N_TESTS` (fewer when the
    input space is too small to find them)."""
    cases: list[list] = []
    seen: set[str] = set()
    for args in edges:
        key = json.dumps(args)
        if key not in seen:
            seen.add(key)
            cases.append(args)
    for _ in range(20 * N_TESTS):
        if len(cases) >= N_TESTS:
            break
        args = draw()
        key = json.dumps(args)
        if key not in seen:
            seen.add(key)
            cases.append(args)
    return cases


def _ints(rng: random.Random, lo: int = -20, hi: int = 20, max_len: int = 8) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(0, max_len))]


def _text(rng: random.Random, letters: str = LETTERS, max_len: int = 12) -> str:
    """Letters from ``letters`` with about one space in five."""
    return "".join(" " if rng.random() < 0.2 else rng.choice(letters)
                   for _ in range(rng.randint(0, max_len)))


def _sentence(rng: random.Random, max_words: int = 4) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, max_words)))


def _dict(rng: random.Random, lo: int = -20, hi: int = 20, keys: tuple[str, ...] = KEYS,
          max_len: int = 6) -> dict[str, int]:
    return {k: rng.randint(lo, hi) for k in rng.sample(keys, rng.randint(0, max_len))}


def _letters_pool(rng: random.Random, chosen: str) -> str:
    """``chosen`` plus four other letters, so that random texts often contain the chosen ones."""
    others = [c for c in LETTERS if c not in chosen]
    return chosen + "".join(rng.sample(others, 4))


def _join(items: str, word: str) -> str:
    """``"abc"`` -> ``"a, b and c"`` (or ``"a, b or c"``)."""
    return items if len(items) == 1 else f"{', '.join(items[:-1])} {word} {items[-1]}"


def _divisor_pair(rng: random.Random) -> tuple[int, int]:
    """Two divisors in 2..7, neither a multiple of the other (so that both matter)."""
    return rng.choice([(a, b) for a in range(2, 8) for b in range(a + 1, 8) if b % a])


def _plus(x: int) -> str:
    """``+ 3`` or ``- 3``, for literals in generated code."""
    return f"+ {x}" if x >= 0 else f"- {-x}"


# ----------------------------------------------------------------------------------------------
# Lists


_SUM_WHICH = {
    "even": ("the even numbers in nums", "sum(x for x in nums if x % 2 == 0)"),
    "odd": ("the odd numbers in nums", "sum(x for x in nums if x % 2 == 1)"),
    "even_index": ("the items of nums at even indexes (0, 2, 4 and so on)", "sum(nums[0::2])"),
    "odd_index": ("the items of nums at odd indexes (1, 3, 5 and so on)", "sum(nums[1::2])"),
}


@_template("list")
def _list_sum_even(rng: random.Random) -> _Draft:
    which = rng.choice(sorted(_SUM_WHICH))
    what, expr = _SUM_WHICH[which]
    return _Draft(
        f"sum_{which}", "nums: list[int]", "int",
        f"Return the sum of {what}, or 0 if there are none.",
        f"return {expr}",
        {"which": which},
        _cases(rng, [[[]], [[0]], [[-3, -4, 5]]], lambda: [_ints(rng)]))


@_template("list")
def _list_count_greater(rng: random.Random) -> _Draft:
    k = rng.randint(-5, 10)
    op, word = rng.choice([(">", "greater"), ("<", "less")])
    return _Draft(
        f"count_{word}", "xs: list[int]", "int",
        f"Return how many numbers in xs are {word} than {k}.",
        f"return sum(1 for x in xs if x {op} {k})",
        {"k": k, "op": op},
        _cases(rng, [[[]], [[k, k - 1, k + 1]]], lambda: [_ints(rng)]))


@_template("list")
def _list_filter_divisible(rng: random.Random) -> _Draft:
    d = rng.randint(2, 7)
    keep = rng.choice([True, False])
    return _Draft(
        f"divisible_by_{d}" if keep else f"not_divisible_by_{d}", "values: list[int]", "list[int]",
        f"Return a list of the numbers in values that are {'' if keep else 'not '}divisible by "
        f"{d}, in their original order.",
        f"return [x for x in values if x % {d} {'==' if keep else '!='} 0]",
        {"d": d, "keep": keep},
        _cases(rng, [[[]], [[0, d, -d, 1]]], lambda: [_ints(rng)]))


@_template("list")
def _list_rotate(rng: random.Random) -> _Draft:
    n = rng.randint(1, 5)
    way = rng.choice(["left", "right"])
    if way == "left":
        move, body = "the first item to the end", "return xs[k:] + xs[:k]"
    else:
        move, body = "the last item to the front", "return xs[-k:] + xs[:-k]"
    return _Draft(
        f"rotate_{way}", "xs: list[int]", "list[int]",
        f"Return xs rotated {way} {n} times, where one rotation moves {move}. Return [] if xs "
        f"is empty.",
        f"if not xs:\n    return []\nk = {n} % len(xs)\n{body}",
        {"n": n, "way": way},
        _cases(rng, [[[]], [[7]], [list(range(1, n + 2))]], lambda: [_ints(rng)]))


_RUNNING = {
    "max": ("largest of", "cur = x if cur is None else max(cur, x)"),
    "min": ("smallest of", "cur = x if cur is None else min(cur, x)"),
    "sum": ("sum of", "cur = x if cur is None else cur + x"),
}


@_template("list")
def _list_running(rng: random.Random) -> _Draft:
    op = rng.choice(sorted(_RUNNING))
    phrase, update = _RUNNING[op]
    return _Draft(
        f"running_{op}", "nums: list[int]", "list[int]",
        f"Return a list of the same length as nums whose item i is the {phrase} nums[0] to "
        f"nums[i].",
        f"out = []\ncur = None\nfor x in nums:\n    {update}\n    out.append(cur)\nreturn out",
        {"op": op},
        _cases(rng, [[[]], [[-4]], [[3, -1, 5, 5, 2]]], lambda: [_ints(rng)]))


@_template("list")
def _list_pairwise_diff(rng: random.Random) -> _Draft:
    op, word, sign = rng.choice([("diff", "xs[i + 1] - xs[i]", "-"),
                                 ("sum", "xs[i] + xs[i + 1]", "+")])
    return _Draft(
        f"pairwise_{op}", "xs: list[int]", "list[int]",
        f"Return the list of {word} for every pair of neighbouring items of xs, in order. "
        f"Return [] if xs has fewer than two items.",
        f"return [b {sign} a for a, b in zip(xs, xs[1:])]",
        {"op": op},
        _cases(rng, [[[]], [[5]], [[1, -2]]], lambda: [_ints(rng)]))


@_template("list")
def _list_dedupe_keep_order(rng: random.Random) -> _Draft:
    keep = rng.choice(["first", "last"])
    if keep == "first":
        body = "out = []\nfor x in nums:\n    if x not in out:\n        out.append(x)\nreturn out"
    else:
        body = ("out = []\nfor i, x in enumerate(nums):\n    if x not in nums[i + 1:]:\n"
                "        out.append(x)\nreturn out")
    return _Draft(
        f"dedupe_keep_{keep}", "nums: list[int]", "list[int]",
        f"Return nums with repeated numbers removed: keep only the {keep} occurrence of each "
        f"number, in the order those occurrences appear in nums.",
        body, {"keep": keep},
        _cases(rng, [[[]], [[2, 2, 2]], [[1, 2, 1, 3, 2]]], lambda: [_ints(rng, -3, 3)]))


@_template("list")
def _list_scale_add(rng: random.Random) -> _Draft:
    a = rng.choice([-3, -2, 2, 3, 4, 5])
    b = rng.randint(-5, 5)
    if b > 0:
        then = f" and then increased by {b}"
    elif b < 0:
        then = f" and then decreased by {-b}"
    else:
        then = ""
    plus = f" {_plus(b)}" if b else ""
    return _Draft(
        "transform", "values: list[int]", "list[int]",
        f"Return a new list with every number of values multiplied by {a}{then}.",
        f"return [x * {a}{plus} for x in values]",
        {"a": a, "b": b},
        _cases(rng, [[[]], [[0, -1]]], lambda: [_ints(rng)]))


@_template("list")
def _list_clip(rng: random.Random) -> _Draft:
    lo = rng.randint(-10, 0)
    hi = rng.randint(1, 10)
    return _Draft(
        "clip", "values: list[int]", "list[int]",
        f"Return a new list where every number of values below {lo} is replaced by {lo} and "
        f"every number above {hi} is replaced by {hi}; the other numbers stay the same.",
        f"return [min(max(x, {lo}), {hi}) for x in values]",
        {"lo": lo, "hi": hi},
        _cases(rng, [[[]], [[lo - 1, lo, hi, hi + 1]]], lambda: [_ints(rng)]))


@_template("list")
def _list_index_first(rng: random.Random) -> _Draft:
    k = rng.randint(-5, 10)
    op, word = rng.choice([(">", "greater"), ("<", "less")])
    return _Draft(
        f"first_{word}", "xs: list[int]", "int",
        f"Return the index of the first number in xs that is {word} than {k}, or -1 if there is "
        f"none.",
        f"for i, x in enumerate(xs):\n    if x {op} {k}:\n        return i\nreturn -1",
        {"k": k, "op": op},
        _cases(rng, [[[]], [[k]]], lambda: [_ints(rng)]))


@_template("list")
def _list_max_or_default(rng: random.Random) -> _Draft:
    op, word = rng.choice([("max", "largest"), ("min", "smallest")])
    default = rng.choice([None, 0, -1])
    return _Draft(
        word, "nums: list[int]", "int | None" if default is None else "int",
        f"Return the {word} number in nums, or {default} if nums is empty.",
        f"return {op}(nums) if nums else {default}",
        {"op": op, "default": default},
        _cases(rng, [[[]], [[-7]], [[0, 0]]], lambda: [_ints(rng)]))


@_template("list")
def _list_every_kth(rng: random.Random) -> _Draft:
    k = rng.randint(2, 4)
    start = rng.randint(0, k - 1)
    return _Draft(
        "every_kth", "xs: list[int]", "list[int]",
        f"Return the items of xs at indexes {start}, {start + k}, {start + 2 * k} and so on "
        f"(every {k} steps), in order. "
        + ("Return [] if xs is empty." if start == 0 else
           f"Return [] if xs has fewer than {start + 1} items."),
        f"return xs[{start}::{k}]",
        {"k": k, "start": start},
        _cases(rng, [[[]], [list(range(1, 10))]], lambda: [_ints(rng)]))


# ----------------------------------------------------------------------------------------------
# Strings


@_template("string")
def _string_count_vowels(rng: random.Random) -> _Draft:
    kind = rng.choice(["vowels", "consonants"])
    cond = "c in \"aeiou\"" if kind == "vowels" else "c != \" \" and c not in \"aeiou\""
    what = ("vowels (a, e, i, o, u)" if kind == "vowels"
            else "consonants (letters other than a, e, i, o, u; spaces do not count)")
    return _Draft(
        f"count_{kind}", "s: str", "int",
        f"Return how many characters of s are {what}.",
        f"return sum(1 for c in s if {cond})",
        {"kind": kind},
        _cases(rng, [[""], ["aeiou"], ["xyz q"]], lambda: [_text(rng)]))


@_template("string")
def _string_count_char(rng: random.Random) -> _Draft:
    c = rng.choice(LETTERS)
    pool = _letters_pool(rng, c)
    return _Draft(
        "count_letter", "s: str", "int",
        f"Return how many times the letter {c} appears in s.",
        f"return s.count(\"{c}\")",
        {"c": c},
        _cases(rng, [[""], [c * 3]], lambda: [_text(rng, pool)]))


@_template("string")
def _string_replace_char(rng: random.Random) -> _Draft:
    old, new = rng.sample(LETTERS, 2)
    pool = _letters_pool(rng, old + new)
    return _Draft(
        "replace_letter", "s: str", "str",
        f"Return s with every letter {old} replaced by the letter {new}.",
        f"return s.replace(\"{old}\", \"{new}\")",
        {"old": old, "new": new},
        _cases(rng, [[""], [old + " " + new]], lambda: [_text(rng, pool)]))


@_template("string")
def _string_caesar(rng: random.Random) -> _Draft:
    shift = rng.randint(1, 25)
    return _Draft(
        "shift_letters", "s: str", "str",
        f"Return s with every letter replaced by the letter {shift} places later in the "
        f"alphabet, wrapping around from z back to a; spaces stay as they are.",
        "out = \"\"\nfor c in s:\n"
        f"    out += c if c == \" \" else chr((ord(c) - ord(\"a\") + {shift}) % 26 + ord(\"a\"))\n"
        "return out",
        {"shift": shift},
        _cases(rng, [[""], ["xyz abc"]], lambda: [_text(rng)]))


@_template("string")
def _string_is_palindrome(rng: random.Random) -> _Draft:
    ignore_spaces = rng.choice([False, True])

    def draw() -> list:
        if rng.random() < 0.5:
            return [_text(rng)]
        half = _text(rng, LETTERS[:5], 6)
        return [half + rng.choice(["", "a", " "]) + half[::-1]]

    if ignore_spaces:
        statement = ("Return True if s reads the same forwards and backwards once its spaces "
                     "are removed, otherwise False.")
        body = "t = s.replace(\" \", \"\")\nreturn t == t[::-1]"
        edges = [[""], ["ab a"], ["ab"]]
    else:
        statement = ("Return True if s reads the same forwards and backwards, spaces included, "
                     "otherwise False.")
        body = "return s == s[::-1]"
        edges = [[""], ["ab a"], ["ab ba"]]
    return _Draft("is_palindrome", "s: str", "bool", statement, body,
                  {"ignore_spaces": ignore_spaces}, _cases(rng, edges, draw))


@_template("string")
def _string_words_longer_than(rng: random.Random) -> _Draft:
    op, word, kind = rng.choice([(">", "more", "long"), ("<", "fewer", "short")])
    n = rng.randint(1, 4) if op == ">" else rng.randint(2, 5)
    return _Draft(
        f"{kind}_words", "text: str", "list[str]",
        f"Return the list of words of text that have {word} than {n} letters, in order. Words "
        f"are separated by one or more spaces.",
        f"return [w for w in text.split() if len(w) {op} {n}]",
        {"n": n, "op": op},
        _cases(rng, [[""], ["  "], ["a bb ccc dddd ee"]], lambda: [_text(rng)]))


@_template("string")
def _string_reverse_words(rng: random.Random) -> _Draft:
    mode = rng.choice(["order", "letters"])
    if mode == "order":
        statement = "Return the words of text in reverse order"
        body = "return \" \".join(text.split()[::-1])"
    else:
        statement = "Return the words of text in the same order but each spelled backwards"
        body = "return \" \".join(w[::-1] for w in text.split())"
    return _Draft(
        f"reverse_{mode}", "text: str", "str",
        statement + ", joined by single spaces. Words are separated by one or more spaces in "
        "text; return \"\" if there are none.",
        body, {"mode": mode},
        _cases(rng, [[""], [" "], ["ab  cd "]], lambda: [_text(rng)]))


@_template("string")
def _string_remove_chars(rng: random.Random) -> _Draft:
    chosen = "".join(rng.sample(LETTERS, rng.randint(1, 3)))
    pool = _letters_pool(rng, chosen)
    return _Draft(
        "remove_letters", "s: str", "str",
        f"Return s without the letter{'s' * (len(chosen) > 1)} {_join(chosen, 'and')}; all "
        f"other characters stay in order.",
        f"return \"\".join(c for c in s if c not in \"{chosen}\")",
        {"letters": chosen},
        _cases(rng, [[""], [chosen]], lambda: [_text(rng, pool)]))


@_template("string")
def _string_repeat_chars(rng: random.Random) -> _Draft:
    k = rng.randint(2, 4)
    return _Draft(
        "stretch", "s: str", "str",
        f"Return s with every character, spaces included, repeated {k} times in a row: "
        f"\"a b\" becomes \"{'a' * k}{' ' * k}{'b' * k}\".",
        f"return \"\".join(c * {k} for c in s)",
        {"k": k},
        _cases(rng, [[""], [" "]], lambda: [_text(rng, max_len=8)]))


@_template("string")
def _string_starts_with(rng: random.Random) -> _Draft:
    affix = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 2)))
    end = rng.choice(["start", "end"])

    def draw() -> list:
        s = _text(rng, max_len=8)
        if rng.random() < 0.5:
            s = affix + s if end == "start" else s + affix
        return [s]

    return _Draft(
        f"{end}s_with", "s: str", "bool",
        f"Return True if s {end}s with \"{affix}\", otherwise False.",
        f"return s.{end}swith(\"{affix}\")",
        {"affix": affix, "end": end},
        _cases(rng, [[""], [affix]], draw))


@_template("string")
def _string_slice(rng: random.Random) -> _Draft:
    n = rng.randint(1, 6)
    part = rng.choice(["first", "last"])
    return _Draft(
        f"{part}_chars", "s: str", "str",
        f"Return the {part} {n} characters of s, or all of s if it is shorter than that.",
        f"return s[:{n}]" if part == "first" else f"return s[-{n}:]",
        {"n": n, "part": part},
        _cases(rng, [[""], ["abcdefghijkl"[:n]]], lambda: [_text(rng)]))


@_template("string")
def _string_char_positions(rng: random.Random) -> _Draft:
    c = rng.choice(LETTERS)
    pool = _letters_pool(rng, c)
    return _Draft(
        "positions", "s: str", "list[int]",
        f"Return the list of indexes where the letter {c} appears in s, in increasing order.",
        f"return [i for i, ch in enumerate(s) if ch == \"{c}\"]",
        {"c": c},
        _cases(rng, [[""], [c + " " + c]], lambda: [_text(rng, pool)]))


@_template("string")
def _string_upper_chars(rng: random.Random) -> _Draft:
    chosen = "".join(rng.sample(LETTERS, rng.randint(1, 3)))
    pool = _letters_pool(rng, chosen)
    return _Draft(
        "upper_letters", "s: str", "str",
        f"Return s with every letter {_join(chosen, 'or')} changed to upper case; all other "
        f"characters stay the same.",
        f"return \"\".join(c.upper() if c in \"{chosen}\" else c for c in s)",
        {"letters": chosen},
        _cases(rng, [[""], [chosen + " "]], lambda: [_text(rng, pool)]))


@_template("string")
def _string_longest_word(rng: random.Random) -> _Draft:
    op, word = rng.choice([(">", "longest"), ("<", "shortest")])
    return _Draft(
        f"{word}_word", "text: str", "str",
        f"Return the {word} word of text; words are separated by one or more spaces. If several "
        f"words are equally {word.removesuffix('est')}, return the first of them; return \"\" if "
        f"text has no words.",
        f"best = \"\"\nfor w in text.split():\n    if best == \"\" or len(w) {op} len(best):\n"
        f"        best = w\nreturn best",
        {"op": op},
        _cases(rng, [[""], ["ab cd"]], lambda: [_sentence(rng)]))


# ----------------------------------------------------------------------------------------------
# Arithmetic


@_template("arithmetic")
def _arith_sum_multiples(rng: random.Random) -> _Draft:
    a, b = _divisor_pair(rng)
    return _Draft(
        f"sum_multiples_{a}_{b}", "n: int", "int",
        f"Return the sum of the numbers from 1 to n (inclusive) that are divisible by {a} or by "
        f"{b}. Return 0 if n is less than 1.",
        f"return sum(i for i in range(1, n + 1) if i % {a} == 0 or i % {b} == 0)",
        {"a": a, "b": b},
        _cases(rng, [[0], [-3], [a * b]], lambda: [rng.randint(1, 30)]))


@_template("arithmetic")
def _arith_digit_sum(rng: random.Random) -> _Draft:
    which = rng.choice(["all", "even", "odd"])
    if which == "all":
        statement = "Return the sum of the digits of n"
        body = "return sum(int(c) for c in str(abs(n)))"
    else:
        statement = f"Return the sum of the {which} digits of n (0 if there are none)"
        body = (f"return sum(int(c) for c in str(abs(n)) "
                f"if int(c) % 2 == {int(which == 'odd')})")
    return _Draft(
        "digit_sum", "n: int", "int",
        statement + "; for a negative n, ignore the minus sign.",
        body, {"which": which},
        _cases(rng, [[0], [-7], [2468]], lambda: [rng.randint(-999, 9999)]))


@_template("arithmetic")
def _arith_gcd(rng: random.Random) -> _Draft:
    def draw() -> list:
        g = rng.randint(1, 6)
        return [g * rng.randint(0, 10), g * rng.randint(0, 10)]

    return _Draft(
        "gcd", "a: int, b: int", "int",
        "Return the greatest common divisor of a and b, which are never negative. The greatest "
        "common divisor of x and 0 is x.",
        "while b:\n    a, b = b, a % b\nreturn a",
        {},
        _cases(rng, [[0, 5], [7, 0], [12, 18]], draw))


_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79)


@_template("arithmetic")
def _arith_is_prime(rng: random.Random) -> _Draft:
    def draw() -> list:
        return [rng.choice(_PRIMES) if rng.random() < 0.5 else rng.randint(-5, 80)]

    return _Draft(
        "is_prime", "n: int", "bool",
        "Return True if n is a prime number, otherwise False; numbers below 2 are not prime.",
        "if n < 2:\n    return False\nfor d in range(2, n):\n    if n % d == 0:\n"
        "        return False\nreturn True",
        {},
        _cases(rng, [[0], [1], [2], [-7]], draw))


@_template("arithmetic")
def _arith_sequence(rng: random.Random) -> _Draft:
    a, b = rng.choice([(x, y) for x in range(4) for y in range(4) if (x, y) != (0, 0)])
    return _Draft(
        "sequence", "n: int", "int",
        f"A sequence starts with {a}, {b} and every later number is the sum of the two before "
        f"it. Return the number at index n, where index 0 is the first {a}; n is never negative.",
        f"a, b = {a}, {b}\nfor _ in range(n):\n    a, b = b, a + b\nreturn a",
        {"a": a, "b": b},
        _cases(rng, [[0], [1], [2]], lambda: [rng.randint(3, 12)]))


@_template("arithmetic")
def _arith_piecewise(rng: random.Random) -> _Draft:
    a = rng.randint(2, 5)
    b = rng.choice([x for x in range(-5, 6) if x])
    change = f"plus {b}" if b > 0 else f"minus {-b}"
    return _Draft(
        "even_odd", "n: int", "int",
        f"Return n times {a} if n is even, otherwise n {change}.",
        f"if n % 2 == 0:\n    return n * {a}\nreturn n {_plus(b)}",
        {"a": a, "b": b},
        _cases(rng, [[0], [-3], [-4]], lambda: [rng.randint(-20, 20)]))


@_template("arithmetic")
def _arith_divisors(rng: random.Random) -> _Draft:
    op = rng.choice(["count", "sum"])
    if op == "count":
        statement = "Return how many positive whole numbers divide n exactly"
        body = "return sum(1 for d in range(1, n + 1) if n % d == 0)"
    else:
        statement = "Return the sum of all positive whole numbers that divide n exactly"
        body = "return sum(d for d in range(1, n + 1) if n % d == 0)"
    return _Draft(
        f"{op}_divisors", "n: int", "int",
        statement + " (1 and n included); n is at least 1.",
        body, {"op": op},
        _cases(rng, [[1], [7], [12]], lambda: [rng.randint(1, 60)]))


@_template("arithmetic")
def _arith_power_sum(rng: random.Random) -> _Draft:
    k = rng.randint(1, 3)
    term = " * ".join(["i"] * k)
    what = {1: "1 + 2 + ... + n", 2: "1*1 + 2*2 + ... + n*n",
            3: "1*1*1 + 2*2*2 + ... + n*n*n"}[k]
    return _Draft(
        "power_sum", "n: int", "int",
        f"Return {what}; n is never negative and the sum is 0 when n is 0.",
        f"return sum({term} for i in range(1, n + 1))",
        {"k": k},
        _cases(rng, [[0], [1]], lambda: [rng.randint(2, 10)]))


@_template("arithmetic")
def _arith_round_multiple(rng: random.Random) -> _Draft:
    m = rng.randint(2, 10)
    way = rng.choice(["down", "up"])
    if way == "down":
        statement = f"Return the largest multiple of {m} that is less than or equal to n."
        body = f"return n // {m} * {m}"
    else:
        statement = f"Return the smallest multiple of {m} that is greater than or equal to n."
        body = f"return (n + {m - 1}) // {m} * {m}"
    return _Draft(
        f"round_{way}_{m}", "n: int", "int", statement, body,
        {"m": m, "way": way},
        _cases(rng, [[0], [m], [-1]], lambda: [rng.randint(-30, 30)]))


@_template("arithmetic")
def _arith_in_range(rng: random.Random) -> _Draft:
    lo = rng.randint(-10, 5)
    hi = lo + rng.randint(1, 15)
    return _Draft(
        "in_range", "n: int", "bool",
        f"Return True if n is at least {lo} and at most {hi}, otherwise False.",
        f"return {lo} <= n <= {hi}",
        {"lo": lo, "hi": hi},
        _cases(rng, [[lo], [hi], [lo - 1], [hi + 1]], lambda: [rng.randint(-20, 20)]))


@_template("arithmetic")
def _arith_reverse_digits(rng: random.Random) -> _Draft:
    return _Draft(
        "reverse_digits", "n: int", "int",
        "Return the number whose digits are those of n in reverse order; n is never negative "
        "and leading zeros are dropped, so 120 gives 21.",
        "return int(str(n)[::-1])",
        {},
        _cases(rng, [[0], [7], [120]], lambda: [rng.randint(10, 9999)]))


_FIZZ_WORDS = ("Fizz", "Buzz", "Foo", "Bar", "Ping", "Pong")


@_template("arithmetic")
def _arith_fizzbuzz(rng: random.Random) -> _Draft:
    a, b = _divisor_pair(rng)
    w1, w2 = rng.sample(_FIZZ_WORDS, 2)
    return _Draft(
        "fizzbuzz", "n: int", "str",
        f"Return \"{w1}{w2}\" if n is divisible by both {a} and {b}, \"{w1}\" if it is divisible "
        f"only by {a}, \"{w2}\" if only by {b}, and otherwise n as a string (like \"1\").",
        f"out = \"\"\nif n % {a} == 0:\n    out += \"{w1}\"\nif n % {b} == 0:\n"
        f"    out += \"{w2}\"\nreturn out or str(n)",
        {"a": a, "b": b, "w1": w1, "w2": w2},
        _cases(rng, [[a], [b], [a * b], [1]], lambda: [rng.randint(-10, 40)]))


# ----------------------------------------------------------------------------------------------
# Dicts


@_template("dict")
def _dict_invert(rng: random.Random) -> _Draft:
    def draw() -> list:
        keys = rng.sample(KEYS, rng.randint(0, 6))
        return [dict(zip(keys, rng.sample(WORDS, len(keys))))]

    return _Draft(
        "invert", "d: dict[str, str]", "dict[str, str]",
        "Return a new dict that maps each value of d to its key. The values of d are all "
        "different.",
        "return {v: k for k, v in d.items()}",
        {},
        _cases(rng, [[{}], [{"a": "a"}]], draw))


@_template("dict")
def _dict_filter_values_above(rng: random.Random) -> _Draft:
    k = rng.randint(-5, 10)
    op, word = rng.choice([(">", "greater"), ("<", "less")])
    return _Draft(
        f"keep_{word}", "d: dict[str, int]", "dict[str, int]",
        f"Return a new dict with only the items of d whose value is {word} than {k}.",
        f"return {{k: v for k, v in d.items() if v {op} {k}}}",
        {"k": k, "op": op},
        _cases(rng, [[{}], [{"a": k}]], lambda: [_dict(rng)]))


@_template("dict")
def _dict_merge(rng: random.Random) -> _Draft:
    op = rng.choice(["sum", "max"])
    if op == "sum":
        phrase = "the sum of its two values"
        update = "out[k] = out.get(k, 0) + v"
    else:
        phrase = "the larger of its two values"
        update = "out[k] = max(out[k], v) if k in out else v"
    keys = KEYS[:6]
    return _Draft(
        f"merge_{op}", "a: dict[str, int], b: dict[str, int]", "dict[str, int]",
        f"Return a new dict with every key that is in a or in b. A key in only one of them keeps "
        f"its value; a key in both maps to {phrase}.",
        f"out = dict(a)\nfor k, v in b.items():\n    {update}\nreturn out",
        {"op": op},
        _cases(rng, [[{}, {}], [{"a": 1}, {}], [{}, {"b": -2}]],
               lambda: [_dict(rng, keys=keys, max_len=4), _dict(rng, keys=keys, max_len=4)]))


@_template("dict")
def _dict_key_of_max(rng: random.Random) -> _Draft:
    op, word = rng.choice([(">", "largest"), ("<", "smallest")])
    return _Draft(
        f"key_of_{word}", "d: dict[str, int]", "str | None",
        f"Return the key of d with the {word} value. If several keys share that value, return "
        f"the one that comes first in d; return None if d is empty.",
        f"best = None\nfor k, v in d.items():\n    if best is None or v {op} d[best]:\n"
        f"        best = k\nreturn best",
        {"op": op},
        _cases(rng, [[{}], [{"x": 3, "y": 3}]], lambda: [_dict(rng, -5, 5)]))


@_template("dict")
def _dict_keys_where(rng: random.Random) -> _Draft:
    parity = rng.choice(["even", "odd"])
    return _Draft(
        f"{parity}_keys", "d: dict[str, int]", "list[str]",
        f"Return the keys of d whose value is {parity}, as a list in alphabetical order.",
        f"return sorted(k for k, v in d.items() if v % 2 == {int(parity == 'odd')})",
        {"parity": parity},
        _cases(rng, [[{}], [{"b": 0, "a": -3}]], lambda: [_dict(rng)]))


@_template("dict")
def _dict_map_values(rng: random.Random) -> _Draft:
    a = rng.choice([-2, 1, 2, 3])
    b = rng.choice([x for x in range(-5, 6) if x or a != 1])
    parts = ([f"multiplied by {a}"] if a != 1 else []) + (
        [f"increased by {b}" if b > 0 else f"decreased by {-b}"] if b else [])
    expr = "v" + (f" * {a}" if a != 1 else "") + (f" {_plus(b)}" if b else "")
    return _Draft(
        "update_values", "d: dict[str, int]", "dict[str, int]",
        f"Return a new dict with the same keys as d and every value {' and then '.join(parts)}.",
        f"return {{k: {expr} for k, v in d.items()}}",
        {"a": a, "b": b},
        _cases(rng, [[{}], [{"a": 0}]], lambda: [_dict(rng)]))


@_template("dict")
def _dict_count_words(rng: random.Random) -> _Draft:
    unit = rng.choice(["word", "letter"])
    if unit == "word":
        things = "text.split()"
        what = "word of text (words are separated by one or more spaces)"
    else:
        things = "text.replace(\" \", \"\")"
        what = "letter of text (spaces are not letters)"
    return _Draft(
        f"count_{unit}s", "text: str", "dict[str, int]",
        f"Return a dict that maps each {what} to the number of times it appears; return {{}} if "
        f"there are none.",
        f"counts = {{}}\nfor w in {things}:\n    counts[w] = counts.get(w, 0) + 1\nreturn counts",
        {"unit": unit},
        _cases(rng, [[""], [" "]], lambda: [_sentence(rng, 5)]))


@_template("dict")
def _dict_get_default(rng: random.Random) -> _Draft:
    default = rng.choice([None, 0, -1])

    def draw() -> list:
        d = _dict(rng)
        key = rng.choice(sorted(d)) if d and rng.random() < 0.6 else rng.choice(KEYS)
        return [d, key]

    return _Draft(
        "lookup", "d: dict[str, int], key: str", "int | None" if default is None else "int",
        f"Return the value of key in d, or {default} if key is not in d.",
        "return d.get(key)" if default is None else f"return d.get(key, {default})",
        {"default": default},
        _cases(rng, [[{}, "a"], [{"a": 5}, "a"]], draw))


@_template("dict")
def _dict_group_by_letter(rng: random.Random) -> _Draft:
    which, index, verb = rng.choice([("first", "0", "start"), ("last", "-1", "end")])
    return _Draft(
        f"group_by_{which}", "words: list[str]", "dict[str, list[str]]",
        f"words is a list of non-empty words. Return a dict that maps each letter that some word "
        f"{verb}s with to the list of the words that {verb} with it, in their original order "
        f"(repeats included).",
        f"groups = {{}}\nfor w in words:\n    if w[{index}] not in groups:\n"
        f"        groups[w[{index}]] = []\n    groups[w[{index}]].append(w)\nreturn groups",
        {"which": which},
        _cases(rng, [[[]], [["a", "a"]]],
               lambda: [[rng.choice(WORDS) for _ in range(rng.randint(1, 6))]]))


@_template("dict")
def _dict_zip(rng: random.Random) -> _Draft:
    def draw() -> list:
        keys = rng.sample(KEYS, rng.randint(1, 6))
        return [keys, [rng.randint(-20, 20) for _ in keys]]

    return _Draft(
        "make_dict", "keys: list[str], values: list[int]", "dict[str, int]",
        "Return a dict that maps keys[i] to values[i] for every index i. The two lists have the "
        "same length and the keys are all different.",
        "return dict(zip(keys, values))",
        {},
        _cases(rng, [[[], []]], draw))


@_template("dict")
def _dict_remove_keys(rng: random.Random) -> _Draft:
    removed = sorted(rng.sample(KEYS[:8], rng.randint(1, 2)))
    if len(removed) == 1:
        cond = f"k != \"{removed[0]}\""
    else:
        cond = f"k not in (\"{removed[0]}\", \"{removed[1]}\")"
    names = " or ".join(f"\"{k}\"" for k in removed)
    return _Draft(
        "drop_keys", "d: dict[str, int]", "dict[str, int]",
        f"Return a new dict with the items of d except the ones with key {names}.",
        f"return {{k: v for k, v in d.items() if {cond}}}",
        {"keys": removed},
        _cases(rng, [[{}], [{k: 1 for k in removed}]], lambda: [_dict(rng, keys=KEYS[:8])]))


@_template("dict")
def _dict_sorted_keys(rng: random.Random) -> _Draft:
    reverse = rng.choice([False, True])
    return _Draft(
        "sorted_keys", "d: dict[str, int]", "list[str]",
        f"Return the keys of d as a list in {'reverse ' if reverse else ''}alphabetical order.",
        "return sorted(d, reverse=True)" if reverse else "return sorted(d)",
        {"reverse": reverse},
        _cases(rng, [[{}], [{"b": 1, "ab": 2, "a": 3}]], lambda: [_dict(rng)]))
