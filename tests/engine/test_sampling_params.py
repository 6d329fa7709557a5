"""SamplingParams validation: bad values raise ValueError naming the field and its allowed range."""
from __future__ import annotations

import math

import pytest

from hybridkv.engine.sampling_params import SamplingParams

# (kwargs, field name that must appear in the message, range text that must appear too)
INVALID: list[tuple[dict, str, str]] = [
    ({"temperature": -0.1}, "temperature", ">= 0"),
    ({"temperature": math.nan}, "temperature", ">= 0"),
    ({"temperature": math.inf}, "temperature", ">= 0"),
    ({"temperature": "hot"}, "temperature", ">= 0"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": -0.5}, "top_p", "(0, 1]"),
    ({"top_p": 1.01}, "top_p", "(0, 1]"),
    ({"top_p": math.nan}, "top_p", "(0, 1]"),
    ({"top_k": -2}, "top_k", "-1, 0 (off) or a positive integer"),
    ({"top_k": 2.5}, "top_k", "-1, 0 (off) or a positive integer"),
    ({"min_p": -0.01}, "min_p", "[0, 1]"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"n": 0}, "n", ">= 1"),
    ({"n": -3}, "n", ">= 1"),
    ({"n": 1.5}, "n", ">= 1"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": -1}, "max_tokens", ">= 1"),
    ({"min_tokens": -1}, "min_tokens", ">= 0"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens", "<= max_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"presence_penalty": -2.01}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": 3.0}, "frequency_penalty", "[-2, 2]"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty", "> 0"),
    ({"repetition_penalty": math.inf}, "repetition_penalty", "> 0"),
    ({"logprobs": -1}, "logprobs", ">= 0"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", ">= 0"),
    ({"stop": ""}, "stop", "non-empty strings"),
    ({"stop": ["ok", ""]}, "stop", "non-empty strings"),
    ({"stop": [1]}, "stop", "non-empty strings"),
    ({"stop": 7}, "stop", "non-empty strings"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "non-negative integers"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids", "non-negative integers"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids", "non-negative integers"),
    ({"stop_token_ids": 7}, "stop_token_ids", "non-negative integers"),
    ({"seed": "abc"}, "seed", "integer"),
]


@pytest.mark.parametrize(("kwargs", "field_name", "allowed"), INVALID, ids=repr)
def test_invalid_value_raises_value_error_naming_field_and_range(kwargs, field_name, allowed):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert field_name in message
    assert allowed in message


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"temperature": 0},
        {"top_p": 1.0, "top_k": 0, "min_p": 0.0},
        {"top_p": 1e-6, "top_k": 1, "min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 1e-3},
        {"min_tokens": 3, "max_tokens": 3},
        {"max_tokens": None, "min_tokens": 100},
        {"logprobs": 0, "prompt_logprobs": 0},
        {"stop": ("a", "b"), "stop_token_ids": [0, 7]},
        {"seed": 0},
    ],
    ids=repr,
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_top_k_minus_one_means_off_and_is_normalised_to_zero():
    assert SamplingParams(top_k=-1).top_k == 0


def test_stop_string_and_stop_ids_are_normalised_to_lists():
    p = SamplingParams(stop="###", stop_token_ids=None)
    assert p.stop == ["###"]
    assert p.stop_token_ids == []


def test_all_stop_token_ids_starts_as_the_user_stop_ids():
    assert SamplingParams(stop_token_ids=[3, 5]).all_stop_token_ids == {3, 5}


def test_greedy_iff_temperature_below_epsilon():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert not SamplingParams().greedy
