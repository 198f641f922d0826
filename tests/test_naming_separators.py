"""Claim names render one-to-one: a template's values never run into its separators."""

from __future__ import annotations

import inspect
import re
import string
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fenced import ConfigError, claim_name, hash_value
from fenced._lease import ClaimKeys
from fenced._naming import _SAFE_VALUE, _VALUE_CHARS, Namer, render_value, validate_name

KEY = "k" * 32


def test_a_separator_inside_a_value_does_not_collide() -> None:
    one = claim_name("export:{org}-{repo}", org="foo-bar", repo="baz")
    other = claim_name("export:{org}-{repo}", org="foo", repo="bar-baz")
    assert one != other


# -- names that stay as they were ------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "values", "name"),
    [
        ("rebuild:{tenant}:{layer}", {"tenant": "acme", "layer": "roads"}, "rebuild:acme:roads"),
        # ':' is never in a value: what a value holds is written as it is.
        (
            "rebuild:{tenant}:{layer}",
            {"tenant": "a-b.c_d", "layer": "x/y@z"},
            "rebuild:a-b.c_d:x/y@z",
        ),
        ("job:{a}:{c}:{d}", {"a": -7, "c": 2.5, "d": None}, "job:-7:2.5:None"),
        ("r:{a}:{b}", {"a": "h1-x", "b": "u v"}, f"r:{hash_value('h1-x')}:{hash_value('u v')}"),
        ("sync:tenant={t}:layer={l}", {"t": "a-b", "l": "c"}, "sync:tenant=a-b:layer=c"),
        ("{a}={b}", {"a": "k-1", "b": "v/2"}, "k-1=v/2"),
        ("{a}+{b}", {"a": "k-1", "b": "v/2"}, "k-1+v/2"),
        ("x:{a}::{b}", {"a": "p.q", "b": "r"}, "x:p.q::r"),
        ("x:{a}:-{b}", {"a": "p-q", "b": "r"}, "x:p-q:-r"),
        # Separators that values hold too: values without them are written as they are.
        ("export:{org}-{repo}", {"org": "acme", "repo": "roads"}, "export:acme-roads"),
        ("export:{org}/{repo}", {"org": "acme-1", "repo": "v2.0"}, "export:acme-1/v2.0"),
        (
            "tiles:{layer}/{z}/{x}/{y}",
            {"layer": "roads", "z": 3, "x": 4, "y": 5},
            "tiles:roads/3/4/5",
        ),
        ("{name}-v{version}", {"name": "lib", "version": 2}, "lib-v2"),
        ("bench:{i}", {"i": 17}, "bench:17"),
        # One field: nothing to tell apart, whatever its text.
        ("feed:{url}-x", {"url": "a-b"}, "feed:a-b-x"),
        ("x:{a}-{a}", {"a": "b"}, "x:b-b"),
    ],
)
def test_names_that_stay_as_they_were(template: str, values: dict[str, Any], name: str) -> None:
    assert claim_name(template, **values) == name
    namer = Namer(template, None, "task t")
    assert namer((), values)[0] == name


def test_a_secret_field_between_colons_stays_as_it_was() -> None:
    from fenced._naming import secret_digest

    name = claim_name(
        "sync:{account}:{api_key:secret}", account="a-1", api_key="pw", secret_key=KEY
    )
    assert name == f"sync:a-1:{secret_digest('pw', KEY.encode())}"


# -- escaped separators ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "values", "name"),
    [
        ("export:{org}-{repo}", {"org": "foo-bar", "repo": "baz"}, "export:foo=2dbar-baz"),
        ("export:{org}-{repo}", {"org": "foo", "repo": "bar-baz"}, "export:foo-bar=2dbaz"),
        ("export:{org}-{repo}", {"org": -1, "repo": "x.y"}, "export:=2d1-x.y"),
        ("export:{org}/{repo}", {"org": "a/b", "repo": "c-d"}, "export:a=2fb/c-d"),
        ("{a}.{b}_{c}", {"a": "1.5", "b": "x_y", "c": "p.q_r"}, "1=2e5.x=5fy_p=2eq=5fr"),
        ("{a}@{b}", {"a": "me@x", "b": "y"}, "me=40x@y"),
        # '=' alone between two fields: the escape is '+'.
        (
            "{k}={v}-{w}",
            {"k": "a-b", "v": "c=d", "w": "e"},
            "a+2db=" + hash_value("c=d").replace("-", "+2d") + "-e",
        ),
    ],
)
def test_a_separator_in_a_value_is_escaped(
    template: str, values: dict[str, Any], name: str
) -> None:
    assert claim_name(template, **values) == name
    assert Namer(template, None, "task t")((), values)[0] == name


def test_a_digest_between_dashes_is_escaped_too() -> None:
    url = "https://example.com/a b"
    digest = hash_value(url)
    name = claim_name("export:{org}-{repo}", org=url, repo="x")
    assert name == "export:" + digest.replace("-", "=2d") + "-x"
    # "h1" and the digest's hex, on either side of the '-', do not spell the digest.
    faked = claim_name("export:{org}-{repo}", org="h1", repo=digest[3:] + "-x")
    assert faked != name


def test_an_escaped_name_is_a_fixed_point_and_its_record_shows_the_value() -> None:
    def export(org: str, repo: str) -> None: ...

    namer = Namer("export:{org}-{repo}", inspect.signature(export), "task export")
    name, shown = namer(("foo-bar", "https://example.com/x y"), {})
    assert validate_name(name) == name
    assert ClaimKeys.of(name).name == name
    # The record keeps each value's text (and digest), not its escaped form.
    assert shown == {"org": "foo-bar", "repo": hash_value("https://example.com/x y")}
    assert namer.readable(("foo-bar", "https://example.com/x y"), {}, shown) == {
        "repo": "https://example.com/x y"
    }


# -- refused templates -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "between"),
    [
        ("x:{a}{b}", "nothing between {a} and {b}"),
        ("resize:{w}x{h}", "only 'x', which a value may hold too, between {w} and {h}"),
        ("{a}:{b}{c}", "nothing between {b} and {c}"),
        ("{a}={b}+{c}-{d}", "only '=', which a value may hold too, between {a} and {b}"),
        ("{a}{a}", "nothing between {a} and {a}"),
    ],
)
def test_a_template_that_cannot_keep_its_values_apart_is_refused_where_defined(
    template: str, between: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Namer(template, None, "task t")
    message = str(info.value)
    assert message.startswith("task t: claim template")
    assert between in message and "put a separator" in message
    with pytest.raises(ConfigError, match="put a separator"):
        claim_name(template, a="1", b="2", c="3", d="4", w="5", h="6")


def test_a_task_or_function_with_such_a_template_fails_where_it_is_defined() -> None:
    from celery import Celery

    from fenced import exclusive
    from fenced.celery import ClaimedTask

    with pytest.raises(ConfigError, match=r"function \S*resize.*put a separator"):

        @exclusive("resize:{w}x{h}", redis="redis://127.0.0.1:9/0")
        def resize(w: int, h: int) -> None: ...

    app = Celery("fenced_naming_tests", set_as_current=False, broker="memory://")
    app.finalize()  # tasks are built (and checked) as they are defined
    with pytest.raises(ConfigError, match=re.escape("nothing between {org} and {repo}")):

        @app.task(shared=False, base=ClaimedTask, claim="export:{org}{repo}")
        def export(org: str, repo: str) -> None: ...


def test_a_refused_template_still_lists_its_fields() -> None:
    # fenced doctor reads templates from run records written before the rule.
    from fenced._naming import template_fields

    assert template_fields("x:{a}{b}") == ["a", "b"]


# -- one-to-one, for any template ------------------------------------------------------

FIELDS = ("a", "b", "c")
# Template text: value characters, the escapes, separators values never hold, braces,
# characters a name cannot keep (space, non-ASCII).
literals = st.one_of(
    st.sampled_from(["-", "/", ".", "_", "@", ":", "=", "+"]),  # one separator, often
    st.lists(
        st.sampled_from(
            ["-", "/", ".", "_", "@", ":", "=", "+", "x", "1", "{", "}", "~", " ", "é"]
        ),
        max_size=3,
    ).map("".join),
)
templates = st.builds(
    lambda parts, tail: (
        "".join(
            lit.replace("{", "{{").replace("}", "}}") + "{" + field + "}" for lit, field in parts
        )
        + tail.replace("{", "{{").replace("}", "}}")
    ),
    st.lists(st.tuples(literals, st.sampled_from(FIELDS)), min_size=1, max_size=4),
    literals,
)
# Values: short texts of the characters that matter, and the edges of rendering.
texts = st.lists(
    st.sampled_from(
        ["a", "-", "/", ".", "_", "@", ":", "=", "+", "2d", "=2d", "h1", "h1-", "{", "}", "é"]
    ),
    max_size=6,
).map("".join)
values = st.one_of(
    texts,
    st.text(max_size=12),
    st.text(alphabet="a-", min_size=62, max_size=66),  # 64 characters: shown, 65: hashed
    st.integers(-20, 20),
    st.sampled_from(["", hash_value("x"), hash_value("x")[3:], "k1-" + "0" * 40]),
    st.binary(max_size=3),
)
value_sets = st.fixed_dictionaries({f: values for f in FIELDS})


def _canon(value: object) -> object:
    # Values equal as text (1 and "1") name the same resource by design.
    return value if isinstance(value, bytes) else str(value)


def _layout(template: str) -> tuple[list[str], list[str]]:
    """A template's fields in order, and the texts between neighbouring ones."""
    order: list[str] = []
    gaps: list[str] = []
    text = ""
    for literal, field, _, _ in string.Formatter().parse(template):
        text += literal
        if field is not None:
            if order:
                gaps.append(text)
            order.append(field)
            text = ""
    return order, gaps


def _refused_rightly(template: str) -> bool:
    # Refused only where some text between fields has no separator and nothing but
    # letters, digits and the escapes: nothing a value could not hold.
    return any(
        all(c.isascii() and (c.isalnum() or c in "=+") for c in gap)
        and not any(c in "_.-/@" for c in gap)
        for gap in _layout(template)[1]
    )


def _name(template: str, vals: Mapping[str, Any]) -> str | None:
    try:
        Namer(template, None, "t")
    except ConfigError:
        assert _refused_rightly(template), template
        return None
    return claim_name(template, **vals)


@settings(max_examples=600, deadline=None)
@given(templates, value_sets, value_sets)
def test_distinct_values_give_distinct_names_in_any_template(
    template: str, one: dict[str, Any], other: dict[str, Any]
) -> None:
    fields = [f for f in FIELDS if "{" + f + "}" in template]
    first, second = _name(template, one), _name(template, other)
    if first is None:
        return
    assert validate_name(first) == first  # a fixed point
    if [_canon(one[f]) for f in fields] != [_canon(other[f]) for f in fields]:
        assert first != second
    else:
        assert first == second


def _resplits(text: str, gaps: list[str]) -> Iterator[list[str]]:
    """Every way of reading ``text`` as values joined by ``gaps``."""
    if not gaps:
        yield [text]
        return
    at = text.find(gaps[0])
    while at >= 0:
        for rest in _resplits(text[at + len(gaps[0]) :], gaps[1:]):
            yield [text[:at], *rest]
        at = text.find(gaps[0], at + 1)


@settings(max_examples=600, deadline=None)
@given(templates, st.fixed_dictionaries({f: texts for f in FIELDS}))
@example("export:{a}-{b}", {"a": "foo-bar", "b": "baz", "c": ""})
@example("{a}/{b}/{c}", {"a": "x", "b": "y/z", "c": "h1"})
def test_values_that_join_to_one_text_give_distinct_names(
    template: str, vals: dict[str, str]
) -> None:
    # The values moved across the text between fields: what a plain join confuses.
    order, gaps = _layout(template)
    joined = "".join(vals[f] + (gaps[i] if i < len(gaps) else "") for i, f in enumerate(order))
    name = _name(template, vals)
    if name is None:
        return
    for count, split in enumerate(_resplits(joined, gaps)):
        if count > 40:
            break
        moved: dict[str, Any] = dict(vals)
        for field, value in zip(order, split, strict=True):
            moved[field] = value
        if [moved[f] for f in order] != split or moved == vals:
            continue  # a field that appears twice would take two values
        assert claim_name(template, **moved) != name


@settings(max_examples=300, deadline=None)
@given(
    templates,
    st.fixed_dictionaries({f: st.from_regex(r"[A-Za-z0-9]{1,64}", fullmatch=True) for f in FIELDS}),
)
def test_letters_and_digits_render_as_they_always_did(template: str, vals: dict[str, str]) -> None:
    name = _name(template, vals)
    if name is None or any(v.startswith(("h1", "k1")) for v in vals.values()):
        return
    assert name == validate_name(template.format(**vals))


def test_value_characters_are_those_a_value_is_shown_with() -> None:
    assert {c for c in map(chr, range(0x250)) if _SAFE_VALUE.fullmatch(c)} == _VALUE_CHARS
    assert set(hash_value("x")) <= _VALUE_CHARS


@settings(max_examples=300, deadline=None)
@given(st.one_of(values, st.text()))
def test_a_rendered_value_holds_only_value_characters(value: object) -> None:
    assert set(render_value(value)) <= _VALUE_CHARS
