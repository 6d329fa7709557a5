"""Token-id prompts: list, tuple, 1-D numpy array or 1-D torch tensor (bare or as a dict's
prompt_token_ids) all become a list of Python ints; anything else is a clear ValueError."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.engine.llm_engine import as_token_ids
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.entrypoints import LLM

IDS = [3, 17, 42, 99, 7]

ACCEPTED = {
    "list": IDS,
    "tuple": tuple(IDS),
    "list_of_numpy_ints": [np.int64(t) for t in IDS],
    "list_of_tensor_scalars": list(torch.tensor(IDS)),
    "numpy_int64": np.array(IDS),
    "numpy_int32": np.array(IDS, dtype=np.int32),
    "numpy_uint16": np.array(IDS, dtype=np.uint16),
    "tensor_int64": torch.tensor(IDS),
    "tensor_int32": torch.tensor(IDS, dtype=torch.int32),
    "tensor_noncontiguous": torch.tensor([IDS, IDS]).t()[:, 0],
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_accepted_forms_become_python_ints(name):
    ids = as_token_ids(ACCEPTED[name])
    assert ids == IDS
    assert all(type(t) is int for t in ids)


REFUSED = {
    "numpy_2d": (np.array([IDS]), "1-D"),
    "tensor_2d": (torch.tensor([IDS]), "1-D"),
    "tensor_0d": (torch.tensor(3), "1-D"),
    "numpy_float": (np.array(IDS, dtype=np.float32), "integers"),
    "tensor_float": (torch.tensor(IDS, dtype=torch.float32), "integers"),
    "numpy_bool": (np.array([True, False]), "integers"),
    "tensor_bool": (torch.tensor([True, False]), "integers"),
    "list_of_floats": ([3.0, 4.0], "integers"),
    "list_of_bools": ([True, 5], "bool"),
    "list_of_numpy_bools": ([np.bool_(True)], "bool"),
    "list_of_strings": (["3"], "integers"),
    "nested_list": ([[3, 4]], "integers"),
    "a_set": ({3, 4}, "list, tuple, 1-D numpy array or tensor"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_forms_raise_a_clear_value_error(name):
    value, message = REFUSED[name]
    with pytest.raises(ValueError, match=message):
        as_token_ids(value)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=64, max_num_seqs=4)


def test_every_form_generates_the_same_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [
        IDS,
        tuple(IDS),
        np.array(IDS),
        torch.tensor(IDS),
        {"prompt_token_ids": np.array(IDS, dtype=np.int32)},
        {"prompt_token_ids": torch.tensor(IDS)},
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.prompt_token_ids == IDS and all(type(t) is int for t in o.prompt_token_ids) for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    # A bare 1-D array or tensor is one prompt, not one prompt per element.
    for single in (np.array(IDS), torch.tensor(IDS)):
        (one,) = llm.generate(single, params, use_tqdm=False)
        assert one.prompt_token_ids == IDS and one.outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt_token_ids": np.array([IDS])}, "1-D"),
        ({"prompt_token_ids": torch.tensor(IDS, dtype=torch.float16)}, "integers"),
        (np.array(IDS, dtype=np.float64), "integers"),
        (torch.tensor([True, False]), "integers"),
        ({"prompt_token_ids": np.array([], dtype=np.int64)}, "prompt is empty"),
        (torch.tensor([3, 10**6]), r"integers in \[0, "),  # outside the vocabulary
    ],
)
def test_engine_refuses_bad_token_ids(llm, prompt, message):
    engine = llm.engine
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()
