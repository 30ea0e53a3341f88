"""Property-based tests of the configuration boundary: any value either builds a valid config or is
rejected with a ConfigError (a one-line message for the user), never another exception."""

import dataclasses
import math
import typing

from hypothesis import given, settings
from hypothesis import strategies as st

from specplay.core.errors import ConfigError
from specplay.core.methods import METHODS
from specplay.core.decoding.types import GenerationConfig, SamplingConfig

ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.lists(st.integers(), max_size=3),
)


def field_values(cls):
    """Per field: arbitrary values, and values of the right type near and beyond the bounds."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        kind = [t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if t is not type(None)][0]
        lo, hi = f.metadata.get("min"), f.metadata.get("max")
        typed = {int: st.integers(-5 if lo is None else lo - 3, 100 if hi is None else hi + 3),
                 float: st.floats(-2.0 if lo is None else lo - 1, 2.0 if hi is None else hi + 1),
                 bool: st.booleans(), str: st.text(max_size=12)}[kind]
        choices = f.metadata.get("choices")
        if choices:
            typed = st.one_of(typed, st.sampled_from(list(choices)))
        out[f.name] = st.one_of(typed, typed, ANY_VALUE)
    return out


def check(cls, kwargs):
    try:
        config = cls(**kwargs)
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message
        return
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value = getattr(config, f.name)
        lo, hi, choices = f.metadata.get("min"), f.metadata.get("max"), f.metadata.get("choices")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert math.isfinite(value)
            assert lo is None or value >= lo
            assert hi is None or value <= hi
        if choices:
            assert value in choices
        kind = [t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if t is not type(None)][0]
        assert isinstance(value, kind) or (kind is float and isinstance(value, int))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_every_method_config_accepts_only_valid_values(data):
    spec = data.draw(st.sampled_from(list(METHODS.values())))
    values = field_values(spec.config_class)
    names = data.draw(st.sets(st.sampled_from(sorted(values)))) if values else set()
    kwargs = {n: data.draw(values[n]) for n in names}
    check(spec.config_class, kwargs)


@settings(max_examples=300, deadline=None)
@given(temperature=ANY_VALUE, top_p=ANY_VALUE, seed=st.integers(), max_new=ANY_VALUE)
def test_generation_settings_accept_only_valid_values(temperature, top_p, seed, max_new):
    try:
        config = GenerationConfig(max_new_tokens=max_new, sampling=SamplingConfig(temperature, top_p, seed))
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    s = config.sampling
    assert isinstance(config.max_new_tokens, int) and config.max_new_tokens >= 1
    assert math.isfinite(s.temperature) and s.temperature >= 0 and 0 < s.top_p <= 1
