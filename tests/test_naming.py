"""Claim names: templates, canonical values, hashing, hash tags; property tests."""

from __future__ import annotations

import datetime
import enum
import uuid
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fenced import ConfigError, claim_name, hash_value
from fenced._lease import ClaimKeys
from fenced._naming import check_fields, template_fields, validate_name

values = st.one_of(st.text(max_size=80), st.integers(), st.binary(max_size=40))


def test_plain_template() -> None:
    assert claim_name("rebuild:{tenant}:{layer}", tenant="acme", layer="roads") == (
        "rebuild:acme:roads"
    )


def test_long_or_unsafe_values_are_hashed_stably() -> None:
    url = "https://example.com/feed?x=1&y={2}"
    name = claim_name("feed:{url}", url=url)
    assert name == "feed:" + hash_value(url)
    assert name == claim_name("feed:{url}", url=url)
    assert hash_value(url).startswith("h1-") and len(hash_value(url)) == 43
    assert "{" not in name and "}" not in name


def test_value_looking_like_a_digest_cannot_collide() -> None:
    digest = hash_value("secret")
    assert claim_name("x:{a}", a=digest) != claim_name("x:{a}", a="secret")


@pytest.mark.parametrize(
    "template", ["x:{a.b}", "x:{a[0]}", "x:{}", "x:{0}", "x:{a!r}", "x:{a:>5}", "x:{a"]
)
def test_only_plain_fields(template: str) -> None:
    with pytest.raises(ConfigError) as info:
        template_fields(template)
    assert isinstance(info.value, ValueError)


def test_missing_field_names_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"layer=\.\.\."):
        claim_name("rebuild:{tenant}:{layer}", tenant="a")


def test_field_the_function_lacks_is_caught_at_definition() -> None:
    with pytest.raises(ConfigError, match="no argument"):
        check_fields("rebuild:{tenant}", ["layer"], "task rebuild_map")


@pytest.mark.parametrize("bad", ["", "   "])
def test_empty_template(bad: str) -> None:
    with pytest.raises(ConfigError, match="empty"):
        claim_name(bad)


def test_all_keys_share_one_hash_tag() -> None:
    keys = ClaimKeys.of("rebuild:acme:roads", "ns")
    tags = {k[k.index("{") + 1 : k.index("}")] for k in keys.all()}
    assert tags == {"rebuild:acme:roads"}
    assert all(k.startswith("ns:") for k in keys.all())
    assert ClaimKeys.name_from_key(keys.lock, "ns") == "rebuild:acme:roads"


def test_the_acquire_keys_are_the_named_keys_in_keys_order() -> None:
    # ACQUIRE's KEYS[1..6]; the store takes lasting and release keys from this list.
    keys = ClaimKeys.of("rebuild:acme:roads", "ns")
    named = [keys.lock, keys.fence, keys.records, keys.skips, keys.rerun, keys.cooldown]
    assert keys.all() == named
    assert keys.lasting() == tuple(named[1:5])


def test_names_with_braces_stay_in_one_slot() -> None:
    keys = ClaimKeys.of("odd {name} here", "fenced")
    assert keys.name.count("{") == 0
    assert all(k.count("{") == 1 for k in keys.all())


def test_bad_namespace() -> None:
    with pytest.raises(ConfigError, match="namespace"):
        ClaimKeys.of("x", "a{b")


@settings(max_examples=400)
@given(values, values, values, values)
def test_distinct_values_give_distinct_names(
    a1: object, b1: object, a2: object, b2: object
) -> None:
    def canon(v: object) -> object:
        # Values equal as text (1 and "1") name the same resource by design.
        return v if isinstance(v, bytes) else str(v)

    n1 = claim_name("r:{a}:{b}", a=a1, b=b1)
    n2 = claim_name("r:{a}:{b}", a=a2, b=b2)
    if (canon(a1), canon(b1)) != (canon(a2), canon(b2)):
        assert n1 != n2
    else:
        assert n1 == n2


@given(st.text(min_size=1, max_size=300))
def test_any_name_becomes_a_safe_key(name: str) -> None:
    safe = validate_name(name)
    keys = ClaimKeys.of(safe)
    assert "{" not in safe and "}" not in safe
    assert all(k.count("{") == 1 and k.count("}") == 1 for k in keys.all())
    assert validate_name(name) == safe  # stable


@given(st.text(min_size=1, max_size=100), st.text(min_size=1, max_size=100))
def test_distinct_raw_names_stay_distinct(a: str, b: str) -> None:
    if a != b:
        assert validate_name(a) != validate_name(b)


@given(st.text(min_size=1, max_size=300))
def test_a_name_is_a_fixed_point(name: str) -> None:
    once = validate_name(name)
    assert validate_name(once) == once
    assert ClaimKeys.of(once).name == once
    assert ClaimKeys.of(ClaimKeys.of(name).name).all() == ClaimKeys.of(name).all()


def test_a_hashed_name_fed_back_addresses_the_same_keys() -> None:
    name = claim_name("feed:{url}", url="https://example.com/a b")
    unsafe = "rebuild {acme} roads"
    for given_name in (name, validate_name(unsafe)):
        assert validate_name(given_name) == given_name
    assert ClaimKeys.of(validate_name(unsafe)).lock == ClaimKeys.of(unsafe).lock


# -- plain values only ----------------------------------------------------------------


class Layer(enum.Enum):
    ROADS = "roads"


class Tenant:
    def __init__(self, slug: str) -> None:
        self.slug = slug


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        (object(), "callable"),
        (Tenant("acme"), "callable"),
        ({"b", "a"}, "sorted"),
        ([1, object()], "list holding a object"),
        ({"k": Tenant("acme")}, "dict holding a Tenant"),
        (Layer, "callable"),  # the class, not a member
    ],
)
def test_values_without_a_stable_text_are_refused_naming_what_is_accepted(
    value: object, hint: str
) -> None:
    with pytest.raises(ConfigError) as info:
        claim_name("sync:{tenant}", tenant=value)
    message = str(info.value)
    assert "{tenant}" in message and hint in message
    assert "str, int, float, bool, None, bytes" in message and "dicts" in message


def test_a_mapping_names_the_same_claim_in_any_order() -> None:
    one = claim_name("sync:{opts}", opts={"region": "eu", "layers": ["roads", "rail"], "n": 2})
    other = claim_name("sync:{opts}", opts={"n": 2, "layers": ["roads", "rail"], "region": "eu"})
    assert one == other
    nested = claim_name("x:{o}", o=[{"b": 1, "a": 2}])
    assert nested == claim_name("x:{o}", o=[{"a": 2, "b": 1}])
    assert one != claim_name("sync:{opts}", opts={"region": "us", "layers": [], "n": 2})


def test_names_of_values_that_were_already_stable_do_not_change() -> None:
    # Digests of the text these values always had: a change here re-keys users' claims.
    assert claim_name("x:{v}", v=[1, "a", None]) == "x:" + hash_value("list:[1, 'a', None]")
    assert claim_name("x:{v}", v=("a", 2.5)) == "x:" + hash_value("tuple:('a', 2.5)")
    assert claim_name("x:{v}", v={"a": 1, "b": [2]}) == "x:" + hash_value("dict:{'a': 1, 'b': [2]}")
    when = datetime.datetime(2026, 1, 2, 3, 4)
    assert claim_name("x:{v}", v=when) == "x:" + hash_value(f"datetime:{when!r}")
    assert claim_name("x:{v}", v=Layer.ROADS) == "x:" + hash_value("Layer:<Layer.ROADS: 'roads'>")
    ident = uuid.UUID(int=7)
    assert claim_name("x:{v}", v=ident) == "x:" + hash_value(f"UUID:{ident!r}")
    assert claim_name("x:{v}", v=Decimal("1.50")) == "x:" + hash_value("Decimal:Decimal('1.50')")
    assert claim_name("x:{v}", v=b"k") == "x:" + hash_value(b"bytes:k")
    assert claim_name("x:{a}:{b}:{c}", a=7, b=True, c=None) == "x:7:True:None"


def test_a_preview_shows_what_a_value_is_about_but_not_its_secrets() -> None:
    from fenced._naming import preview

    assert preview("https://u:pw@feeds.example.com:8443/a/b?token=x#f") == (
        "https://feeds.example.com:8443/a/b?…"
    )
    assert preview("s3cr3tT0kenABCDEFGHIJKLMNOP") == "<a token, 27 characters>"
    assert preview("the roads layer of " * 4) == ("the roads layer of " * 3)[:39] + "…"
    assert preview(b"\x00" * 300) == "<300 bytes>"
    assert preview({"region": "eu", "password": "pw"}) == "<dict of region, password>"
    assert preview([1, 2, 3]) == "<list of 3>"
    assert preview(datetime.date(2026, 1, 2)) == "2026-01-02"


@settings(max_examples=300, deadline=None)
@given(
    args=st.lists(st.sampled_from(["x", 7, None]), max_size=4),
    kwargs=st.dictionaries(st.sampled_from(["a", "b", "c", "d", "zz"]), st.just("k"), max_size=4),
)
def test_a_call_names_its_claim_as_signature_binding_does(
    args: list[object], kwargs: dict[str, object]
) -> None:
    import inspect

    from fenced._naming import Namer

    def job(a: object, b: object = 2, *, c: object, d: object = 4) -> None: ...

    def bound_by_binding() -> object:
        try:
            bound = inspect.signature(job).bind_partial(*args, **kwargs)
        except TypeError:
            return "refused"
        bound.apply_defaults()
        values = bound.arguments
        if "a" not in values or "c" not in values:
            return "missing"
        return claim_name("job:{a}:{c}:{d}", a=values["a"], c=values["c"], d=values["d"])

    namer = Namer("job:{a}:{c}:{d}", inspect.signature(job), "task job")
    try:
        got: object = namer(tuple(args), kwargs)[0]
    except ConfigError as exc:
        got = "refused" if "do not fit" in str(exc) else "missing"
    assert got == bound_by_binding()
